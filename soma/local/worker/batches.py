"""A batching node alone's turn: its queued jobs and Bundles, decoded, run in one `forward_batch`, encoded.

    run_batch(turn) ─▶ each JobSpec: decode its input                      ─┐
                       each Bundle: open_bundle (its inputs in one decode)  ─┴▶ one forward_batch ─▶
                       each JobSpec: its Outcome;  each Bundle: close_bundle (one Outcome, its outputs as one list)

A Bundle's outcome (see soma.wire.protocol): `Outcome(ids, [per id: True | bytes |
error body], the encoded list of the True ones' outputs, None, seconds each)`.
"""

from __future__ import annotations

import time

from ...errors import Cancelled, NodeError
from ...wire import failures
from ...wire.protocol import Bundle, Outcome
from .values import decode_input, encode_listed, encode_output, let_go


def run_batch(runner, piece, node_id: str, jobs: list, dropped: set) -> list:
    """The jobs of a piece that is one batching node, on this thread (`runner`: running.JobRunner): decoded (a
    Bundle's inputs in one pass), one `forward_batch`, encoded (a Bundle's outputs as one list); an outcome per
    job and one per Bundle. The status page names every job of the batch (a death meanwhile counts a try for
    each: they had all started)."""
    start = time.perf_counter()
    outcomes: list = [None] * len(jobs)
    answers: list = [None] * len(jobs)  # a Bundle's: {job id: ok, or its error body} (see protocol.Outcome)
    at, ids, xs = [], [], []  # each input that runs: its job's place in the turn, its job id, its value
    for i, job in enumerate(jobs):
        if type(job) is Bundle:
            answers[i] = open_bundle(runner, job, i, node_id, dropped, at, ids, xs)
            continue
        if job.id in dropped or runner.over_memory:  # (over max_memory: what has not started runs elsewhere)
            let_go(job.payload, runner.get_store)
            outcomes[i] = Outcome(job.id, False, failures.error_body(Cancelled()), None, 0.0)
            continue
        try:
            xs.append(decode_input(job.payload, node_id, runner.id, runner.get_store))
            at.append(i)
            ids.append(job.id)
        except NodeError as err:
            outcomes[i] = Outcome(job.id, False, failures.error_body(err), None, 0.0)
    if ids:
        status = runner.status
        status.enter_batch(ids, node_id)
        try:
            try:  # (no RunStates: nothing is cancelled mid-turn here, and a traced job never shares a turn)
                results = piece.interpreter.run_batch(node_id, xs)
            except BaseException as err:  # never lose a job: the host is waiting for it
                results = [(False, runner.could_not_run(node_id, err))] * len(ids)
            del xs
            seconds = (time.perf_counter() - start) / len(ids)  # (each job's share: what the host measures)
            bundled: dict = {}  # a Bundle's place in the turn → ([job id], [output]) of its inputs that ran ok
            for i, job_id, (ok, value) in zip(at, ids, results):
                if ok and answers[i] is not None:
                    done = bundled.get(i)
                    if done is None:
                        done = bundled[i] = ([], [])
                    done[0].append(job_id)
                    done[1].append(value)
                    continue
                body = None
                if ok:
                    try:
                        body = encode_output(value, node_id, runner.get_store)
                    except NodeError as err:
                        ok, value = False, err
                if not ok:
                    if not isinstance(value, NodeError):
                        value = NodeError.failed(node_id, f"{type(value).__name__}: {value}")
                    body = failures.error_body(value)
                if answers[i] is not None:
                    answers[i][job_id] = body
                else:
                    outcomes[i] = Outcome(job_id, ok, body, None, seconds)
            for i, (done_ids, values) in bundled.items():
                outcomes[i] = close_bundle(runner, answers[i], done_ids, values, node_id, seconds)
        finally:
            status.leave()
    for i, job in enumerate(jobs):
        if outcomes[i] is None:  # a Bundle none of whose inputs ran ok
            outcomes[i] = close_bundle(runner, answers[i], [], [], node_id, 0.0)
    runner.check_memory()
    return outcomes


def open_bundle(runner, bundle: Bundle, i: int, node_id: str, dropped: set, at: list, ids: list,
                xs: list) -> dict:
    """A Bundle's inputs that run (decoded in one pass) go to `at`, `ids` and `xs`; what becomes of the others
    (dropped, or not decodable) is in the answers it returns: {job id: its error body}, in payload order (None
    for one that runs, until its output comes)."""
    named = bundle.ids
    if runner.over_memory or 0 in named or (dropped and not dropped.isdisjoint(named)):
        answers: dict = {}
        wanted = []  # (position, job id) of each input that runs
        for position, job_id in enumerate(named):
            if not job_id:
                continue
            if job_id in dropped or runner.over_memory:  # (over max_memory: what has not started runs elsewhere)
                answers[job_id] = failures.error_body(Cancelled())
            else:
                answers[job_id] = None
                wanted.append((position, job_id))
        if not wanted:
            let_go(bundle.payload, runner.get_store)
            return answers
    else:  # (the common case: every input of the bundle runs)
        answers, wanted = dict.fromkeys(named), None
    try:
        values = decode_input(bundle.payload, node_id, runner.id, runner.get_store)
        if type(values) is not list or len(values) != len(named):
            raise NodeError.failed(node_id, f"its input could not be received in worker {runner.id}: a bundle "
                                            f"of {len(named)} inputs decoded to something else (a bug in "
                                            f"soma: please report it)")
    except NodeError as err:
        body = failures.error_body(err)
        for job_id in answers:
            if answers[job_id] is None:
                answers[job_id] = body
        return answers
    if wanted is None:
        at += [i] * len(named)
        ids += named
        xs += values
        return answers
    for position, job_id in wanted:
        at.append(i)
        ids.append(job_id)
        xs.append(values[position])
    return answers


def close_bundle(runner, answers: dict, done_ids: list, values: list, node_id: str, seconds: float) -> Outcome:
    """A Bundle's one outcome: the outputs `values` of its inputs `done_ids` (those that ran ok) encoded as one
    list, or each alone when the list cannot be (then one that cannot fails by itself); every other input's
    answer."""
    body = None
    if done_ids:
        body, listed = encode_listed(values, node_id, runner.get_store)
        answers.update(zip(done_ids, listed))
    said = list(answers.values())
    if None in said:  # (never: each input has its answer by now)
        lost = failures.error_body(NodeError.failed(
            node_id, f"worker {runner.id} lost its output (a bug in soma: please report it)"))
        said = [lost if answer is None else answer for answer in said]
    return Outcome(list(answers), said, body, None, seconds)


def failed(entry, err: NodeError, get_store) -> Outcome:
    """The outcome of a turn's entry that could not run: `err` (a Bundle's: for each of its inputs)."""
    let_go(entry.payload, get_store)
    body = failures.error_body(err)
    if type(entry) is not Bundle:
        return Outcome(entry.id, False, body, None, 0.0)
    ids = [i for i in entry.ids if i]
    return Outcome(ids, [body] * len(ids), None, None, 0.0)
