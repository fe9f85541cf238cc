"""`runner.map(g, xs)`: many inputs through one graph, the same way on every runner.

The runner supplies an *in-flight set* (`Inflight`): something that starts inputs and reports what
became of them. This module does the rest, once for every runner: taking inputs lazily from `xs` within
the window, order, errors in their place with their `.index`, per-input timeouts, progress, and stopping
cleanly when the caller leaves the loop.

    xs ──1. take (only while taken - yielded < window)──▶ inflight.start(indices, xs)
                                                               │  (the runner's workers)
    caller ◀──2. yield in input order (or as ready)◀── 3. inflight.wait() → [(index, ok, value)]

`MapLoop` keeps the books of those three steps (the window, the order, the deadlines); `map_outputs`
drives it with a plain iterator. Each step is a method of its own, so another driver (an async one) walks
the same loop.

The books also say which outputs the caller consumed: `state_dict()`, `resume=` and `checkpoint=`
(soma.run.resuming) are the loop's, so every runner resumes the same way.

    loop.outputs() ──yield──▶ caller (holds it: `out`) ──next()──▶ consumed for a checkpoint too
                                                                    (its loop body ran)
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from itertools import islice
from operator import length_hint

from .._log import warn
from ..errors import SomaError
from .pending import Pending
from .progress import reporter, silent
from .resuming import (
    DEFAULT_EVERY_S,
    Checkpoint,
    Consumed,
    checked,
    checked_every,
    consumed_count,
    fingerprint,
    identity,
    length_of,
    positions,
    remaining,
    without,
)

ERRORS = ("raise", "yield")


class Span(list):
    """The outputs of consecutive inputs, all ok, reported at once: `(index, True, Span([...]))` from
    `Inflight.wait` stands for `(index + i, True, span[i])` of each. A runner whose inputs travel in chunks
    hands a chunk's outputs over in one entry; the loop hands them out one by one, in their turn."""

    __slots__ = ()

    @staticmethod
    def indices(first: int, value) -> range:
        """The inputs a delivered `(first, ok, value)` stands for: one, or a Span's."""
        return range(first, first + (len(value) if type(value) is Span else 1))


class Inflight:
    """What a runner provides for `map`. Every method is called from the iterating thread."""

    # The runner enforces `timeout` itself (map then never calls `expire`).
    enforces_timeout = False
    # The runner copies an input's buffers as it starts it (an amap starts large ones on a thread: amapping).
    copies_inputs = False

    def parallelism(self) -> int:
        """How many inputs the runner can usefully work on at once (the default window is twice this)."""
        raise NotImplementedError

    async def ready(self) -> None:
        """An amap's first step, before anything else is asked (on the event loop): what its runner must still
        do to take inputs, done without blocking the loop (Local's pool not started yet starts on a thread)."""

    def start(self, indices: list, xs: list) -> None:
        """Start these inputs: `xs[i]` is input `indices[i]` (ascending)."""
        raise NotImplementedError

    def wait(self, timeout: float | None) -> list:
        """`(index, ok, value)` for inputs that finished, at least one unless `timeout` (seconds) passed first
        (or `(index, True, Span)` for consecutive inputs that all finished ok)."""
        raise NotImplementedError

    async def await_wait(self, timeout: float | None, wake=None) -> list:
        """`wait`, awaited on the event loop (amap). `wake`, an asyncio future: once it is done, return at once with
        what finished by then, maybe nothing (amap's async source gave an input while others run: it starts now,
        not when one of them finishes)."""
        raise NotImplementedError

    def room(self, arrived: int) -> int | None:
        """How many inputs the map's window may hold now by the memory their values take (None: no bound but
        the window's): a runner whose values fill a bounded memory (Local's /dev/shm) holds the map back here.
        `arrived`: inputs in the window whose outputs arrived and wait to be handed out."""
        return None

    def expire(self, index: int) -> BaseException:
        """Input `index` ran out of time: stop it, and return the error to raise for it."""
        raise NotImplementedError

    def expire_all(self, indices: list) -> list:
        """Inputs that ran out of time at once (a batch's, started together): each stopped as `expire` stops one,
        their errors in order. A runner that stops a worker for one of them looks at all of them first (Local:
        the first one's replaced worker took its batch's others with it, which then said "still running: none")."""
        return [self.expire(index) for index in indices]

    def close(self) -> None:
        """The map is over: cancel what has not started, let the rest finish, release everything."""


