"""The receiver's spin (soma.wire.transport.Receiver.wait): real ZeroMQ sockets, a real busy machine."""

import multiprocessing as mp
import os
import time

import pytest
import zmq

from soma.wire import transport
from soma.wire.transport import LOAD_EVERY_S, Receiver, cores_wanted

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pair():
    """A PUSH socket and a Receiver on its PULL end (inproc: delivered as soon as it is sent)."""
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("inproc://spin")
    push.connect("inproc://spin")
    yield push, Receiver(pull)
    push.close(0)
    pull.close(0)
    ctx.term()


class Looks:
    """Counts the receiver's looks at its socket (`queued`), without changing what they find."""

    def __init__(self, receiver):
        self.count, self.queued = 0, receiver.queued
        receiver.queued = self

    def __call__(self):
        self.count += 1
        return self.queued()


def test_a_spinning_wait_finds_a_queued_frame_without_sleeping(pair):
    push, receiver = pair
    push.send(b"one")
    looks = Looks(receiver)
    assert receiver.wait(1000, spin=True) == b"one"
    assert looks.count >= 1 and receiver.quick


def test_a_wait_that_ran_out_stops_the_spin_until_one_is_quick_again(pair, monkeypatch):
    push, receiver = pair
    assert receiver.wait(20, spin=True) is None  # (nothing comes: it spun SPIN_S, then slept out its time)
    assert not receiver.quick
    looks = Looks(receiver)
    assert receiver.wait(20, spin=True) is None
    assert looks.count == 0  # (slept at once)
    push.send(b"two")
    # (answered at once: quick again; within a bound no preemption on a busy machine reaches, not SPIN_S's 250 µs)
    monkeypatch.setattr(transport, "SPIN_S", 10.0)
    assert receiver.wait(1000, spin=True) == b"two" and receiver.quick
    assert looks.count == 0


def test_a_wait_that_does_not_spin_never_looks(pair):
    push, receiver = pair
    looks = Looks(receiver)
    push.send(b"three")
    assert receiver.wait(1000) == b"three"
    assert receiver.wait(10) is None
    assert looks.count == 0 and receiver.quick  # (what a wait without spin found says nothing of spins)


def test_a_look_that_comes_back_late_backs_off(pair, monkeypatch):
    """A yield that handed the core away for longer than LATE_S (another program ran: the machine is busy) ends
    the spin, and the next spinning waits sleep at once: 16, then 32 after the next such look."""
    push, receiver = pair
    monkeypatch.setattr(os, "sched_yield", lambda: time.sleep(0.002))
    assert receiver.wait(5, spin=True) is None
    assert receiver.backoff == 16 and receiver.skip == 16
    looks = Looks(receiver)
    for _ in range(16):
        assert receiver.wait(1, spin=True) is None
    assert looks.count == 0 and receiver.skip == 0
    receiver.quick = True  # (as if the last wait were quick: the next one spins, and backs off further)
    assert receiver.wait(1, spin=True) is None
    assert looks.count >= 1 and receiver.backoff == 32 and receiver.skip == 32


def _burn(until: float) -> None:
    while time.monotonic() < until:
        pass


def test_a_machine_whose_cores_are_all_busy_wants_its_cores():
    """With one more burning process than the machine has cores, a receiver must not spin: the verdict says
    so once it is read again (at most LOAD_EVERY_S after the last read)."""
    ctx = mp.get_context("spawn")
    n = (os.cpu_count() or 1) + 1
    burners = [ctx.Process(target=_burn, args=(time.monotonic() + 20,), daemon=True) for _ in range(n)]
    for burner in burners:
        burner.start()
    try:
        deadline = time.monotonic() + 15
        seen = False
        while not seen and time.monotonic() < deadline:
            time.sleep(LOAD_EVERY_S)
            seen = cores_wanted()
        assert seen
    finally:
        for burner in burners:
            burner.kill()
            burner.join(10)

