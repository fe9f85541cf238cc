"""The protocol between a `Local` host and its workers: every message that crosses, both ways.

Both sides import this module, and nothing else decides what a message holds:
the records below are the messages, `pack` seals one into a frame and `parse`
opens a frame into a record. The values inside (a node's input and output) are
`soma.wire.codec`'s business; how the frames travel is `soma.wire.transport`'s.

    host → worker   Task(code, pieces, jobs, frees, forget, held, room_s, sys_path)
                        code    {node key: the node, pickled}      only what this worker lacks
                        pieces  {piece id: piece spec}             only what this worker lacks
                        jobs   [JobSpec(id, piece, payload, traced)] one input for one piece each,
                               or Bundle(ids, piece, payload)   inputs of a one-node batching piece,
                                                                 encoded together as one list
                               or Chunk(ids, piece, payload, traced)  consecutive inputs of any other
                                                                 piece, encoded together as one list
                        frees   [[segment, n]]                     see soma.wire.shm
                        forget  [node key]                         the host let these nodes go
                        held    bytes of /dev/shm the caller's results hold (see soma.wire.room)
                        sys_path  the host's sys.path, with code, when it changed since the worker had it
                    Free(frees)      Cancel(job ids: drop them if not started)      Stop()
                    GiveBack(job ids: those not started come back unrun, named in `returned`)
    worker → host   Hello(worker, pid, device)
                    Result(worker, pid, outcomes, releases, leaving, returned)
                        outcomes [Outcome(job, ok, body, spans, seconds)]
                                 body: the encoded output when ok, else an error body (below)
                                 a Bundle's: Outcome(ids, [per id: True | bytes | error body],
                                 the encoded list of the True ones' outputs, None, seconds each)
                                 a Chunk's: one or more ChunkPart(ids, said, body, spans, seconds, more)
                                 (said None: every one True; seconds: the typical input's)
                        releases [[segment, n]]                    receipts whose storages died
                        leaving  over max_memory: it takes nothing more, and the host replaces it
                                 once every job it was sent has come back (answered, or Cancelled)
                        returned [job id]: given back unstarted (a GiveBack's answer), never to run here

A chunk (the host's choice for inputs measured cheap) is answered input by input,
in parts: each part a `ChunkPart` of the inputs done since the last, each with its
own ok or error and spans, the outputs of those that ran ok encoded as one
list, and the part's typical input's seconds (what the host sizes chunks by). The
worker sends a part when what is done has waited PART_S (40 ms) while the chunk
still runs, when a Cancel names one of its inputs that has not started
(answered Cancelled in that part), when a GiveBack names any of it, and when the
chunk is over; `more` says whether later parts follow. A GiveBack is always
answered by one Result, at once, even while an input runs long: it carries the
parts of what is done and, in `returned`, the named inputs that had not started
(dropped: the host sends them elsewhere). Every input of a chunk is answered
exactly once, in a part or in `returned`; an id of 0 is an input not wanted.
The host reads a part as it reads a Bundle's outcomes (host/outcomes.py's `bundled`).

A chunk's ids that are consecutive (the common case: a whole chunk, or a part of
one) are a `range`, in the records and on the wire (an ext of two integers: the
ids of 1,024 inputs were 9 KiB to pack, parse and compare on each side); a
Bundle's, or a chunk's with gaps (the rest of one sent again), a list.

A frame is `mac + body`, body = msgpack([kind, *fields]), mac = keyed BLAKE2b of
the body with the pool's secret, or for a body of SHA_FROM bytes or more its
HMAC-SHA-256 cut to 16 bytes (`mac`: the faster of the two at each size). A
frame that does not authenticate or decode is dropped and logged (rate-limited);
nothing in it is ever unpickled.

A piece spec is a plan tree in the plan's own words: `["Step", id, key, device]`,
`["Seq", [...]]`, `["Wave", [...]]`. An error body is a dict that rebuilds the
same `NodeError` on the host (`soma.wire.failures`).
"""

from __future__ import annotations

import struct
import time
from typing import NamedTuple

import msgpack

