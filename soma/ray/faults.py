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
from .copies import control
from .flows import Flow, first_line, release

CONTROL_ANSWER_S = 2.0  # how long a timeout waits for the late actors to say what they run
UNANSWERED = "soma: no answer"  # what `ask` reports for an actor that did not answer in time


def translate(ray, flow: Flow, err, drop) -> SomaError:
    """The soma error for a Ray error met while waiting for an input; `drop(copy)` replaces the copy at fault."""
    exceptions = ray.exceptions
    if isinstance(err, exceptions.RayActorError):
        task = next((t for t in flow.tasks if t[1].actor_id == err.actor_id), None) or culprit(ray, flow)
        if task is not None:
            node_id, copy, _ = task
            if not copy.ready:
                copy.owner.learn(copy)  # its hello came long ago if it ever started: the pid is there
            if copy.pid is None:
                copy.pid = _pid_in(str(err))
            drop(copy)
            how = f"was stopped: {copy.stopped}" if copy.stopped else f"died ({_death_reason(err)})"
            return WorkerDied(f"{copy.describe()}, which held a copy of node `{node_id}`, {how}; soma starts a new "
                              f"copy for the next input: run again", worker=copy.actor_id, pid=copy.pid, node=node_id)
    if isinstance(err, exceptions.ObjectLostError):
        hex_id = getattr(err, "object_ref_hex", None)
        task = next((t for t in flow.tasks if t[2].hex() == hex_id), None) or culprit(ray, flow)
        if task is not None:
            node_id, copy, _ = task
            drop(copy)
            return WorkerDied(f"the output of node `{node_id}` was lost with the machine or process that held it "
                              f"({copy.describe()}): {first_line(err)}; run again",
                              worker=copy.actor_id, pid=copy.pid, node=node_id)
    task = culprit(ray, flow)
    node_id = task[0] if task is not None else flow.tasks[0][0]
    cause = getattr(err, "cause", None)
    cause = cause if isinstance(cause, BaseException) else err
    failed = NodeError.failed(node_id, f"Ray could not carry its input or output: {type(cause).__name__}: "
                                       f"{first_line(cause)}", remote_traceback=str(err))
    if cause is not err:
        failed.__cause__ = cause
    return failed


def culprit(ray, flow: Flow):
    """The first call of the input (in submission order, so upstream first) whose ref holds a Ray error.

    Only on a failure's path: a ready ref is fetched to see whether it holds an error.
    """
    for task in flow.tasks:
        ready, _ = ray.wait([task[2]], timeout=0, fetch_local=False)
        if not ready:
            continue
        try:
            ray.get(task[2], timeout=0)
        except ray.exceptions.RayError:
            return task
        except Exception:
            continue
    return None


def expire(ray, flow: Flow, timeout: float, lock, drop) -> RunTimeout:
    """The input's time is up: which of its nodes run now (their actors are stopped), which wait.

    Only an input with a timeout carries its token, which each actor reports from its control
    group ("which input are you running?") even while busy.
    """
    done = _finished(ray, flow)
    late = [t for t in flow.tasks if t[2] not in done]
    asked: dict = {}  # actor id → Copy: the late calls' copies that are up
    with lock:
        for _, copy, _ in late:
            if copy.ready or copy.owner.has_said_hello(copy):
                asked[copy.actor_id] = copy
    answer_of = dict(zip(asked, ask(ray, [copy.actor for copy in asked.values()], "running_token",
                                    CONTROL_ANSWER_S)))
    running, waiting, stop = {}, [], {}
    for node_id, copy, ref in late:
        if copy.actor_id not in answer_of:
            waiting.append(node_id)  # its actor has not started yet
            continue
        answer = answer_of[copy.actor_id]
        # No answer even from the control group: stuck holding the GIL (in C code), as good as running.
        busy_with_this = answer == flow.token or answer == UNANSWERED
        if busy_with_this:
            running[node_id] = copy.actor_id
            stop[copy.actor_id] = copy
        else:
            waiting.append(node_id)
            ray.cancel(ref)  # queued behind other inputs, or waiting for its args: it will not start
    for copy in stop.values():
        copy.stopped = f"another input timed out while it ran node `{copy.owner.node_id}` there"
        drop(copy)
    with lock:
        release(flow, "RunTimeout")
    then = "the actors running them were stopped; new copies start for the next input" if stop else None
    return RunTimeout.after(timeout, {node: f"Ray actor {actor}" for node, actor in running.items()}, waiting, then)


def ask(ray, actors: list, method: str, answer_s: float) -> list:
    """Each actor's answer to a control method, or `UNANSWERED` where none came within `answer_s` seconds."""
    refs = [control(actor, method) for actor in actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=answer_s) if refs else ([], [])
    ready = set(ready)
    answers = []
    for ref in refs:
        try:
            answers.append(ray.get(ref) if ref in ready else UNANSWERED)
        except Exception:  # it died meanwhile: no answer either
            answers.append(UNANSWERED)
    return answers


def abandon(ray, flow: Flow, lock) -> None:
    """Nobody waits for this input any more (a map that ended early): cancel what has not started."""
    done = _finished(ray, flow)
    for _, _, ref in flow.tasks:
        if ref not in done:
            with contextlib.suppress(Exception):
                ray.cancel(ref)
    with lock:
        release(flow, "cancelled")


def _finished(ray, flow: Flow) -> set:
    """The refs of the input's calls that are ready now (never waits, fetches nothing)."""
    refs = [t[2] for t in flow.tasks]
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
