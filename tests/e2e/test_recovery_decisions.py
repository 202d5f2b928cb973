"""The controller's decisions in the sequences that used to end wrong: the last replica holding the run's state dies
before another has healed from it, and too few survivors are left but for a replica ready to join them.

Real replicas and real deaths, injected at points of the protocol (`--fault ...:at=heal_donor`) or from outside by
pid; the checks read the run's own step log and events: a run never trains from weights it did not train (a step
trained again after a restore has the loss it had the first time), and every sample of every epoch counts once.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from support.procs import alive, stopped
from support.runs import WORKLOADS

pytestmark = pytest.mark.timeout(240)
SAMPLES, BATCH, EPOCHS = 240, 24, 3  # 10 steps an epoch
TOTAL = EPOCHS * SAMPLES // BATCH
# Replica 1 dies at step 8; replica 0, the only holder left, dies serving the replacement's heal.
LAST_HOLDER_LOST = "sigkill:replica=1:step=8,sigkill:replica=0:at=heal_donor:step=1"


def _logged(run, *args: str, faults: str = LAST_HOLDER_LOST, extra: tuple[str, ...] = ()):
    return run.start("--replicas", "2", "--min-replicas", "1", "--fault", faults, *args,
                     script=WORKLOADS / "logged_loop.py",
                     script_args=("--samples", str(SAMPLES), "--batch", str(BATCH), "--epochs", str(EPOCHS),
                                  "--step-sleep", "0.05", "--out", str(run.out), *extra))


def _steps(run) -> list[dict]:
    path = run.out / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _no_orphans(run) -> None:
    for pids in run.pids().values():
        assert not any(alive(p) for p in pids), run.pids()


def test_the_last_holder_dying_mid_heal_restores_the_runs_checkpoint_and_trains_the_lost_steps_again(elastic_run):
    # Where the heal falls is pinned, so steps after the checkpoint are always lost: the replacement gets ready only
    # once replica 0, training alone, has frozen at the start of step 11 (the checkpoint of step 10 behind it), and
    # replica 0 goes on once the grow is announced. It dies serving the heal at the first boundary after the
    # announcement reaches it (a message to a process that was stopped: one step or three late), while it trains
    # slowly enough (`--straggle`) that the boundary comes before the checkpoint of step 15.
    run = elastic_run()
    release = run.tmp / "release-replica-2"
    _logged(run, "--checkpoint-steps", "5", faults=f"{LAST_HOLDER_LOST},stop:replica=0:step=11",
            extra=("--hold", f"2:{release}", "--straggler", "0", "--straggle", "0.25", "--straggle-until", "15"))
    run.wait_for(lambda: 0 in run.pids() and stopped(run.pids()[0][0]), timeout=120, what="replica 0 frozen at step 11")
    release.touch()
    run.wait_for(lambda: [0, 2] in [q["members"] for q in run.events("quorum")], timeout=120,
                 what="the replacement admitted")
    os.kill(run.pids()[0][0], signal.SIGCONT)
    assert run.wait(timeout=200) == 0, run.output

    [restore] = run.events("restore")
    start = restore["step"]  # the newest complete checkpoint when the holder died: 10, or 5 if 10 was still writing
    assert start in (5, 10) and restore["members"] == [2], restore
    quorum = next(q for q in run.events("quorum") if q["gen"] == restore["gen"])
    assert quorum["action"] == "restore" and quorum["holders"] == [] and quorum["checkpoint"] == restore["path"]
    assert [e["replica"] for e in run.events("restored")] == [2]
    assert not any(e["replica"] == 2 for e in run.events("first_commit") if e["gen"] < restore["gen"]), \
        "the replacement trained before it restored the run's state"
    assert f"restore {restore['path']} and train again what the run trained after its step {start}" in run.output

    # Every step's last record is the one that counts: those before the checkpoint from the first replicas, the
    # rest from the restore.
    records = _steps(run)
    final = {r["step"]: r for r in records}
    assert sorted(final) == list(range(TOTAL))
    restart = next(i for i in range(1, len(records)) if records[i]["step"] <= records[i - 1]["step"])
    assert [r["step"] for r in records[restart:]] == list(range(start, TOTAL))
    redone = [r for r in records[:restart] if r["step"] >= start]
    assert [r["step"] for r in redone] == list(range(start, redone[-1]["step"] + 1)) and redone[-1]["step"] >= 11
    for old in redone:  # the same batch from the same state: the loss it had the first time
        assert final[old["step"]]["batch"] == old["batch"]
        assert final[old["step"]]["loss"] == pytest.approx(old["loss"], rel=1e-5), (old, final[old["step"]])
    for epoch in range(EPOCHS):
        trained = sorted(i for r in final.values() if r["epoch"] == epoch for i in r["batch"])
        assert trained == list(range(SAMPLES)), epoch
    results = run.results()
    assert set(results) == {2, 3} and {r["step"] for r in results.values()} == {TOTAL}
    assert len({r["checksum"] for r in results.values()}) == 1
    _no_orphans(run)


def test_the_last_holder_dying_mid_heal_without_a_checkpoint_stops_the_run_and_writes_nothing(elastic_run):
    run = _logged(elastic_run())
    assert run.wait(timeout=200) == 1, run.output
    assert "the last replica holding the run's trained state died before another had healed from it" in run.output
    assert "(ElasticLoop's --checkpoint-steps)" in run.output  # the fix, in monarch-run's spelling
    [give_up] = run.events("give_up")
    assert give_up["checkpoint"] is None and give_up["resume_from"] is None
    assert not (run.tmp / "ckpt").exists() or not os.listdir(run.tmp / "ckpt")
    assert not [e for e in run.events("first_commit") if e["replica"] == 2], "the replacement trained from nothing"
    assert max(r["step"] for r in _steps(run)) < TOTAL - 1
    _no_orphans(run)


def test_a_ready_replica_counts_towards_min_replicas_with_the_survivor_it_heals_from(elastic_run):
    """2 replicas, `--min-replicas 2`, a hot spare ready: replica 1 is SIGKILLed from outside. The survivor and the
    ready spare make two, so the run goes on (it used to count the survivors alone, and stop), exactly as when a
    survivor dies the moment a replacement is ready but not yet admitted."""
    run = elastic_run()
    run.start("--replicas", "2", "--min-replicas", "2", "--spares", "1",
              script_args=("--epochs", "12", "--samples", "256", "--batch", "16", "--step-sleep", "0.05",
                           "--out", str(run.out)))
    run.wait_for(lambda: any(e["replica"] == 2 for e in run.events("ready")) and run.progress(0) >= 5,
                 timeout=120, what="the spare ready and step 5")
    os.kill(run.pids()[1][0], signal.SIGKILL)
    assert run.wait(timeout=200) == 0, run.output
    assert not run.events("give_up")
    assert [d["replica"] for d in run.events("death")] == [1]
    assert [q["members"] for q in run.events("quorum")][:2] == [[0, 1], [0, 2]]
    results = run.results()
    assert set(results) == {0, 2} and {r["step"] for r in results.values()} == {12 * 16}
    assert len({r["checksum"] for r in results.values()}) == 1
    for epoch, counts in enumerate(results[0]["seen"]):  # replica 0 trained from the start to the end
        assert set(counts) == {1.0}, f"epoch {epoch}: {counts}"
    _no_orphans(run)


def test_a_replacement_stuck_before_its_training_loop_is_replaced_after_join_timeout(elastic_run):
    """The first replacement hangs while starting (its process answers; its training code never gets to the loop):
    it is treated as hung `--join-timeout` after its spawn began, as the initial replicas are, and the next one
    joins. It used to hold its slot, and the survivor's wait for a regrow, forever."""
    run = elastic_run()
    run.start("--replicas", "2", "--min-replicas", "1", "--join-timeout", "10", "--fault", "sigkill:replica=1:step=5",
              script=WORKLOADS / "hangs_when_replaced.py",
              script_args=("2", "--replicas", "2", "--hold-for-regrow-from", "8", "--epochs", "6", "--samples", "256",
                           "--batch", "16", "--out", str(run.out)))
    assert run.wait(timeout=200) == 0, run.output
    [hang] = run.events("hang")
    assert hang["replica"] == 2 and hang["detected_by"] == "hang (never ready)", hang
    assert "`join_timeout_s`" in hang["why"] or "--join-timeout" in hang["why"], hang
    spawned = next(e for e in run.events("respawn_scheduled"))["ts"]
    assert 10 <= hang["ts"] - spawned < 10 + 5, hang["ts"] - spawned
    assert [q["members"] for q in run.events("quorum")] == [[0, 1], [0], [0, 3]]
    results = run.results()
    assert set(results) == {0, 3} and len({r["checksum"] for r in results.values()}) == 1
    for epoch, counts in enumerate(results[0]["seen"]):
        assert set(counts) == {1.0}, f"epoch {epoch}: {counts}"
    _no_orphans(run)


