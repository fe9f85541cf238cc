"""What crosses a process boundary: messages (protocol), values (codec: tensors in tensors, numpy arrays,
bytes-like values and pickles in buffers), shared-memory segments (shm),
ZeroMQ tuning (transport), a worker's status page (status), node code (nodecode), and a node's failure as data
(failures), on its way between a `Local` host and its workers, or between Ray actors.

Both sides of every boundary import these modules; this package's `__init__` imports nothing.
"""
