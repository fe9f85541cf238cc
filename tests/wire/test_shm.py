"""Shared-memory segments and the host's lease book, in one process (two stores stand for two processes)."""

import ctypes
import gc
import os
import time

import pytest

from soma.local.host.leases import LeaseBook
from soma.wire import room
from soma.wire.mapping import address_of
from soma.wire.shm import (
    GRANULE,
    IDLE_TRIM_S,
    SHM_DIR,
    Mapper,
    SegmentStore,
    ShmError,
    mark_exported,
    owner_pid,
    pool_prefix,
    unlink_all,
)


@pytest.fixture
def prefix():
    p = pool_prefix(os.getpid(), os.urandom(4).hex())
    yield p
    unlink_all(p)


def files(prefix):
    """The pool's segment files in /dev/shm (not its room-wanted flag)."""
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix) and not n.endswith("-wanted"))


def fds():
    return len(os.listdir("/proc/self/fd"))


def test_allocate_names_a_private_segment(prefix):
    store = SegmentStore(prefix, cap=1 << 30)
    view, name = store.allocate(1000)
    assert len(view) == GRANULE and files(prefix) == [name]
    assert owner_pid(name) == os.getpid()
    assert os.stat(os.path.join(SHM_DIR, name)).st_mode & 0o777 == 0o600
    assert store.locate(address_of(view) + 10, 100) == (name, GRANULE, 10)
    assert store.locate(address_of(view) + 10, GRANULE) is None  # reaches past its end