def test_one_stuck_proc_of_a_two_proc_replica_replaces_the_replica_whole(elastic_run):
    """Local rank 1 of replica 1 stops making progress in step 5, its process answering, while its sibling waits
    for it inside the replica's own all-reduce (DDP's, inside a replica): the replica is found (by the probe, or by
    the vote of its procs timing out) and replaced whole, and the replacement heals shard by shard."""
    run = elastic_run()
    run.start("--replicas", "2", "--min-replicas", "1", "--procs-per-replica", "2", "--collective-timeout", "3",
              "--join-timeout", "120", "--fault", "hang:replica=1:lane=1:step=5",
              script=WORKLOADS / "two_procs_per_replica.py", script_args=(str(run.out), "60"))
    assert run.wait(timeout=200) == 0, run.output
    [fired] = run.events("fault_injected")
    assert fired["source"] == "replica1.1" and fired["step"] == 5
    [hang] = run.events("hang")
    assert hang["replica"] == 1 and hang["detected_by"] in ("hang", "reported unfit"), hang
    assert [d["replica"] for d in run.events("death")] == [1]
    results = [json.loads(p.read_text()) for p in run.out.glob("result-*.json")]
    assert sorted((r["replica"], r["local_rank"]) for r in results) == [(0, 0), (0, 1), (2, 0), (2, 1)]
    assert {r["checksum"] for r in results} == {results[0]["checksum"]} and {r["step"] for r in results} == {60}
    survivor = [r for r in results if r["replica"] == 0]  # its two procs together saw each sample once an epoch
    counts = [[a + b for a, b in zip(*epoch)] for epoch in zip(*(r["seen"] for r in survivor))]
    for epoch in counts[:3]:
        assert set(epoch) == {1.0}, counts
    _no_orphans(run)


