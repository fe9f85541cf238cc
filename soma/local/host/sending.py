"""What jobs travel as: inputs encoded for the worker they go to (the loop's side of a `Send`).

    core: Send(slot, jobs) ── dispatch.entries(jobs) ─▶ [each job alone | a batching node alone's in a bundle]
    loop: encode(get_store, entries) ─▶ items (jobs, `BundleSend`s) for pool.send, the inputs that could
          not be encoded, each with its NodeError (handed back to the core: `unsent`), and the /dev/shm each
          piece's inputs were copied into, the bytes of a chunk's message each took (`weights`: the core
          weighs them)

An input is encoded once, when its job is first sent: a wave's branches share one
encoding (`Job.twins`), a bundle's inputs are one encoder pass and one payload
(`Packed`), and a job sent again after its worker left goes as it was. Encoding
uses the host's shared-memory store, so it happens here, never in the core.
"""

from __future__ import annotations

import copy

from ...errors import NodeError, SharedMemoryFull
from ...wire import codec
from .places import Places


class Packed:
    """A bundle's inputs encoded together: one payload (a list), the segments it lends, and the encoder that
    keeps what its handles name alive (every job of the bundle holds it: see Job.keep)."""

    __slots__ = ("piece", "payload", "shared", "keep", "size", "places")

    def __init__(self, piece, payload: bytes, encoder, size: int):
        self.piece, self.payload, self.shared, self.keep, self.size = piece, payload, encoder.shared, encoder, size
        self.places = None  # a chunk's: the place in its chunk of each input of the payload


class BundleSend:
    """What one send of a bundle carries: its payload, and the ids of the jobs of it that run now (0 for an
    input whose job is elsewhere or over: a bundle sent again after its worker left carries its whole
    payload, and the worker runs only the inputs named)."""

    __slots__ = ("packed", "ids", "piece", "shared", "jobs", "spec")

    def __init__(self, packed: Packed, jobs: list):
        self.packed, self.piece, self.shared, self.jobs = packed, packed.piece, packed.shared, jobs
        first = jobs[0]
        if first.places is not None:  # a chunk's job: it runs the inputs of its places
            base = first.base
            places = packed.places
            if first.places is places:  # (all of them: the common case; ascending, and consecutive but where
                # an input could not be encoded: then a range, two integers on the wire: protocol.Chunk)
                consecutive = places[-1] - places[0] == len(places) - 1
                self.ids = (range(base + places[0], base + places[-1] + 1) if consecutive
                            else [base + place for place in places])
            else:
                wanted = set(first.places)
                self.ids = [base + place if place in wanted else 0 for place in places]
            chunk = first.flow  # (its fields as protocol.Chunk's; a traced chunk's inputs: each its index)
            self.spec = (self.ids, self.piece.id, packed.payload, False if chunk.trace is None else [
                [chunk.index + place] for place in places])
            return
        self.ids = [0] * packed.size
        for job in jobs:
            self.ids[job.position] = job.id
        self.spec = (self.ids, self.piece.id, packed.payload)  # (as protocol.Bundle's fields)


def encode(get_store, groups: list) -> tuple[list, list, list]:
    """`(items to send, [(job, the NodeError its input raised)], weights(items))` for `groups` (dispatch.entries)."""
    items, failed = [], []
    for group in groups:
        first = group[0]
        if first.places is not None and first.packed is None:  # a chunk, first sent: its inputs as one list
            try:
                _pack_chunk(get_store, first)
            except NodeError:
                failed += _chunk_split(get_store, first)  # (each bad input fails by itself: see _chunk_split)
            if first.packed is None:
                continue
        if first.packed is not None:
            items.append(BundleSend(first.packed, group))
        elif len(group) == 1:
            if first.spec is None:
                try:
                    encode_alone(get_store, first)
                except NodeError as err:
                    failed.append((first, err))
                    continue
            items.append(first)
        else:
            bundled, bad = _bundle(get_store, first.piece, group)
            failed += bad
            by_packed: dict = {}
            for job in bundled:
                by_packed.setdefault(id(job.packed), []).append(job)
            items += [BundleSend(members[0].packed, members) for members in by_packed.values()]
    return items, failed, weights(items)


