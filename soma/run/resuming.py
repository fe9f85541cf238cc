"""Resuming a map: its `state_dict()`, `resume=` and `checkpoint=` (SPEC 7.4, "Resuming"), for every runner.

What a state says: which inputs' outputs the caller has consumed. Every input before `next` is
consumed; `after` lists the runs `[start, stop)` of inputs at or after `next` consumed too (an
unordered map's outputs arrive out of order; an ordered map's list is always empty). Each gap
between runs holds an input taken and not yet consumed, so there are never more runs than the
map's window. Beside it, what identifies the map, so that a state is never applied to another one:

    {"format": "soma.map/1", "graph": "tokenize >> (encoder | other) >> join", "inputs": 3000,
     "ordered": false, "next": 1200, "after": [[1203, 1205], [1210, 1211]]}

Resuming, the map is given the inputs not consumed, each at its own position:

    xs a sequence (list, range, numpy array, ...)  xs[i] for i in the gaps: nothing before is touched
    xs any other iterable                          read past the consumed ones (islice, not run)
    the map's indices                               the same gaps (`positions`), so `.index` and
                                                    progress go on where they were

`Checkpoint` is `checkpoint=PATH`'s file: read at the start, written atomically (a temporary file
beside it, fsync, rename, fsync of the folder), removed once the map has yielded everything.
"""

from __future__ import annotations

import errno
import json
import os
import sys
from collections.abc import Mapping, Sequence
from itertools import chain, count, islice

from ..errors import SomaError

FORMAT = "soma.map/1"
DEFAULT_EVERY_S = 10.0  # checkpoint_every's default


def fingerprint(graph) -> str:
    """What identifies a map's graph in its state: its plan, which names every node and how they connect
    (placing a node elsewhere does not change it, so a state survives a move to another device)."""
    return str(graph.plan())


def length_of(xs):
    try:
        return len(xs)
    except TypeError:
        return None


def identity(graph_print: str, length, ordered: bool) -> dict:
    """What identifies a map in its state (the rest is `next` and `after`)."""
    return {"format": FORMAT, "graph": graph_print, "inputs": length, "ordered": ordered}


# -- refusing a state that is not this map's ---------------------------------------------------------

def checked(state, *, graph_print: str, length, ordered: bool, source: str) -> tuple[int, list]:
    """`(next, after)` of `state` when it is a state of this map; otherwise a SomaError that says what differs.
    `source` names where it came from ("map's resume= state", "the checkpoint /x/job.ckpt")."""
    if not isinstance(state, Mapping) or state.get("format") != FORMAT:
        raise SomaError(f"{source} is not the state of a soma map (a dict from map(...).state_dict() with "
                        f"format {FORMAT!r}); got {_short(state)}")
    missing = [k for k in ("graph", "inputs", "ordered", "next", "after") if k not in state]
    if missing:
        raise SomaError(f"{source} is not the state of a soma map: it has no {', '.join(map(repr, missing))}")
    if state["graph"] != graph_print:
        raise SomaError(f"{source} is of another graph: it was saved by a map over `{state['graph']}`, and this "
                        f"map's graph is `{graph_print}`; resume a map of the same graph (or start from input 0 "
                        f"without it)")
    if state["ordered"] != ordered:
        raise SomaError(f"{source} was saved by a map with ordered={state['ordered']}, and this map has "
                        f"ordered={ordered}: pass the same ordered= to resume it")
    if state["inputs"] is not None and length is not None and state["inputs"] != length:
        raise SomaError(f"{source} was saved by a map over {state['inputs']} inputs, and this map's xs has "
                        f"{length} (len(xs)): resume with the same xs")
    next_index, after = state["next"], state["after"]
    if not _is_count(next_index) or not _are_runs(after, next_index):
        raise SomaError(f"{source} is not the state of a soma map: 'next' must be an int >= 0 and 'after' sorted "
                        f"[start, stop) runs above it; got next={next_index!r}, after={_short(after)}")
    if ordered and after:  # (an ordered map hands out in order: nothing above `next` can have been consumed)
        raise SomaError(f"{source} is not the state of a soma map: an ordered map's state has no 'after' runs; "
                        f"got after={_short(after)}")
    end = after[-1][1] if after else next_index
    if length is not None and end > length:
        raise SomaError(f"{source} says inputs up to {end} were consumed, and this map's xs has {length} "
                        f"(len(xs)): resume with the same xs")
    return next_index, [list(run) for run in after]


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _are_runs(after, above: int) -> bool:
    if not isinstance(after, (list, tuple)):
        return False
    for run in after:
        if not (isinstance(run, (list, tuple)) and len(run) == 2 and all(map(_is_count, run))):
            return False
        start, stop = run
        if start <= above or stop <= start:  # (`next` itself is not consumed, or it would be above)
            return False
        above = stop
    return True


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def consumed_count(next_index: int, after: list) -> int:
    return next_index + sum(stop - start for start, stop in after)