from .._log import warn
from ..plan import Plan, Seq, Step, Wave, fold
from .codec import ThreadPacker

try:  # keyed BLAKE2 straight from its module: hashlib would load OpenSSL first (5 ms per worker start)
    from _blake2 import blake2b
except ImportError:  # pragma: no cover - every CPython has it, other interpreters may not
    from hashlib import blake2b
try:
    from _operator import _compare_digest as compare_digest
except ImportError:  # pragma: no cover
    from hmac import compare_digest

SECRET_ENV = "SOMA_SECRET"
SYS_PATH_ENV = "SOMA_SYS_PATH"  # the host's sys.path as a worker starts with it: a JSON list of str
MAC_SIZE = 16

HELLO, TASK, RESULT, FREE, CANCEL, STOP, GIVE_BACK = range(1, 8)


# -- the messages ----------------------------------------------------------------------------------

class JobSpec(NamedTuple):
    """One input for one piece: what a worker runs, one at a time per piece."""

    id: int
    piece: int
    payload: bytes  # the input, encoded by soma.wire.codec
    traced: object  # False, or [the input's index (None for a run)]: record spans for runner.trace()


class Bundle(NamedTuple):
    """Inputs of one piece that is a batching node alone, encoded together (one encoder pass, one message
    entry, one decode in the worker, one outcome back): the per-input costs hand-batching does not pay.
    `ids[i]` is the job of `payload`'s i-th input, or 0 when that input is not wanted (the rest of a bundle
    sent again after its worker left before starting it: the whole payload travels, only these run)."""

    ids: list
    piece: int
    payload: bytes  # the inputs, as one list encoded by soma.wire.codec


class Chunk(NamedTuple):
    """Consecutive inputs of one piece that is not a batching node alone (a map's, measured cheap), encoded
    together and sent as one entry: the worker runs them one by one, in order, and answers in `ChunkPart`s
    (the host chunks only pieces without a batching node: one by one, each input would wait at its meeting).
    `ids[i]` is the job of `payload`'s i-th input, or 0 when that input is not wanted (a chunk sent again:
    the whole payload travels, only these run); `traced` is False, or each input's JobSpec `traced`."""

    ids: list | range  # (a range when they are consecutive: see the module's docstring)
    piece: int
    payload: bytes  # the inputs, as one list encoded by soma.wire.codec
    traced: object  # False, or [per input: False, or [its index]]


class Outcome(NamedTuple):
    """What became of one job (or of a Bundle's: see the module's docstring)."""

    job: int
    ok: bool
    body: object  # the encoded output (bytes) when ok, else an error body (dict)
    spans: list | None  # soma.run.interpreter.span records, when the job was traced
    seconds: float  # how long the job ran in the worker (the host sizes its batches by it)


class ChunkPart(NamedTuple):
    """What became of some inputs of a Chunk (see the module's docstring)."""

    ids: list | range  # the inputs answered here, in the chunk's order (a range when consecutive)
    said: list | None  # per id: True (its output is the next of `body`'s list), bytes (its output, alone), or
    #                    error body; None when every one is True (the common case: one byte, not one per input)
    body: object  # the encoded list of the True ones' outputs, or None
    spans: list | None  # None when no input here was traced, else per id: its spans, or None
    seconds: float  # how long its typical input ran in the worker (the median of at most ~32 of them, evenly
    #                 spread: one straggler among cheap inputs must not make the next chunks small)
    more: bool  # inputs of the chunk are still to be answered, in later parts


class Hello(NamedTuple):
    worker: str
    pid: int
    device: str


class Task(NamedTuple):
    code: dict
    pieces: dict
    jobs: list
    frees: list
    forget: list
    held: int = 0  # bytes of /dev/shm the caller's results hold now (a worker short of room says so: soma.wire.room)
    # How long a reservation short of room in /dev/shm waits for frees on their way before it spills (None: by
    # its size, soma.wire.room.room_wait_s): a map held back by memory counted room for its outputs.
    room_s: float | None = None
    # The host's sys.path, with code, when it changed since this worker was given it (None: it did not): the
    # worker searches it before it loads that code (host/procs.py `path_news`).
    sys_path: list | None = None


