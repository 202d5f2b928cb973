"""Planned departures: a signal with notice (SIGTERM, SIGUSR1) is not a crash.

To one replica's proc it drains that replica at the next step boundary (nothing dropped, a replacement at once); to
the controller, or to every process of the job as a scheduler's preemption sends it, it stops the run with a
checkpoint that the relaunch resumes exactly. Real Monarch procs and gloo groups under `monarch-run`, signalled from
outside, as `kill`, `scancel` and SLURM's preemption do.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from support.procs import alive, descendants
from support.runs import WORKLOADS

pytestmark = pytest.mark.timeout(300)

SAMPLES, BATCH, EPOCHS = 240, 24, 3  # 10 steps an epoch
STEPS = EPOCHS * SAMPLES // BATCH
LOOP = ("--samples", str(SAMPLES), "--batch", str(BATCH), "--epochs", str(EPOCHS), "--step-sleep", "0.1")
EXACT = (*LOOP, "--batchnorm", "--dropout")
"""A model whose forward moves BatchNorm's statistics and draws dropout's masks: a stop that drops the step in flight
must checkpoint both as the last committed step left them, for its relaunch to train as a run never stopped."""


def _steps(run) -> list[dict]:
    path = run.out / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _no_orphans(run) -> None:
    for pids in run.pids().values():
        assert not any(alive(p) for p in pids), run.pids()


def test_sigterm_to_one_replicas_proc_drains_it_at_a_step_boundary_with_nothing_dropped(elastic_run):
    run = elastic_run()
    run.start("--replicas", "3", "--min-replicas", "2", script=WORKLOADS / "logged_loop.py",
              script_args=(*LOOP, "--out", str(run.out)))
    run.wait_for(lambda: len(_steps(run)) >= 6, timeout=120, what="step 6")
    [pid] = run.pids()[1]
    os.kill(pid, signal.SIGTERM)
    assert run.wait(timeout=180) == 0, run.output

    [notice] = run.events("notice")
    assert (notice["replica"], notice["signal"], notice["pid"]) == (1, "SIGTERM", pid)
    [drain] = run.events("drain")
    assert (drain["replicas"], drain["members"]) == ([1], [0, 2])
    [drained] = run.events("drained")
    assert drained["replica"] == 1 and drained["seconds"] < 5
    plans = [q["members"] for q in run.events("quorum")]
    assert plans[:2] == [[0, 1, 2], [0, 2]] and plans[-1] == [0, 2, 3], plans
    assert not [q for q in run.events("quorum") if q["interrupt"]]  # every change at a step boundary
    assert not run.events("dropped_step") and not run.events("death")
    steps = _steps(run)
    assert [r["step"] for r in steps] == list(range(STEPS))  # each step once: none lost, none redone
    for epoch in range(EPOCHS):
        assert sorted(i for r in steps if r["epoch"] == epoch for i in r["batch"]) == list(range(SAMPLES)), epoch
    results = run.results()
    assert set(results) == {0, 2, 3} and len({r["checksum"] for r in results.values()}) == 1
    assert "replica 1 got SIGTERM" in run.output
    _no_orphans(run)


def test_the_controller_told_to_stop_leaves_a_checkpoint_and_two_relaunches_end_as_a_run_never_stopped(elastic_run):
    """SIGTERM to `monarch-run` alone (a user's `kill`), then SIGUSR1 to every process of the relaunched job at once
    (SLURM's `--signal=USR1@N` before the time limit, or a preemption): each stops with a checkpoint of its last
    committed step and the status of the signal; the third run finishes, and the three trained every step once, the
    same batches as a run never stopped, to the same weights."""
    clean = elastic_run()
    clean.start("--replicas", "2", script=WORKLOADS / "logged_loop.py",
                script_args=(*EXACT, "--out", str(clean.out)))
    first = elastic_run()
    first.start("--replicas", "2", script=WORKLOADS / "logged_loop.py",
                script_args=(*EXACT, "--out", str(first.out)))
    first.wait_for(lambda: len(_steps(first)) >= 5, timeout=120, what="step 5")
    os.kill(first.proc.pid, signal.SIGTERM)
    assert first.wait(timeout=120) == 143, first.output
    [give_up] = first.events("give_up")
    path = give_up["checkpoint"]
    assert path and f"checkpoint written to {path}" in first.output and "relaunch with your front end's resume" \
        in first.output and "SIGTERM received" in first.output
    assert not first.events("death") and not first.events("respawn_scheduled")
    _no_orphans(first)

    ckpt = first.tmp / "ckpt"
    second = elastic_run()
    second.start("--replicas", "2", "--checkpoint-dir", str(ckpt), "--resume", "auto",
                 script=WORKLOADS / "logged_loop.py", script_args=(*EXACT, "--out", str(second.out)))
    second.wait_for(lambda: len(_steps(second)) >= 8, timeout=120, what="8 more steps")
    job = {second.proc.pid, *descendants(second.proc.pid)}  # the controller, the forkserver, every proc
    for pid in job:
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    assert second.wait(timeout=120) == 138, second.output
    [give_up] = second.events("give_up")
    assert give_up["checkpoint"] and not second.events("death") and not second.events("drain")
    _no_orphans(second)

    third = elastic_run()
    third.start("--replicas", "2", "--checkpoint-dir", str(ckpt), "--resume", "auto",
                script=WORKLOADS / "logged_loop.py", script_args=(*EXACT, "--out", str(third.out)))
    assert third.wait(timeout=180) == 0, third.output
    assert clean.wait(timeout=60) == 0, clean.output
    # A step dropped in flight by a stop was never logged: each run's log starts where the previous one's ended.
    steps = _steps(first) + _steps(second) + _steps(third)
    assert [r["step"] for r in steps] == list(range(STEPS))
    assert steps == _steps(clean)
    assert {r["checksum"] for r in third.results().values()} == {clean.results()[0]["checksum"]}


@pytest.mark.parametrize("lost", ["sigkill", "raise"])
def test_a_stop_whose_writer_is_lost_mid_write_is_written_by_the_next_holder_and_resumes_exactly(elastic_run, lost):
    """The controller told to stop; the replica writing the stop's checkpoint dies as it starts the write (or its code
    raises there): the next holder writes it instead, and the relaunch trains on as a run never stopped."""
    clean = elastic_run()
    clean.start("--replicas", "3", script=WORKLOADS / "logged_loop.py", script_args=(*EXACT, "--out", str(clean.out)))
    first = elastic_run()
    first.start("--replicas", "3", "--fault", f"{lost}:replica=0:at=stop_checkpoint",
                script=WORKLOADS / "logged_loop.py", script_args=(*EXACT, "--out", str(first.out)))
    first.wait_for(lambda: len(_steps(first)) >= 5, timeout=120, what="step 5")
    os.kill(first.proc.pid, signal.SIGTERM)
    assert first.wait(timeout=120) == 143, first.output
    stops = [q for q in first.events("quorum") if q["action"] == "checkpoint"]
    assert [q["members"] for q in stops] == [[0, 1, 2], [1, 2]], stops
    [written] = first.events("checkpoint")
    [give_up] = first.events("give_up")
    assert written["replica"] == 1 and give_up["checkpoint"] == written["path"], first.output
    assert "replica 0 did not write the checkpoint" in first.output
    assert not first.events("respawn_scheduled")
    _no_orphans(first)

    second = elastic_run()
    second.start("--replicas", "3", "--checkpoint-dir", str(first.tmp / "ckpt"), "--resume", "auto",
                 script=WORKLOADS / "logged_loop.py", script_args=(*EXACT, "--out", str(second.out)))
    assert second.wait(timeout=180) == 0, second.output
    assert clean.wait(timeout=60) == 0, clean.output
    steps = _steps(first) + _steps(second)
    assert [r["step"] for r in steps] == list(range(STEPS)) and steps == _steps(clean)
    assert {r["checksum"] for r in second.results().values()} == {clean.results()[0]["checksum"]}


def test_a_replica_draining_when_a_member_dies_is_aborted_with_the_members(elastic_run):
    """Replica 3 is told to go; before the generation without it forms, member 1 dies. The death's generation drops
    the step in flight for the draining replica too, which is in that step with the dead member: it leaves at once,
    drained, instead of waiting there for `drain_grace_s` and being counted as a death."""
    run = elastic_run()
    run.start("--replicas", "4", "--min-replicas", "1", "--drain-grace", "20", script=WORKLOADS / "logged_loop.py",
              script_args=(*LOOP[:-1], "0.5", "--out", str(run.out)))
    run.wait_for(lambda: len(_steps(run)) >= 3, timeout=120, what="step 3")
    pids = run.pids()
    os.kill(pids[3][0], signal.SIGTERM)
    run.wait_for(lambda: run.events("drain"), timeout=30, what="the drain")
    os.kill(pids[1][0], signal.SIGKILL)
    killed = time.monotonic()
    run.wait_for(lambda: run.events("drained"), timeout=30, what="replica 3 drained")
    assert time.monotonic() - killed < 10, run.output
    assert run.wait(timeout=180) == 0, run.output
    assert [d["replica"] for d in run.events("death")] == [1]
    [drained] = run.events("drained")
    assert drained["replica"] == 3
    steps = _steps(run)
    assert [r["step"] for r in steps] == list(range(STEPS))
    for epoch in range(EPOCHS):
        assert sorted(i for r in steps if r["epoch"] == epoch for i in r["batch"]) == list(range(SAMPLES)), epoch
    assert len({r["checksum"] for r in run.results().values()}) == 1
    _no_orphans(run)
