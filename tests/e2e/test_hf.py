"""The HF transformers front end end to end: a real `Trainer.train()` on a tiny GPT-2 built from `GPT2Config`,
real Monarch procs under `monarch-run`, real gloo, a real SIGKILL sent by this test to a replica's pid; the
baselines are the same script under `torchrun` (DDP) and under plain `python`.

Every run is `tests/workloads/hf_train.py` as a subprocess, started through the shared harness, which kills
every pid the run reported, pass or fail. The stream's cursor (`ElasticStream`) is also tested alone, in this
process, on real `datasets` streams.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from support.procs import alive  # noqa: E402
from support.runs import WORKLOADS, ElasticRun, run_factory, saved_on_controller_loss  # noqa: E402
from torch.utils.data import IterableDataset  # noqa: E402

from monarch_plugin.integrations.hf._stream import ElasticStream  # noqa: E402

WORKLOAD = WORKLOADS / "hf_train.py"
INACTIVE = "MonarchElasticCallback is inactive"


class HFRun(ElasticRun):
    """`hf_train.py` under `monarch-run` (`start`), `torchrun` (`start_ddp`) or plain `python` (`start_plain`)."""

    def start(self, *launcher: str, script_args: tuple[str, ...] = ()) -> HFRun:
        return super().start(*launcher, "--join-timeout", "120", script=WORKLOAD,
                             script_args=("--out", str(self.out), *script_args))

    def start_default_events(self, *launcher: str, script_args: tuple[str, ...] = ()) -> HFRun:
        """`start` without `--events`: monarch-run then writes its default, in its working directory."""
        self.events_path = self.tmp / "monarch_events.jsonl"
        cmd = [sys.executable, "-m", "monarch_plugin.tools.cli", "--checkpoint-dir", str(self.tmp / "ckpt"), *launcher,
               "--join-timeout", "120", str(WORKLOAD), "--out", str(self.out), *script_args]
        return self._popen(cmd)

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


def _survivors_and_replacement_identical_each_sample_once(run, pids: dict, steps: int) -> None:
    """Replica 0 was killed: train() returned normally on the survivors (never restarted) and on the replacement,
    at the exact step, with identical weights, and every sample took part in exactly one committed step of each
    epoch (counted by the gradients)."""
    results = run.results()
    assert set(results) == {"1", "2", "3"}, run.output
    assert results["1"]["pid"] == pids[1][0] and results["2"]["pid"] == pids[2][0]
    assert results["3"]["initial"] is False
    assert {r["checksum"] for r in results.values()} == {results["1"]["checksum"]}
    assert {(r["global_step"], r["train_output_step"]) for r in results.values()} == {(steps, steps)}
    for r in results.values():
        counts = torch.tensor(r["counts"])
        torch.testing.assert_close(counts, torch.ones_like(counts), atol=1e-4, rtol=0)


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
    # Every sample of every epoch took part in exactly one committed step, counted by the gradients, including
    # the epoch the replacement joined halfway through.
    _survivors_and_replacement_identical_each_sample_once(run, pids, steps)
    results = run.results()

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
    # ...and the run's target, and the one recovery the new main replica lived through (its pause in seconds).
    assert {h["elastic/target"] for h in history if "elastic/target" in h} == {3.0}
    last = [h for h in history if "elastic/recoveries" in h][-1]
    assert last["elastic/recoveries"] == 1.0 and 0 < last["elastic/last_recovery_s"] < 30, last
    for replica_pids in run.pids().values():
        assert not any(alive(pid) for pid in replica_pids)


@pytest.mark.timeout(240)
def test_the_last_holder_dying_mid_heal_stops_the_run_naming_the_newest_save_steps_checkpoint(hf_run):
    """The only replica holding the run's state (its main one, the writer) dies serving the replacement's heal: the
    replacement never trains from its own weights and nothing is saved from them; the run stops, exit 1, naming
    the newest `checkpoint-N` of `output_dir` to resume from (HF's own checkpoints are not restored mid-run)."""
    run = hf_run().start("--replicas", "2", "--min-replicas", "1",
                         "--fault", "sigkill:replica=1:step=6,sigkill:replica=0:at=heal_donor:step=1", script_args=(
                             "--replicas", "2", "--samples", "96", "--epochs", "3", "--save-steps", "4",
                             "--step-sleep", "0.2"))  # 30 steps after the kill: time for the replacement to start
    assert run.wait(timeout=200) == 1, run.output
    saved = sorted((run.out / "hf").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert saved, "no save_steps checkpoint was written before the holder died"
    [give_up] = run.events("give_up")
    assert give_up["checkpoint"] is None and give_up["resume_from"] == str(saved[-1]), (give_up, saved)
    assert f"resume from {saved[-1]}, the newest checkpoint" in run.output
    assert "the last replica holding the run's trained state died before another had healed from it" in run.output
    assert not [e for e in run.events("first_commit") if e["replica"] == 2], "the replacement trained from nothing"
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

    assert "below --min-replicas 2" in stopped.output  # monarch-run's flag: it launched the run
    give_up = stopped.events("give_up")
    assert len(give_up) == 1 and give_up[0]["checkpoint"] == str(stopped.out / "hf" / "checkpoint-5"), (
        give_up, stopped.events("user_error"), stopped.output)
    assert [c["replica"] for c in stopped.events("checkpoint")] == [1]
    resumed = hf_run().start("--replicas", "2", script_args=(*common, "--resume", give_up[0]["checkpoint"]))
    assert resumed.wait(timeout=180) == 0, resumed.output
    assert {r["global_step"] for r in resumed.results().values()} == {steps}
    _assert_close(resumed.weights("0"), elastic.weights("0"), rtol=0, atol=0)


@pytest.mark.timeout(300)
def test_an_exception_in_one_replica_is_replaced_and_the_same_in_both_stops_with_a_checkpoint_that_resumes_exactly(
        hf_run):
    """Replica 1's forward raises: it is replaced, and train() returns at the exact step on identical replicas, every
    sample once. Both replicas raising mid-backward at one step is the code's own bug: the run stops, exit 1, and the
    one that raised last writes HF's checkpoint from the state it held (nobody was left training); train() resumed
    from it ends bitwise where a run that never failed ends."""
    counted = ("--replicas", "3", "--count", "--max-grad-norm", "0", "--batch", "4", "--accumulate", "2",
               "--samples", "96", "--epochs", "2", "--step-sleep", "0.05", "--pause-at", "5")
    common = ("--replicas", "2", "--optimizer", "hf", "--batch", "4", "--accumulate", "2", "--samples", "96",
              "--epochs", "2", "--max-grad-norm", "0.3")
    replaced = hf_run().start("--replicas", "3", "--fault", "raise:replica=1:step=3:at=forward", script_args=counted)
    stopped = hf_run().start("--replicas", "2", "--fault", "raise:step=3:at=backward", script_args=common)
    replaced.wait_for(lambda: any(3 in q["members"] for q in replaced.events("quorum")), timeout=150,
                      what="the replacement to be ready and admitted")
    (replaced.out / "release").touch()  # the survivors held step 5 for it
    assert replaced.wait(timeout=200) == 0, replaced.output
    assert stopped.wait(timeout=200) == 1, stopped.output

    results = replaced.results()
    assert set(results) == {"0", "2", "3"} and len({r["checksum"] for r in results.values()}) == 1, replaced.output
    assert {r["global_step"] for r in results.values()} == {2 * 96 // (4 * 3 * 2)}
    for r in results.values():
        torch.testing.assert_close(torch.tensor(r["counts"]), torch.ones(len(r["counts"]), 96), atol=1e-4, rtol=0)
    [death] = replaced.events("death")
    assert (death["replica"], death["detected_by"]) == (1, "raised InjectedFault at step 3")

    assert "raised at step 3 in replica" in stopped.output and "--- replica 1 traceback ---" in stopped.output
    [give_up] = stopped.events("give_up")
    assert give_up["checkpoint"] == str(stopped.out / "hf" / "checkpoint-3"), (give_up, stopped.output)
    clean = hf_run().start("--replicas", "2", script_args=common)
    resumed = hf_run().start("--replicas", "2", script_args=(*common, "--resume", give_up["checkpoint"]))
    assert clean.wait(timeout=180) == 0, clean.output
    assert resumed.wait(timeout=180) == 0, resumed.output
    assert {r["global_step"] for r in resumed.results().values()} == {2 * 96 // 16}
    _assert_close(resumed.weights("0"), clean.weights("0"), rtol=0, atol=0)


@pytest.mark.timeout(300)
def test_lost_controller_costs_at_most_the_step_in_flight_and_train_resumes_the_newest_checkpoint_from_it(hf_run):
    """monarch-run, HF's controller here, is SIGKILLed mid-epoch, 2 steps after the last `save_steps` checkpoint: its
    replicas do not end with it. They stop at the next step boundary, and the generation's first replica writes the
    last committed step as HF's own `checkpoint-N` in output_dir, which `train(resume_from_checkpoint=True)` takes
    as the newest: at most the step in flight is lost, not the steps since the last save. The relaunch, on 2
    replicas instead of 3 with per_device_train_batch_size raised so that the global batch stays 12, ends equal to
    a run that never stopped."""
    common = ("--optimizer", "hf", "--samples", "96", "--epochs", "4", "--save-steps", "5")  # 8 steps an epoch
    steps = 4 * 96 // 12
    killed = hf_run().start("--replicas", "3", script_args=(*common, "--replicas", "3", "--batch", "4",
                                                            "--step-sleep", "0.2"))
    whole = hf_run().start("--replicas", "3", script_args=(*common, "--replicas", "3", "--batch", "4"))
    killed.wait_for(lambda: killed.progress(0) >= 17, timeout=150, what="17 committed steps")
    killed.kill_controller()  # the procs end once the writer has written (`worker.orphan`)
    committed = max(killed.progress(r) for r in range(3))  # each replica's global_step after its last step
    writer = saved_on_controller_loss(killed.events("controller_lost"), range(3))  # the others wrote nothing
    held = writer["step"]
    # HF's own checkpoint of the held step, whole (HF writes trainer_state.json last), and HF's newest.
    output_dir = killed.out / "hf"
    assert writer["checkpoint"] == str(output_dir / f"checkpoint-{held}"), writer
    assert [c["path"] for c in killed.events("checkpoint")] == [writer["checkpoint"]]
    saved = sorted(int(p.name.split("-")[1]) for p in output_dir.glob("checkpoint-*"))
    assert saved == [5, 10, 15, held] and held > 15, saved
    state = json.loads((output_dir / f"checkpoint-{held}" / "trainer_state.json").read_text())
    assert state["global_step"] == held, state["global_step"]

    # The relaunch writes into the same output_dir and lets HF pick the checkpoint: resume_from_checkpoint=True.
    resumed = hf_run().start("--replicas", "2", script_args=(
        *common, "--replicas", "2", "--batch", "6", "--resume", "true",
        "--training-args", json.dumps({"output_dir": str(output_dir)})))
    assert whole.wait(timeout=180) == 0, whole.output
    assert resumed.wait(timeout=180) == 0, resumed.output
    results = resumed.results()
    assert set(results) == {"0", "1"} and {r["global_step"] for r in results.values()} == {steps}
    assert results["0"]["checksum"] == results["1"]["checksum"]
    _assert_close(resumed.weights("0"), whole.weights("0"), rtol=1e-4, atol=1e-5)
    # It went on from the saved step: what the kill cost is at most the step in flight.
    assert min(e["step"] for e in resumed.events("first_commit")) == held
    assert committed - held <= 1, (committed, held)
    # HF's log history: the checkpoint's lines (3 replicas), then the resumed run's own (2), one per step.
    history = {h["step"]: h["elastic/replicas"] for h in results["0"]["log_history"] if "loss" in h}
    assert sorted(history) == list(range(1, steps + 1))
    assert {history[s] for s in history if s <= held} == {3.0}
    assert {history[s] for s in history if s > held} == {2.0}
    for replica_pids in (*killed.pids().values(), *resumed.pids().values()):
        assert not any(alive(pid) for pid in replica_pids)


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
    workers = hf_run().start("--replicas", "1", script_args=("--stream", "torch", "--max-steps", "4", "--workers", "2"))
    compiled = hf_run().start("--replicas", "1", script_args=("--training-args", '{"torch_compile": true}'))
    assert uneven.wait(timeout=120) == 1
    assert "ValueError: per_device_train_batch_size=4 x 1 replica(s) is a global batch of 4" in uneven.output
    assert "cannot be split over up to 2 replicas" in uneven.output
    assert "dataloader_drop_last=True" in uneven.output
    assert deepspeed.wait(timeout=120) == 1
    assert "ValueError: DeepSpeed is not supported by MonarchElasticCallback" in deepspeed.output
    assert "Remove `deepspeed=` from TrainingArguments" in deepspeed.output
    assert workers.wait(timeout=120) == 1
    assert "ValueError: dataloader_num_workers=2 with a streaming train_dataset is not supported" in workers.output
    assert "Set dataloader_num_workers=0" in workers.output
    assert compiled.wait(timeout=120) == 1
    assert "ValueError: torch_compile=True is not supported by MonarchElasticCallback" in compiled.output
    for run in (uneven, deepspeed, workers, compiled):
        assert not run.results() and not run.events("quorum")  # rejected before any training
        for replica_pids in run.pids().values():
            assert not any(alive(pid) for pid in replica_pids)


@pytest.mark.timeout(240)
def test_streaming_dataset_sigkill_mid_pass_every_sample_of_the_stream_trained_once(hf_run):
    # A datasets.IterableDataset (it has state_dict) of 96 samples; 3 replicas x 4 samples a global micro-batch, 2
    # micro-batches a step: 4 steps a pass, 5 passes. The survivors hold step 9, so the replacement joins inside
    # pass 2 and is positioned there by the stream's own state.
    pytest.importorskip("datasets")
    passes, samples, pause = 5, 96, 9
    per_pass = samples // (4 * 3 * 2)
    steps = passes * per_pass
    run = hf_run().start("--replicas", "3", "--min-replicas", "2", script_args=(
        "--replicas", "3", "--stream", "datasets", "--count", "--max-grad-norm", "0", "--batch", "4",
        "--accumulate", "2", "--samples", str(samples), "--epochs", str(passes), "--max-steps", str(steps),
        "--step-sleep", "0.1", "--pause-at", str(pause)))
    run.wait_for(lambda: run.progress(0) >= 2, timeout=150, what="replica 0 to reach step 2")
    pids = run.pids()
    os.kill(pids[0][0], signal.SIGKILL)
    run.wait_for(lambda: any(3 in q["members"] for q in run.events("quorum")), timeout=150,
                 what="the replacement to be ready and admitted")
    (run.out / "release").touch()

    assert run.wait(timeout=150) == 0, run.output
    # Every sample of every pass over the stream took part in exactly one committed step, across the death, the
    # shrunk steps and the replacement's entry mid-pass.
    _survivors_and_replacement_identical_each_sample_once(run, pids, steps)
    assert [q["members"] for q in run.events("quorum")] == [[0, 1, 2], [1, 2], [1, 2, 3]]
    assert {d["replica"] for d in run.events("dropped_step")} == {1, 2}
    joined = next(h["step"] for h in run.events("heal") if h["recipients"] == [3])
    assert pause < joined < pause + 3 and joined % per_pass, joined  # inside a pass, not at its start
    assert "do not fill an optimizer step" not in run.output  # 96 samples are whole steps
    for replica_pids in run.pids().values():
        assert not any(alive(pid) for pid in replica_pids)


@pytest.mark.timeout(300)
def test_streaming_dataset_added_late_matches_torchrun_and_its_give_up_checkpoint_resumes_mid_pass(hf_run):
    # A plain torch IterableDataset (no state_dict: positioned by skipping) of 48 samples; 2 replicas x 4 samples x 2
    # micro-batches: 3 steps a pass, 3 passes. The elastic run adds the callback with trainer.add_callback after
    # Trainer(...), and leaves the events file to monarch-run's default.
    common = ("--replicas", "2", "--stream", "torch", "--count", "--max-grad-norm", "0", "--batch", "4",
              "--accumulate", "2", "--samples", "48", "--epochs", "3", "--max-steps", "9")
    elastic = hf_run().start_default_events("--replicas", "2", script_args=(*common, "--add-late"))
    ddp = hf_run().start_ddp(2, *common)
    stopped = hf_run().start("--replicas", "2", "--min-replicas", "2", "--fault", "sigkill:replica=0:step=5",
                             script_args=common)
    assert ddp.wait(timeout=240) == 0, ddp.output
    assert elastic.wait(timeout=240) == 0, elastic.output
    assert stopped.wait(timeout=240) == 1, stopped.output

    results = elastic.results()
    assert set(results) == {"0", "1"} and {r["global_step"] for r in results.values()} == {9}
    assert results["0"]["checksum"] == results["1"]["checksum"]
    for r in results.values():
        counts = torch.tensor(r["counts"])
        torch.testing.assert_close(counts, torch.ones_like(counts), atol=1e-4, rtol=0)
    # Added late, it still joined ahead of the other callbacks: one main replica.
    assert {k: (r["main"], r["world_process_zero"]) for k, r in results.items()} == {
        "0": (True, True), "1": (False, False)}
    # The same global batches of the stream in the same order as torchrun's (accelerate dispatches slices of
    # each one), so the same weights: the late-added callback did shape the data.
    assert ddp.results()["rank0"]["global_step"] == 9
    _assert_close(elastic.weights("0"), ddp.weights("rank0"), rtol=1e-4, atol=1e-5)
    # The events file stays monarch-run's choice, made before any replica runs the script: not output_dir.
    assert elastic.events("spawn") and not (elastic.out / "hf" / "monarch_events.jsonl").exists()
    assert "events in monarch_events.jsonl" in elastic.output

    # Replica 0 died at step 5, inside pass 1: the survivor's checkpoint carries the stream's position.
    give_up = stopped.events("give_up")
    assert len(give_up) == 1 and give_up[0]["checkpoint"] == str(stopped.out / "hf" / "checkpoint-5"), (
        give_up, stopped.events("user_error"), stopped.output)
    assert (Path(give_up[0]["checkpoint"]) / "monarch_stream.pt").is_file()
    resumed = hf_run().start("--replicas", "2", script_args=(*common, "--resume", give_up[0]["checkpoint"]))
    assert resumed.wait(timeout=180) == 0, resumed.output
    assert {r["global_step"] for r in resumed.results().values()} == {9}
    _assert_close(resumed.weights("0"), elastic.weights("0"), rtol=0, atol=0)


class _Numbers(IterableDataset):
    """0..n-1 as a plain stream (no state_dict, no set_epoch)."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return ({"idx": i} for i in range(self.n))


def _stream_of(kind: str, n: int, seed: int | None = 0):
    if kind == "torch":
        return _Numbers(n)
    datasets = pytest.importorskip("datasets")
    stream = datasets.Dataset.from_dict({"idx": list(range(n))}).to_iterable_dataset(num_shards=4)
    return stream.shuffle(seed=seed, buffer_size=8) if kind == "shuffled" else stream


def _train(stream: ElasticStream, steps: int) -> list[tuple[int, list[int]]]:
    """(pass, sample ids) of each step the stream hands out, each committed."""
    trained = []
    for _ in range(steps):
        window = stream.window()
        if window is None:
            break
        trained.append((stream.epoch, [s["idx"] for s in window]))
        stream.commit()
    return trained


@pytest.mark.parametrize("kind", ["datasets", "shuffled", "torch"])
def test_a_stream_newcomer_positioned_at_the_cursor_reads_what_its_peers_read(kind):
    # datasets: by the stream's own state. shuffled: datasets documents that the state loses the shuffle buffer, so
    # the fingerprint check replaces it by replaying the pass. torch: no state, replayed.
    reference = _train(ElasticStream(_stream_of(kind, 50), 4, 2), 20)
    donor = ElasticStream(_stream_of(kind, 50), 4, 2)
    head = _train(donor, 8)  # two steps into the second pass
    newcomer = ElasticStream(_stream_of(kind, 50), 4, 2)
    survivor = ElasticStream(_stream_of(kind, 50), 4, 2)
    _train(survivor, 7)
    survivor.window()  # it holds step 8's samples, dropped here but committed by the donor
    state = donor.state_dict()
    newcomer.load_state_dict(pickle.loads(pickle.dumps(state)))  # as the heal sends it
    survivor.load_state_dict(pickle.loads(pickle.dumps(state)))
    assert head + _train(newcomer, 12) == reference
    assert head + _train(survivor, 12) == reference


def test_a_stream_pass_trains_whole_steps_and_a_stream_that_differs_between_replicas_is_refused(caplog):
    # 52 samples in steps of 4 x 2: each pass trains 6 whole steps, and its last 4 samples are not trained.
    trained = _train(ElasticStream(_stream_of("torch", 52), 4, 2), 13)
    assert [p for p, _ in trained] == [0] * 6 + [1] * 6 + [2]
    for p in (0, 1):
        assert sorted(i for q, ids in trained if q == p for i in ids) == list(range(48))
    assert "ends with 4 sample(s) that do not fill an optimizer step of 8" in caplog.text
    with pytest.raises(ValueError, match="fewer than one optimizer step takes"):
        ElasticStream(_stream_of("torch", 7), 4, 2).window()
    # Shuffled with no seed, each process reads its own order: caught at the first heal, not trained on.
    donor = ElasticStream(_stream_of("shuffled", 50, seed=None), 4, 2)
    newcomer = ElasticStream(_stream_of("shuffled", 50, seed=None), 4, 2)
    with pytest.raises(RuntimeError, match=r"seed its shuffling"):
        newcomer.load_state_dict(donor.state_dict())


@pytest.mark.timeout(300)
def test_sigterm_drains_a_replica_and_sigterm_to_monarch_run_stops_with_an_hf_checkpoint_that_resumes_exactly(hf_run):
    """SIGTERM to replica 1's proc: it leaves at the next step boundary (no step dropped, no death) and a replacement
    joins. SIGTERM to monarch-run, HF's controller here: status 143 after the main replica wrote HF's checkpoint of
    the last committed step; train(resume_from_checkpoint=...) ends where a run never stopped ends."""
    common = ("--optimizer", "hf", "--batch", "4", "--accumulate", "2", "--samples", "96", "--epochs", "3")
    run = hf_run().start("--replicas", "3", script_args=(*common, "--step-sleep", "0.6"))  # time for a replacement
    clean = hf_run().start("--replicas", "3", script_args=common)
    run.wait_for(lambda: run.progress(0) >= 2, timeout=150, what="step 2")
    os.kill(run.pids()[1][0], signal.SIGTERM)
    run.wait_for(lambda: any(3 in q["members"] for q in run.events("quorum")), timeout=150,
                 what="the replacement to join")
    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.wait(timeout=150) == 143, run.output
    assert [d["replica"] for d in run.events("drained")] == [1] and not run.events("death")
    [give_up] = run.events("give_up")
    assert give_up["checkpoint"] and "/hf/checkpoint-" in give_up["checkpoint"], run.output
    resumed = hf_run().start("--replicas", "3", script_args=(*common, "--resume", give_up["checkpoint"]))
    assert clean.wait(timeout=180) == 0, clean.output
    assert resumed.wait(timeout=180) == 0, resumed.output
    assert {r["global_step"] for r in resumed.results().values()} == {3 * 96 // 24}
    _assert_close(resumed.weights("0"), clean.weights("0"), rtol=1e-5, atol=1e-6)