def weights(items: list) -> list:
    """`[(piece, bytes of /dev/shm one input was copied into or None, bytes one input takes of its chunk's
    message or None)]` for the encodings among `items` (encode's) that copied any, or are a chunk's: what a
    map's back-pressure by memory counts for its inputs, and what bounds a chunk (Measures.weigh, weigh_message)."""
    found = []
    for item in items:
        message = None
        if type(item) is BundleSend:
            packed = item.packed
            encoder, count = packed.keep, packed.size
            if packed.places is not None:  # (a chunk's)
                message = len(packed.payload) // count
        else:
            encoder, count = item.keep, 1
        copied = encoder is not None and encoder.copied
        if copied or message is not None:
            found.append((item.piece, sum(encoder.copied) // count if copied else None, message))
    return found


def encode_alone(get_store, job) -> None:
    """Encode a job's input on its own (once per value for the jobs made from it in one step: `twins`)."""
    x, twins = job.value, job.twins
    found = twins.get(id(x))
    if found is None:
        trace, piece = job.flow.trace, job.piece
        payload = codec.pack_scalar(x) if trace is None else None  # (one number, say: no Encoder, nothing kept)
        if payload is not None:
            found = (payload, (), None)
        else:
            encoder = codec.Encoder(get_store)
            if trace is not None:
                with trace.host_step("encode input", node=piece.entry, input=job.flow.index) as args:
                    payload = _packed(encoder.pack, x, piece.entry)
                    args.update(bytes=len(payload), shm_copies=encoder.copied)
            else:
                payload = _packed(encoder.pack, x, piece.entry)
            found = (payload, encoder.shared, encoder)
        twins[id(x)] = found
    payload, job.shared, job.keep = found
    job.spec = (job.id, job.piece.id, payload, [job.flow.index] if job.traced else False)  # (protocol.JobSpec's)
    job.value = None


def _bundle(get_store, piece, jobs: list) -> tuple[list, list]:
    """Encode the inputs of `jobs` (of one bundled piece, going to one worker) together: `(the jobs now in a
    bundle, [(job, the NodeError its input raised)])`. One encoder pass for all; when that fails, each input
    goes in a bundle of its own, so a bad input fails by itself and the others still go."""
    try:
        return _packed_together(get_store, piece, jobs), []
    except NodeError:
        pass
    bundled, failed = [], []
    for job in jobs:
        try:
            bundled += _packed_together(get_store, piece, [job])
        except NodeError as err:
            failed.append((job, err))
    return bundled, failed


def _packed_together(get_store, piece, jobs: list) -> list:
    encoder = codec.Encoder(get_store)
    payload = _packed(encoder.pack_each, [job.value for job in jobs], piece.entry)
    packed = Packed(piece, payload, encoder, len(jobs))
    for position, job in enumerate(jobs):
        job.packed, job.position, job.keep, job.value = packed, position, encoder, None
    return jobs


def _pack_chunk(get_store, job) -> None:
    """Encode a chunk's inputs as one list (one encoder pass): the job's payload, for each of its places."""
    encoder = codec.Encoder(get_store)
    job.packed = Packed(job.piece, _packed(encoder.pack_each, job.value, job.piece.entry), encoder, len(job.value))
    job.packed.places = job.places
    job.keep, job.shared, job.value = encoder, encoder.shared, None


def _chunk_split(get_store, job) -> list:
    """A chunk whose inputs cannot be encoded as one list: `[(a job of the place of each input that cannot be
    encoded, its NodeError)]` (each fails by itself: core.unsent); the job keeps the others, encoded together,
    or, when none can be, the last input that cannot: it fails with it, and with it the job is over (a copy
    failed in its place, and the job, out at its worker in the core's books, was never sent nor given back:
    its worker's load stayed up by one for good, and after a few such maps no chunk found room, Dec 7)."""
    failed, places, kept = [], [], []
    for place, x in zip(job.places, job.value):
        try:
            _packed(codec.Encoder(get_store).pack, x, job.piece.entry)
        except NodeError as err:
            failed.append((_alone(job, place), err))
            continue
        places.append(place)
        kept.append(x)
    if places:
        job.value, job.places, job.pending = kept, places, Places(job.flow.count, places)
        try:
            _pack_chunk(get_store, job)
        except NodeError as err:  # (each alone went, all together not: they fail together, never silently)
            failed += [(_alone(job, place), err) for place in places]
    if job.packed is None and failed:  # (no input of it goes: the job itself fails with the last)
        last, err = failed[-1]
        job.value, job.places, job.pending = None, last.places, last.pending
        failed[-1] = (job, err)
    return failed


def _alone(job, place: int):
    """A job of `job`'s chunk for the input at `place` alone, that fails (core.unsent: it never goes out)."""
    alone = copy.copy(job)
    alone.places, alone.pending, alone.slot = [place], Places(job.flow.count, [place]), None
    return alone


def _packed(pack, x, entry: str) -> bytes:
    """`pack(x)` (an encoder's); what stops it is a NodeError of node `entry` that says why."""
    try:
        return pack(x)
    except codec.GradCrossing as err:
        raise NodeError.failed(entry, err.reason("its input is")) from None
    except codec.Unsendable as err:
        raise NodeError.failed(entry, f"its input cannot be sent to a worker: {err}") from None
    except SharedMemoryFull as err:
        raise SharedMemoryFull.again(entry, err, "its input") from None
    except OSError as err:  # a segment that could not be made or mapped (too many open files, ...)
        raise NodeError.failed(entry, f"its input could not be put in shared memory: {type(err).__name__}: "
                                      f"{err}") from err
