"""The controller itself lost: `monarch-run` SIGKILLed (its machine gone, the OOM killer's pick) mid-training, mid-heal,
mid-drain and mid-stop. Its replicas write the last committed step and end (`worker.orphan`); a relaunch with
`--resume auto` goes on from it, on the same global batches in the same order, losing at most the step in flight.

Real Monarch procs, real SIGKILLs from outside; each test bounds its time and the fixture kills leftovers by pid.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from support.procs import alive, parent
from support.runs import WORKLOADS, saved_on_controller_loss
from monarch_plugin.storage.checkpoint import step_path

pytestmark = pytest.mark.timeout(300)
SAMPLES, BATCH, EPOCHS = 240, 24, 4  # 10 steps an epoch
TOTAL = EPOCHS * SAMPLES // BATCH
LOOP = ("--samples", str(SAMPLES), "--batch", str(BATCH), "--epochs", str(EPOCHS))


def _steps(run) -> list[dict]:
    path = run.out / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _saved(run, replicas=(0, 1, 2), lanes: int = 1) -> dict:
    """The `controller_lost` event of the proc that wrote the run's checkpoint (`saved_on_controller_loss`), named for
    its step in the run's checkpoint directory."""
    writer = saved_on_controller_loss(run.events("controller_lost"), replicas, lanes)
    assert writer["checkpoint"] == step_path(str(run.tmp / "ckpt"), writer["step"]), writer
    return writer


def _resume(elastic_run, killed, before: list[dict], start: int, replicas: int = 2, *extra: str) -> None:
    """Relaunch on `replicas` with --resume auto from the killed run's checkpoints: it resumes `start` steps in, trains
    the rest of the run exactly as the killed one trained the steps both did, every sample once an epoch across both."""
    resumed = elastic_run()
    resumed.start("--replicas", str(replicas), "--checkpoint-dir", str(killed.tmp / "ckpt"), "--resume", "auto",
                  *extra, script=WORKLOADS / "logged_loop.py", script_args=(*LOOP, "--out", str(resumed.out)))
    assert resumed.wait(timeout=150) == 0, resumed.output
    [resume] = resumed.events("resume")
    assert resume["path"] == step_path(str(killed.tmp / "ckpt"), start), resume
    after = _steps(resumed)
    assert [r["step"] for r in after] == list(range(start, TOTAL)) and {r["replicas"] for r in after} == {replicas}
    for old, new in zip(before[start:], after):  # a step trained before the kill and again after: the same
        assert old["batch"] == new["batch"] and old["epoch"] == new["epoch"], (old, new)
        assert new["loss"] == pytest.approx(old["loss"], rel=1e-5), (old, new)
    for epoch in range(EPOCHS):
        trained = [i for r in before[:start] + after if r["epoch"] == epoch for i in r["batch"]]
        assert sorted(trained) == list(range(SAMPLES)), epoch
    results = resumed.results()
    assert {r["step"] for r in results.values()} == {TOTAL} and len({r["checksum"] for r in results.values()}) == 1
    assert not any(alive(p) for pids in resumed.pids().values() for p in pids)


def test_a_killed_controller_costs_at_most_the_step_in_flight_and_resume_auto_goes_on_from_the_saved_step(
        elastic_run):
    """Three replicas and a periodic checkpoint every 5 steps; the controller SIGKILLed after 17 steps. The generation's
    first replica writes the step it holds (what it last logged, or one more committed between its log and the
    kill), every proc ends within seconds, and a relaunch on two replicas goes on from that step, not from the
    periodic one."""
    killed = elastic_run()
    killed.start("--replicas", "3", "--checkpoint-steps", "5", script=WORKLOADS / "logged_loop.py",
                 script_args=(*LOOP, "--out", str(killed.out)))
    killed.wait_for(lambda: len(_steps(killed)) >= 17, timeout=120, what="17 committed steps")
    [server] = killed.events("forkserver")  # its procs outlive the controller by the forkserver's leave
    assert server["ready"] and all(parent(p) == server["pid"] for pids in killed.pids().values() for p in pids)
    t0 = time.monotonic()
    killed.kill_controller(within=20)
    gone_s = time.monotonic() - t0
    before = _steps(killed)
    writer = _saved(killed)
    assert len(before) <= writer["step"] <= len(before) + 1, (writer, len(before))
    # The save is the step held, a checkpoint of its own, whether or not that step is also a periodic one's.
    [saved] = [e for e in killed.events("checkpoint") if not e.get("periodic")]
    assert (saved["step"], saved["path"]) == (writer["step"], writer["checkpoint"]), saved
    assert gone_s < 10, gone_s
    _resume(elastic_run, killed, before, writer["step"])


