"""The Lightning front end end to end: a real Trainer, real Monarch procs, a real SIGKILL from this test.

Each run is `tests/workloads/lightning_fit.py` as a subprocess (`python script.py`, no launcher), so the
user's process is the controller exactly as in production; the harness kills every worker pid the run
reported, pass or fail. The checks that need no spawn run in this process.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.accelerators import Accelerator  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from lightning.pytorch.utilities.exceptions import MisconfigurationException  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from support.procs import alive, descendants  # noqa: E402
from support.runs import WORKLOADS, ElasticRun, run_factory, saved_on_controller_loss  # noqa: E402
from monarch_plugin.integrations.lightning import MonarchFSDPStrategy, MonarchStrategy  # noqa: E402

WORKLOAD = WORKLOADS / "lightning_fit.py"
sys.path.insert(0, str(WORKLOAD.parent))
import lightning_fit  # noqa: E402


class LightningRun(ElasticRun):
    """`python lightning_fit.py ...`: the script's own process is the controller."""

    def start(self, *script_args: str) -> "LightningRun":
        cmd = [sys.executable, str(WORKLOAD), "--out", str(self.out), "--events", str(self.events_path),
               *script_args]
        self.log = open(self.tmp / "run.log", "w")
        self.proc = subprocess.Popen(cmd, cwd=self.tmp, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        return self

    def result(self) -> dict:
        return json.loads((self.out / "result.json").read_text())

    def cleanup(self) -> None:
        for path in self.out.glob("ddp-pid-*"):  # the reference runs' ddp_spawn ranks
            pid = int(path.read_text())
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        super().cleanup()

    def validation_curve(self, replica: int = 0) -> dict[int, float]:
        """global_step -> validation loss of `replica` (it validates every sample), or under ddp_spawn the mean
        over its ranks' lines (each rank validated an equal part of the samples)."""
        path = self.out / "val-single"
        curve: dict[int, list[float]] = {}
        for line in (path if path.exists() else self.out / f"val-{replica}").read_text().splitlines():
            step, loss = line.split()
            curve.setdefault(int(step), []).append(float(loss))
        return {step: sum(v) / len(v) for step, v in curve.items()}

    def logged(self, key: str) -> list[float]:
        with open(self.out / "logs" / "version_0" / "metrics.csv") as f:
            return [float(row[key]) for row in csv.DictReader(f) if row.get(key)]


@pytest.fixture
def lightning_run(tmp_path):
    yield from run_factory(tmp_path, LightningRun)


def _every_sample_once_per_epoch(result: dict) -> None:
    counts = torch.tensor(result["counts"])
    assert torch.allclose(counts, torch.ones_like(counts), atol=1e-4), counts


def _resumed_like_one_process(resumed: LightningRun, single: LightningRun, steps: int) -> None:
    """`fit(ckpt_path=...)` restored the checkpoint and ended where one process that never stopped ended: the same
    global step and weights, every sample once per epoch."""
    assert resumed.wait(timeout=150) == 0, resumed.output
    assert single.wait(timeout=60) == 0, single.output
    assert "Restored all states from the checkpoint" in resumed.output
    assert resumed.result()["global_step"] == single.result()["global_step"] == steps
    _every_sample_once_per_epoch(resumed.result())
    mine = torch.load(resumed.out / "weights.pt")
    for name, tensor in torch.load(single.out / "weights.pt").items():
        torch.testing.assert_close(mine[name], tensor, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.timeout(240)
def test_sigkill_of_rank_zero_mid_epoch_fit_survives_with_exact_steps_data_and_checkpoints(lightning_run):
    epochs, samples, batch, devices = 6, 240, 8, 3
    run = lightning_run().start("--devices", str(devices), "--min-replicas", "2", "--epochs", str(epochs),
                                "--samples", str(samples), "--batch", str(batch), "--step-sleep", "0.1",
                                "--checkpoint-every", "20", "--hold-for-regrow-from", "12", "--workers", "2")
    run.wait_for(lambda: run.progress(0) >= 6, timeout=150, what="replica 0 to reach step 6")
    pids = run.pids()
    left = descendants(pids[0][0]) - {pids[0][0]}  # its DataLoader workers, forked from it as under torchrun
    assert len(left) == 2, left
    os.kill(pids[0][0], signal.SIGKILL)  # rank 0: the replica that logs and writes checkpoints

    assert run.wait(timeout=180) == 0, run.output
    result = run.result()
    # fit returned in the controller with the trained weights, at the exact global step.
    assert result["state"] == "finished"
    assert result["global_step"] == epochs * samples // (batch * devices)
    # Survivors and the replacement finished bitwise identical, and equal to the controller's weights.
    assert {"1", "2", "3"} == set(result["replica_checksums"]), run.output
    assert set(result["replica_checksums"].values()) == {result["checksum"]}
    # ...and at the same logging step, so metrics stay on the same x-axis when another replica becomes rank 0.
    logger_steps = {r: int((run.out / f"logger-step-{r}").read_text()) for r in (1, 2, 3)}
    assert logger_steps == dict.fromkeys((1, 2, 3), result["global_step"]), logger_steps
    # Every sample of every epoch took part in exactly one committed step (counted by the gradients).
    _every_sample_once_per_epoch(result)
    assert not [pid for pid in left if alive(pid)]  # what the dead replica left ended with it

    quorums = [q["members"] for q in run.events("quorum")]
    assert quorums == [[0, 1, 2], [1, 2], [1, 2, 3]], quorums
    assert [d["replica"] for d in run.events("death")] == [0]
    assert any(3 in h["recipients"] for h in run.events("heal"))
    assert "replica 0 died" in run.output and "survivors [1, 2] kept training" in run.output
    # The replica count reached the logger (and so the progress bar) as it changed, with the run's target and the
    # recovery the new rank 0 lived through: one, a pause of some milliseconds, from its drop to its next commit.
    assert {3.0, 2.0} <= set(run.logged("elastic/replicas")) and set(run.logged("elastic/target")) == {3.0}
    assert max(run.logged("elastic/recoveries")) == 1.0
    assert run.logged("elastic/last_recovery_s") and 0 < max(run.logged("elastic/last_recovery_s")) < 30
    # ModelCheckpoint kept saving after its writer died: each checkpoint once, by the rank 0 of its time.
    saved = sorted(p.name for p in (run.out / "ckpts").iterdir())
    assert saved == [f"step={s}.ckpt" for s in (20, 40, 60)], saved
    last = torch.load(run.out / "ckpts" / "step=60.ckpt", weights_only=False)
    assert last["global_step"] == 60
    torch.testing.assert_close(-last["state_dict"]["seen"], torch.tensor(result["counts"]))
    for replica_pids in run.pids().values():
        assert not any(alive(pid) for pid in replica_pids)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("procs, tp", [pytest.param(2, 1, id="fsdp2"), pytest.param(4, 2, id="fsdp2_tp2")])
def test_fsdp_replica_loses_one_proc_and_is_replaced_whole(lightning_run, procs, tp):
    # 2 replicas x 2 FSDP procs (x 2 TP procs: a 2 x 2 mesh, configure_model's TP plan and fully_shard). 102 samples
    # in global batches of 16: the epoch's last batch of 6 splits 3+3 over two replicas and then 2+1 over a
    # replica's data-parallel procs, so uneven shares are weighted right too.
    common = ("--devices", str(2 * procs), "--batch", "4", "--samples", "102", "--epochs", "4", "--tp", str(tp))
    # From step 8 a shrunk group waits for the replacement: how fast it starts is not what this tests.
    run = lightning_run().start("--fsdp", str(procs), "--min-replicas", "1", "--step-sleep", "0.15",
                                "--hold-for-regrow-from", "8", *common)
    single = lightning_run().start("--strategy", "single", *common)
    run.wait_for(lambda: run.progress(1) >= 5, timeout=150, what="replica 1 to reach step 5")
    pids = run.pids()
    assert len(pids[1]) == procs
    os.kill(pids[1][-1], signal.SIGKILL)  # one shard-holder of replica 1: the whole replica must go

    assert run.wait(timeout=180) == 0, run.output
    assert single.wait(timeout=60) == 0, single.output
    result = run.result()
    assert result["global_step"] == single.result()["global_step"] == 4 * 7
    assert {"0", "2"} == set(result["replica_checksums"]), run.output
    assert set(result["replica_checksums"].values()) == {result["checksum"]}
    # The dropped step was redone on the same global batch: the weights are those of one process, the sample
    # counter `seen` included (it counts 16/6 per sighting in the epoch's short last batch, in both runs).
    mine, reference = torch.load(run.out / "weights.pt"), torch.load(single.out / "weights.pt")
    for name, tensor in reference.items():
        torch.testing.assert_close(mine[name], tensor, rtol=1e-5, atol=1e-5, msg=name)

    assert [q["members"] for q in run.events("quorum")] == [[0, 1], [0], [0, 2]]
    assert [d["replica"] for d in run.events("death")] == [1]
    heals = [h for h in run.events("heal") if 2 in h["recipients"]]
    assert len(heals) == procs and {h["source"] for h in heals} == {f"replica0.{k}" for k in range(procs)}
    assert not any(alive(pid) for pid in pids[1])


@pytest.mark.timeout(240)
def test_the_same_script_under_monarch_run_trains_in_place_and_survives_a_sigkill(elastic_run):
    run = elastic_run()
    run.start("--replicas", "2", "--min-replicas", "1", "--join-timeout", "120", script=WORKLOAD,
              script_args=("--out", str(run.out), "--devices", "2", "--epochs", "8", "--samples", "96",
                           "--batch", "8", "--step-sleep", "0.1", "--hold-for-regrow-from", "10"))
    run.wait_for(lambda: run.progress(1) >= 4, timeout=150, what="replica 1 to reach step 4")
    os.kill(run.pids()[1][0], signal.SIGKILL)
    assert run.wait(timeout=180) == 0, run.output

    results = run.results()  # every replica ran the script to its end and wrote what its fit returned
    assert set(results) == {0, 2}, run.output
    assert {r["global_step"] for r in results.values()} == {8 * 96 // 16}
    assert len({r["checksum"] for r in results.values()}) == 1
    _every_sample_once_per_epoch(results[0])
    assert [q["members"] for q in run.events("quorum")] == [[0, 1], [0], [0, 2]]


def _validations(run: LightningRun, name: str) -> list[tuple[int, float]]:
    path = run.out / f"val-{name}"
    return [(int(step), float(loss)) for step, loss in (line.split() for line in path.read_text().splitlines())]


@pytest.mark.timeout(240)
def test_two_sigkills_mid_window_keep_accumulation_clipping_schedule_validation_and_max_steps_exact(lightning_run):
    # A step is a window of 2 micro-batches of 12 samples (4 per replica at 3 replicas, 6 at 2); 10 steps an
    # epoch; validation every 6 micro-batches of every 2nd epoch; max_steps ends the run halfway into epoch 6.
    common = ("--devices", "3", "--batch", "4", "--accumulate", "2", "--clip", "0.05", "--samples", "240",
              "--epochs", "10", "--max-steps", "65", "--val-samples", "32", "--val-interval", "6",
              "--val-every-n-epoch", "2")
    # From step 50 a shrunk group waits for its replacement, so the second one joins before max_steps however
    # slowly this machine starts it (Lightning's import and setup take ~8 s here).
    run = lightning_run().start("--min-replicas", "2", "--step-sleep", "0.1", "--slow-replica", "1",
                                "--hold-for-regrow-from", "50", *common)
    single = lightning_run().start("--strategy", "single", *common)

    def right_after_a_commit() -> int:
        """The step replica 0 starts next, within a few ms of the previous one committing."""
        before = run.progress(0)
        deadline = time.monotonic() + 30
        while run.progress(0) <= before:
            assert time.monotonic() < deadline and run.proc.poll() is None, run._tail()
            time.sleep(0.002)
        return run.progress(0)

    # Kill 1: the survivors have run both micro-batches and wait inside the reduction for the straggler, so
    # the step is dropped and the whole window redone by the shrunk group.
    run.wait_for(lambda: run.progress(1) >= 5, timeout=150, what="replica 1 to reach step 5")
    dropped = right_after_a_commit()
    time.sleep(0.3)
    os.kill(run.pids()[1][0], signal.SIGKILL)
    # Kill 2: the replacement dies while the others run the first micro-batch of a window, so they enter the
    # shrunk generation before reducing and rerun that micro-batch on their new shares.
    run.wait_for(lambda: run.progress(3) >= 1, timeout=90, what="replacement replica 3 to train")
    right_after_a_commit()
    os.kill(run.pids()[3][0], signal.SIGKILL)

    assert run.wait(timeout=180) == 0, run.output
    assert single.wait(timeout=60) == 0, single.output
    result, reference = run.result(), single.result()
    quorums = [q["members"] for q in run.events("quorum")]
    assert quorums == [[0, 1, 2], [0, 2], [0, 2, 3], [0, 2], [0, 2, 4]], run.output
    dropped_steps = {(d["gen"], d["replica"], d["step"]) for d in run.events("dropped_step")}
    assert dropped_steps == {(0, 0, dropped), (0, 2, dropped)}, dropped_steps  # kill 2 dropped nothing
    assert result["global_step"] == reference["global_step"] == 65
    assert {"0", "2", "4"} == set(result["replica_checksums"]), run.output
    assert set(result["replica_checksums"].values()) == {result["checksum"]}
    # Every sample of epochs 0-5 and of the first 5 steps of epoch 6 took part in exactly one committed step:
    # a window whose first micro-batch was cut for the old group and not redone would miss or repeat samples.
    counts = torch.tensor(result["counts"])
    torch.testing.assert_close(counts[:6], torch.ones_like(counts[:6]), atol=1e-4, rtol=0)
    torch.testing.assert_close(counts[6, :120], torch.ones(120), atol=1e-4, rtol=0)
    assert counts[6, 120:].abs().max() < 1e-6 and counts[7:].abs().max() < 1e-6
    # Same trajectory as one process taking whole global micro-batches: accumulation, value clipping of the
    # reduced gradient (clipping each replica's weighted share would differ), momentum, the per-step schedule.
    mine, ref = torch.load(run.out / "weights.pt"), torch.load(single.out / "weights.pt")
    for name, tensor in ref.items():
        torch.testing.assert_close(mine[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    # Validation ran at the same global steps as in the single process and on the same weights, on every
    # replica; each replacement validated from its join on, on weights bitwise equal to the survivors'.
    expected = [step for step, _ in _validations(single, "single")]
    assert expected == [13, 16, 19, 33, 36, 39, 53, 56, 59]
    survivors = {r: dict(_validations(run, str(r))) for r in (0, 2)}
    assert list(survivors[0]) == expected and survivors[0] == survivors[2]
    for step, loss in _validations(single, "single"):
        assert survivors[0][step] == pytest.approx(loss, rel=1e-4)
    for replica in (3, 4):
        joined = next(h["step"] for h in run.events("heal") if replica in h["recipients"])
        since_join = [(step, survivors[0][step]) for step in expected if step > joined]
        validated = _validations(run, str(replica)) if (run.out / f"val-{replica}").exists() else []
        # Replica 3 was killed part-way: what it validated before is a prefix of the schedule since its join.
        assert validated == (since_join if replica == 4 else since_join[: len(validated)]), (replica, joined)


@pytest.mark.timeout(180)
def test_hot_spare_admitted_mid_window_resumes_at_the_window_start(lightning_run):
    # 3 micro-batches a step. The survivor has run all three and waits in the reduction for the straggler when
    # it dies; the death's generation admits the spare at once, so the survivor heals it from inside a window
    # it has half run: the spare must start at that window's first micro-batch, not where the donor's loop is.
    common = ("--devices", "2", "--batch", "4", "--accumulate", "3", "--samples", "144", "--epochs", "3")
    run = lightning_run().start("--min-replicas", "1", "--spares", "1", "--step-sleep", "0.05",
                                "--slow-replica", "1", *common)
    single = lightning_run().start("--strategy", "single", *common)
    run.wait_for(lambda: run.progress(1) >= 3 and any(e["replica"] == 2 for e in run.events("ready")),
                 timeout=150, what="replica 1 at step 3 and the spare ready")
    before = run.progress(0)
    run.wait_for(lambda: run.progress(0) > before, timeout=30, what="a commit")
    time.sleep(0.45)
    os.kill(run.pids()[1][0], signal.SIGKILL)

    assert run.wait(timeout=150) == 0, run.output
    assert single.wait(timeout=60) == 0, single.output
    assert [q["members"] for q in run.events("quorum")][:2] == [[0, 1], [0, 2]], run.output
    assert [d["replica"] for d in run.events("dropped_step")] == [0], run.output
    assert any(h["recipients"] == [2] and h["gen"] == 1 for h in run.events("heal")), run.output
    result = run.result()
    assert result["global_step"] == single.result()["global_step"] == 3 * 144 // 24
    assert set(result["replica_checksums"]) >= {"0", "2"} and len(set(result["replica_checksums"].values())) == 1
    _every_sample_once_per_epoch(result)
    mine, ref = torch.load(run.out / "weights.pt"), torch.load(single.out / "weights.pt")
    for name, tensor in ref.items():
        torch.testing.assert_close(mine[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.timeout(330)
def test_epochs_steps_samples_and_batchnorm_match_ddp_spawn_with_and_without_a_sigkill(lightning_run):
    # Lightning plans the epochs: 5 of the 16 batches (limit_train_batches), accumulation 2 then 3 from epoch 1
    # (a callback changes it mid-fit), max_steps ending epoch 2 after its first step, validation every 2
    # batches, shuffled data, and a BatchNorm whose running statistics the validation loss depends on.
    common = ("--devices", "2", "--samples", "256", "--batch", "8", "--epochs", "3", "--limit-train-batches", "5",
              "--accumulate-schedule", "0:2,1:3", "--max-steps", "6", "--shuffle", "--batchnorm",
              "--val-samples", "48", "--val-interval", "2")
    ddp = lightning_run().start("--strategy", "ddp_spawn", *common)
    elastic = lightning_run().start(*common)
    # Replica 1 dies at step 4, the middle of epoch 1; from step 5 the shrunk group waits for the replacement.
    killed = lightning_run().start(*common, "--fault", "sigkill:replica=1:step=4", "--hold-for-regrow-from", "5")
    for run in (ddp, elastic, killed):
        assert run.wait(timeout=300) == 0, run.output
    assert [d["replica"] for d in killed.events("death")] == [1], killed.output
    assert killed.events("heal"), killed.output  # the replacement healed its BatchNorm statistics too

    # Validation inside an accumulation window runs on the last commit's buffers, so replicas agree on it (and on
    # what EarlyStopping or ModelCheckpoint would decide from it).
    assert (elastic.out / "val-0").read_text() == (elastic.out / "val-1").read_text()
    reference = torch.tensor(ddp.result()["counts"])
    for run in (elastic, killed):
        assert (run.out / "trained-steps").read_text() == (ddp.out / "trained-steps").read_text() == "6"
        # Each epoch trained exactly ddp's samples, each with ddp's weight (1/accumulation of its window).
        torch.testing.assert_close(torch.tensor(run.result()["counts"]), reference, rtol=0, atol=1e-5)
        # BatchNorm buffers averaged at every commit: every replica ends identical.
        checksums = run.result()["replica_checksums"]
        assert len(checksums) == 2 and len(set(checksums.values())) == 1, checksums
        # Per-replica batch statistics differ from ddp's strided split, so the curves cannot be equal; they stay
        # within 10% of the initial validation loss of ddp's.
        curve, want = run.validation_curve(), ddp.validation_curve()
        assert sorted(curve) == sorted(want) == [1, 2, 3, 4, 5]
        first = want[1]
        for step in want:
            assert abs(curve[step] - want[step]) < 0.1 * first, (step, curve, want)


@pytest.mark.timeout(300)
def test_fit_then_test_and_predict_return_a_single_devices_results_and_survive_a_death_mid_test(lightning_run):
    # fit with StochasticWeightAveraging on a BatchNorm model: it changes accumulate_grad_batches for an extra
    # epoch and replaces the BatchNorm buffers, which must still end equal on every replica (or fit raises).
    run = lightning_run().start("--devices", "2", "--samples", "64", "--batch", "8", "--epochs", "2", "--swa",
                                "--batchnorm", "--val-samples", "48", "--then", "test,predict", "--eval-sleep", "1.0")
    test_events = run.tmp / "events-test.jsonl"  # each stage keeps its own record; fit's stays in events.jsonl

    def test_spawns():
        return [json.loads(line) for line in test_events.read_text().splitlines()
                if '"spawn"' in line] if test_events.exists() else []

    run.wait_for(lambda: (run.out / "test-progress-0").exists(), timeout=200, what="replica 0 testing")
    os.kill(next(e["pids"][0] for e in test_spawns() if e["replica"] == 0), signal.SIGKILL)
    assert run.wait(timeout=200) == 0, run.output

    stages = run.result()["stages"]
    assert stages["test_fn"] == "test" and stages["predict_fn"] == "predict"  # trainer.state came back
    assert '"death"' in test_events.read_text() and len(test_spawns()) == 2, run.output  # nobody respawned
    model = lightning_fit.Model(64, 3, 8, 16, 0.0, str(run.out), batchnorm=True)
    model.load_state_dict(torch.load(run.out / "weights.pt"))
    model.eval()
    data = lightning_fit.Regression(48, 8, split=1)
    with torch.no_grad():
        predicted = model.net(data.x)
    # Every replica evaluated every sample: the metrics and the predictions (in dataset order) are one device's.
    assert stages["test"][0]["test_loss"] == pytest.approx(float(((predicted - data.y) ** 2).mean()), rel=1e-5)
    torch.testing.assert_close(torch.tensor(stages["predict"]), predicted.reshape(-1), rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(240)
def test_runs_leave_the_users_process_as_they_found_it_and_profile_a_file_per_replica_in_every_stage(tmp_path):
    """Two runs of the runtime's Python API, then fit, validate, test, predict and fit again, in one process: after
    each, the process has the threads, environment, signal handlers and open files it had before the first (the
    controller and Monarch's runtime ran in a child of it, `procs.apart`)."""
    script = WORKLOADS / "left_behind.py"
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=200)
    finally:
        for pid in descendants(proc.pid):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0, output[-4000:]
    runs = json.loads((tmp_path / "result.json").read_text())
    assert [r["run"] for r in runs] == ["api 0", "api 1", "fit", "validate", "test", "predict", "fit"]
    assert [r["result"] for r in runs] == [[0, 1], [0, 1], 4, 1, 1, 8, 4], runs  # steps, metric dicts, batches
    assert {r["run"]: r["left"] for r in runs if r["left"]} == {}
    profiles = {f"{stage}-profiler-{rank}.txt" for stage in ("fit", "validate", "test", "predict") for rank in (0, 1)}
    assert set(os.listdir(tmp_path / "profiler")) == profiles  # one per replica in every stage, as ddp_spawn's ranks


@pytest.mark.timeout(180)
def test_failure_free_fit_matches_single_process_with_same_global_batch(lightning_run):
    common = ("--devices", "2", "--epochs", "2", "--samples", "96", "--batch", "8")
    elastic = lightning_run().start("--strategy", "monarch-name", *common)
    single = lightning_run().start("--strategy", "single", *common)
    assert single.wait(timeout=120) == 0, single.output
    assert elastic.wait(timeout=150) == 0, elastic.output

    assert elastic.result()["global_step"] == single.result()["global_step"] == 2 * 96 // 16
    mine = torch.load(elastic.out / "weights.pt")
    reference = torch.load(single.out / "weights.pt")
    for name, tensor in reference.items():
        torch.testing.assert_close(mine[name], tensor, rtol=1e-5, atol=1e-5, msg=name)
    _every_sample_once_per_epoch(elastic.result())
    assert set(elastic.logged("elastic/replicas")) == {2.0}


@pytest.mark.timeout(180)
def test_a_configure_model_that_skips_the_tp_plan_stops_the_run_naming_the_fix_and_respawns_nothing(lightning_run):
    """`MonarchFSDPStrategy(tensor_parallel_size=2)` and a `configure_model` that leaves the model as it is: the
    controller cannot tell (the method exists), so each replica's procs refuse the model as they set up, naming the
    fix. The same error everywhere is the code's own, so the run stops, spawning nothing again, leaving nothing."""
    run = lightning_run().start("--fsdp", "2", "--tp", "2", "--devices", "4", "--batch", "4", "--samples", "32",
                                "--skip-tp-plan")
    assert run.wait(timeout=150) == 1, run.output
    assert "MonarchFSDPStrategy(tensor_parallel_size=2) leaves parallelizing the model to the LightningModule" in \
        run.output and "apply your TP plan over self.device_mesh['tensor_parallel']" in run.output, run.output
    assert [s["initial"] for s in run.events("spawn")] == [True, True], run.events("spawn")
    assert not run.events("respawn_scheduled") and not run.events("first_commit")
    for replica_pids in run.pids().values():
        assert not any(alive(pid) for pid in replica_pids)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
def test_below_min_replicas_writes_a_checkpoint_that_fit_resumes_exactly(lightning_run, layout):
    # Two micro-batches a step: the survivor writes the checkpoint with the window's first micro-batch run (a
    # death is noticed mid-window), so the checkpoint must hold Lightning's progress as of the window's start.
    # Global batch 16 either way; an FSDP run's checkpoint holds full tensors, so plain replicas resume it.
    common = ("--devices", "2", "--epochs", "2", "--samples", "192", "--batch", "8", "--accumulate", "2")
    layout_args = ("--fsdp", "2", "--devices", "4", "--batch", "4") if layout == "fsdp" else ()
    # Replica 0 (rank 0, the one that logs and checkpoints) dies: its successor must write the checkpoint.
    stopped = lightning_run().start("--min-replicas", "2", "--fault", "sigkill:replica=0:step=8",
                                    "--step-sleep", "0.05", *common, *layout_args)
    single = lightning_run().start("--strategy", "single", *common)
    assert stopped.wait(timeout=150) == 1
    assert "below `min_replicas` 2" in stopped.output  # the strategy's own argument
    give_up = stopped.events("give_up")
    assert len(give_up) == 1 and give_up[0]["checkpoint"].endswith("step00000008.ckpt"), stopped.output
    assert [c["replica"] for c in stopped.events("checkpoint")] == [1]

    resumed = lightning_run().start("--resume", give_up[0]["checkpoint"], *common)
    _resumed_like_one_process(resumed, single, steps=12)


@pytest.mark.timeout(300)
def test_an_exception_in_training_step_replaces_the_replica_and_the_same_in_both_stops_with_a_resumable_checkpoint(
        lightning_run):
    """Replica 1's training_step raises mid-forward: it is replaced as after a death, and fit returns at the exact
    step with identical weights and every sample once. Both replicas raising mid-backward at one step (in a window of
    two micro-batches) is the code's own bug: fit raises ReplicaCodeError with both tracebacks, and the checkpoint the
    last one wrote from the state it held (nobody was left training) resumes as one process that never stopped."""
    common = ("--devices", "2", "--epochs", "2", "--samples", "192", "--batch", "8", "--accumulate", "2")
    # From step 5 the shrunk group waits for the replacement, which must join before the 20 steps end.
    replaced = lightning_run().start("--devices", "3", "--epochs", "2", "--step-sleep", "0.05",
                                     "--fault", "raise:replica=1:step=4:at=forward", "--hold-for-regrow-from", "5")
    stopped = lightning_run().start("--fault", "raise:step=5:at=backward", *common)
    single = lightning_run().start("--strategy", "single", *common)
    assert replaced.wait(timeout=200) == 0, replaced.output
    result = replaced.result()
    assert result["global_step"] == 2 * 240 // (8 * 3) and set(result["replica_checksums"]) == {"0", "2", "3"}
    assert set(result["replica_checksums"].values()) == {result["checksum"]}
    _every_sample_once_per_epoch(result)
    [death] = replaced.events("death")
    assert (death["replica"], death["detected_by"]) == (1, "raised InjectedFault at step 4")
    assert [q["members"] for q in replaced.events("quorum")] == [[0, 1, 2], [0, 2], [0, 2, 3]]

    assert stopped.wait(timeout=200) == 1, stopped.output
    assert "ReplicaCodeError" in stopped.output and "raised at step 5 in replica" in stopped.output
    assert "--- replica 0 traceback ---" in stopped.output and "--- replica 1 traceback ---" in stopped.output
    [give_up] = stopped.events("give_up")
    assert give_up["checkpoint"].endswith("step00000005.ckpt"), stopped.output
    resumed = lightning_run().start("--resume", give_up["checkpoint"], *common)
    _resumed_like_one_process(resumed, single, steps=12)


def test_the_last_holder_dying_mid_heal_stops_fit_naming_the_newest_modelcheckpoint_file(lightning_run):
    """The only replica holding the run's state dies serving the replacement's heal: fit raises ElasticRunAborted
    in the user's process naming ModelCheckpoint's newest file, and the replacement never trained from its own
    weights (nothing was saved from them either)."""
    run = lightning_run().start("--devices", "2", "--epochs", "3", "--checkpoint-every", "4", "--step-sleep", "0.05",
                                "--fault", "sigkill:replica=1:step=6,sigkill:replica=0:at=heal_donor:step=1")
    assert run.wait(timeout=200) == 1, run.output
    saved = sorted((run.out / "ckpts").glob("step=*.ckpt"), key=lambda p: int(p.stem.split("=")[1]))
    assert saved, "no ModelCheckpoint file was written before the holder died"
    [give_up] = run.events("give_up")
    assert give_up["checkpoint"] is None and give_up["resume_from"] == str(saved[-1]), (give_up, saved)
    assert "ElasticRunAborted" in run.output and f"resume from {saved[-1]}, the newest checkpoint" in run.output
    assert not [e for e in run.events("first_commit") if e["replica"] == 2], "the replacement trained from nothing"
    for pids in run.pids().values():
        assert not any(alive(p) for p in pids)


@pytest.mark.timeout(300)
def test_lost_controller_costs_at_most_the_step_in_flight_and_fit_resumes_from_modelcheckpoints_newest_file(
        lightning_run):
    """The launching process (Lightning's controller) is SIGKILLed mid-epoch, 2 steps after ModelCheckpoint's last
    file: its replicas do not end with it. They stop at the next step boundary, and the generation's first replica
    writes the last committed step as the trainer's own `.ckpt`, beside ModelCheckpoint's files, so that the newest
    file there (what a relaunch passes to `fit(ckpt_path=...)`) is that step: at most the step in flight is lost, not
    the steps since ModelCheckpoint's last. fit resumes it on 2 replicas instead of 3, with batch_size raised so the
    global batch (and so the run) stays the same: it ends equal to one process that never stopped."""
    common = ("--epochs", "4", "--samples", "240")  # a global batch of 24: 10 steps an epoch, 40 in all
    killed = lightning_run().start("--devices", "3", "--batch", "8", "--checkpoint-every", "5", "--step-sleep", "0.1",
                                   *common)
    single = lightning_run().start("--strategy", "single", "--devices", "3", "--batch", "8", *common)
    killed.wait_for(lambda: killed.progress(0) >= 17, timeout=150, what="17 committed steps")
    killed.kill_controller()  # the procs end once the writer has written (`worker.orphan`)
    committed = max(killed.progress(r) for r in range(3))  # each replica's global_step after its last batch
    writer = saved_on_controller_loss(killed.events("controller_lost"), range(3))  # the others wrote nothing
    held = writer["step"]
    # Named for its step, beside ModelCheckpoint's files (each whole: written to a temporary name, then renamed).
    ckpts = killed.out / "ckpts"
    assert writer["checkpoint"] == str(ckpts / f"step{held:08d}.ckpt"), writer
    assert [c["path"] for c in killed.events("checkpoint")] == [writer["checkpoint"]]
    saved = sorted(int(p.stem.split("=")[1]) for p in ckpts.glob("step=*.ckpt"))
    assert saved[:3] == [5, 10, 15] and held > saved[-1] and not list(ckpts.glob("*.tmp*")), (saved, held)
    newest = max(ckpts.glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    assert str(newest) == writer["checkpoint"], newest

    resumed = lightning_run().start("--devices", "2", "--batch", "12", "--resume", str(newest), *common)
    _resumed_like_one_process(resumed, single, steps=40)
    # It went on from the saved step: what the kill cost is at most the step in flight.
    assert min(e["step"] for e in resumed.events("first_commit")) == held
    assert committed - held <= 1, (committed, held)


class _NotCPU(Accelerator):
    """A real (if minimal) Lightning accelerator that is not the CPU one."""

    def setup_device(self, device):
        pass

    def teardown(self):
        pass

    @staticmethod
    def parse_devices(devices):
        return devices

    @staticmethod
    def get_parallel_devices(devices):
        return [torch.device("cpu")] * devices

    @staticmethod
    def auto_device_count():
        return 1

    @staticmethod
    def is_available():
        return True

    def get_device_stats(self, device):
        return {}

    @staticmethod
    def name():
        return "not_cpu"


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(lightning_fit.Regression(16, 4)[i] for i in range(16))


def test_bad_input_fails_before_spawning_and_names_the_fix(tmp_path):
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="monarch", logger=False)
    assert isinstance(trainer.strategy, MonarchStrategy) and trainer.strategy.launcher.replicas == 2
    try:
        import pytorch_lightning
    except ImportError:
        pass
    else:  # the standalone package has its own class hierarchy and registry; the name works there too
        trainer = pytorch_lightning.Trainer(accelerator="cpu", devices=3, strategy="monarch", logger=False)
        assert isinstance(trainer.strategy, pytorch_lightning.strategies.ParallelStrategy)
        assert type(trainer.strategy).__name__ == "MonarchStrategy" and trainer.strategy.launcher.replicas == 3
        trainer = pytorch_lightning.Trainer(accelerator="cpu", devices=4, strategy="monarch_fsdp", logger=False)
        assert type(trainer.strategy).__name__ == "MonarchFSDPStrategy" and trainer.strategy.launcher.replicas == 2

    with pytest.raises(MisconfigurationException, match=r"raise `devices` or lower `min_replicas`"):
        pl.Trainer(accelerator="cpu", devices=2, strategy=MonarchStrategy(min_replicas=3), logger=False)
    with pytest.raises(MisconfigurationException, match=r"MonarchStrategy: unknown `backend` 'mpi'"):
        pl.Trainer(accelerator="cpu", devices=2, strategy=MonarchStrategy(backend="mpi"), logger=False)

    trainer = pl.Trainer(accelerator="cpu", devices=6, strategy="monarch_fsdp", logger=False)
    assert isinstance(trainer.strategy, MonarchFSDPStrategy) and trainer.strategy.launcher.config().replicas == 3
    with pytest.raises(MisconfigurationException, match=r"make devices a multiple of procs_per_replica"):
        pl.Trainer(accelerator="cpu", devices=5, strategy=MonarchFSDPStrategy(procs_per_replica=2), logger=False)
    with pytest.raises(MisconfigurationException, match=r"tensor_parallel_size=3\) must divide procs_per_replica=4"):
        MonarchFSDPStrategy(procs_per_replica=4, tensor_parallel_size=3)

    with pytest.raises(MisconfigurationException, match=r"Trainer\(accelerator='cpu' or 'gpu'"):
        pl.Trainer(accelerator=_NotCPU(), devices=2, strategy=MonarchStrategy(), logger=False)

    events = tmp_path / "events.jsonl"
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=MonarchStrategy(events_path=str(events)),
                         logger=False, max_epochs=1)
    model = lightning_fit.Unpicklable(16, 1, 4, 4, 0.0, str(tmp_path))
    loader = DataLoader(lightning_fit.Regression(16, 4), batch_size=2)
    with pytest.raises(MisconfigurationException, match=r"Unpicklable cannot be pickled.*create them in setup\(\)"):
        trainer.fit(model, loader)
    model = lightning_fit.Model(16, 1, 4, 4, 0.0, str(tmp_path))
    model.automatic_optimization = False
    with pytest.raises(MisconfigurationException, match=r"remove `self.automatic_optimization = False`"):
        trainer.fit(model, loader)
    model.automatic_optimization = True
    stream = DataLoader(_Stream(), batch_size=2)
    with pytest.raises(MisconfigurationException, match=r"over a map-style Dataset .* an IterableDataset has no index"):
        trainer.fit(model, stream)
    sampled = DataLoader(lightning_fit.Regression(16, 4), batch_sampler=[[0, 1], [2, 3]])
    with pytest.raises(MisconfigurationException, match=r"give the training DataLoader a batch_size"):
        trainer.fit(model, sampled)
    tensor_parallel = pl.Trainer(accelerator="cpu", devices=4, logger=False, max_epochs=1,
                                 strategy=MonarchFSDPStrategy(procs_per_replica=2, tensor_parallel_size=2,
                                                              events_path=str(events)))
    unplanned = lightning_fit.Model(16, 1, 4, 4, 0.0, str(tmp_path))
    unplanned.configure_model = pl.LightningModule.configure_model.__get__(unplanned)  # no TP plan
    with pytest.raises(MisconfigurationException, match=r"tensor_parallel_size=2\) needs Model.configure_model"):
        tensor_parallel.fit(unplanned, loader)
    from lightning.pytorch.callbacks import SpikeDetection  # Lightning 2.6's cannot load its own state

    spiky = pl.Trainer(accelerator="cpu", devices=2, strategy=MonarchStrategy(events_path=str(events)),
                       logger=False, max_epochs=1, callbacks=[SpikeDetection()])
    with pytest.raises(MisconfigurationException, match=r"remove the SpikeDetection callback or fix its load_state"):
        spiky.fit(model, loader)
    from lightning.pytorch.tuner import Tuner

    with pytest.raises(MisconfigurationException, match=r"Batch size finder is not supported .* MonarchStrategy"):
        Tuner(trainer).scale_batch_size(model, loader)
    assert not events.exists()  # nothing was spawned


@pytest.mark.skipif(shutil.which("srun") is None, reason="Lightning warns only where srun is installed")
def test_in_a_slurm_batch_script_lightnings_own_slurm_detection_stays_out_of_the_controller(monkeypatch):
    """The controller's world is its one process: Lightning's SLURMEnvironment (which would warn that `srun` is not
    used, or take SLURM's task variables as the controller's rank) is not chosen for it."""
    for name, value in {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "n[0-1]",
                        "SLURM_JOB_NAME": "train.sbatch"}.items():
        monkeypatch.setenv(name, value)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=MonarchStrategy(), logger=False)
    assert not [w for w in seen if "srun" in str(w.message)], [str(w.message) for w in seen]
    assert type(trainer.strategy.cluster_environment).__name__ == "LightningEnvironment"
    assert trainer.strategy.launcher.config().slurm  # the run takes the allocation: its agents are SLURM's steps


def test_events_default_to_the_trainers_log_dir_one_file_per_stage(tmp_path, monkeypatch):
    monkeypatch.delenv("MONARCH_PLUGIN_EVENTS", raising=False)
    logged = pl.Trainer(accelerator="cpu", devices=2, strategy="monarch", default_root_dir=str(tmp_path),
                        logger=CSVLogger(str(tmp_path)))
    assert logged.strategy.launcher.config(log_dir=logged.log_dir).events_path == str(  # next to metrics.csv
        tmp_path / "lightning_logs" / "version_0" / "monarch_events.jsonl")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="monarch", logger=False,
                         default_root_dir=str(tmp_path))
    strategy = trainer.strategy
    assert strategy.launcher.config(log_dir=trainer.log_dir).events_path == str(tmp_path / "monarch_events.jsonl")
    test = strategy.launcher.config(log_dir=trainer.log_dir, stage="test")
    assert test.events_path == str(tmp_path / "monarch_events-test.jsonl")
    assert (test.max_restarts, test.spares, test.min_replicas) == (0, 0, 1)  # an evaluation stage respawns nobody
    monkeypatch.setenv("MONARCH_PLUGIN_EVENTS", str(tmp_path / "mine.jsonl"))
    assert strategy.launcher.config(log_dir=trainer.log_dir).events_path == str(tmp_path / "mine.jsonl")


@pytest.mark.timeout(300)
def test_sigterm_drains_a_replica_at_a_step_boundary_and_sigterm_to_fit_stops_with_a_checkpoint_that_resumes_exactly(
        lightning_run):
    """SIGTERM to replica 1's proc: it leaves at the next step boundary (no step dropped, no death) and a replacement
    joins. SIGTERM to the script's process, the controller: fit ends the process with status 143 after the replicas
    wrote Lightning's checkpoint of the last committed step, and fit(ckpt_path=...) ends as one process never
    stopped."""
    common = ("--devices", "3", "--epochs", "2", "--samples", "240", "--batch", "8")  # 10 steps an epoch
    run = lightning_run().start(*common, "--step-sleep", "0.1")
    single = lightning_run().start("--strategy", "single", *common)
    run.wait_for(lambda: run.progress(0) >= 3, timeout=150, what="step 3")
    os.kill(run.pids()[1][0], signal.SIGTERM)
    run.wait_for(lambda: any(3 in q["members"] for q in run.events("quorum")), timeout=150,
                 what="the replacement to join")
    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.wait(timeout=150) == 143, run.output
    [drain] = run.events("drain")
    assert drain["replicas"] == [1] and [d["replica"] for d in run.events("drained")] == [1]
    assert not run.events("death") and not [q for q in run.events("quorum")[:3] if q["interrupt"]]
    [give_up] = run.events("give_up")
    assert give_up["reason"] == "SIGTERM received" and give_up["checkpoint"].endswith(".ckpt"), run.output
    for pids in run.pids().values():
        assert not any(alive(p) for p in pids)
    resumed = lightning_run().start("--resume", give_up["checkpoint"], *common)
    _resumed_like_one_process(resumed, single, steps=20)