class Result(NamedTuple):
    worker: str
    pid: int
    outcomes: list  # Outcome, or ChunkPart
    releases: list
    leaving: bool = False
    returned: list = []  # job ids given back unstarted (GiveBack); (never changed in place: one default for all)


class Free(NamedTuple):
    frees: list


class Cancel(NamedTuple):
    jobs: list


class Stop(NamedTuple):
    pass


class GiveBack(NamedTuple):
    """The host wants these jobs back if they have not started (a straggler holds up the rest of a chunk)."""

    jobs: list


_KIND_OF = {Hello: HELLO, Task: TASK, Result: RESULT, Free: FREE, Cancel: CANCEL, Stop: STOP, GiveBack: GIVE_BACK}


EXT_RANGE = 1  # a msgpack ext of the message layer (values are codec's, inside payloads): a range of ids
_RANGE = struct.Struct("<qq")  # its start and stop (its step is 1)


def _packed_range(obj) -> msgpack.ExtType:
    """The Packer's `default`: a range of ids (step 1) as EXT_RANGE; nothing else but msgpack's own types."""
    if type(obj) is range and obj.step == 1:
        return msgpack.ExtType(EXT_RANGE, _RANGE.pack(obj.start, obj.stop))
    raise TypeError(f"a message cannot hold {type(obj).__name__}")


def _unpacked_ext(code: int, data: bytes):
    if code == EXT_RANGE:
        return range(*_RANGE.unpack(data))
    raise ValueError(f"unknown ext {code} in a message")


_local = ThreadPacker(use_bin_type=True, default=_packed_range)  # (see soma.wire.codec: one Packer per thread)


def pack(secret: bytes, message) -> bytes:
    """One sealed frame for a message record (NamedTuples pack as msgpack arrays, as they are)."""
    body = _local.pack([_KIND_OF[type(message)], *message])
    return mac(secret, body) + body


def parse(secret: bytes, frame: bytes, origin: str):
    """The message record in `frame`, or None (logged) when it does not authenticate or is malformed."""
    if len(frame) < MAC_SIZE:
        _dropped(origin, f"a frame of {len(frame)} bytes, shorter than its {MAC_SIZE}-byte seal")
        return None
    tag, body = frame[:MAC_SIZE], frame[MAC_SIZE:]
    if not compare_digest(tag, mac(secret, body)):
        _dropped(origin, "a message that failed authentication")
        return None
    try:
        fields = msgpack.unpackb(body, raw=False, strict_map_key=False, use_list=True, ext_hook=_unpacked_ext)
        kind = fields[0]
        if kind == TASK:
            code, pieces, jobs, frees, forget, held, room_s, sys_path = fields[1:]
            return Task(code, pieces, [_entry(u) for u in jobs], frees, forget, held, room_s, sys_path)
        if kind == RESULT:
            worker, pid, outcomes, releases, leaving, returned = fields[1:]
            return Result(worker, pid, [Outcome(*o) if len(o) == 5 else ChunkPart(*o) for o in outcomes], releases,
                          leaving, returned)
        if kind == HELLO:
            return Hello(*fields[1:])
        if kind == FREE:
            return Free(*fields[1:])
        if kind == CANCEL:
            return Cancel(*fields[1:])
        if kind == STOP and len(fields) == 1:
            return Stop()
        if kind == GIVE_BACK:
            return GiveBack(*fields[1:])
    except Exception as err:
        _dropped(origin, f"an authenticated message that did not decode ({type(err).__name__}: {err})")
        return None
    _dropped(origin, f"an authenticated message of unknown shape (kind {fields[0]!r}, {len(fields)} fields)")
    return None


def _entry(fields: list):
    """A Task's entry: a JobSpec (4 fields, one id), a Bundle (3 fields) or a Chunk (4 fields, a list or a range
    of ids)."""
    if len(fields) == 3:
        return Bundle(*fields)
    return JobSpec(*fields) if type(fields[0]) is int else Chunk(*fields)


