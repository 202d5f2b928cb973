"""Durable checkpoints of the plain loop, end to end under `monarch-run`: a lane's failed write never costs the newest
complete checkpoint, a run with another number of replicas *and* of procs per replica resumes it exactly, and a
second run on the same files is refused. Real Monarch procs, FSDP2 over a replica's procs on gloo, a real SIGKILL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from support.runs import WORKLOADS

pytestmark = pytest.mark.timeout(300)

SAMPLES, BATCH, EPOCHS, EVERY = 240, 24, 3, 4  # 10 steps an epoch
TOTAL = EPOCHS * SAMPLES // BATCH
LOOP = ("--samples", str(SAMPLES), "--batch", str(BATCH), "--epochs", str(EPOCHS), "--step-sleep", "0.15")


def _steps(run) -> list[dict]:
    path = run.out / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_lanes_failed_write_keeps_the_newest_complete_checkpoint_which_another_shape_resumes_exactly(elastic_run):
    """2 replicas of 2 FSDP procs checkpoint every 4 steps, keeping 1; from step 12 on, lane 1's file name is taken
    by a directory, so its writes fail while lane 0's succeed. The controller is SIGKILLed after such a failure, and
    the save of the step held fails the same way: step 8's checkpoint is still there, whole (a lane pruning by itself once deleted it), and 3 replicas of 1 proc
    each, without FSDP, resume it: the same global batches from step 8 on, every sample once per epoch."""
    first = elastic_run()
    ckpt = first.tmp / "ckpt"
    first.start("--replicas", "2", "--procs-per-replica", "2", "--checkpoint-steps", str(EVERY), "--checkpoint-keep",
                "1", script=WORKLOADS / "logged_loop.py", script_args=(*LOOP, "--fsdp", "--out", str(first.out)))
    first.wait_for(lambda: first.events("run_start"), timeout=120, what="the run's start")  # it cleaned the dir
    for step in range(12, TOTAL + 1):  # the periodic ones, and the one the controller's loss has written
        os.makedirs(ckpt / f"step{step:08d}" / "__1_0.distcp")  # lane 1's part of that checkpoint: a directory
    first.wait_for(lambda: first.events("checkpoint_failed"), timeout=120, what="a failed checkpoint write")
    first.kill_controller()
    assert [e["step"] for e in first.events("checkpoint")] == [4, 8], first.events("checkpoint")
    [writer] = [e for e in first.events("controller_lost") if e["replica"] == 0 and e["lane"] == 0]
    assert "IsADirectoryError" in writer["skipped"] or "failed" in writer["skipped"], writer  # its save failed too
    assert first.events("checkpoint_failed")[0]["step"] == 12 and "IsADirectoryError" in \
        first.events("checkpoint_failed")[0]["error"]
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step"))[0] == "step00000008"
    for private in (ckpt, ckpt / "step00000008", first.events_path):  # the run's user's alone (`share_files` off)
        assert os.stat(private).st_mode & 0o077 == 0, (private, oct(os.stat(private).st_mode))
    before = _steps(first)
    assert len(before) >= 12

    resumed = elastic_run()
    resumed.start("--replicas", "3", "--checkpoint-steps", str(EVERY), "--checkpoint-dir", str(ckpt), "--resume",
                  "auto", script=WORKLOADS / "logged_loop.py", script_args=(*LOOP, "--out", str(resumed.out)))
    assert resumed.wait(timeout=180) == 0, resumed.output
    [cleaned] = resumed.events("checkpoint_cleaned")  # the failed writes the SIGKILL left
    assert sorted(os.path.basename(p) for p in cleaned["paths"])[0] == "step00000012"
    [resume] = resumed.events("resume")
    assert resume["path"] == str(ckpt / "step00000008")
    after = _steps(resumed)
    assert [r["step"] for r in after] == list(range(8, TOTAL)) and {r["replicas"] for r in after} == {3}
    for old, new in zip(before[8:], after):
        assert old["batch"] == new["batch"] and old["epoch"] == new["epoch"], (old, new)
        assert new["loss"] == pytest.approx(old["loss"], rel=1e-4), (old, new)
    trained = before[:8] + after
    for epoch in range(EPOCHS):  # every sample once per epoch, over both runs
        seen = sorted(i for r in trained if r["epoch"] == epoch for i in r["batch"])
        assert seen == list(range(SAMPLES)), epoch
    results = resumed.results()
    assert {r["step"] for r in results.values()} == {TOTAL} and len({r["checksum"] for r in results.values()}) == 1


def test_a_second_run_on_the_same_checkpoint_directory_or_events_file_is_refused_naming_the_first(elastic_run):
    first = elastic_run()
    ckpt = first.tmp / "ckpt"
    first.start("--replicas", "2", "--checkpoint-steps", str(EVERY), script=WORKLOADS / "logged_loop.py",
                script_args=(*LOOP, "--out", str(first.out)))
    first.wait_for(lambda: first.events("run_start"), timeout=60, what="the first run's start")
    cli = [sys.executable, "-m", "monarch_plugin.tools.cli"]
    script = [str(WORKLOADS / "logged_loop.py"), *LOOP, "--out", str(first.out)]
    second = subprocess.run([*cli, "--events", str(first.tmp / "second.jsonl"), "--checkpoint-dir", str(ckpt),
                             "--checkpoint-steps", "2", *script], capture_output=True, text=True, timeout=60)
    assert second.returncode == 2, second.stderr
    assert f"the checkpoint directory {ckpt} is in use by another run (pid {first.proc.pid} on " in second.stderr
    assert "give this run its own --checkpoint-dir, or stop that run first" in second.stderr
    third = subprocess.run([*cli, "--events", str(first.events_path), *script], capture_output=True, text=True,
                           timeout=60)
    assert third.returncode == 2 and f"the events file {first.events_path} is in use by another run" in third.stderr
    assert first.wait(timeout=180) == 0, first.output
    assert len(first.events("run_start")) == 1 and first.events("finished")  # never truncated by the others
    assert not (first.tmp / "second.jsonl").exists()  # refused before anything was started or written


def _largest(checkpoint) -> str:
    return max((p for p in checkpoint.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)


def test_damaged_checkpoints_are_refused_by_name_and_passed_over_by_resume_auto(elastic_run):
    """The newest checkpoint with a low bit flipped in four bytes of its largest file, the one before it cut short:
    named, one is refused before anything is spawned; `--resume auto` passes over both, saying why, and goes on from
    the newest intact one exactly."""
    first = elastic_run()
    ckpt = first.tmp / "ckpt"
    first.start("--replicas", "2", "--checkpoint-steps", str(EVERY), "--checkpoint-keep", "0",
                script=WORKLOADS / "logged_loop.py", script_args=(*LOOP[:-1], "0.05", "--out", str(first.out)))
    assert first.wait(timeout=120) == 0, first.output
    newest, before = ckpt / "step00000028", ckpt / "step00000024"
    with open(_largest(newest), "r+b") as f:
        for at in (1000, 2000, 3000, 4000):
            f.seek(at)
            byte = f.read(1)[0]
            f.seek(at)
            f.write(bytes([byte ^ 1]))
    os.truncate(_largest(before), _largest(before).stat().st_size - 100)

    cli = [sys.executable, "-m", "monarch_plugin.tools.cli", "--replicas", "2", "--checkpoint-dir", str(ckpt)]
    script = [str(WORKLOADS / "logged_loop.py"), *LOOP[:-1], "0.05", "--out", str(first.out)]
    named = subprocess.run([*cli, "--events", str(first.tmp / "named.jsonl"), "--resume", str(newest), *script],
                           capture_output=True, text=True, timeout=60)
    assert named.returncode == 2, named.stderr
    assert f"the checkpoint {newest} is damaged: __0_0.distcp changed since it was written" in named.stderr
    assert "Traceback" not in named.stderr and "spawn" not in (first.tmp / "named.jsonl").read_text()

    resumed = elastic_run()
    resumed.start("--replicas", "2", "--checkpoint-dir", str(ckpt), "--resume", "auto",
                  script=WORKLOADS / "logged_loop.py", script_args=(*LOOP[:-1], "0.05", "--out", str(resumed.out)))
    assert resumed.wait(timeout=120) == 0, resumed.output
    assert [(e["path"], e["why"].split(" ", 1)[1]) for e in resumed.events("checkpoint_damaged")] == [
        (str(newest), "changed since it was written (its SHA-256 is not the one written with it: a bit flipped on "
                      "the disk or on its way there, or a write over it)"),
        (str(before), f"is cut short: {_largest(before).stat().st_size} of the "
                      f"{_largest(before).stat().st_size + 100} bytes written")]
    [resume] = resumed.events("resume")
    assert resume["path"] == str(ckpt / "step00000020") and "is damaged" in resumed.output
    assert _steps(resumed) == _steps(first)[20:]  # the same batches and losses, exactly
    assert {r["checksum"] for r in resumed.results().values()} == {first.results()[0]["checksum"]}


def test_a_disk_that_fills_mid_run_fails_checkpoints_not_the_run_and_a_stop_then_says_why(elastic_run, small_disk):
    """The checkpoint directory's filesystem fills mid-run: the periodic writes fail (`checkpoint_failed`) while
    training goes on; the controller told to stop then cannot write its checkpoint either, and says so, naming the
    newest one to resume from; with room again, that resume goes on from it."""
    run = elastic_run()
    ckpt = small_disk.path / "ckpt"
    run.start("--replicas", "2", "--checkpoint-steps", "2", "--checkpoint-keep", "2", "--checkpoint-dir", str(ckpt),
              script=WORKLOADS / "logged_loop.py", script_args=(*LOOP, "--out", str(run.out)))
    run.wait_for(lambda: len(run.events("checkpoint")) >= 2, timeout=120, what="two checkpoints")
    small_disk.fill()
    run.wait_for(lambda: len(run.events("checkpoint_failed")) >= 2, timeout=60, what="two failed writes")
    at = len(_steps(run))
    run.wait_for(lambda: len(_steps(run)) >= at + 2, timeout=60, what="training on")
    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.wait(timeout=120) == 143, run.output
    assert all("No space left on device" in e["error"] for e in run.events("checkpoint_failed"))
    [give_up] = run.events("give_up")
    newest = max(e["path"] for e in run.events("checkpoint"))
    assert give_up["checkpoint"] is None and give_up["resume_from"] == newest
    assert "its checkpoint could not be written (" in run.output and "No space left on device" in run.output
    assert f"resume from {newest}, the newest checkpoint" in run.output
    small_disk.free()
    resumed = elastic_run()
    resumed.start("--replicas", "2", "--checkpoint-dir", str(ckpt), "--resume", "auto",
                  script=WORKLOADS / "logged_loop.py", script_args=(*LOOP, "--out", str(resumed.out)))
    assert resumed.wait(timeout=120) == 0, resumed.output
    step = int(os.path.basename(newest)[4:])
    assert [r["step"] for r in _steps(run)[:step] + _steps(resumed)] == list(range(TOTAL))
