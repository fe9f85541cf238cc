"""Mapping memory without Python's mmap: segment files mapped with libc, seen through ctypes byte arrays.

Why a ctypes array over memory soma maps itself (libc `mmap`, fd closed at once),
and not Python's `mmap.mmap`, for the bytes view of a segment (`soma.wire.shm`):

* `mmap.mmap` keeps a duplicate file descriptor open for its whole life: a caller
  holding a few thousand results would run out of descriptors. Ours keep none.
* `mmap.mmap` unmaps before its weak references are cleared (measured on 3.11:
  inside a finalizer the pages are already gone), so for a moment another thread
  could be given the same addresses while a store still lists them. Here the
  finalizer forgets the view first and unmaps after.
* numpy keeps a ctypes array itself as an array's base (a memoryview it would
  replace by one of its own), and ctypes arrays can be weakly referenced.

A tensor's view of a segment is torch's own mapping instead (a `Mapper`: see
`soma.wire.tensors.SharedStorages`), which keeps no descriptor either and is
unmapped after its weak references are cleared (measured: torch 2.13).
"""

from __future__ import annotations

import ctypes
import os

_PROT_RW, _MAP_SHARED = 0x1 | 0x2, 0x01
_libc = None


def libc():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                             ctypes.c_long]
        lib.munmap.restype = ctypes.c_int
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.madvise.restype = ctypes.c_int
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc = lib
    return _libc


# Linux >= 5.14: map every page of a range now, in one call, instead of one fault per 4 KiB page when the bytes
# are first touched (a value is about to be written or read whole). Measured here for 1 GiB: about half the
# time of the faults it replaces. Older kernels answer EINVAL and the pages fault in as before.
POPULATE_READ, POPULATE_WRITE = 22, 23
POPULATE_BYTES = 1 << 20  # smaller mappings fault in few pages: not worth a call


def map_file(path: str, nbytes: int, populate: int = 0) -> int:
    """The address of a fresh shared, writable mapping of the first `nbytes` of `path` (no fd kept);
    `populate`: POPULATE_WRITE or _READ to map its pages now when it is large."""
    fd = os.open(path, os.O_RDWR)
    try:
        address = libc().mmap(None, nbytes, _PROT_RW, _MAP_SHARED, fd, 0)
    finally:
        os.close(fd)
    if address is None or address == ctypes.c_void_p(-1).value:
        err = ctypes.get_errno()
        raise map_failed(path, err, os.strerror(err))
    if populate:
        populate_pages(address, nbytes, populate)
    return address


def map_failed(path: str, errno: int, detail: str) -> OSError:
    """The OSError for a mapping of `path` that failed; out of memory (ENOMEM) with memory to spare is most often
    the kernel's cap on mappings per process (vm.max_map_count, 65,530 by default), which results a caller keeps
    reach: each value of 32 KiB or more that crossed holds one mapping while it lives (in the process holding it,
    and one in the worker that made it), and a caller keeping 65,000 outputs, or 16,000 of four arrays each,
    failed hours into a map with "Cannot allocate memory" and most of the machine's memory free (Dec 7)."""
    message = f"could not map {path}: {detail}"
    if errno == 12:  # ENOMEM
        try:
            with open("/proc/sys/vm/max_map_count") as f:
                cap = f"{int(f.read()):,}"
        except (OSError, ValueError):
            cap = "the kernel's"
        message += (f" (if memory is not short, this process may have reached its cap of {cap} memory mappings, "
                    f"vm.max_map_count: each array or tensor of 32 KiB or more that crossed between processes and "
                    f"is still held takes one; keep copies of the results you keep for long (a.copy(), t.clone()), "
                    f"or raise the cap: sysctl -w vm.max_map_count=1048576)")
    return OSError(errno, message)


def populate_pages(address: int, nbytes: int, how: int) -> None:
    """Map the pages of a large mapping now (`how`: POPULATE_READ or POPULATE_WRITE); a hint: its failure
    changes nothing but speed."""
    if nbytes >= POPULATE_BYTES:
        libc().madvise(address, nbytes, how)


def unmap(address: int, nbytes: int) -> None:
    libc().munmap(address, nbytes)


def view_at(address: int, nbytes: int):
    """A ctypes byte array over memory that someone else keeps mapped (it does not own it)."""
    return (ctypes.c_ubyte * nbytes).from_address(address)


def address_of(view) -> int:
    return ctypes.addressof(view)


class Mapper:
    """How another library maps a segment so that it knows the memory as its own shared memory (torch's
    `is_shared()`): `map(path, nbytes)` gives the object whose life is the mapping's (weakly referable;
    it unmaps when it dies), `address(obj)` where its bytes are now (elsewhere once that library moved them)."""

    def map(self, path: str, nbytes: int):
        raise NotImplementedError

    def address(self, obj) -> int:
        raise NotImplementedError
