"""What every runner (Executor, Local, Ray) shares: a context manager, and `trace(path)`.

    with soma.Local(workers=2) as local:    __enter__ → start(), __exit__ → close()
        y = local.run(g, x)
"""

from __future__ import annotations

from .trace import Traced


class RunnerBase(Traced):
    """A runner's life: `start()` makes it ready (nothing to do by default), `close()` releases what it
    holds (an Executor holds no threads or processes between runs: nothing)."""

    def start(self):
        return self

    def close(self) -> None:
        pass

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