def test_two_wedged_replicas_are_probed_together_and_lost_in_one_generation_change(elastic_run):
    """Replicas 1 and 2 wedge in step 5 holding Python's GIL (their processes, and Monarch's supervision of them,
    still answer; their control actors do not): the survivor's reduction stalls, and one probe asks both at once,
    so both are found within one probe deadline, not one after the other, and lost in one generation change."""
    run = elastic_run()
    run.start("--replicas", "3", "--min-replicas", "1", "--collective-timeout", "2", "--join-timeout", "120",
              "--fault", "gil:replica=1:step=5,gil:replica=2:step=5",
              script=WORKLOADS / "held_loop.py",  # the survivor holds from step 6 until its replacements join
              script_args=("--epochs", "4", "--samples", "256", "--batch", "16", "--step-sleep", "0.05",
                           "--replicas", "3", "--hold-for-regrow-from", "6", "--out", str(run.out)))
    assert run.wait(timeout=200) == 0, run.output
    wedged_at = max(e["ts"] for e in run.events("fault_injected"))
    hangs = [e for e in run.events("hang") if e["replica"] in (1, 2)]
    assert sorted(e["replica"] for e in hangs) == [1, 2], run.events("hang")
    assert all(e["why"].startswith("no answer from its control actor") for e in hangs), hangs
    assert abs(hangs[0]["ts"] - hangs[1]["ts"]) < 1.0, hangs  # one deadline for both
    assert hangs[-1]["ts"] - wedged_at < 2 + 0.5 + 5 + 3.0, hangs[-1]["ts"] - wedged_at  # timeout, grace, one probe
    assert [q["members"] for q in run.events("quorum")][:2] == [[0, 1, 2], [0]]
    results = run.results()
    assert 0 in results and len({r["checksum"] for r in results.values()}) == 1
    for epoch, counts in enumerate(results[0]["seen"]):
        assert set(counts) == {1.0}, f"epoch {epoch}: {counts}"
    _no_orphans(run)
