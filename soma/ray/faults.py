"""When an input on Ray goes wrong by circumstance: Ray's errors as soma's, timeouts, abandoned inputs.

    an actor died (its process, or its machine)  → WorkerDied naming the node; the copy is dropped
    a value was lost with its machine            → WorkerDied naming the node that made it
    Ray could not carry a value (pickling)       → NodeError naming the node
    the input's time is up                       → RunTimeout naming what runs (their actors are
                                                   stopped) and what waits (its calls are cancelled)

A node's own failures never come this way: they travel as values (soma.ray.actor.Failed).
No Ray exception reaches the caller, and none is chained as a cause: its words are
in the message, its text in `.remote_traceback`.
"""

from __future__ import annotations

import contextlib
import re

from ..errors import NodeError, RunTimeout, SomaError, WorkerDied
from . import records
from .copies import ActorBook, control, cut_frames
from .submission import Submission, first_line

CONTROL_ANSWER_S = 2.0  # how long a timeout waits for the late actors to say what they run
UNANSWERED = "soma: no answer"  # what `ask` reports for an actor that did not answer in time


def translate(ray, submission: Submission, err, book: ActorBook) -> SomaError:
    """The soma error for a Ray error met while waiting for an input; the actor at fault leaves the book.

    An input lost to a dead actor also learns whether that actor had started it (`submission.lost`:
    its call there, and True or False; soma.ray.records): only then does the loss cost it a try.
    """
    exceptions = ray.exceptions
    if isinstance(err, exceptions.RayActorError):
        call = next((c for c in submission.calls if c.actor.actor_id == err.actor_id), None) \
            or culprit(ray, submission)
        if call is not None:
            node_id, actor = call.node_id, call.actor
            book.learn(actor)  # its hello came long ago if it ever started: the pid is there
            if actor.pid is None:
                actor.pid = _pid_in(str(err))
            if actor.actor_id is None:
                actor.actor_id = err.actor_id  # (it died before its hello was read)
            book.drop(actor)  # (what it had started is read from its record now)
            submission.lost = (call, records.started(actor.death, call))
            how = f"was stopped: {actor.stopped}" if actor.stopped else f"died ({_death_reason(err)})"
            return WorkerDied(f"{actor.describe()}, which held a copy of node `{node_id}`, {how}; soma starts a new "
                              f"copy for the next input: {_then(submission)}", worker=actor.actor_id, pid=actor.pid,
                              node=node_id, tries=submission.tries)
    if isinstance(err, exceptions.ObjectLostError):
        hex_id = getattr(err, "object_ref_hex", None)
        call = next((c for c in submission.calls if c.ref.hex() == hex_id), None) or culprit(ray, submission)
        if call is not None:
            node_id, actor = call.node_id, call.actor
            book.drop(actor)
            submission.lost = (call, True)  # the value existed: the input had started
            return WorkerDied(f"the output of node `{node_id}` was lost with the machine or process that held it "
                              f"({actor.describe()}): {first_line(err)}; {_then(submission)}",
                              worker=actor.actor_id, pid=actor.pid, node=node_id, tries=submission.tries)
    call = culprit(ray, submission)
    node_id = (call or submission.calls[0]).node_id
    cause = getattr(err, "cause", None)
    cause = cause if isinstance(cause, BaseException) else err
    said = f"{type(cause).__name__}: {first_line(cause)}"
    # (an input Ray cannot pickle is refused as it is sent: this is what a node returned; "unpickling" is not)
    if re.search(r"\bpickl", said, re.IGNORECASE):
        said = (f"its output cannot be sent back to the driver: {said} (return plain data, tensors, or picklable "
                f"objects)")  # (Local's words)
    else:
        said = f"Ray could not carry its input or output: {said}"
    failed = NodeError.failed(node_id, said, remote_traceback=str(err))
    if cause is not err:
        failed.__cause__ = cause
    return failed


def _then(submission: Submission) -> str:
    """What a WorkerDied says to do, in Local's words: retries=N, or how many tries were made."""
    if not submission.retries:
        return "run again, or pass retries=N"
    return f"{submission.tries} tries, each lost to a dead worker (retries={submission.retries})"


def culprit(ray, submission: Submission):
    """The first call of the input (in submission order, so upstream first) whose ref holds a Ray error.

    Only on a failure's path: a ready ref is fetched to see whether it holds an error.
    """
    for call in submission.calls:
        ready, _ = ray.wait([call.ref], timeout=0, fetch_local=False)
        if not ready:
            continue
        try:
            ray.get(call.ref, timeout=0)
        except Exception as err:
            cut_frames(err)
            if isinstance(err, ray.exceptions.RayError):
                return call
    return None