@pytest.mark.parametrize("start", ["forkserver", "no-forkserver"])
def test_a_writer_that_cannot_write_is_ended_by_the_bound_and_the_relaunch_takes_the_periodic_checkpoint(
        elastic_run, start):
    """The first replica wedged in step 12 holding the GIL (a C call that never returns) when the controller goes:
    nothing can write the last step, not even the proc's own bound thread runs, and still nothing outlives
    `--controller-loss-save` (5 s) by more than a second: whatever started the proc SIGKILLs it, its forkserver client
    or, for a fresh interpreter, its watchdog. The other replica writes nothing, and the relaunch resumes the newest
    periodic checkpoint."""
    killed = elastic_run()
    killed.start("--replicas", "2", "--checkpoint-steps", "5", "--controller-loss-save", "5", f"--{start}",
                 "--fault", "gil:replica=0:step=12", script=WORKLOADS / "logged_loop.py",
                 script_args=(*LOOP, "--out", str(killed.out)))
    killed.wait_for(lambda: killed.events("fault_injected"), timeout=120, what="replica 0 wedged")
    os.kill(killed.proc.pid, signal.SIGKILL)
    t0 = time.monotonic()
    assert killed.wait(timeout=30) == -signal.SIGKILL
    killed.kill_controller(within=15)  # waits for every proc to be gone
    assert 4 < time.monotonic() - t0 < 9, "the wedged proc lived out the bound, and no longer"
    before = _steps(killed)
    [survivor] = killed.events("controller_lost")
    assert survivor["replica"] == 1 and survivor["checkpoint"] is None and survivor["skipped"]
    assert len(before) == 12 and max(e["step"] for e in killed.events("checkpoint")) == 10
    _resume(elastic_run, killed, before, 10)


def test_a_controller_killed_mid_heal_leaves_the_held_step_written_and_the_newcomer_writes_nothing(elastic_run):
    """Replica 1 SIGKILLed at step 8; its replacement (replica 3) freezes while receiving its state from a donor, the
    controller is SIGKILLed then, and the newcomer thawed: the heal's donor side holds the run's last committed step,
    which the generation's first replica writes; the newcomer, whose state was being replaced, writes nothing."""
    killed = elastic_run()
    killed.start("--replicas", "3", "--fault", "sigkill:replica=1:step=8,stop:replica=3:at=heal_recipient",
                 script=WORKLOADS / "logged_loop.py", script_args=(*LOOP, "--out", str(killed.out)))
    killed.wait_for(lambda: [e for e in killed.events("fault_injected") if e["at"] == "heal_recipient"],
                    timeout=150, what="the newcomer frozen mid-heal")
    [newcomer] = killed.pids()[3]
    os.kill(killed.proc.pid, signal.SIGKILL)
    assert killed.wait(timeout=30) == -signal.SIGKILL
    os.kill(newcomer, signal.SIGCONT)
    killed.kill_controller(within=30)
    before = _steps(killed)
    writer = _saved(killed, replicas=(0, 2, 3))
    assert len(before) <= writer["step"] <= len(before) + 1, (writer, len(before))
    _resume(elastic_run, killed, before, writer["step"])


