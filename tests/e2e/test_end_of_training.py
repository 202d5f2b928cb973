"""The end of a run: once its replicas have all reached the end of training, what happens to them after (in their own
code after the loop, or while one is still finishing its last step) is no failure of the run's.

Real Monarch procs and gloo groups under `monarch-run`, signalled from outside by PID. Each test checks the exit
status, that no give-up checkpoint was written and no replacement spawned, the finishers' identical weights and
sample counts, and that no process is left.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from support.procs import alive
from support.runs import WORKLOADS

pytestmark = pytest.mark.timeout(120)

SAMPLES, BATCH, EPOCHS = 96, 24, 2  # 4 steps an epoch
STEPS = EPOCHS * SAMPLES // BATCH


def _start(run, replicas: int, *flags: str, workload_args: tuple[str, ...] = ()) -> None:
    run.start("--replicas", str(replicas), *flags, script=WORKLOADS / "held_loop.py",
              script_args=("--replicas", str(replicas), "--samples", str(SAMPLES), "--batch", str(BATCH),
                           "--epochs", str(EPOCHS), *workload_args, "--out", str(run.out)))


def _marked(run, name: str, replica: int) -> int | None:
    path = run.out / f"{name}-{replica}"
    return int(path.read_text()) if path.exists() and path.read_text() else None


def _finished_as_trained(run, finishers: set[int]) -> None:
    """Every finisher returned at the last step with the same weights, having trained every sample once an epoch; no
    replica was spawned after the start, no checkpoint written, nothing left running."""
    results = run.results()
    assert set(results) == finishers, (results.keys(), run.output)
    assert {r["step"] for r in results.values()} <= {STEPS}
    assert len({r["checksum"] for r in results.values()}) <= 1
    for r in results.values():
        assert all(set(epoch) == {1.0} for epoch in r["seen"]), r
    assert not run.events("give_up") and not run.events("respawn_scheduled"), run.output
    assert not (run.tmp / "ckpt").exists()
    assert not any(alive(p) for pids in run.pids().values() for p in pids), run.pids()


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_replica_killed_in_its_code_after_training_leaves_the_run_finished(elastic_run, replicas):
    """With every other replica returned (or none at all), the death of the last one still running its own code after
    the loop (an evaluation, an upload) takes no step the run trained: exit 0, its peers' results kept."""
    run = elastic_run()
    _start(run, replicas, "--min-replicas", "1", workload_args=("--linger", "60", "--linger-replica", "0"))
    others = set(range(1, replicas))
    run.wait_for(lambda: _marked(run, "after", 0) and others <= set(run.results()), 60, "replica 0 after its loop")
    os.kill(_marked(run, "after", 0), signal.SIGKILL)
    assert run.wait(timeout=60) == 0, run.output
    [death] = run.events("death")
    assert death["replica"] == 0 and "after training ended" in run.output
    assert [q["members"] for q in run.events("quorum")] == [list(range(replicas))]
    _finished_as_trained(run, others)


def test_sigterm_to_a_replica_in_its_code_after_training_lets_that_code_finish(elastic_run):
    """A signal with notice after the end drains nothing and stops nothing: the replica's own code goes on, and its
    result is kept."""
    run = elastic_run()
    _start(run, 2, "--min-replicas", "1", workload_args=("--linger", "3", "--linger-replica", "0"))
    run.wait_for(lambda: _marked(run, "after", 0) and 1 in run.results(), 60, "replica 0 after its loop")
    os.kill(_marked(run, "after", 0), signal.SIGTERM)
    assert run.wait(timeout=60) == 0, run.output
    [notice] = run.events("notice")
    assert notice["replica"] == 0 and not run.events("drain") and not run.events("death")
    assert "got SIGTERM" in run.output and "after training ended" in run.output
    _finished_as_trained(run, {0, 1})


def test_a_replica_lost_while_the_others_wait_for_it_at_the_end_does_not_hold_them(elastic_run):
    """Replica 2 is still in its last step (committed, its loop not left) when the others reach the end-of-training
    barrier; it is told to go, then killed a second later, as a scheduler whose grace is short does. The drain's
    generation leaves the others waiting at that barrier: the death's generation ends their wait, and they finish
    together without it, at once (not after `join_timeout_s`)."""
    run = elastic_run()
    _start(run, 3, "--min-replicas", "2", "--join-timeout", "60", workload_args=("--late", "2", "--late-s", "60"))
    run.wait_for(lambda: all(_marked(run, "at-end", r) for r in range(3)), 60, "every replica at its last step")
    pid = _marked(run, "at-end", 2)
    os.kill(pid, signal.SIGTERM)
    run.wait_for(lambda: run.events("drain"), 30, "the drain")
    time.sleep(1.0)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    assert run.wait(timeout=60) == 0, run.output
    assert time.monotonic() - killed < 20, run.output
    assert [d["replica"] for d in run.events("death")] == [2]
    assert [q["members"] for q in run.events("quorum")] == [[0, 1, 2], [0, 1], [0, 1]]
    [end] = run.events("run_end")
    assert end["members"] == [0, 1]
    results = run.results()
    assert set(results) == {0, 1} and {r["step"] for r in results.values()} == {STEPS}
    assert len({r["checksum"] for r in results.values()}) == 1 and not run.events("give_up")
    assert not any(alive(p) for pids in run.pids().values() for p in pids), run.pids()


def test_sigterm_to_the_controller_after_training_gives_the_replicas_a_grace_then_ends_with_success(elastic_run):
    """The job told to stop once training is over has nothing to save: the replicas still in their code after training
    get `drain_grace_s`, then are stopped, and the run exits 0 (under SLURM: not requeued)."""
    run = elastic_run()
    _start(run, 2, "--min-replicas", "1", "--drain-grace", "2",
           workload_args=("--linger", "60", "--linger-replica", "0"))
    run.wait_for(lambda: _marked(run, "after", 0) and 1 in run.results(), 60, "replica 0 after its loop")
    os.kill(run.proc.pid, signal.SIGTERM)
    told = time.monotonic()
    assert run.wait(timeout=60) == 0, run.output
    assert 2 <= time.monotonic() - told < 15, run.output
    [end] = run.events("run_end")
    assert end["unfinished"] == [0] and "SIGTERM received after training ended" in run.output
    _finished_as_trained(run, {1})