def expire(ray, submission: Submission, timeout: float, book: ActorBook) -> RunTimeout:
    """The input's time is up: which of its nodes run now (their actors are stopped), which wait.

    Only an input with a timeout carries its token, which each actor reports from its control
    group ("which input are you running?") even while busy.
    """
    done = _finished(ray, submission)
    # A call whose actor soma stopped (another input timed out on it) ran nothing of this input: it waits (asked,
    # it answered nothing and was named running; finished, its ref failing with the death, it was named nowhere)
    late = [call for call in submission.calls if call.ref not in done or call.actor.dead]
    asked = {actor.actor_id: actor for actor in book.up_now([c.actor for c in late if not c.actor.dead])}
    answer_of = dict(zip(asked, ask(ray, [actor.handle for actor in asked.values()], "running_token",
                                    CONTROL_ANSWER_S)))
    running, waiting, stop = {}, [], {}
    for call in late:
        actor_id = call.actor.actor_id
        if call.actor.dead:
            waiting.append(call.node_id)
            continue
        if actor_id not in answer_of:  # its actor has not started yet: it will not start the call (it did, once
            waiting.append(call.node_id)  # up: the timed-out input ran, and the next waited behind it, Dec 7)
            _cancel(ray, submission, call)
            continue
        answer = answer_of[actor_id]
        # No answer even from the control group: stuck holding the GIL (in C code), as good as running.
        busy_with_this = answer == submission.token or answer == UNANSWERED
        if busy_with_this:
            running[call.node_id] = actor_id
            stop[actor_id] = call.actor
        else:
            waiting.append(call.node_id)
            _cancel(ray, submission, call)  # queued behind other inputs, or waiting for its args: it will not start
    for actor in stop.values():
        actor.stopped = f"another input timed out while it ran node `{actor.owner.node_id}` there"
        book.drop(actor)
    book.release(submission, "RunTimeout")
    then = "the actors running them were stopped; new copies start for the next input" if stop else None
    return RunTimeout.after(timeout, {node: f"Ray actor {actor}" for node, actor in running.items()}, waiting, then)


def ask(ray, handles: list, method: str, answer_s: float) -> list:
    """Each actor's answer to a control method, or `UNANSWERED` where none came within `answer_s` seconds."""
    refs = [control(handle, method) for handle in handles]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=answer_s) if refs else ([], [])
    ready = set(ready)
    answers = []
    for ref in refs:
        try:
            answers.append(ray.get(ref) if ref in ready else UNANSWERED)
        except Exception as err:  # it died meanwhile: no answer either
            cut_frames(err)
            answers.append(UNANSWERED)
    return answers


def abandon(ray, submission: Submission, book: ActorBook, how: str = "cancelled") -> None:
    """Nobody waits for this try any more (a map that ended early, a cancelled future, or its input goes on in
    another try: `how` is "again"): cancel what has not started."""
    done = _finished(ray, submission)
    # Calls it shares with other inputs still wanted (a map's batch, concurrent runs gathered at a batching node)
    # are one Ray task with a return each: Ray's cancel of one return cancels the task, and the others failed
    # with TaskCancelledError. Those calls run on; only its own outcome is dropped.
    shared = any(other is not submission and not other.over for other in submission.batch)
    unfinished = [call for call in submission.calls if call.ref not in done]
    for call in unfinished:
        _cancel(ray, submission, call, forget=how != "again", task=not shared)
    # (its calls still running keep their copies busy until they end; one cancelled in time ends at once)
    book.release(submission, how, unfinished if how != "again" else ())


def _cancel(ray, submission: Submission, call, forget: bool = True, task: bool = True) -> None:
    """Its call at an actor will not start: Ray's cancel and, for an input whose calls carry its token, the
    actor told to skip it (NodeCopy.forget): Ray's cancel of a call on its way to the actor is retried after
    seconds, and the call may start meanwhile (CI saw a cancelled future's input start 2 s later). Not when
    the input goes on in another try (`forget` False): its next calls carry the same token. Not Ray's cancel
    when the call carries other inputs too (`task` False)."""
    if task:
        with contextlib.suppress(Exception):
            ray.cancel(call.ref)
    if forget and submission.tokened and not call.actor.dead:
        with contextlib.suppress(Exception):
            control(call.actor.handle, "forget", submission.token)  # (not awaited: the actor decides)


def _finished(ray, submission: Submission) -> set:
    """The refs of the input's calls that are ready now (never waits, fetches nothing)."""
    refs = [call.ref for call in submission.calls]
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
    return set(done)


def _death_reason(err) -> str:
    """Ray's own words for why an actor is gone ("its worker process has died", "its node has died", ...)."""
    text = str(err)
    found = re.search(r"The actor (?:is dead|died) because (.+?)(?:\.\s|\.$|$)", text, re.S)
    if found:
        return found.group(1).strip()
    return first_line(err)


def _pid_in(text: str) -> int | None:
    found = re.search(r"\bpid: (\d+)", text)
    return int(found.group(1)) if found else None
