"""`soma.Local`: runs graphs on worker processes. See `soma.scheduler` for the drawing.

This module decides what runs where (programs, node identity, which worker a
piece goes to) and checks what comes back; `pool.py` runs the processes and the
sockets, `registry.py` keeps the nodes' keys and code.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections import Counter

from .. import wire
from ..device import Device
from ..errors import DeviceError, NodeError, PostconditionError, SomaError
from ..postcondition import find_misplaced
from .dispatch import Chain, Remote, Spread, compile_program, output_devices
from .pool import WorkerPool
from .registry import NodeRegistry


class Local:
    """Runs graphs on worker processes on this machine.

        with soma.Local(workers=4) as local:
            y = local.run(g, x)

    `workers`: how many (default: the number of cores). `devices`: `None` (CPU
    workers), a list pinning worker i to `devices[i % len(devices)]`, or `"auto"`
    (every visible CUDA device). `arena`: bytes of shared memory each process keeps
    mapped for reuse (default: a quarter of RAM shared among the processes, at most
    1 GiB each). `preload_torch`: import torch in each worker in the background
    right after it starts (default False: a worker imports torch when a tensor or a
    torch node first needs it, so a pool that never sees torch stays small and
    starts fast; True spares the first torch run the ~1 s import).
    `start_timeout`: how long `start()` waits for the workers to say hello.
    """

    def __init__(self, workers: int | None = None, devices=None, *, arena: int | None = None,
                 preload_torch: bool = False, start_timeout: float = 60.0):
        self.n_workers = int(workers) if workers is not None else (os.cpu_count() or 1)
        if self.n_workers < 1:
            raise ValueError(f"soma.Local needs at least one worker, got workers={workers}")
        self.worker_devices = _pinning(devices, self.n_workers)
        self.arena = arena if arena is not None else _default_arena(self.n_workers)
        self.preload_torch = bool(preload_torch)
        self.start_timeout = start_timeout
        self.threads_per_worker = max(1, (os.cpu_count() or 1) // self.n_workers)
        self._start_lock = threading.Lock()
        self._pool: WorkerPool | None = None
        self._closed = False
        self._programs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph → {placement: program}
        self._registry = NodeRegistry()
        self._affinity: dict[int, int] = {}  # node key → the slot that first ran it
        self._assign_lock = threading.Lock()

    # -- life ------------------------------------------------------------------------------------
    def __enter__(self) -> "Local":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> "Local":
        """Start the workers (in parallel) and wait until each has said hello."""
        with self._start_lock:
            if self._closed:
                raise SomaError("this soma.Local is closed; make a new one")
            if self._pool is None:
                pool = WorkerPool(self.worker_devices, arena=self.arena, threads=self.threads_per_worker,
                                  preload_torch=self.preload_torch)
                try:
                    pool.start(time.monotonic() + self.start_timeout)
                except BaseException:
                    pool.close()  # no half-started pool: processes, sockets and files go, the error stays
                    raise
                self._pool = pool
                _live_pools.add(self)
        return self

    def close(self) -> None:
        """Stop the workers; leave no processes, segments or socket files. Results already returned stay valid."""
        with self._start_lock:
            if self._closed:
                return
            self._closed = True
        _live_pools.discard(self)
        if self._pool is not None:
            self._pool.close()

    def pids(self) -> list[int]:
        """The pids of the workers running now, in slot order (none before `start()`)."""
        if self._pool is None:
            return []
        return [w.pid for w in self._pool.workers if w is not None]

    # -- running ------------------------------------------------------------------------------------
    def run(self, g, x, *, timeout: float | None = None):
        """Run graph `g` on input `x` on the workers and return its output."""
        if self._pool is None:
            self.start()
        if self._closed:
            raise SomaError("this soma.Local is closed; make a new one")
        program = self._program(g)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            return self._execute(program, x, deadline, timeout)
        finally:
            self._pool.settle()
            self._pool.flush_frees()

    def _program(self, g):
        """Compiled once per graph and placement (placing after a run compiles again)."""
        key = tuple(g.devices().items())
        per_graph = self._programs.get(g)
        if per_graph is None:
            per_graph = self._programs[g] = {}
        program = per_graph.get(key)
        if program is None:
            program = per_graph[key] = compile_program(g, self._registry.key_of, self.worker_devices)
        return program

    def _execute(self, part, x, deadline, timeout):
        if isinstance(part, Chain):
            for item in part.parts:
                x = self._execute(item, x, deadline, timeout)
            return x
        if isinstance(part, Remote):
            return self._run_pieces([part], x, deadline, timeout)[0]
        return self._run_spread(part, x, deadline, timeout)

    def _run_spread(self, spread: Spread, x, deadline, timeout):
        """A top-level wave: pieces to workers, and branches split across devices orchestrated from here."""
        pieces = [p for p in spread.parts if isinstance(p, Remote)]
        others = [p for p in spread.parts if not isinstance(p, Remote)]
        results: dict[int, object] = {}

        def other(part):
            try:
                results[id(part)] = self._execute(part, x, deadline, timeout)
            except BaseException as exc:
                results[id(part)] = _Failure(exc)

        threads = [threading.Thread(target=other, args=(part,), daemon=True) for part in others]
        for t in threads:
            t.start()
        failure = None
        try:
            for piece, value in zip(pieces, self._run_pieces(pieces, x, deadline, timeout)):
                results[id(piece)] = value
        except BaseException as exc:
            failure = exc
        for t in threads:  # a wave waits for all its branches before raising
            t.join()
        if failure is not None:
            raise failure
        values = [results[id(p)] for p in spread.parts]
        for value in values:
            if isinstance(value, _Failure):
                raise value.exc
        return tuple(values)

    def _run_pieces(self, pieces: list, x, deadline, timeout) -> list:
        """Send pieces (one message per worker), wait for all of them, return their outputs in order."""
        pool = self._pool
        self._assign(pieces)
        encoder = wire.Encoder(pool.get_store)
        try:
            payload = encoder.pack(x)  # once, whatever the number of workers it goes to
        except wire.GradCrossing as err:
            entry = pieces[0].entry
            raise NodeError(entry, f"node `{entry}` failed: its input is {err}") from None
        except wire.Unsendable as err:
            entry = pieces[0].entry
            raise NodeError(entry, f"node `{entry}` failed: its input cannot be sent to a worker: {err}") from None
        except (MemoryError, OSError) as err:  # /dev/shm full, or a segment that could not be made
            entry = pieces[0].entry
            raise NodeError(entry, f"node `{entry}` failed: its input could not be put in shared memory: "
                                   f"{type(err).__name__}: {err}") from err
        pool.settle()
        dead = self._registry.take_dead()
        if dead:
            pool.forget(dead)
            for key in dead:
                self._affinity.pop(key, None)
        by_slot: dict[int, list] = {}
        for piece in pieces:
            by_slot.setdefault(piece.slot, []).append(piece)
        tasks = [(slot, group, self._code_for(slot, group)) for slot, group in by_slot.items()]
        pendings = [pool.submit(slot, group, code, payload, encoder.shared, deadline) for slot, group, code in tasks]
        del payload, encoder
        if not pool.wait(pendings, deadline):
            raise pool.timed_out(pendings, timeout)
        outputs = {}
        for pending in pendings:
            for piece, outcome in zip(pending.remotes, pending.outcomes or [pending.error] * len(pending.remotes)):
                outputs[id(piece)] = outcome
        ordered = [outputs[id(p)] for p in pieces]
        for piece, value in zip(pieces, ordered):
            if not isinstance(value, BaseException):
                _check_arrival(piece, value)
        first_error = next((v for v in ordered if isinstance(v, BaseException)), None)
        if first_error is not None:
            raise first_error
        return ordered

    def _assign(self, pieces: list) -> None:
        """Fix each piece's worker at its first dispatch: where its nodes already live, else the least used."""
        if all(p.slot is not None for p in pieces):
            return
        with self._assign_lock:
            load = Counter(p.slot for p in pieces if p.slot is not None)
            weight = Counter(self._affinity.values())
            for piece in pieces:
                if piece.slot is not None:
                    continue
                eligible = [s for s in range(self.n_workers)
                            if piece.cuda is None or self.worker_devices[s] == piece.cuda]
                homes = Counter(self._affinity[k] for k in piece.keys.values() if k in self._affinity)
                homes = Counter({s: n for s, n in homes.items() if s in eligible})
                if homes:
                    piece.slot = homes.most_common(1)[0][0]
                else:
                    piece.slot = min(eligible, key=lambda s: (load[s], weight[s], s))
                load[piece.slot] += 1
                for key in piece.keys.values():
                    if key not in self._affinity:
                        self._affinity[key] = piece.slot
                        weight[piece.slot] += 1

    def _code_for(self, slot: int, group: list) -> dict:
        """The code of the nodes this worker does not hold yet."""
        worker = self._pool.workers[slot]
        code = {}
        for piece in group:
            for node_id, key in piece.keys.items():
                if key not in worker.loaded and key not in code:
                    code[key] = self._registry.code(node_id, key)
        return code