def map_outputs(inflight: Inflight, xs, **options) -> "MapIterator":
    """The iterator behind every runner's `map` (see docs/design.md, "Many inputs"); `options` are
    MapLoop's (`graph`: the Graph it runs, what a state is checked against; window, ordered, ...)."""
    loop, source = opened(inflight, xs, lambda loop: _source(xs, loop), **options)
    return MapIterator(_drive(loop, source), loop)


def opened(inflight: Inflight, xs, source_of, **options) -> tuple:
    """A map's loop over `inflight` (`options`: MapLoop's) and its source of inputs, `source_of(loop)`, from
    where the loop starts (`resume=`). Anything refused here (an option, a `resume=` state, an `xs` that is
    not iterable: a TypeError now, not at the first `next`) gives the in-flight set back at once: nothing
    was started. Shared by `map_outputs` and `amap_outputs` (soma.run.amapping)."""
    try:
        loop = MapLoop(inflight, xs, **options)
        return loop, source_of(loop)
    except BaseException:
        inflight.close()
        raise


class MapIterator:
    """What `runner.map` returns: the outputs, one `next()` at a time, and `state_dict()`."""

    __slots__ = ("_outputs", "_loop")

    def __init__(self, outputs, loop: "MapLoop"):
        self._outputs, self._loop = outputs, loop

    def __iter__(self):
        # The generator itself: a `for` loop then steps it from C, with no Python call of ours per output
        # (a tiny map's loop is a few microseconds an output; a method here was a twentieth of it). A map with
        # a checkpoint is stepped holding its `stepping` lock (see `save_open`): through `__next__`.
        return self._outputs if self._loop.stepping is None else self

    def __next__(self):
        stepping = self._loop.stepping
        if stepping is None:
            return self._outputs.__next__()
        with stepping:
            return self._outputs.__next__()

    def state_dict(self) -> dict:
        """Which outputs were consumed so far, as plain data (JSON-able): pass it as `resume=` to a map of
        the same graph and `xs` to get only the others. The output last handed out counts as consumed
        (call it after handling that output, as torchdata's StatefulDataLoader counts)."""
        return self._loop.state(held=True)

    def close(self) -> None:
        """Leave the map early: no more inputs are taken, nothing leaks, and `checkpoint=`'s file is written
        (a `break` does the same once the iterator is let go of)."""
        self._outputs.close()
        self._loop.close()  # (a map never iterated has no generator frame to close it)


_RAISED = object()  # MapLoop.source_error once raised: the map is over, and the error let go


def _drive(loop: "MapLoop", source):
    try:
        while True:
            wanted = loop.wanted()
            if wanted:
                loop.start(_take(source, wanted, loop))
            yield from loop.outputs()
            if loop.over():
                return
            if not loop.must_wait():
                continue  # room for more inputs: take them before waiting
            loop.finished(loop.inflight.wait(loop.wait_s()))
    except KeyboardInterrupt:  # Ctrl-C while waiting: the traceback stops here, not deep in the runner
        raise KeyboardInterrupt from None
    finally:
        loop.close()


# Sources whose iterators never raise (nor do `remaining`'s over them): taken from without a guard, whose
# generator step cost every input ~0.1 µs (a fifteenth of a tiny map's host time).
_PLAIN = (list, tuple, range)


def _source(xs, loop: "MapLoop"):
    """The iterator a map takes its inputs from: what is left of `xs` (`resume=`), guarded unless plain."""
    source = remaining(xs, loop.next_index, loop.after_start)
    return source if type(xs) in _PLAIN else _guarded(source, loop)


def _guarded(source, loop: "MapLoop"):
    """`source`'s items; its end, or its own exception, is told to the loop (and ends this)."""
    try:
        yield from source
    except Exception as exc:
        loop.source_ended(exc)
        return
    loop.source_ended()