def mac(secret: bytes, body: bytes) -> bytes:
    """The seal of `body`: keyed BLAKE2b under SHA_FROM bytes, HMAC-SHA-256 (cut to MAC_SIZE) from there on."""
    if len(body) < SHA_FROM:
        keyed = _keyed.get(secret)
        if keyed is None:
            keyed = _keep(_keyed, secret, blake2b(key=secret, digest_size=MAC_SIZE))
        h = keyed.copy()  # a copy of the keyed state: cheaper than keying a new hash for every frame
        h.update(body)
        return h.digest()
    keyed = _keyed_big.get(secret)
    if keyed is None:
        keyed = _keep(_keyed_big, secret, _hmac_sha256(secret))
    h = keyed.copy()
    h.update(body)
    return h.digest()[:MAC_SIZE]


def _keep(keyed: dict, secret: bytes, state):
    if len(keyed) >= _KEYED_MAX:  # (a process that makes many pools must not keep every secret)
        keyed.clear()
    keyed[secret] = state
    return state


# Both sides choose by the body's length. A run's messages (~150 bytes) seal in 0.45 µs with BLAKE2b against 0.9
# with HMAC; from ~1 KiB on, SHA-256 on the CPU's SHA instructions (OpenSSL) is the faster: 1.6-1.8 GB/s against
# BLAKE2b's 0.6-0.9 here (a bundle of 13 4-KiB tensors: 31 against 58 µs, on each side). Measured Dec 6.
SHA_FROM = 1024
_keyed: dict = {}  # secret → a BLAKE2b keyed with it, never updated (a pool has one secret)
_keyed_big: dict = {}  # secret → an HMAC-SHA-256 keyed with it, the same way
_KEYED_MAX = 16


def _hmac_sha256(secret: bytes):
    """HMAC-SHA-256 keyed with `secret`, as a state to copy: OpenSSL's (its module loads here, at the first big
    frame: 2.5 ms once, not at every worker's start), else the standard library's."""
    try:
        from _hashlib import hmac_new
        return hmac_new(secret, digestmod="sha256")
    except ImportError:  # pragma: no cover - a CPython built without OpenSSL
        import hashlib
        import hmac
        return hmac.new(secret, digestmod=hashlib.sha256)


class _DropLog:
    """One warning for the first dropped frame, then one line per interval with the count since.

    A flood of forged frames must not become a flood of log lines.
    """

    INTERVAL_S = 10.0

    def __init__(self):
        self.since = 0  # drops not yet reported
        self.last = float("-inf")

    def __call__(self, origin: str, what: str) -> None:
        now = time.monotonic()
        if now - self.last < self.INTERVAL_S:
            self.since += 1
            return
        more = f" (and {self.since} more dropped since the last report)" if self.since else ""
        self.since, self.last = 0, now
        warn("soma.protocol", "soma: dropped %s from %s%s", what, origin, more)


_dropped = _DropLog()


# -- pieces: plan trees with node keys and devices --------------------------------------------------

def pack_piece(plan: Plan, keys: dict, devices: dict) -> bytes:
    """A piece's spec: its plan tree, each step with its node key and declared device."""
    tree = fold(plan, lambda step: ["Step", step.id, keys[step.id], devices.get(step.id)],
                lambda _, items: ["Seq", items], lambda _, branches: ["Wave", branches])
    return msgpack.packb(tree, use_bin_type=True)


def parse_piece(spec: bytes) -> tuple[Plan, dict]:
    """`(plan, {node id: (key, device)})` from a piece spec."""
    steps: dict = {}
    return _plan(msgpack.unpackb(spec, raw=False, use_list=False), steps), steps


def _plan(tree, steps: dict) -> Plan:
    kind = tree[0]
    if kind == "Step":
        _, node_id, key, device = tree
        steps[node_id] = (key, device)
        return Step(node_id)
    children = tuple(_plan(child, steps) for child in tree[1])
    if kind == "Seq":
        return Seq(children)
    if kind == "Wave":
        return Wave(children)
    raise ValueError(f"unknown plan kind {kind!r} in a piece spec")
