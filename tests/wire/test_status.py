"""A worker's status page: what each thread runs, readable from another process's mapping."""

import threading

from soma.wire.status import SLOTS, StatusPage


def test_each_thread_has_its_slot_and_a_reader_sees_them_all(tmp_path):
    path = str(tmp_path / "status")
    writer = StatusPage(path, create=True)
    reader = StatusPage(path, create=False)
    assert reader.read() == []
    writer.enter(7, "encoder")
    seen = threading.Event()
    done = threading.Event()

    def other():
        writer.enter(8, "join")
        seen.set()
        done.wait(5)
        writer.leave()

    t = threading.Thread(target=other)
    t.start()
    assert seen.wait(5), "the other thread never wrote its slot"
    assert sorted(reader.read()) == [(7, "encoder"), (8, "join")]
    done.set()
    t.join(5)
    assert not t.is_alive()
    writer.leave()
    assert reader.read() == []
    writer.close()
    reader.close()


def test_slots_of_threads_that_ended_are_reused(tmp_path):
    page = StatusPage(str(tmp_path / "status"), create=True)
    for i in range(3 * SLOTS):  # more threads over time than there are slots
        t = threading.Thread(target=lambda: (page.enter(i, "n"), page.leave()))
        t.start()
        t.join()
    import gc

    gc.collect()
    page.enter(1, "still named")
    assert page.read() == [(1, "still named")]
    page.close()
