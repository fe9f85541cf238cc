"""What every runner shares: the interpreter that runs a plan in one process, the in-process `Executor`,
`map` over an in-flight set, the trace, the device postcondition, the runner base, and the node registry.

Imported by the host, by every `Local` worker and by every Ray actor: nothing here imports torch,
ZeroMQ or Ray, and this package's `__init__` imports nothing at all.
"""
