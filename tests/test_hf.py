"""The HF transformers front end end to end: a real `Trainer.train()` on a tiny GPT-2 built from `GPT2Config`,
real Monarch procs under `monarch-run`, real gloo, a real SIGKILL sent by this test to a replica's pid; the
baselines are the same script under `torchrun` (DDP) and under plain `python`.

Every run is `tests/workloads/hf_train.py` as a subprocess, started through the shared harness, which kills
every pid the run reported, pass or fail.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from conftest import ElasticRun, alive, run_factory  # noqa: E402

WORKLOAD = Path(__file__).parent / "workloads" / "hf_train.py"
INACTIVE = "MonarchElasticCallback is inactive"


class HFRun(ElasticRun):
    """`hf_train.py` under `monarch-run` (`start`), `torchrun` (`start_ddp`) or plain `python` (`start_plain`)."""

    def start(self, *launcher: str, script_args: tuple[str, ...] = ()) -> HFRun:
        return super().start(*launcher, "--join-timeout", "120", script=WORKLOAD,
                             script_args=("--out", str(self.out), *script_args))

    def start_ddp(self, nproc: int, *script_args: str) -> HFRun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(WORKLOAD), "--out", str(self.out), *script_args]
        return self._popen(cmd)

    def start_plain(self, *script_args: str) -> HFRun:
        return self._popen([sys.executable, str(WORKLOAD), "--out", str(self.out), *script_args])

    def _popen(self, cmd: list[str]) -> HFRun:
        self.log = open(self.tmp / "run.log", "w")
        self.proc = subprocess.Popen(cmd, cwd=self.tmp, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        return self

    def results(self) -> dict[str, dict]:
        return {p.stem.removeprefix("result-"): json.loads(p.read_text()) for p in self.out.glob("result-*.json")}

    def weights(self, ident: str) -> dict[str, torch.Tensor]:
        return torch.load(self.out / f"weights-{ident}.pt")

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None and not self.pids():
            self.proc.terminate()  # torchrun and plain python: torchrun stops its workers on SIGTERM
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        super().cleanup()


@pytest.fixture
def hf_run(tmp_path):
    yield from run_factory(tmp_path, HFRun)


def _assert_close(mine: dict, reference: dict, **tolerance) -> None:
    assert mine.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(mine[name], tensor, msg=name, **tolerance)


@pytest.mark.timeout(240)
def test_sigkill_of_the_writer_mid_epoch_train_survives_shrinks_regrows_exactly(hf_run):
    # 3 replicas x 4 samples a global micro-batch, 2 micro-batches a step: 8 steps an epoch, 40 in all. The
    # survivors hold step 16 and the replacement starts train() only then, so it joins mid-epoch 2 however fast or
    # slow this machine is.
    epochs, samples, save_steps, logging_steps, pause = 5, 192, 10, 3, 16
    steps = epochs * samples // (4 * 3 * 2)
    run = hf_run().start("--replicas", "3", "--min-replicas", "2", script_args=(
        "--replicas", "3", "--count", "--max-grad-norm", "0", "--batch", "4", "--accumulate", "2",
        "--samples", str(samples), "--epochs", str(epochs), "--save-steps", str(save_steps),
        "--logging-steps", str(logging_steps), "--step-sleep", "0.1", "--pause-at", str(pause)))
    run.wait_for(lambda: run.progress(0) >= 5, timeout=150, what="replica 0 to reach step 5")
    pids = run.pids()
    os.kill(pids[0][0], signal.SIGKILL)  # replica 0 is rank 0: the checkpoint writer and the one that logs
    run.wait_for(lambda: any(3 in q["members"] for q in run.events("quorum")), timeout=150,
                 what="the replacement to be ready and admitted")
    (run.out / "release").touch()

    assert run.wait(timeout=150) == 0, run.output
    results = run.results()
    # train() returned normally on the survivors (never restarted) and on the replacement, all identical.
    assert set(results) == {"1", "2", "3"}, run.output
    assert results["1"]["pid"] == pids[1][0] and results["2"]["pid"] == pids[2][0]
    assert results["3"]["initial"] is False
    assert {r["checksum"] for r in results.values()} == {results["1"]["checksum"]}
    assert {(r["global_step"], r["train_output_step"]) for r in results.values()} == {(steps, steps)}
    # Every sample of every epoch took part in exactly one committed step, counted by the gradients, including
    # the epoch the replacement joined halfway through.
    for r in results.values():
        counts = torch.tensor(r["counts"])
        torch.testing.assert_close(counts, torch.ones_like(counts), atol=1e-4, rtol=0)

    quorums = [q["members"] for q in run.events("quorum")]
    assert quorums == [[0, 1, 2], [1, 2], [1, 2, 3]], quorums
    assert [d["replica"] for d in run.events("death")] == [0]
    assert {d["replica"] for d in run.events("dropped_step")} == {1, 2}
    joined = next(h["step"] for h in run.events("heal") if h["recipients"] == [3])
    assert pause < joined < 24, joined  # the grow is agreed inside step 16 (or one just after): mid-epoch 2
    assert "replica 0 died" in run.output and "survivors [1, 2] kept training" in run.output

    # One writer: replica 1 took over as rank 0 and wrote every save_steps checkpoint, nobody else wrote any.
    expected = list(range(save_steps, steps + 1, save_steps))
    assert {k: r["saved"] for k, r in results.items()} == {"1": expected, "2": [], "3": []}
    written = sorted(int(p.name.split("-")[1]) for p in (run.out / "hf").glob("checkpoint-*"))
    assert written == expected
    assert {k: (r["main"], r["world_process_zero"]) for k, r in results.items()} == {
        "1": (True, True), "2": (False, False), "3": (False, False)}
    # HF's logging kept its schedule and its log lines carry the replica count as it changed.
    history = results["1"]["log_history"]
    assert [h["step"] for h in history if "loss" in h] == list(range(logging_steps, steps + 1, logging_steps))
    assert [h["elastic/replicas"] for h in history if "loss" in h][0] == 3.0
    replicas = [h["elastic/replicas"] for h in history if "elastic/replicas" in h]
    assert replicas[-1] == 3.0 and 2.0 in replicas
    for replica_pids in run.pids().values():
        assert not any(alive(pid) for pid in replica_pids)


@pytest.mark.timeout(240)
def test_failure_free_run_matches_torchrun_ddp_and_a_give_up_checkpoint_resumes_exactly(hf_run):
    # HF's own AdamW and linear schedule, clipping that bites (grad norms here are ~0.7), accumulation, shuffling.
    common = ("--replicas", "2", "--optimizer", "hf", "--batch", "4", "--accumulate", "2", "--samples", "96",
              "--epochs", "2", "--max-grad-norm", "0.3")
    elastic = hf_run().start("--replicas", "2", script_args=common)
    ddp = hf_run().start_ddp(2, *common)
    # Replica 0 (the writer) dies below min_replicas: its successor writes the Trainer's own checkpoint.
    stopped = hf_run().start("--replicas", "2", "--min-replicas", "2", "--fault", "sigkill:replica=0:step=5",
                             script_args=common)
    assert ddp.wait(timeout=180) == 0, ddp.output
    assert elastic.wait(timeout=180) == 0, elastic.output
    assert stopped.wait(timeout=180) == 1, stopped.output

    steps = 2 * 96 // 16
    results = elastic.results()
    assert set(results) == {"0", "1"} and {r["global_step"] for r in results.values()} == {steps}
    assert results["0"]["checksum"] == results["1"]["checksum"]
    assert ddp.results()["rank0"]["global_step"] == steps
    # The same global batches in the same order as torchrun's, and the same maths on them.
    _assert_close(elastic.weights("0"), ddp.weights("rank0"), rtol=1e-4, atol=1e-5)
    assert {h["elastic/replicas"] for h in results["0"]["log_history"] if "elastic/replicas" in h} == {2.0}
    assert INACTIVE in ddp.output  # under torchrun the callback stays out of the way

    assert "below min_replicas=2" in stopped.output
    give_up = stopped.events("give_up")
    assert len(give_up) == 1 and give_up[0]["checkpoint"] == str(stopped.out / "hf" / "checkpoint-5"), give_up
    assert [c["replica"] for c in stopped.events("checkpoint")] == [1]
    resumed = hf_run().start("--replicas", "2", script_args=(*common, "--resume", give_up[0]["checkpoint"]))
    assert resumed.wait(timeout=180) == 0, resumed.output
    assert {r["global_step"] for r in resumed.results().values()} == {steps}
    _assert_close(resumed.weights("0"), elastic.weights("0"), rtol=0, atol=0)


@pytest.mark.timeout(120)
def test_plain_python_says_once_it_is_inactive_and_trains_as_usual(hf_run):
    common = ("--batch", "4", "--accumulate", "2", "--samples", "96", "--epochs", "2")
    with_callback = hf_run().start_plain(*common)
    without = hf_run().start_plain(*common, "--no-callback")
    assert with_callback.wait(timeout=90) == 0, with_callback.output
    assert without.wait(timeout=90) == 0, without.output
    assert with_callback.output.count(INACTIVE) == 1, with_callback.output
    assert INACTIVE not in without.output
    mine, reference = with_callback.results()["single"], without.results()["single"]
    assert mine["global_step"] == reference["global_step"] == 2 * 96 // 8  # per-device batch 4, one process
    assert mine["checksum"] == reference["checksum"]
    losses = [[h for h in r["log_history"] if "loss" in h] for r in (mine, reference)]
    assert losses[0] == losses[1] and len(losses[0]) == mine["global_step"]


@pytest.mark.timeout(150)
def test_bad_input_stops_the_run_with_a_message_that_names_the_fix(hf_run):
    # 49 samples in global batches of 4 x 1 replica end each epoch with 1 sample for up to 2 replicas.
    uneven = hf_run().start("--replicas", "1", "--max-replicas", "2", script_args=("--samples", "49", "--batch", "4"))
    deepspeed = hf_run().start("--replicas", "1", script_args=("--bad", "deepspeed"))
    assert uneven.wait(timeout=120) == 1
    assert "ValueError: per_device_train_batch_size=4 x 1 replica(s) is a global batch of 4" in uneven.output
    assert "cannot be split over up to 2 replicas" in uneven.output
    assert "dataloader_drop_last=True" in uneven.output
    assert deepspeed.wait(timeout=120) == 1
    assert "ValueError: DeepSpeed is not supported by MonarchElasticCallback" in deepspeed.output
    assert "Remove `deepspeed=` from TrainingArguments" in deepspeed.output
    for run in (uneven, deepspeed):
        assert not run.results() and not run.events("quorum")  # rejected before any training
        for replica_pids in run.pids().values():
            assert not any(alive(pid) for pid in replica_pids)