# -- what is left to run -----------------------------------------------------------------------------

def gaps(next_index: int, after: list) -> list:
    """The `[start, stop)` ranges of inputs still to run, the last one endless (`stop` None)."""
    found, start = [], next_index
    for run_start, run_stop in after:
        found.append((start, run_start))
        start = run_stop
    found.append((start, None))
    return found


def positions(next_index: int, after: list):
    """The indices of the inputs still to run, in order (what the map numbers its inputs with)."""
    if not after:
        return count(next_index)
    return chain(*(range(a, b) if b is not None else count(a) for a, b in gaps(next_index, after)))


def is_sequence(xs) -> bool:
    """Whether `xs[i]` is the i-th item `iter(xs)` gives, so that inputs can be skipped by index: a
    collections.abc.Sequence (list, tuple, range, str), a numpy array or torch tensor, or an object that
    has `__len__` and `__getitem__` and no `__iter__` (iterating it is indexing it: a map-style torch Dataset).
    A dict, a pandas DataFrame (iterating gives its keys) or a set is read past as any other iterable."""
    if isinstance(xs, Sequence):
        return True
    kind = type(xs)
    if isinstance(xs, Mapping) or not hasattr(kind, "__len__") or not hasattr(kind, "__getitem__"):
        return False
    if not hasattr(kind, "__iter__"):
        return True
    numpy, torch = sys.modules.get("numpy"), sys.modules.get("torch")  # (never imported here for this)
    return (numpy is not None and type(xs) is numpy.ndarray and xs.ndim > 0) or \
        (torch is not None and isinstance(xs, torch.Tensor) and xs.dim() > 0)


def remaining(xs, next_index: int, after: list):
    """An iterator over the inputs of `xs` still to run (at `positions(next_index, after)`)."""
    if next_index == 0 and not after:
        return iter(xs)
    if is_sequence(xs):
        length = len(xs)
        indices = chain(*(range(a, length if b is None else min(b, length)) for a, b in gaps(next_index, after)))
        return map(xs.__getitem__, indices)
    source = iter(xs)
    return chain(_read_past(source, next_index, after), source)


def _read_past(source, next_index: int, after: list):
    """The inputs of the gaps before the last consumed run, reading past the consumed ones; the caller
    chains the rest of `source` after it (no generator step per input there)."""
    at = 0
    for start, stop in [(0, next_index)] + after:
        if start > at:
            yield from islice(source, start - at)  # a gap: these run
        if stop > start and next(islice(source, stop - start - 1, None), _ENDED) is _ENDED:
            raise SomaError(f"map was resumed with inputs up to {stop} consumed, but xs has fewer than {stop} "
                            f"inputs: resume with the same xs the state was saved from")
        at = stop


_ENDED = object()


async def aremaining(source, next_index: int, after: list):
    """`remaining` for an async iterable's iterator: the inputs still to run, the consumed ones read past."""
    at = 0
    for start, stop in [(0, next_index)] + after:
        for _ in range(start - at):
            try:
                yield await source.__anext__()
            except StopAsyncIteration:
                return
        for index in range(start, stop):
            try:
                await source.__anext__()
            except StopAsyncIteration:
                raise SomaError(f"map was resumed with inputs up to {stop} consumed, but xs has fewer than "
                                f"{stop} inputs: resume with the same xs the state was saved from") from None
        at = stop
    async for x in _rest(source):
        yield x


async def _rest(source):
    while True:
        try:
            yield await source.__anext__()
        except StopAsyncIteration:
            return


# -- the consumed inputs of an unordered map ----------------------------------------------------------

