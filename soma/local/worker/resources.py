"""What a worker process gives its nodes, and measures of itself: tensors and arrays born in shared memory
(`ctx.empty`), torch's threads and CUDA device set once torch is imported, the process's own memory
(`max_memory`)."""

from __future__ import annotations

import os
import sys
import threading

from ...wire import codec
from .imports import AfterImport


def private_memory() -> int:
    """This process's own resident memory: its resident set less file-backed and shared pages (libraries,
    and the shared-memory segments values cross in, which soma bounds itself)."""
    with open("/proc/self/statm", "rb") as f:
        fields = f.read().split()
    return (int(fields[1]) - int(fields[2])) * _PAGE


_PAGE = os.sysconf("SC_PAGE_SIZE")


class DeviceSetup:
    """This worker's share of torch's threads and its CUDA device: set once torch is imported (by whoever
    imports it), and the device on every thread that runs nodes."""

    def __init__(self, device: str, threads: int):
        self.device, self.threads = device, threads
        self.cuda = device.startswith("cuda")
        self.torch_ready = False
        self.torch_lock = threading.Lock()
        self.local = threading.local()

    def setup_torch(self) -> None:
        """This worker's share of threads and its CUDA device, once torch is imported (by whoever)."""
        import torch

        with self.torch_lock:
            if self.torch_ready:
                return
            torch.set_num_threads(self.threads)
            if self.cuda:
                torch.cuda.set_device(int(self.device.split(":")[1]))
            self.torch_ready = True

    def when_torch_imports(self) -> None:
        """Run setup_torch as part of the first `import torch` in this process (see imports.py for why)."""
        if "torch" in sys.modules:
            self.setup_torch()
        else:
            # torch's heap tensors of 2 MiB and more on transparent huge pages, as numpy's arrays are by default:
            # a 256 MiB tensor made and filled with a quarter of the CPU (640 page faults, not 65,537) and let go
            # of in 1 ms, not 35-40 (measured here): a heap-born result pays that free on its way back, which an
            # array of its bytes did not. The user's own setting wins (THP_MEM_ALLOC_ENABLE=0 for the host).
            os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
            sys.meta_path.insert(0, AfterImport("torch", self.setup_torch))

    def on_thread(self) -> None:
        """First thing on every thread that runs nodes: CUDA's current device is per thread."""
        if self.cuda and not getattr(self.local, "pinned", False):
            import torch

            torch.cuda.set_device(int(self.device.split(":")[1]))
            self.local.pinned = True


class Arena:
    """`ctx.empty` and `ctx.empty_array` in a worker: a tensor or an ndarray born in a segment this worker owns
    and has mapped already (reused ones are faulted in), so returning it copies nothing.

    Small ones come from the heap: they travel inline anyway.
    """

    def __init__(self, get_store):
        self.get_store = get_store

    def tensor(self, size: tuple, dtype):
        import torch

        from ...wire.tensors import tensor_over

        numel = 1
        for s in size:
            numel *= s
        nbytes = numel * dtype.itemsize
        if nbytes < codec.INLINE_LIMIT:
            return torch.empty(size, dtype=dtype)
        view, _ = self.get_store().allocate(nbytes)
        return tensor_over(torch, view, dtype, 0, size, None)

    def array(self, shape, dtype, order: str):
        import numpy

        dtype = numpy.dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        nbytes = dtype.itemsize
        for s in shape:
            nbytes *= s
        if nbytes < codec.INLINE_LIMIT or dtype.hasobject:
            return numpy.empty(shape, dtype, order)
        view, _ = self.get_store().allocate(nbytes)
        return numpy.ndarray(shape, dtype, buffer=view, order=order)
