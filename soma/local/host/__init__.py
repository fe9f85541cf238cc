"""The host side of `soma.Local`: one owner of its state (core.py), the one loop around it (loop.py), and the
processes and sockets (pool.py).

Drawn in `soma.local`; `soma.local.runner.Local` is the public face over it.
"""
