"""A job's input and output in a worker: decoded from the host's message, encoded for it, every failure a
NodeError that names the node (the encoder's sends counted before it goes: see codec.Encoder)."""

from __future__ import annotations

from ...errors import NodeError, SharedMemoryFull
from ...wire import codec, failures


def decode_input(payload: bytes, entry: str, worker: str, get_store):
    try:
        x = codec.unpack_scalar(payload)  # (one number, say: without a Decoder)
        return codec.Decoder(get_store).unpack(payload) if x is codec.NOT_SCALAR else x
    except Exception as err:
        raise NodeError.failed(entry, f"its input could not be received in worker {worker}: "
                                      f"{type(err).__name__}: {err}") from None


def let_go(payload: bytes, get_store) -> None:
    """An input this worker will never decode (dropped unstarted, given back, its piece not loadable): the
    segments the host lent with it are reported released (codec.segments_named), as a decoded one's are when
    its views die. (Never reported, they stayed counted as held here until this worker ended: the host's own
    were never reused, and /dev/shm grew with each input dropped so, Dec 7.)"""
    try:
        names = codec.segments_named(payload)
    except Exception:  # (one that cannot be read names nothing to tell; this worker's end settles it)
        return
    if names:
        get_store(True).release_unopened(names)


def encode_output(value, producer: str, get_store) -> bytes:
    data = codec.pack_scalar(value)  # (one number, say: the same bytes, without an Encoder and its passes)
    if data is not None:
        return data
    encoder = codec.Encoder(get_store)
    return _encoded(encoder, encoder.pack, value, producer, get_store, "its output")


def encode_outputs(values: list, producer: str, get_store) -> bytes:
    """A batch's outputs as one list, each encoded as if alone (`Encoder.pack_each`: no two share an object
    on arrival); a NodeError when any of them cannot be (the caller encodes them one by one then)."""
    encoder = codec.Encoder(get_store)
    return _encoded(encoder, encoder.pack_each, values, producer, get_store, "an output of its batch")


def encode_listed(values: list, producer: str, get_store) -> tuple:
    """`(body, said)` for outputs that travel together (a Bundle's, a chunk's part): `body` the encoded list
    of those `said` True for, in order, or None; `said[i]` True, or the i-th output encoded alone (bytes) when
    the list cannot be encoded, or its error body when it cannot be encoded at all (it fails by itself)."""
    try:
        return encode_outputs(values, producer, get_store), [True] * len(values)
    except NodeError:
        pass
    said: list = []
    for value in values:
        try:
            said.append(encode_output(value, producer, get_store))
        except NodeError as err:
            said.append(failures.error_body(err))
    return None, said


def _encoded(encoder, pack, value, producer: str, get_store, what: str) -> bytes:
    try:
        data = pack(value)
    except codec.GradCrossing as err:
        raise NodeError.failed(producer, err.reason("it returned")) from None
    except SharedMemoryFull as err:
        raise SharedMemoryFull.again(producer, err, what) from None
    except codec.Unsendable as err:
        hint = "" if err.too_deep else " (return plain data, tensors, or picklable objects)"
        raise NodeError.failed(producer, f"{what} cannot be sent back to the host: {err}{hint}") from None
    except OSError as err:  # a segment that could not be made or mapped (too many open files, no memory, ...)
        raise NodeError.failed(producer, f"{what} could not be put in shared memory: {type(err).__name__}: "
                                         f"{err}") from None
    except Exception as err:
        raise NodeError.failed(
            producer, f"{what} cannot be sent back to the host: {type(err).__name__}: {err} "
                      f"(return plain data, tensors, or picklable objects)") from None
    if encoder.shared:
        store = get_store()
        for name in encoder.shared:
            store.note_sent(name)  # before the encoder (and the copies it keeps alive) goes
    return data
