"""What becomes of a chunk's inputs: the core's rules for `Chunk` flows (core.py calls these; pure).

    a map of a one-piece program, untraced (soma.local.inflight), inputs measured
    cheap ──▶ Chunk(index, [x0 .. xk-1]) ── one Job (ids base+0 .. base+k-1) ── one Bundle ──▶ worker:
    each input run by itself, in order ──▶ one Outcome: each input's own output or error (a Bundled here)
      ├ the ok ones, consecutive ──▶ (index + p, True, Span([...]))   handed out one by one by the map
      ├ a failed one ─────────────▶ (index + p, False, its error)     in its place, like any input's
      └ handed back unstarted ───▶ a job of those places, sent again (same payload, only they run)
    its worker dies: the input it was running goes again if it has tries left (retries, its own), else fails
    (WorkerDied); the others go again elsewhere, no try counted.
    an input's time runs out: it alone ends (RunTimeout), never run after (core_chunks._expire_place).

Each input of a chunk ends once, with its own outcome: `Chunk.open` holds the places not ended yet.
"""

from __future__ import annotations

import copy

from ...errors import Cancelled
from ...run.mapping import Span
from .events import Bundled
from .flows import MAX_CHUNK, Job
from .outcomes import checked

CHUNK_S = 0.025  # a chunk holds about this much work (measured): see the note below
#                and at most flows.MAX_CHUNK inputs (UNWEIGHED_FILL until one of the piece's chunks was sent),
CHUNK_SHM = 4 << 20  # and no more than take this much /dev/shm (their inputs and outputs: Measures.chunk),
CHUNK_BYTES = 4 << 20  # nor this much of its message (its inputs as encoded: Measures.weigh_message)
UNWEIGHED_FILL = 1024  # (the message of a chunk of inputs of up to 32 KiB each, inline: 32 MiB at most)
AHEAD = 3  # chunks per worker a map keeps in flight: one running, the next two waiting behind it (see below)
STRAGGLER_S = 0.02  # a chunk's job out this long (and 4 times what it should take) while a worker idles:
#                     what it has not started goes to that worker
# Why 25 ms of work a chunk: a chunk's messages cost the host ~300 µs of Python and a worker ~200 µs (measured:
# 20,000 tiny inputs in chunks of 50 against 1,024), on the cores the workers need. At 5 ms a chunk, 100 µs inputs
# ran at 0.74x the chunked process pool (whose chunks hold ~30 ms); at 25 ms, 0.91x (medians of 8, alternated in
# one process). A straggler still gets a worker of its own (STRAGGLER_S), and outputs still come every PART_S.
# Why up to 4,096 inputs: a chunk's messages and books cost the host ~115 µs and its worker ~110 µs of CPU (fitted
# from maps of 20,000 tiny inputs in chunks of 64 and of 1,024, Dec 6): in chunks of 1,024 a fifth of a tiny
# input's cost. 20,000 tiny inputs in chunks of up to 1,024, 4,096, 8,192 ran at 0.98x, 1.10x, 1.06x the chunked
# process pool (a map splits its inputs evenly over the workers: chunks.even_chunks). Why three chunks ahead: with
# two, a worker that finished both waited ~1.2 ms for its next (its outcome and the next chunk each waiting for a
# core the other worker and the host were using: a timeline of one map, Dec 6); the map of 20,000 went 1.10x
# faster with three (medians of 4 x 40 maps, alternated).


def size(service_s: float | None) -> int:
    """How many inputs a chunk of a piece holds whose jobs take `service_s` each (None: not measured yet: 1)."""
    if service_s is None:
        return 1
    return max(1, min(MAX_CHUNK, int(CHUNK_S / max(service_s, 1e-7))))


