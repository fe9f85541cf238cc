"""The host side of `soma.Local`: which worker runs what (scheduler), the processes and sockets (pool).

Drawn in `soma.local`; `soma.local.runner.Local` is the public face over it.
"""