def _check_arrival(piece: Remote, value) -> None:
    """The postcondition, on what arrived: a transport that moved a tensor is caught too."""
    for node_id, declared, item in output_devices(piece.plan, piece.devices, value):
        actual = find_misplaced(item, declared)
        if actual is not None:
            raise PostconditionError(node_id, declared, actual)


class _Failure:
    __slots__ = ("exc",)

    def __init__(self, exc):
        self.exc = exc


def _pinning(devices, n: int) -> list[str]:
    if devices is None:
        return ["cpu"] * n
    if devices == "auto":
        import torch

        count = torch.cuda.device_count()
        devices = [f"cuda:{i}" for i in range(count)] or ["cpu"]
    if isinstance(devices, str):
        devices = [devices]
    parsed = []
    for d in devices:
        dev = Device.parse(d)
        if dev.kind == "meta":
            raise DeviceError("a worker cannot be pinned to `meta` (meta nodes run on any worker); pin cpu or cuda:N")
        parsed.append(str(dev))
    if not parsed:
        raise DeviceError("devices= is an empty list; give at least one device, or None for CPU workers")
    return [parsed[i % len(parsed)] for i in range(n)]


def _default_arena(workers: int) -> int:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 8 << 30
    return int(min(1 << 30, total // 4 // (workers + 1)))


_live_pools: "weakref.WeakSet[Local]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for pool in list(_live_pools):
        try:
            pool.close()
        except Exception:
            pass