def even_chunks(count: int, most: int, workers: int) -> int:
    """How many inputs each chunk of `count` inputs started together holds: at most `most`, the chunks as many as
    a multiple of `workers` (each worker gets as many, of nearly one size: none is left running the last one
    alone while the others idle; 20,000 inputs in chunks of up to 4,096 on 2 workers: 6 of 3,334, not 4 of
    4,096 and one of 3,616)."""
    chunks = -(-count // most)
    chunks = -(-chunks // workers) * workers
    return -(-count // chunks)


def arrived(job: Job, one: Bundled, worker) -> tuple[list, list]:
    """(Part of) a chunk's answer (`one`: its ids, oks, values in the order of its places): `([(index, ok, value) to
    deliver], [places handed back unstarted])`. Only the job's pending places count (what was handed on to
    another worker meanwhile is that job's, and an input that ended already is not delivered twice); those
    answered are no longer pending, nor open once delivered."""
    chunk = job.flow
    base, index, piece, pending, open_ = job.base, chunk.index, job.piece, job.pending, chunk.open
    out, back = [], []
    ids, oks, values = one.jobs, one.oks, one.values
    first, n = (ids[0], len(ids)) if ids else (base, 0)
    # (the common case: the part's ids consecutive, a range (protocol.ChunkPart), its places checked and cleared
    # as one slice; else one by one)
    start, stop = first - base, first - base + n
    places = range(start, stop) if type(ids) is range else [i - base for i in ids]
    if (one.decoded and type(places) is range and not piece.devices and pending.covers(start, stop)
            and open_.covers(start, stop)):
        if n:  # (all ok, all wanted, nothing to look at: one Span)
            out.append((index + start, True, Span(values)))
        pending.drop_run(start, stop)
        open_.drop_run(start, stop)
        return out, back
    run_places, run_values = [], []
    for place, ok, value in zip(places, oks, values):
        if place not in pending:
            continue
        pending.discard(place)
        if not ok and type(value) is Cancelled:
            back.append(place)
            continue
        if place not in open_:
            continue
        if ok:
            value, ok = checked(job, value, worker)
        open_.discard(place)
        if ok:
            run_places.append(place)
            run_values.append(value)
            continue
        out.append((index + place, False, value))
    _runs(out, index, run_places, run_values)
    return out, back


def _runs(out: list, index: int, places: list, values: list) -> None:
    """The ok outputs as Spans of consecutive places."""
    if not places:
        return
    if places[-1] - places[0] == len(places) - 1:
        out.append((index + places[0], True, Span(values)))
        return
    start = 0
    for i in range(1, len(places) + 1):
        if i == len(places) or places[i] != places[i - 1] + 1:
            out.append((index + places[start], True, Span(values[start:i])))
            start = i


def failed(chunk, places, error: BaseException) -> list:
    """`(index, False, error)` for each of these places of `chunk` still open (each its own copy of `error`:
    a map hands each out with its own `.index`); they are no longer open."""
    out = []
    for place in places:
        if place in chunk.open:
            chunk.open.discard(place)
            out.append((chunk.index + place, False, _copy(error) if out else error))
    return out


def lost(job: Job, running: dict | None) -> int | None:
    """The place of `job`'s chunk its dead worker was running (its status page: `running`, job id → node;
    None when unreadable: its first place still pending counts as running), or None when it ran none."""
    pending = sorted(job.pending)
    if running is None:
        return pending[0]
    base = job.base
    for place in pending:
        if base + place in running:
            return place
    return None


def still_open(chunk, places) -> list:
    """Those of `places` (of `chunk`) whose inputs have not ended."""
    return [p for p in places if p in chunk.open]


def running(job: Job, running: list) -> int | None:
    """The place of `job`'s chunk its worker runs now (its status page: `running`, [(job id, node)]), or None."""
    pending = job.pending
    for job_id, _ in running:
        place = job_id - job.base
        if place in pending:
            return place
    return None


def _copy(error: BaseException) -> BaseException:
    try:
        return copy.copy(error)
    except Exception:  # (an exception that cannot be copied: shared, rather than lost)
        return error
