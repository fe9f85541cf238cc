"""Warnings from soma's runtime, without importing `logging` until there is one to give.

A worker process imports this at start; `logging` (with `traceback`) costs ~10 ms
of a worker's start-up, and most workers never warn about anything.
"""

from __future__ import annotations


def warn(logger: str, message: str, *args) -> None:
    import logging

    logging.getLogger(logger).warning(message, *args)
