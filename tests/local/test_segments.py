"""How long a value short of room in /dev/shm waits for frees on their way, as the host tells its workers: the
host's side (HostSegments.room_s, a Task's `room_s`) and the worker's (Segments.told, its store's wait)."""

import gc
import os
import threading
import time

import pytest

from soma.local.host.leases import HostSegments, LeaseBook
from soma.local.worker.segments import Segments
from soma.wire import room
from soma.wire.shm import GRANULE, SHM_DIR, pool_prefix, unlink_all

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def prefix():
    p = pool_prefix(os.getpid(), os.urandom(4).hex())
    yield p
    unlink_all(p)


class HeldBackMap:
    """Stands for a map's in-flight set (what the loop registers: only its identity matters here)."""


def test_a_task_says_wait_for_room_only_while_a_map_held_back_by_memory_is_open(prefix):
    segments = HostSegments(prefix, 1 << 20, LeaseBook(os.getpid()))
    assert segments.for_task()[1] is None  # by the value's size (soma.wire.room.room_wait_s)
    held = HeldBackMap()
    segments.held_back.add(held)
    assert segments.for_task()[1] == room.ROOM_WAIT_S
    segments.held_back.discard(held)
    assert segments.for_task()[1] is None
    segments.held_back.add(held)
    del held  # a map dropped without closing (its iterator garbage): nobody waits on its account any more
    gc.collect()
    assert segments.for_task()[1] is None
    assert segments.for_task()[0] == 0  # (no map open, nothing received: the caller holds nothing)


def test_what_the_host_received_and_lends_on_is_not_counted_as_the_callers_results(prefix):
    """A Task says what the caller's results hold: what the host maps of other processes' segments, less the
    values on their way through it (lent to a worker now, or by that Task: a wave's input after a node)."""
    from soma.wire.shm import SegmentStore

    worker, book = 4_000_000, LeaseBook(os.getpid())
    owner = SegmentStore(f"{prefix}", 1 << 30)  # (a worker's store: the host maps its segment, as it receives it)
    segments = HostSegments(prefix, 1 << 20, book)
    view, name = owner.allocate(3 * GRANULE)
    received = segments.get_store().open(name, 3 * GRANULE)
    book.received(name, worker)

    class Lending:
        shared = [name]

    assert segments.for_task()[0] == 3 * GRANULE  # the caller's result, kept
    assert segments.for_task([Lending()])[0] == 0  # this Task lends it: on its way
    book.lent(name, worker + 1)
    assert book.passing() == [name] and segments.for_task()[0] == 0  # lent: still on its way
    book.released(worker + 1, name, 1)
    assert book.passing() == [] and segments.for_task()[0] == 3 * GRANULE  # back with the host alone: kept
    del received, view
    owner.close()


def _dev_shm_full_until(event, monkeypatch):
    """posix_fallocate refuses files in /dev/shm (a full tmpfs) until `event` is set: the free on its way; and
    shm_room says so (wait_for_room looks at it between tries)."""
    real_fallocate, real_room = os.posix_fallocate, room.shm_room

    def refuse_in_dev_shm(fd, offset, length):
        if not event.is_set() and os.readlink(f"/proc/self/fd/{fd}").startswith(SHM_DIR + "/"):
            raise OSError(28, "No space left on device")
        return real_fallocate(fd, offset, length)

    def no_room_until_freed():
        free, total = real_room()
        return (free if event.is_set() else 0), total

    monkeypatch.setattr(os, "posix_fallocate", refuse_in_dev_shm)
    monkeypatch.setattr(room, "shm_room", no_room_until_freed)


@pytest.mark.parametrize("told", [False, True])
def test_a_worker_told_to_wait_for_room_waits_for_the_free_on_its_way_rather_than_spill(prefix, monkeypatch, told):
    # The free comes 0.3 s after the reservation starts: longer than a small value's wait by its size (20 ms),
    # shorter than the wait the host asks for while a map held back by memory is open.
    segments = Segments(prefix, 1 << 20)
    if told:
        segments.told(0, 2.0)
    segments.get_store()  # (made before or after the Task said: both follow it)
    if not told:
        segments.told(0, None)
    freed = threading.Event()
    _dev_shm_full_until(freed, monkeypatch)
    timer = threading.Timer(0.3, freed.set)
    timer.start()
    try:
        start = time.monotonic()
        view, name = segments.get_store().allocate(GRANULE)
        waited = time.monotonic() - start
    finally:
        timer.cancel()
        segments.close()
    spilled = room.is_spilled(name)
    assert spilled is not told, (name, waited)
    assert (waited >= 0.3) is told, waited
    del view


def test_a_worker_waiting_for_room_stops_once_its_host_says_no_free_is_coming(prefix, monkeypatch):
    # Told to wait (a map held back by memory: 2 s; 5 here, so a loaded machine cannot blur the two), then, while
    # it waits, told not to (that map's caller keeps the room: LocalInflight.room): the value goes to disk then,
    # not after the wait it was first told.
    segments = Segments(prefix, 1 << 20)
    segments.told(0, 5.0)
    store = segments.get_store()
    never = threading.Event()
    _dev_shm_full_until(never, monkeypatch)
    timer = threading.Timer(0.2, segments.told, (0, None))
    timer.start()
    try:
        start = time.monotonic()
        view, name = store.allocate(GRANULE)
        waited = time.monotonic() - start
    finally:
        timer.cancel()
        segments.close()
    assert room.is_spilled(name), name
    assert 0.2 <= waited < 5.0, waited  # (it waited until it was told not to, and not the whole first wait)
    del view