def _take(source, wanted: int, loop: "MapLoop") -> list:
    """Up to `wanted` inputs from `source` (at C speed; `_guarded`: none lost to its exception). Fewer is the
    source's end: told to the loop here when plain (a guarded one told it already, with its exception if any)."""
    items = list(islice(source, wanted))
    if len(items) < wanted and not loop.exhausted:
        loop.source_ended()
    return items


WINDOW_LOOK_S = 0.05  # how often a map without `window=` asks the runner how many inputs it works on at once

class MapLoop:
    """The books of one map: what was taken, what is in flight, what is done and not yet handed out.

    `errors="raise"`: a failed input's error is raised in its place (after every earlier output, in
    order), and no input after it is taken. `errors="yield"`: the error object is handed out in its
    place (`.index` set) and the map goes on. The iterable's own exception is raised either way."""

    def __init__(self, inflight: Inflight, xs, *, graph, window=None, ordered: bool = True, progress=False,
                 timeout=None, errors: str = "raise", resume=None, checkpoint=None, checkpoint_every=DEFAULT_EVERY_S,
                 owner=None):
        if errors not in ERRORS:
            raise ValueError(f"map's errors must be 'raise' or 'yield', got {errors!r}")
        self.inflight = inflight
        self.owner = owner  # the runner it runs on (its close() writes this map's checkpoint: `save_open`)
        self.stepping = None  # with a checkpoint: held while its caller steps it (`save_open`)
        self.window = _checked_window(window)
        if type(ordered) is not bool:
            raise TypeError(f"map's ordered must be True or False, got {ordered!r}")
        self.ordered = ordered
        self.timeout = timeout
        self.yield_errors = errors == "yield"
        self.graph = graph
        self.length = length_of(xs)
        self._graph_print = None  # fingerprint(graph), made when a state is first wanted
        self._identity = None  # resuming.identity(...), the same
        checked_every(checkpoint_every)
        self.checkpoint = Checkpoint(checkpoint, checkpoint_every) if checkpoint is not None else None
        if self.checkpoint is not None:
            self.stepping = threading.Lock()
        # next_index: where the map starts; with ordered=True, the index to hand out next.
        self.next_index, self.after_start = self._starting_point(resume)
        # Inputs are numbered by their position in xs: on resuming, only those not consumed are taken.
        self.positions = positions(self.next_index, self.after_start)
        self.consumed = None if ordered else Consumed(self.next_index, self.after_start)
        self.taken = self.yielded = consumed_count(self.next_index, self.after_start)
        self.out = None  # the index of the output the caller holds (a map with a checkpoint), or held when it ended
        self.unhanded = False  # it ended before `out` was handed to the caller (not consumed, whatever `held` says)
        self.handing = None  # (index, yielded, count, iterator) of the Span being handed out (see _settle)
        self.saved = self.yielded  # how many were consumed in the checkpoint's file (or at the start)
        self.save_at = time.monotonic() + (self.checkpoint.every if self.checkpoint is not None else 0.0)
        self.completed = self.closed = False
        self.report = reporter(progress, self.length, "soma map", start=self.yielded)
        self.exhausted = False
        self.source_error = None  # xs itself raised: the caller gets it after every earlier output
        self.failure = None  # (index, error) of the earliest input known to have failed (errors="raise")
        self.pending = Pending()  # started and not finished
        self.done: dict = {}  # index → (ok, value): finished and not yet handed out
        self.arrived: deque = deque()  # ordered=False: finished indices in arrival order
        self.deadlines: dict = {}  # index → deadline, in the order taken (one timeout for all: the first is next)
        self._default = 0  # the default window, as last looked at (`_limit`)
        self._look_at = 0.0  # when to look again
        self._eager_until = time.monotonic() + WINDOW_LOOK_S  # looked at on every turn until then (`_limit`)
        if self.checkpoint is not None:  # (last: one refused above, its checkpoint another map's, is never open)
            _OPEN.add(self)

    # -- 0. where it starts, and what was consumed ------------------------------------------------------------
    def _starting_point(self, resume) -> tuple[int, list]:
        """`(next, after)`: the consumed inputs of `resume=` or of the checkpoint's file; (0, []) for none."""
        if resume is not None and self.checkpoint is not None:
            raise ValueError("map takes resume= or checkpoint=, not both: with checkpoint= the state to resume "
                             "is the file's")
        if resume is not None:
            return checked(resume, graph_print=self.graph_print(), length=self.length, ordered=self.ordered,
                           source="map's resume= state")
        state = self.checkpoint.load() if self.checkpoint is not None else None
        if state is None:
            return 0, []
        next_index, after = checked(state, graph_print=self.graph_print(), length=self.length,
                                    ordered=self.ordered, source=f"the checkpoint {self.checkpoint.path}")
        done = consumed_count(next_index, after)
        warn("soma.map", "soma map: resumed at input %d from the checkpoint %s (%d outputs consumed before)",
             next_index, self.checkpoint.path, done)
        return next_index, after

    def graph_print(self) -> str:
        if self._graph_print is None:
            self._graph_print = fingerprint(self.graph)
        return self._graph_print

    def state(self, held: bool) -> dict:
        """The consumed inputs, as `state_dict()` gives them. `held=False`: without the output the caller
        holds (its loop body may not have run: what a checkpoint saves)."""
        if self.handing is not None:
            self._settle()
        if self._identity is None:
            self._identity = identity(self.graph_print(), self.length, self.ordered)
        held_out = self.out is not None and (not held or self.unhanded)  # (left out: its input runs again)
        if self.ordered:
            next_index, after = self.next_index, []
            if held_out:
                next_index = self.out
        else:
            next_index, after = self.consumed.next, self.consumed.runs()
            if held_out:
                next_index, after = without(next_index, after, self.out)
        return {**self._identity, "next": next_index, "after": after}

    def save(self) -> None:
        """Write the checkpoint if what was consumed changed since it was last written."""
        consumed = self.yielded - (self.out is not None)  # (at an ask, or while waiting: the caller holds none)
        if consumed != self.saved:
            self.checkpoint.write(self.state(held=False))
            self.saved = consumed
        self.save_at = time.monotonic() + self.checkpoint.every

    # -- 1. taking inputs ----------------------------------------------------------------------------------
    def _limit(self) -> int:
        if self.window:
            return self.window
        # The default window follows what the runner measures: looked at on every turn for the map's first
        # WINDOW_LOOK_S, where the first outcomes of a piece not measured yet widen it (looked at only every
        # WINDOW_LOOK_S, a map of 1,000 tiny inputs through a new piece took them 12 at a time to its end), then
        # at most every WINDOW_LOOK_S (asking on every turn was a tenth of a tiny map's host time once).
        now = time.monotonic()
        if now >= self._look_at or now < self._eager_until:
            self._default = default_window(self.inflight.parallelism())
            self._look_at = now + WINDOW_LOOK_S
        return self._default

    def wanted(self) -> int:
        """How many inputs to take now: none until a quarter of the window is free (inputs ship in chunks);
        where the runner holds the map back by memory, as many as it has room for, and at least one when
        nothing is in flight (the map always goes on: what finds no room then waits for it or travels another
        way, see soma.wire.room)."""
        if self.exhausted or self.failure is not None:
            return 0
        limit = self._limit()
        in_window = self.taken - self.yielded
        room = self.inflight.room(in_window - len(self.pending))
        if room is not None and room < limit:
            return max(room, 1) - in_window if room > in_window or in_window == 0 else 0
        if in_window == 0 or in_window <= limit - max(1, limit // 4):
            return limit - in_window
        return 0

    def source_ended(self, error: Exception | None = None) -> None:
        self.exhausted = True
        self.source_error = error

    def start(self, xs: list) -> None:
        """Start inputs just taken from the source."""
        if not xs:
            return
        indices = list(islice(self.positions, len(xs)))
        self.taken += len(xs)
        if self.timeout is not None and not self.inflight.enforces_timeout:
            self.deadlines.update(dict.fromkeys(indices, time.monotonic() + self.timeout))
        self.pending.add(indices)
        self.inflight.start(indices, xs)

    # -- 2. handing outputs out ----------------------------------------------------------------------------
    def outputs(self):
        """Every output that may be handed out now, in its turn; a failure is raised in its place.

        Each `yield` returns when the caller asks for the next output (its loop body ran); an exception
        there (`close()`, a `break` or an error let go of the iterator, Ctrl-C) means it never asked:
        the output it held is then `out`, which a checkpoint does not count."""
        done, ordered = self.done, self.ordered
        while True:
            if ordered:
                index = self.next_index
                if index not in done:
                    break
            elif self.arrived:
                index = self.arrived.popleft()
            else:
                break
            entry = done.pop(index)
            if type(entry) is Span:
                if ordered and self.report is silent and self.checkpoint is None:
                    # The common case: its books kept by how far its iterator went (`_settle`), with no step of
                    # ours per value (each was ~35 bytecodes: a fifth of a tiny map's host time).
                    count, values, yielded = len(entry), iter(entry), self.yielded
                    self.handing = (index, yielded, count, values)
                    try:
                        yield from values
                    except BaseException:
                        self._settle()
                        self.handing = None
                        self.out, self.unhanded = self.next_index - 1, False
                        raise
                    self.handing = None
                    self.next_index, self.yielded = index + count, yielded + count
                    continue
                values = entry
            else:
                ok, value = entry
                if not ok:
                    if not self.yield_errors:  # (only ordered maps keep such an entry: see finished)
                        if self.failure is not None:  # (the map ends here: its earliest failure's error let go)
                            self.failure = (self.failure[0], None)
                        try:
                            raise _indexed(value, index)  # (not consumed: a state says to run it again)
                        finally:  # (the error's traceback holds this frame: the frame must not hold it)
                            value = entry = failure = None
                    value = _indexed(value, index)
                values = (value,)
            # Each value in its turn, its books kept here: a Span's values too, without a generator of their own
            # (each level of `yield from` costs every output a frame's resume: ~0.15 µs, a tenth of a tiny map's
            # host time).
            consumed, failure, checkpoint = self.consumed, self.failure, self.checkpoint
            report = None if self.report is silent else self.report
            for value in values:
                handed = False
                try:
                    if ordered:
                        self.next_index = index + 1
                    elif failure is not None and index > failure[0]:
                        index += 1
                        continue  # after a failure: cancelled with the rest
                    elif index == consumed.next and not consumed.stops:
                        consumed.next = index + 1  # in order, no run above: Consumed.add's answer, without its call
                    else:
                        consumed.add(index)
                    self.yielded += 1
                    if checkpoint is not None:
                        self.out = index  # (held until the caller asks again: a save from outside skips it)
                    handed = True
                    yield value
                except BaseException:  # the caller's body cut short, or a Ctrl-C before it had the value
                    self.out, self.unhanded = index, not handed
                    raise
                if checkpoint is not None:
                    self.out = None
                if report is not None:  # (after the caller's body: what it consumed; a progress callable that
                    report(self.yielded)  # raised before the value was handed lost it from a checkpoint)
                index += 1
                if checkpoint is not None and time.monotonic() >= self.save_at:
                    self.save()
        if not ordered and self.failure is not None and not (self.pending and self.pending.oldest() < self.failure[0]):
            index, failed = self.failure
            self.failure = (index, None)  # (the error raised holds this frame, whose `self` must not hold it)
            try:
                raise _indexed(failed, index)
            finally:
                failed = failure = None

    def _settle(self) -> None:
        """The books of the Span being handed out (`handing`) brought up to the value the caller holds."""
        index, yielded, count, values = self.handing
        handed = count - length_hint(values)
        self.next_index, self.yielded = index + handed, yielded + handed

    def over(self) -> bool:
        """Whether the map has ended (its source's own exception, if any, is raised here)."""
        if self.pending or self.done or not (self.exhausted or self.failure is not None):
            return False
        if self.source_error is _RAISED:
            return True
        if self.source_error is not None:
            error, self.source_error = self.source_error, _RAISED  # (its traceback holds this frame, and `self`)
            try:
                raise error
            finally:
                error = None
        self.completed = True
        return True

    # -- 3. waiting for the runner ---------------------------------------------------------------------------
    def must_wait(self) -> bool:
        """Whether nothing can be done before the runner finishes something (no room to take more)."""
        return bool(self.pending) and not self.wanted()

    def wait_s(self) -> float | None:
        """How long to wait at most: until the oldest input's deadline (None: as long as it takes)."""
        wait = None
        if self.deadlines:
            wait = max(0.0, self.deadlines[next(iter(self.deadlines))] - time.monotonic())
        if self.checkpoint is not None and self.yielded != self.saved:
            due = max(0.0, self.save_at - time.monotonic())  # (what the caller consumed is written in time)
            wait = due if wait is None else min(wait, due)
        return wait

    def finished(self, results: list) -> None:
        """What the runner reports finished, and inputs whose time ran out meanwhile."""
        now = time.monotonic()
        deadlines = self.deadlines
        expired = []
        while deadlines and deadlines[(index := next(iter(deadlines)))] <= now:  # (the oldest first)
            del deadlines[index]
            expired.append(index)
        if expired:  # (none whose output came in `results`: its own, or in a chunk's Span)
            came = {i for first, _, v in results for i in Span.indices(first, v)}
            late = [i for i in expired if i in self.pending and i not in came]
            results += [(i, False, err) for i, err in zip(late, self.inflight.expire_all(late))]
        for index, ok, value in results:
            if index not in self.pending:
                continue
            if type(value) is Span:
                self.pending.discard_run(index, len(value))
                self.done[index] = value
                for i in range(index, index + len(value)) if deadlines else ():  # (each input its own deadline)
                    deadlines.pop(i, None)
                if not self.ordered:
                    self.arrived.append(index)
                continue
            self.pending.discard(index)
            deadlines.pop(index, None)
            if not ok and not self.yield_errors:
                if self.failure is None or index < self.failure[0]:
                    self.failure = (index, value)
                if not self.ordered:
                    continue  # raised in its turn by outputs(), never handed out as a value
            self.done[index] = (ok, value)
            if not self.ordered:
                self.arrived.append(index)
        if self.checkpoint is not None and time.monotonic() >= self.save_at:
            self.save()

    def save_unless_stepped(self) -> None:
        """Its runner closes: write the checkpoint now (what the caller consumed), unless the caller is stepping
        the map this moment (then it ends with the runner's error, and its close writes it)."""
        if self.stepping.acquire(blocking=False):
            try:
                if not self.closed and not self.checkpoint.failed:
                    self.save()
            finally:
                self.stepping.release()

    def close(self) -> None:
        """The map is over: its checkpoint removed (all yielded) or written (ended early), its in-flight set closed."""
        if self.closed:
            return
        self.closed = True
        _OPEN.discard(self)
        try:
            if self.checkpoint is not None and not self.checkpoint.failed:
                if self.completed:
                    self.checkpoint.remove()
                else:
                    self.save()
        finally:
            self.inflight.close()
            self.report(None)


_OPEN: "weakref.WeakSet[MapLoop]" = weakref.WeakSet()  # maps with a checkpoint, not over yet


def save_open(owner) -> None:
    """`owner`, a runner, is closing: each of its maps with a checkpoint that is not over writes it as of now,
    as one that ends early does. Its caller may never step it again, and a generator's `finally` runs only when
    it is collected: Ctrl-C in a loop body, out of `with soma.Local()`, left the map's iterator held by the
    traceback's frame, and its checkpoint was not written, not even at exit (resuming redid up to
    `checkpoint_every` of outputs). One being stepped by another thread now is left to write its own.
    One that cannot be written is warned about, not raised: the runner's close goes on to stop what it runs."""
    for loop in list(_OPEN):
        if loop.owner is owner:
            try:
                loop.save_unless_stepped()
            except Exception as err:  # (a full disk: its caller learns it here, and the workers still stop)
                warn("soma.map", "%s closed before its map with checkpoint=%r wrote it: %s", type(owner).__name__,
                     loop.checkpoint.path, err)


def default_window(parallelism: int) -> int:
    """The window of a `map` given none: twice the inputs the runner can work on at once."""
    return 2 * max(1, parallelism)


def _indexed(err: BaseException, index: int) -> BaseException:
    if isinstance(err, SomaError):
        err.index = index
    return err


def _checked_window(window):
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"map's window must be a positive number of inputs, got {window!r}")
    return window

