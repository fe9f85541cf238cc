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


def test_a_thread_naming_one_node_for_job_after_job_stores_only_each_job(tmp_path):
    """A chunk's inputs: the node's name written once, each job's id stored into the slot's job field; the
    other ways of writing the slot (one job, a batch's jobs, nothing) still read as they say."""
    path = str(tmp_path / "status")
    writer, reader = StatusPage(path, create=True), StatusPage(path, create=False)
    now = writer.naming("encoder")
    for job in (5, 6, 2**40, -3):
        now[0] = job
        assert reader.read() == [(job, "encoder")]
    writer.enter_batch([7, 8], "batcher")
    assert sorted(reader.read()) == [(7, "batcher"), (8, "batcher")]
    writer.enter(9, "encoder")
    assert reader.read() == [(9, "encoder")]
    writer.naming("encoder")[0] = 10
    writer.enter(11, "join")
    assert reader.read() == [(11, "join")]
    writer.leave()
    assert reader.read() == []
    writer.close()
    reader.close()


def test_a_thread_without_a_slot_goes_unnamed_when_naming(tmp_path):
    page = StatusPage(str(tmp_path / "status"), create=True)
    started, go = threading.Barrier(SLOTS + 1), threading.Event()

    def hold(i):
        page.enter(i + 1, "n")  # (job ids start at 1: 0 names no job)
        started.wait(5)
        go.wait(5)

    threads = [threading.Thread(target=hold, args=(i,)) for i in range(SLOTS)]
    for t in threads:
        t.start()
    started.wait(5)
    page.naming("late")[0] = 99  # every slot is taken: nothing is written, nothing raised
    assert (99, "late") not in page.read() and len(page.read()) == SLOTS
    go.set()
    for t in threads:
        t.join(5)
    page.close()


def test_between_jobs_of_one_node_a_thread_reads_as_running_nothing(tmp_path):
    """Leaving a job stores 0 in its field (the node's name stays for the next job): read, that is nothing; a
    batch's jobs, written in the text, are cleared whole."""
    path = str(tmp_path / "status")
    writer, reader = StatusPage(path, create=True), StatusPage(path, create=False)
    for job in (1, 2, 3):
        writer.enter(job, "encoder")
        assert reader.read() == [(job, "encoder")]
        writer.leave()
        assert reader.read() == []
    writer.enter_batch([4, 5], "batcher")
    writer.leave()
    assert reader.read() == []
    writer.enter(6, "encoder")
    assert reader.read() == [(6, "encoder")]
    writer.leave()
    writer.leave()  # (twice: still nothing)
    assert reader.read() == []
    writer.close()
    reader.close()