def test_a_controller_killed_while_a_replica_drains_leaves_the_held_step_written(elastic_run, tmp_path):
    """Replica 1 told to go (SIGTERM) while every replica is held inside step 12, then the controller SIGKILLed before
    the boundary where replica 1 would leave: the step in flight is dropped, the first replica writes step 12, and the
    relaunch trains from there, the drained replica's share included."""
    pause = tmp_path / "pause"
    pause.touch()
    killed = elastic_run()
    killed.start("--replicas", "3", script=WORKLOADS / "logged_loop.py",
                 script_args=(*LOOP, "--out", str(killed.out), "--pause", f"12:{pause}"))
    killed.wait_for(lambda: len(_steps(killed)) >= 12, timeout=120, what="12 committed steps")
    os.kill(killed.pids()[1][0], signal.SIGTERM)
    killed.wait_for(lambda: killed.events("notice"), timeout=30, what="the controller told of the SIGTERM")
    os.kill(killed.proc.pid, signal.SIGKILL)
    assert killed.wait(timeout=30) == -signal.SIGKILL
    pause.unlink()
    killed.kill_controller(within=30)
    before = _steps(killed)
    writer = _saved(killed)
    assert writer["replica"] == 0 and writer["step"] == len(before) == 12, (writer, len(before))
    _resume(elastic_run, killed, before, 12)


def test_a_controller_killed_while_its_stop_checkpoint_is_written_leaves_that_checkpoint_complete(elastic_run):
    """Every replica told to go (SIGTERM, a preempted job): the run stops with a checkpoint, and the controller is
    SIGKILLed while its writer is frozen at the start of the write. Thawed, the writer completes that checkpoint and
    ends; the others, waiting for the stop, end writing nothing; the relaunch resumes it exactly."""
    killed = elastic_run()
    killed.start("--replicas", "2", "--fault", "stop:replica=0:at=stop_checkpoint",
                 script=WORKLOADS / "logged_loop.py", script_args=(*LOOP, "--out", str(killed.out)))
    killed.wait_for(lambda: len(_steps(killed)) >= 12, timeout=120, what="12 committed steps")
    for pids in killed.pids().values():
        os.kill(pids[0], signal.SIGTERM)
    killed.wait_for(lambda: [e for e in killed.events("fault_injected") if e["at"] == "stop_checkpoint"],
                    timeout=60, what="the stop's writer frozen")
    os.kill(killed.proc.pid, signal.SIGKILL)
    assert killed.wait(timeout=30) == -signal.SIGKILL
    os.kill(killed.pids()[0][0], signal.SIGCONT)
    killed.kill_controller(within=30)
    before = _steps(killed)
    [written] = [e for e in killed.events("checkpoint") if e.get("replica") == 0]
    assert written["step"] == len(before), (written, len(before))
    assert not [e for e in killed.events("controller_lost") if e["checkpoint"]]
    _resume(elastic_run, killed, before, len(before))


def test_a_replica_of_two_fsdp_procs_writes_its_shards_together_and_another_shape_resumes_them(elastic_run):
    """Two replicas of two FSDP procs each: both procs of the first replica agree (their own vote, which the
    controller's loss must not break) and write their shards of the held step as one checkpoint; three replicas of one
    proc, without FSDP, resume it exactly."""
    killed = elastic_run()
    killed.start("--replicas", "2", "--procs-per-replica", "2", script=WORKLOADS / "logged_loop.py",
                 script_args=(*LOOP, "--fsdp", "--out", str(killed.out)))
    killed.wait_for(lambda: len(_steps(killed)) >= 12, timeout=150, what="12 committed steps")
    killed.kill_controller(within=30)
    before = _steps(killed)
    writer = _saved(killed, replicas=(0, 1), lanes=2)  # lane 1 of replica 0 wrote its shard of the same step
    assert len(before) <= writer["step"] <= len(before) + 1, (writer, len(before))
    _resume(elastic_run, killed, before, writer["step"], 3)
