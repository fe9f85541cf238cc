"""Shared-memory segments and the host's lease book, in one process (two stores stand for two processes)."""

import gc
import os

import pytest

torch = pytest.importorskip("torch")

from soma.local.host.leases import LeaseBook  # noqa: E402
from soma.wire.shm import GRANULE, SHM_DIR, SegmentStore, ShmError, owner_pid, pool_prefix  # noqa: E402


@pytest.fixture
def prefix():
    p = pool_prefix(os.getpid(), os.urandom(4).hex())
    yield p
    for name in os.listdir(SHM_DIR):
        if name.startswith(p):
            os.unlink(os.path.join(SHM_DIR, name))


def files(prefix):
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))


def test_allocate_names_a_private_segment(prefix):
    store = SegmentStore(prefix, cap=1 << 30)
    storage = store.allocate(1000)
    assert storage.nbytes() == GRANULE
    (name,) = files(prefix)
    assert owner_pid(name) == os.getpid()
    assert os.stat(os.path.join(SHM_DIR, name)).st_mode & 0o777 == 0o600
    t = torch.empty(0).set_(storage, 0, (10,))
    assert store.locate(t) == (name, GRANULE)


def test_a_segment_is_reused_only_when_nobody_uses_it(prefix):
    owner = SegmentStore(prefix, cap=1 << 30)
    receiver = SegmentStore(prefix, cap=1 << 30)
    storage = owner.allocate(GRANULE)
    (name,) = files(prefix)
    owner.note_sent(name)  # a handle went to the receiver
    del storage
    gc.collect()
    meanwhile = owner.allocate(GRANULE)  # sent and not settled: not reusable, so a second segment is made
    assert len(files(prefix)) == 2 and owner.locate(torch.empty(0).set_(meanwhile, 0, (1,)))[0] != name
    mapped = receiver.open(name, GRANULE)
    assert torch.empty(0).set_(mapped, 0, (4,)).is_shared()
    assert receiver.releases() == []
    del mapped
    gc.collect()
    assert receiver.releases() == [(name, 1)]  # what the receiver reports to the host
    owner.free(name, 1)  # what the host tells the owner once nobody holds it
    again = owner.allocate(GRANULE // 2)
    assert owner.locate(torch.empty(0).set_(again, 0, (1,)))[0] == name  # the same segment, reused
    assert len(files(prefix)) == 2  # and no third one
    del meanwhile


def test_receipts_of_a_live_storage_accumulate(prefix):
    owner = SegmentStore(prefix, cap=1 << 30)
    receiver = SegmentStore(prefix, cap=1 << 30)
    kept = owner.allocate(GRANULE)
    (name,) = files(prefix)
    a = receiver.open(name, GRANULE)
    b = receiver.open(name, GRANULE)
    assert a is b  # one mapping per live storage
    view = torch.empty(0).set_(a, 8, (2,))
    del a, b
    gc.collect()
    assert receiver.releases() == []  # a view keeps the storage alive
    del view
    gc.collect()
    assert receiver.releases() == [(name, 2)]
    del kept


def test_freed_segments_beyond_the_cap_are_unlinked(prefix):
    store = SegmentStore(prefix, cap=GRANULE)
    a, b = store.allocate(GRANULE), store.allocate(GRANULE)
    assert len(files(prefix)) == 2
    del a, b
    gc.collect()
    assert len(files(prefix)) == 1  # one kept for reuse (the cap), the other unlinked
    c = store.allocate(GRANULE)
    assert store.locate(torch.empty(0).set_(c, 0, (1,)))[0] in files(prefix) and len(files(prefix)) == 1


def test_names_outside_the_pool_and_oversized_claims_are_refused(prefix):
    store = SegmentStore(prefix, cap=1 << 30)
    with pytest.raises(ShmError, match="is not one of this pool's"):
        store.open("torch_123_456_7", 10)
    with pytest.raises(ShmError, match="is gone"):
        store.open(f"{prefix}-1-999", 10)
    kept = store.allocate(10)
    (name,) = files(prefix)
    other = SegmentStore(prefix, cap=1 << 30)
    with pytest.raises(ShmError, match=f"holds {GRANULE} bytes, the handle claims {GRANULE * 4}"):
        other.open(name, GRANULE * 4)
    assert os.stat(os.path.join(SHM_DIR, name)).st_size == GRANULE  # not grown
    del kept


def test_close_unlinks_but_mappings_stay_valid(prefix):
    store = SegmentStore(prefix, cap=1 << 30)
    t = torch.empty(0).set_(store.allocate(GRANULE), 0, (GRANULE // 4,)).fill_(7)
    store.close()
    assert files(prefix) == []
    assert float(t[0]) == 7.0


def test_copy_in_makes_a_compact_shared_copy(prefix):
    store = SegmentStore(prefix, cap=1 << 30)
    src = torch.arange(40000, dtype=torch.float32).reshape(200, 200).t()[::2]
    copy, name, nbytes = store.copy_in(src)
    assert torch.equal(copy, src) and copy.is_contiguous() and nbytes >= src.numel() * 4


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