class Consumed:
    """Which inputs an unordered map handed out: everything before `next`, and runs above it, merged as
    outputs come (a few dict operations an output)."""

    __slots__ = ("next", "stops", "starts")

    def __init__(self, next_index: int, after: list):
        self.next = next_index
        self.stops = {start: stop for start, stop in after}  # a run's start → its stop
        self.starts = {stop: start for start, stop in after}  # a run's stop → its start

    def add(self, index: int) -> None:
        start, stop = index, index + 1
        if stop in self.stops:
            stop = self.stops.pop(stop)
            del self.starts[stop]
        if start in self.starts:
            start = self.starts.pop(start)
            del self.stops[start]
        if start == self.next:
            self.next = stop
        else:
            self.stops[start] = stop
            self.starts[stop] = start

    def runs(self) -> list:
        return [[start, self.stops[start]] for start in sorted(self.stops)]


def without(next_index: int, after: list, index: int) -> tuple[int, list]:
    """`(next, after)` with input `index` (one that is in it) taken out again."""
    if index < next_index:
        rest = [[index + 1, next_index]] if index + 1 < next_index else []
        return index, rest + after
    runs = []
    for start, stop in after:
        if start <= index < stop:
            runs += [run for run in ([start, index], [index + 1, stop]) if run[1] > run[0]]
        else:
            runs.append([start, stop])
    return next_index, runs


# -- checkpoint=PATH ---------------------------------------------------------------------------------

def checked_every(every) -> float:
    """`checkpoint_every`, checked whether or not a checkpoint is given (as every other option of map is)."""
    if isinstance(every, bool) or not isinstance(every, (int, float)) or not every >= 0:  # (NaN too)
        raise ValueError(f"map's checkpoint_every must be a number of seconds >= 0, got {every!r}")
    return float(every)


class Checkpoint:
    """The file of `checkpoint=PATH`: its state, written atomically at most every `every` seconds."""

    def __init__(self, path, every):
        every = checked_every(every)
        self.path = os.path.abspath(os.fspath(path))
        self.temporary = self.path + ".tmp"  # one fixed name: a write cut short is overwritten by the next
        self.folder = os.path.dirname(self.path)
        self.every = float(every)
        self.failed = False
        if not os.fspath(path):
            raise SomaError("map's checkpoint='' names no file: give the path of the file its state is written to")
        if os.path.isdir(self.path):
            raise SomaError(f"map's checkpoint={os.fspath(path)!r} is a folder: name a file in it (its map's state "
                            f"is written there), e.g. {os.path.join(self.path, 'map.ckpt')!r}")
        if not os.path.isdir(self.folder):
            raise SomaError(f"map's checkpoint={os.fspath(path)!r}: the folder {self.folder} does not exist")
        if not os.access(self.folder, os.W_OK | os.X_OK):
            raise SomaError(f"map's checkpoint={os.fspath(path)!r}: the folder {self.folder} is not writable")

    def load(self):
        """The state saved there, or None when there is no file."""
        try:
            with open(self.path, "rb") as f:
                text = f.read()
        except FileNotFoundError:
            return None
        try:
            return json.loads(text)
        except ValueError as err:
            raise SomaError(f"the checkpoint {self.path} is not a soma map's state (not JSON: {err}); delete it to "
                            f"start from input 0") from None

    def write(self, state: dict) -> None:
        """Write `state` so that the file holds either the old state or the new one, whatever happens."""
        data = json.dumps(state, separators=(",", ":")).encode()
        try:
            fd = os.open(self.temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(self.temporary, self.path)
            self._sync_folder()
        except OSError as err:
            self.failed = True
            raise SomaError(f"map could not write its checkpoint {self.path}: {type(err).__name__}: {err}") from err

    def remove(self) -> None:
        """The map has yielded everything: nothing to resume."""
        for path in (self.path, self.temporary):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._sync_folder()

    def _sync_folder(self) -> None:
        fd = os.open(self.folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        except OSError as err:  # a file system that cannot sync a folder (EINVAL: /proc, some FUSE): the rename
            if err.errno not in (errno.EINVAL, errno.ENOTSUP):  # stands as it is, as rename's own promise says
                raise
        finally:
            os.close(fd)