def test_a_segment_is_reused_only_when_nobody_uses_it(prefix):
    owner = SegmentStore(prefix, cap=1 << 30)
    receiver = SegmentStore(prefix, cap=1 << 30)
    view, name = owner.allocate(GRANULE)
    owner.note_sent(name)  # a handle went to the receiver
    del view
    gc.collect()
    meanwhile, other = owner.allocate(GRANULE)  # sent and not settled: not reusable, so a second segment is made
    assert len(files(prefix)) == 2 and other != name
    mapped = receiver.open(name, GRANULE)
    mapped[0] = 7
    assert receiver.releases() == []
    del mapped
    gc.collect()
    assert receiver.releases() == [(name, 1)]  # what the receiver reports to the host
    owner.free(name, 1)  # what the host tells the owner once nobody holds it
    again, reused = owner.allocate(GRANULE // 2)
    assert reused == name and again[0] == 7  # the same segment, reused (and the same memory)
    assert len(files(prefix)) == 2  # and no third one
    del meanwhile


def test_receipts_of_a_live_view_accumulate(prefix):
    owner = SegmentStore(prefix, cap=1 << 30)
    receiver = SegmentStore(prefix, cap=1 << 30)
    kept, name = owner.allocate(GRANULE)
    a = receiver.open(name, GRANULE)
    b = receiver.open(name, GRANULE)
    assert a is b  # one view per segment while it lives
    window = memoryview(a).cast("B")[8:16]  # anything made from the view keeps it alive
    del a, b
    gc.collect()
    assert receiver.releases() == []
    del window
    gc.collect()
    assert receiver.releases() == [(name, 2)]
    del kept


def test_views_keep_no_file_descriptor_and_unmap_when_they_die(prefix):
    owner = SegmentStore(prefix, cap=1 << 30)
    receiver = SegmentStore(prefix, cap=1 << 30)
    names = [owner.allocate(GRANULE)[1] for _ in range(50)]
    gc.collect()
    before = fds()
    views = [receiver.open(name, GRANULE) for name in names]
    assert fds() == before  # Python's mmap would keep one open per mapping
    start = address_of(views[0])
    del views
    gc.collect()
    assert receiver.locate(start, 1) is None
    with open("/proc/self/maps") as maps:  # unmapped
        assert not any(int(line.split("-")[0], 16) <= start < int(line.split()[0].split("-")[1], 16)
                       for line in maps)


def test_anything_made_from_a_view_keeps_it_alive(prefix):
    np = pytest.importorskip("numpy")
    owner = SegmentStore(prefix, cap=1 << 30)
    receiver = SegmentStore(prefix, cap=1 << 30)
    view, name = owner.allocate(GRANULE)
    ctypes.memset(address_of(view), 5, GRANULE)
    mapped = receiver.open(name, GRANULE)
    arr = np.ndarray((10, 4), np.uint8, buffer=mapped, offset=64)[::2].T  # a view of a view of the segment
    del mapped
    gc.collect()
    assert receiver.releases() == [] and int(arr.sum()) == 5 * 20
    del arr
    gc.collect()
    assert receiver.releases() == [(name, 1)]
    del view


class MmapMapper(Mapper):
    """A Mapper as torch's is, without torch: Python's mmap maps the file and unmaps it when it dies."""

    def map(self, path, nbytes):
        import mmap

        with open(path, "r+b") as f:
            return mmap.mmap(f.fileno(), nbytes)

    def address(self, m):
        pointer = ctypes.c_char.from_buffer(m)  # (an export of the buffer while it lives: dropped at once)
        try:
            return ctypes.addressof(pointer)
        finally:
            del pointer


def test_a_mappers_view_and_a_bytes_view_count_their_receipts_apart(prefix):
    owner = SegmentStore(prefix, cap=1 << 30)
    receiver = SegmentStore(prefix, cap=1 << 30)
    view, name = owner.allocate(GRANULE)
    ctypes.memset(address_of(view), 9, GRANULE)
    for _ in range(3):
        owner.note_sent(name)
    mapper = MmapMapper()
    plain, mapped = receiver.open(name, GRANULE), receiver.open(name, GRANULE, mapper)
    assert receiver.open(name, GRANULE, mapper) is mapped and mapped[100] == 9  # one of each kind per segment
    start = mapper.address(mapped)
    assert start != address_of(plain) and receiver.locate(start + 8, 8) == (name, GRANULE, 8)
    del plain
    gc.collect()
    assert receiver.releases() == [(name, 1)]
    del mapped
    gc.collect()
    assert receiver.releases() == [(name, 2)] and receiver.locate(start, 1) is None
    del view
    owner.free(name, 3)
    assert owner.allocate(GRANULE)[1] == name  # nobody holds it any more: reused


def test_the_owner_maps_its_own_segment_apart_for_a_mapper_and_reuses_it_after(prefix):
    owner = SegmentStore(prefix, cap=1 << 30)
    view, name = owner.allocate(GRANULE)
    base = address_of(view)
    owner.note_sent(name)
    mapped = owner.open(name, GRANULE, MmapMapper())  # sent back to it: a mapping of its own, not the base
    assert MmapMapper().address(mapped) != base
    del view
    gc.collect()
    owner.free(name, 1)
    assert owner.allocate(GRANULE)[1] != name  # the mapper's view still lives: not reusable
    del mapped
    gc.collect()
    held = [owner.allocate(GRANULE) for _ in range(2)]  # (the two free ones: kept alive, so both are taken)
    assert name in [n for _, n in held]


def test_a_segment_gone_while_a_mapper_maps_it_is_gone_not_a_fresh_empty_file(prefix):
    """torch's from_file creates a file that is missing: one made so is unlinked again, and never read."""
    pytest.importorskip("torch")
    from soma.wire.tensors import SHARED_STORAGES

    class LateMapper(Mapper):  # the owner's file goes just before the mapper opens the name
        def map(self, path, nbytes):
            os.unlink(path)
            return SHARED_STORAGES.map(path, nbytes)

        address = SHARED_STORAGES.address

    owner = SegmentStore(prefix, cap=1 << 30)
    receiver = SegmentStore(prefix, cap=1 << 30)
    view, name = owner.allocate(GRANULE)
    with pytest.raises(ShmError, match=f"segment {name} is gone"):
        receiver.open(name, GRANULE, LateMapper())
    assert files(prefix) == [] and receiver.releases() == []
    del view


def test_a_segment_handed_on_outside_soma_is_unlinked_never_reused(prefix):
    owner = SegmentStore(prefix, cap=1 << 30)
    receiver = SegmentStore(prefix, cap=1 << 30)
    view, name = owner.allocate(GRANULE)
    owner.note_sent(name)
    mapped = receiver.open(name, GRANULE)
    mark_exported(os.path.join(SHM_DIR, name))  # torch.multiprocessing was given its descriptor
    del mapped, view
    gc.collect()
    assert receiver.releases() == [(name, 1)]
    owner.free(name, 1)
    assert name not in files(prefix)  # unlinked: the other process may map it as long as it likes
    assert owner.allocate(GRANULE)[1] != name


def test_freed_segments_beyond_the_cap_are_unlinked(prefix):
    store = SegmentStore(prefix, cap=GRANULE)
    (a, _), (b, _) = store.allocate(GRANULE), store.allocate(GRANULE)
    assert len(files(prefix)) == 2
    del a, b
    gc.collect()
    assert len(files(prefix)) == 1  # one kept for reuse (the cap), the other unlinked
    c, name = store.allocate(GRANULE)
    assert files(prefix) == [name]


def test_names_outside_the_pool_and_oversized_claims_are_refused(prefix):
    store = SegmentStore(prefix, cap=1 << 30)
    with pytest.raises(ShmError, match="is not one of this pool's"):
        store.open("torch_123_456_7", 10)
    with pytest.raises(ShmError, match="is gone"):
        store.open(f"{prefix}-1-999", 10)
    kept, name = store.allocate(10)
    other = SegmentStore(prefix, cap=1 << 30)
    with pytest.raises(ShmError, match=f"holds {GRANULE} bytes, the handle claims {GRANULE * 4}"):
        other.open(name, GRANULE * 4)
    with pytest.raises(ShmError, match=f"holds {GRANULE} bytes, the handle claims {GRANULE * 4}"):
        store.open(name, GRANULE * 4)  # its own segment, sent back with a bigger claim
    assert os.stat(os.path.join(SHM_DIR, name)).st_size == GRANULE  # not grown
    del kept


def test_close_unlinks_but_views_stay_valid(prefix):
    store = SegmentStore(prefix, cap=1 << 30)
    view, _ = store.allocate(GRANULE)
    ctypes.memset(address_of(view), 7, GRANULE)
    store.close()
    assert files(prefix) == []
    assert view[0] == 7 and view[GRANULE - 1] == 7


def test_no_torch_is_needed_to_hold_segments(prefix):
    import subprocess
    import sys

    code = ("import sys, os; from soma.wire.shm import SegmentStore; s = SegmentStore(sys.argv[1], 1 << 30); "
            "v, n = s.allocate(100); v[0] = 1; s.close(); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, prefix], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- the host's lease book ------------------------------------------------------------------------

def test_lease_book_frees_a_workers_segment_once_nobody_holds_it():
    host, w1, w2 = 100, 201, 202
    book = LeaseBook(host)
    name = f"soma-{host}-abcd-{w1}-1"
    book.received(name, sender=w1)  # w1 returned it to the host
    book.lent(name, to=w2)  # the host passed it on to w2
    book.released(host, name, 1)  # the host's own views died
    assert book.take_frees(w1) == []  # w2 still holds it
    book.released(w2, name, 1)
    assert book.take_frees(w1) == [(name, 1)]  # one send of w1's settled


def test_lease_book_counts_only_the_owners_sends():
    host, w1, w2 = 100, 201, 202
    book = LeaseBook(host)
    name = f"soma-{host}-abcd-{w1}-1"
    book.received(name, sender=w1)
    book.received(name, sender=w1)
    book.lent(name, to=w2)
    book.received(name, sender=w2)  # w2 echoed it back: not a send of the owner
    book.released(host, name, 3)
    book.released(w2, name, 1)
    assert book.take_frees(w1) == [(name, 2)]


def test_lease_book_settles_what_a_dead_worker_held_and_owned(tmp_path):
    host, w1, w2 = 100, 201, 202
    book = LeaseBook(host)
    mine = f"soma-{host}-abcd-{host}-1"
    book.lent(mine, to=w2)
    book.holder_gone(w2)
    assert book.take_frees(host) == [(mine, 1)]  # the host's own segment is reusable again
    theirs = f"soma-{host}-abcd-{w1}-1"
    book.received(theirs, sender=w1)
    book.holder_gone(w1)
    assert theirs in book.held_names()  # the host still maps it: its file stays
    book.released(host, theirs, 1)
    assert theirs not in book.held_names() and book.take_frees(w1) == []


def _free_segment(store, nbytes):
    """A segment of `store` that is free and kept for reuse (allocated, its view dead, nothing sent)."""
    view, name = store.allocate(nbytes)
    del view
    gc.collect()
    return name


def test_a_failed_reservation_first_gives_back_the_free_segments_kept_for_reuse(prefix, monkeypatch):
    store = SegmentStore(prefix, cap=1 << 30)
    kept = _free_segment(store, 4 * GRANULE)
    assert store.pooled_bytes() == 4 * GRANULE and kept in files(prefix)
    real, calls = os.posix_fallocate, []

    def full_until_something_is_given_back(fd, offset, length):  # /dev/shm is full while our cache holds it
        calls.append(length)
        if kept in files(prefix):
            raise OSError(28, "No space left on device")
        return real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", full_until_something_is_given_back)
    view, name = store.allocate(8 * GRANULE)  # too big for the kept one: a new segment, after a retry
    assert len(calls) == 2 and kept not in files(prefix) and name in files(prefix)
    assert store.pooled_bytes() == 0
    del view


def _dev_shm_full(monkeypatch):
    """posix_fallocate refuses every file in /dev/shm (what a full tmpfs answers); files elsewhere get their room."""
    real = os.posix_fallocate

    def refuse_in_dev_shm(fd, offset, length):
        if os.readlink(f"/proc/self/fd/{fd}").startswith(SHM_DIR + "/"):
            raise OSError(28, "No space left on device")
        return real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", refuse_in_dev_shm)
    monkeypatch.setattr(room, "ROOM_WAIT_S", 0.05)  # (a 20 MiB value would wait 40 ms)


def test_a_full_dev_shm_with_nothing_kept_for_reuse_spills_to_a_file_on_disk(prefix, monkeypatch, caplog):
    _dev_shm_full(monkeypatch)
    owner, receiver = SegmentStore(prefix, cap=1 << 30), SegmentStore(prefix, cap=1 << 30)
    with caplog.at_level("WARNING", logger="soma.shm"):
        view, name = owner.allocate(3 * GRANULE)
        view2, name2 = owner.allocate(GRANULE)
    spill = room.spill_dir(prefix)
    assert files(prefix) == [] and sorted(os.listdir(spill)) == sorted([name, name2])
    assert os.stat(spill).st_mode & 0o777 == 0o700 and os.stat(room.path_of(name)).st_mode & 0o777 == 0o600
    assert os.path.exists(os.path.join(SHM_DIR, f"{prefix}-wanted"))  # the others were told room is wanted
    [warning] = caplog.messages  # one per pool, naming the size, the room and --shm-size
    assert "192.0 KiB does not fit in /dev/shm" in warning and "free of" in warning and "--shm-size" in warning
    view[5] = 9
    owner.note_sent(name)
    seen = receiver.open(name, 3 * GRANULE)  # the receiver maps it from the spill directory
    assert seen[5] == 9
    del view, view2
    gc.collect()
    owner.free(name, 1)
    assert owner.pooled_bytes() == 0  # (kept apart: it takes no room in /dev/shm)
    again, same = owner.allocate(GRANULE)  # a spilled one kept for reuse, warm: no new file
    assert same == name2 and sorted(os.listdir(spill)) == sorted([name, name2])
    del seen, again
    gc.collect()
    owner.idle(0.0)
    assert sorted(os.listdir(spill)) == sorted([name, name2])  # kept while busy ...
    owner.idle(IDLE_TRIM_S)
    assert os.listdir(spill) == []  # ... and given back once idle
    unlink_all(prefix)
    assert not os.path.exists(spill) and files(prefix) == []


def test_a_value_larger_than_dev_shm_spills_at_once(prefix, monkeypatch):
    monkeypatch.setattr(room, "shm_room", lambda: (8 * GRANULE, 16 * GRANULE))
    store = SegmentStore(prefix, cap=1 << 30)
    started = time.monotonic()
    view, name = store.allocate(17 * GRANULE)  # can never fit: no wait for room
    assert time.monotonic() - started < room.ROOM_WAIT_S and room.is_spilled(name)
    del view
    store.close()
    unlink_all(prefix)
    assert not os.path.exists(room.spill_dir(prefix))


def test_a_reservation_that_lacks_room_the_caller_holds_is_shared_memory_full_naming_it(prefix, monkeypatch):
    from soma.errors import SharedMemoryFull

    _dev_shm_full(monkeypatch)
    monkeypatch.setattr(room, "shm_room", lambda: (4 << 20, 64 << 20))  # (a container's: 4 MiB free of 64)
    store = SegmentStore(prefix, cap=1 << 30, caller_held=lambda: 60 << 20)
    with pytest.raises(SharedMemoryFull, match="the results this program keeps hold 60.0 MiB") as caught:
        store.allocate(20 << 20)
    assert caught.value.held == 60 << 20 and files(prefix) == []
    assert not os.path.exists(room.spill_dir(prefix))


def test_results_held_taking_under_half_of_dev_shm_do_not_stop_a_value_that_spills_instead(prefix, monkeypatch):
    """What the caller holds counts as a hoard only from half of /dev/shm: less is results a few threads hold a
    moment (each run's, dropped next), and a value short of room spills (three threads running a wave in 64 MiB,
    each keeping its 12 MiB result a moment: 7 of 18 runs failed SharedMemoryFull, nothing kept)."""
    _dev_shm_full(monkeypatch)
    monkeypatch.setattr(room, "shm_room", lambda: (4 << 20, 64 << 20))
    store = SegmentStore(prefix, cap=1 << 30, caller_held=lambda: 24 << 20)
    view, name = store.allocate(20 << 20)
    assert room.is_spilled(name) and len(view) >= 20 << 20
    del view
    store.close()
    unlink_all(prefix)


def test_a_store_that_hears_room_is_wanted_gives_back_what_it_keeps(prefix):
    keeper, wanting = SegmentStore(prefix, cap=1 << 30), SegmentStore(prefix, cap=1 << 30)
    kept = _free_segment(keeper, 4 * GRANULE)
    keeper.idle(0.0)
    assert kept in files(prefix)  # nobody wants room: kept
    wanting.wanted.say()
    keeper.idle(0.0)
    assert kept not in files(prefix) and keeper.pooled_bytes() == 0


def _sent_segment(store, nbytes):
    """A segment of `store` whose only hold is one send (its view dead): the owner's `free` settles it."""
    view, name = store.allocate(nbytes)
    store.note_sent(name)
    del view
    gc.collect()
    return name


def test_a_segment_that_comes_free_while_room_is_wanted_is_given_back_at_once(prefix):
    # Under load, a process short of room waited out its 40 ms before the owner's next idle look: the segment
    # that came free in between was kept for reuse and the value spilled (CI beside two CPU burners).
    keeper, wanting = SegmentStore(prefix, cap=1 << 30), SegmentStore(prefix, cap=1 << 30)
    quiet, wanted = _sent_segment(keeper, 4 * GRANULE), _sent_segment(keeper, 4 * GRANULE)
    keeper.free(quiet, 1)
    assert quiet in files(prefix) and keeper.pooled_bytes() == 4 * GRANULE  # nobody wants room: kept
    wanting.wanted.say()
    keeper.free(wanted, 1)
    assert files(prefix) == [] and keeper.pooled_bytes() == 0  # both given back as the second came free


def test_a_wait_for_room_says_it_is_wanted_at_each_look(prefix, monkeypatch):
    # A keeper that heard the flag before its segment came free hears it again while the wait goes on.
    keeper, wanting = SegmentStore(prefix, cap=1 << 30), SegmentStore(prefix, cap=1 << 30)
    wanting.wanted.say()
    assert keeper.wanted.heard() and not keeper.wanted.heard()
    monkeypatch.setattr(room, "shm_room", lambda: (0, 64 << 20))  # no room comes
    time.sleep(0.01)  # (the flag's time must move on)
    deadline = time.monotonic() + 0.05
    assert not room.wait_for_room(GRANULE, lambda: deadline, wanting.wanted)
    assert keeper.wanted.heard()


def test_a_spill_after_a_wait_in_vain_lets_the_next_ones_spill_without_waiting_until_frees_come(prefix, monkeypatch):
    # A map whose caller kept more outputs than /dev/shm holds had its host copy 190 inputs in a row into no
    # room, each spilling after its own wait: 3.8 s without an output (room.STREAK_S).
    _dev_shm_full(monkeypatch)
    free = [0]
    monkeypatch.setattr(room, "shm_room", lambda: (free[0], 64 << 20))
    waits = []
    real_wait = room.wait_for_room

    def counted(nbytes, deadline, wanted):
        waits.append(nbytes)
        return real_wait(nbytes, deadline, wanted)

    monkeypatch.setattr(room, "wait_for_room", counted)
    store = SegmentStore(prefix, cap=0)  # (keeps nothing for reuse: step 1 gives nothing back)
    views = [store.allocate(GRANULE) for _ in range(5)]
    assert all(room.is_spilled(name) for _, name in views)
    assert len(waits) == 1  # the first waited in vain; the four after it spilled at once
    free[0] = GRANULE // 2  # frees came (not enough for a segment): the next waits again
    views.append(store.allocate(GRANULE))
    assert len(waits) == 2 and room.is_spilled(views[-1][1])
    store.streak.at -= room.STREAK_S  # the streak is over
    free[0] = 0
    views.append(store.allocate(GRANULE))
    assert len(waits) == 3
    store.room_wait_s = 0.05  # told to wait for frees on their way (a map held back by memory): it waits
    views.append(store.allocate(GRANULE))
    assert len(waits) == 4
    del views
    store.close()
    unlink_all(prefix)


def test_trim_gives_back_the_largest_free_segments_first_down_to_what_is_kept(prefix):
    store = SegmentStore(prefix, cap=1 << 30)
    live, live_name = store.allocate(GRANULE)  # in use: never trimmed
    small, _big = _free_segment(store, GRANULE), _free_segment(store, 8 * GRANULE)
    assert store.trim(4 * GRANULE) == 8 * GRANULE
    assert files(prefix) == sorted([small, live_name]) and store.pooled_bytes() == GRANULE
    assert store.trim(0) == GRANULE and files(prefix) == [live_name]
    live[0] = 1  # still mapped
    del live


def test_received_bytes_counts_the_live_views_of_other_processes_segments(prefix):
    owner, receiver = SegmentStore(prefix, cap=1 << 30), SegmentStore(prefix, cap=1 << 30)
    view, name = owner.allocate(3 * GRANULE)
    assert owner.received_bytes() == 0  # its own: not received
    seen = receiver.open(name, 3 * GRANULE)
    assert receiver.received_bytes() == 3 * GRANULE
    del seen
    gc.collect()
    assert receiver.received_bytes() == 0
    del view
