"""The torchtitan front end: a real torchtitan Trainer in real Monarch procs, a real SIGKILL from this test.

Each run is `python -m torchtitan.train --module torchtitan_probe --config llama3_probe ...` as a subprocess:
the integration's CPU debug config (2 replicas x 2 FSDP procs on gloo; its model cut to 2 transformer blocks) with
a trainer that logs every committed step (`tests/workloads/torchtitan_probe.py`). The harness kills every worker
pid the run reported, pass or fail. The config section's parsing and validation are checked in this process,
without spawning.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

from torchtitan.config import ConfigManager, ParallelismConfig  # noqa: E402

from support.procs import alive  # noqa: E402
from support.runs import WORKLOADS, ElasticRun, run_factory, saved_on_controller_loss  # noqa: E402
from monarch_plugin.integrations.torchtitan import ElasticLauncher, MonarchConfig, MonarchTrainer  # noqa: E402
from monarch_plugin.integrations.torchtitan.config import elastic_config  # noqa: E402
from monarch_plugin.integrations.torchtitan.config_registry import (  # noqa: E402
    llama3_debugmodel_cpu,
    llama3_debugmodel_elastic,
)

STEPS, SEQ_LEN, GLOBAL_BATCH = 10, 64, 8  # 2 replicas x 2 procs x local batch 2
COMMON = ("--training.steps", str(STEPS), "--training.seq_len", str(SEQ_LEN), "--debug.seed", "7",
          "--metrics.log_freq", "1")


class TitanRun(ElasticRun):
    """`python -m torchtitan.train ...`: the launching process is the controller."""

    def start(self, *args: str, default_events_path: bool = False) -> "TitanRun":
        """`default_events_path`: leave `--monarch.events_path` unset; the events are then read where it defaults to."""
        if default_events_path:
            self.events_path = self.out / "monarch_events.jsonl"
        events = [] if default_events_path else ["--monarch.events_path", str(self.events_path)]
        cmd = [sys.executable, "-m", "torchtitan.train", "--module", "torchtitan_probe", "--config", "llama3_probe",
               "--dump_folder", str(self.out), *events, *COMMON, *args]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(WORKLOADS), os.environ.get("PYTHONPATH", "")]),
               "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
        self.log = open(self.tmp / "run.log", "w")
        self.proc = subprocess.Popen(cmd, cwd=self.tmp, stdout=self.log, stderr=subprocess.STDOUT, text=True, env=env)
        return self

    def steps(self) -> dict[tuple[int, int], list[dict]]:
        found = {}
        for path in (self.out / "probe").glob("steps-*.jsonl"):
            replica, local = map(int, path.stem.split("-")[1:])
            found[replica, local] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return found

    def progress(self, replica: int) -> int:
        path = self.out / "probe" / f"steps-{replica}-0.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def outcome(self) -> dict[tuple[int, int], dict]:
        found = {}
        for path in (self.out / "probe").glob("result-*.json"):
            replica, local = map(int, path.stem.split("-")[1:])
            found[replica, local] = json.loads(path.read_text())
        return found


@pytest.fixture
def titan_run(tmp_path):
    yield from run_factory(tmp_path, TitanRun)


def _final_records(steps: dict[tuple[int, int], list[dict]]) -> dict[int, list[dict]]:
    """Per step, the records of the generation that last committed it (a step a dead replica committed alone
    is redone by the survivors' next generation)."""
    by_step: dict[int, list[dict]] = {}
    for (replica, local), records in steps.items():
        for r in records:
            by_step.setdefault(r["step"], []).append({**r, "replica": replica, "local": local})
    return {s: [r for r in rs if r["generation"] == max(x["generation"] for x in rs)] for s, rs in by_step.items()}


@pytest.mark.timeout(480)
@pytest.mark.parametrize("procs, tp, cp", [pytest.param(2, 1, 2, id="cp2"), pytest.param(4, 2, 1, id="fsdp2_tp2")])
def test_sigkilled_worker_shrinks_regrows_heals_shard_by_shard_and_matches_an_uninterrupted_run(titan_run, procs, tp,
                                                                                                cp):
    """A replica of `procs` procs is a (procs / tp / cp) x cp x tp FSDP x CP x TP mesh; the procs of a CP x TP group
    read the same samples. Context parallelism on CPU splits sequences in blocks of 128 per proc. (TP alone, 2 procs
    a replica, survives a SIGKILL in torchtitan's own `tp2` flag set: benchmarks/frontends/torchtitan_features.py.)"""
    seq_len = SEQ_LEN if cp == 1 else 128 * cp
    layout = ("--monarch.procs_per_replica", str(procs), "--parallelism.tensor_parallel_degree", str(tp),
              "--parallelism.context_parallel_degree", str(cp), "--training.seq_len", str(seq_len))
    group = tp * cp  # procs that read the same samples
    global_batch = 2 * (procs // group) * 2  # local batch 2 x data-parallel procs x replicas
    # Both deterministic (torchtitan's determinism setup must keep the CPU attention stand-in); the reference leaves
    # the events where they default to and, in the 2-proc layout, profiles and writes TensorBoard, whose files each
    # replica must keep apart (the same check over 4 procs would only add 8 traces exported on 2 cores).
    observed = ("--profiler.enable_profiling", "--profiler.profile_freq", str(STEPS), "--profiler.profiler_warmup",
                "1", "--metrics.enable_tensorboard") if procs == 2 else ()
    run = titan_run().start(*layout, "--probe.shrunk_steps", "2", "--debug.deterministic")
    reference = titan_run().start(*layout, "--debug.deterministic", *observed, default_events_path=True)
    run.wait_for(lambda: run.progress(0) >= 3, timeout=300, what="replica 0 to commit step 3")
    pids = run.pids()
    # The last proc of replica 0: a shard holder of the generation's rank 0, the replica that seeded the others.
    victim = next(r["pid"] for r in run.steps()[0, procs - 1])
    assert victim in pids[0]
    os.kill(victim, signal.SIGKILL)

    assert run.wait(timeout=300) == 0, run.output
    assert reference.wait(timeout=120) == 0, reference.output

    # One death, a shrink to the survivor, a regrow with the replacement, healed shard by shard from the survivor.
    assert [d["replica"] for d in run.events("death")] == [0]
    assert [q["members"] for q in run.events("quorum")] == [[0, 1], [1], [1, 2]]
    heals = [h for h in run.events("heal") if 2 in h["recipients"]]
    assert {h["source"] for h in heals} == {f"replica1.{k}" for k in range(procs)}
    # The survivor was never restarted; it and the replacement finished every step, holding identical shards.
    outcome = run.outcome()
    assert set(outcome) == {(r, k) for r in (1, 2) for k in range(procs)}, run.output
    assert {o["step"] for o in outcome.values()} == {STEPS}
    assert {outcome[1, k]["pid"] for k in range(procs)} == set(pids[1])
    for local in range(procs):
        assert outcome[1, local]["checksum"] == outcome[2, local]["checksum"]
    assert len({outcome[1, k]["checksum"] for k in range(procs)}) == procs  # each proc holds a shard of its own
    assert {o["ntokens_seen"] for o in outcome.values()} == {STEPS * global_batch * seq_len}

    final = _final_records(run.steps())
    assert sorted(final) == list(range(1, STEPS + 1))
    # The survivor trained on by itself (the global batch cut over one replica) before the regrow.
    shrunk = [s for s, records in final.items() if {r["replicas"] for r in records} == {1}]
    assert shrunk and {r["step"] for r in run.steps()[2, 0]} >= {STEPS}  # (how many: how fast the replacement came)
    # The loader is sharded by the live replicas and, inside one, by its data-parallel procs (a TP group reads
    # the same samples): each step trained its whole global batch exactly once. A killed proc may have committed
    # a step and died before writing its record of it, so a step may lack the killed replica's records, and only
    # those: the survivor's records are the witness of what it trained.
    for step, records in final.items():
        samples = _trained(records, group)
        batch = set(range((step - 1) * global_batch, step * global_batch))
        assert len(samples) == len(set(samples)) and set(samples) <= batch, (step, records)
        unread = records[0]["replicas"] * procs // group - len({(r["replica"], r["local"] // group) for r in records})
        assert len(batch - set(samples)) == unread * global_batch * group // (records[0]["replicas"] * procs), step
        if len(records) < records[0]["replicas"] * procs:  # only in the generation the kill ended
            assert records[0]["generation"] == run.events("death")[0]["gen"], (step, records)
            assert {r["pid"] for r in records} & set(pids[1]), (step, records)
    # The loss continues from where it was: step for step, the uninterrupted run's (same seed, same batches).
    expected = {r["step"]: r["loss"] for r in reference.steps()[0, 0]}
    for step, records in final.items():
        assert {round(r["loss"], 9) for r in records} == {round(records[0]["loss"], 9)}
        assert records[0]["loss"] == pytest.approx(expected[step], rel=1e-5), (step, records[0], expected[step])
    assert expected[STEPS] < expected[1]

    # Without --monarch.events_path the events are in torchtitan's dump folder, not the working directory.
    assert [q["members"] for q in reference.events("quorum")] == [[0, 1]]
    assert not list(reference.tmp.glob("*.jsonl"))
    # Each replica writes its own profiler traces and TensorBoard run: the same file names, apart.
    traces = sorted(p.relative_to(reference.out).as_posix()
                    for p in (reference.out / "profiling").rglob("*.json.gz"))
    assert traces == [f"profiling/traces/replica_{r}/iteration_{STEPS}/rank{k}_trace.json.gz"
                      for r in (0, 1) for k in range(procs) if observed]
    for replica in (0, 1) if observed else ():
        assert len(list((reference.out / "tb" / f"replica_{replica}").rglob("events.out.tfevents.*"))) == 1
    assert not list((reference.out / "tb").glob("*/events.out.tfevents.*"))  # none outside a replica folder
    # So does each replica's structured trace log (its files named by the replica-local rank); the launching
    # process writes its own where torchtitan puts it.
    logs = sorted(re.sub(r"\.\d{8}-\d{6}-\w{6}\.jsonl$", "", p.relative_to(reference.out).as_posix())
                  for p in reference.out.rglob("structured_logs/*.jsonl"))
    assert logs == [*(f"replica_{r}/structured_logs/training.global_rank_{k}"
                      for r in (0, 1) for k in range(procs)), "structured_logs/training.global_rank_0"], logs

    # No orphans: every worker process the runs spawned is gone.
    for replica_pids in [*run.pids().values(), *reference.pids().values()]:
        assert not any(alive(pid) for pid in replica_pids)


def _trained(records: list[dict], group: int) -> list[int]:
    """The samples a step trained: each data-parallel reader's once (the `group` procs of a TP or CP group read the
    same)."""
    readers: dict[tuple[int, int], list[int]] = {}
    for r in records:
        assert readers.setdefault((r["replica"], r["local"] // group), r["samples"]) == r["samples"], r
    return sorted(i for samples in readers.values() for i in samples)


@pytest.mark.timeout(420)
def test_an_exception_in_one_proc_replaces_its_replica_and_the_same_in_both_stops_with_a_checkpoint_that_resumes(
        titan_run):
    """Proc 0 of replica 1 raises mid-backward while its sibling waits in their FSDP collectives: the replica is
    replaced whole, and the job ends with identical shards at every step's loss. Two one-proc replicas both raising
    at step 4 is the code's own bug: the job stops, and the replica that raised last writes torchtitan's checkpoint
    of step 3 from the state it held (nobody was left training); `--checkpoint.enable` resumes it on the same
    batches to the same losses."""
    steps = 6
    deterministic = ("--debug.deterministic", "--training.steps", str(steps))
    replaced = titan_run().start(*deterministic, "--probe.shrunk_steps", "2",
                                 "--monarch.fault", "raise:replica=1:lane=0:step=3:at=backward")
    one_proc = ("--monarch.procs_per_replica", "1", "--training.global_batch_size", str(GLOBAL_BATCH),
                "--checkpoint.enable", "--checkpoint.interval", "1000", "--checkpoint.no-last-save-model-only",
                *deterministic)
    stopped = titan_run().start(*one_proc, "--monarch.fault", "raise:step=4:at=backward")
    assert replaced.wait(timeout=300) == 0, replaced.output
    assert stopped.wait(timeout=200) == 1, stopped.output

    assert [(d["replica"], d["detected_by"]) for d in replaced.events("death")] == [(1, "raised InjectedFault at step 3")]
    assert [q["members"] for q in replaced.events("quorum")] == [[0, 1], [0], [0, 2]]
    outcome = replaced.outcome()
    assert set(outcome) == {(0, 0), (0, 1), (2, 0), (2, 1)} and {o["step"] for o in outcome.values()} == {steps}
    for local in (0, 1):
        assert outcome[0, local]["checksum"] == outcome[2, local]["checksum"]
    final = _final_records(replaced.steps())
    assert sorted(final) == list(range(1, steps + 1))
    for step, records in final.items():
        assert sorted(i for r in records for i in r["samples"]) == list(range((step - 1) * GLOBAL_BATCH,
                                                                            step * GLOBAL_BATCH)), step

    assert "raised at step 4 in replica" in stopped.output and "--- replica 1 traceback ---" in stopped.output
    [give_up] = stopped.events("give_up")
    assert give_up["checkpoint"] == str(stopped.out / "checkpoint" / "step-3"), (give_up, stopped.output)
    resumed = titan_run().start(*one_proc, "--checkpoint.folder", str(stopped.out / "checkpoint"))
    clean = titan_run().start(*one_proc)  # the same layout (its FSDP mesh seeds the model), never stopped
    assert resumed.wait(timeout=200) == 0, resumed.output
    assert clean.wait(timeout=200) == 0, clean.output
    again, expected = _final_records(resumed.steps()), _final_records(clean.steps())
    assert sorted(again) == list(range(4, steps + 1))
    for step, records in again.items():  # the same global batches as the job that never stopped, the same losses
        assert sorted(i for r in records for i in r["samples"]) == sorted(i for r in final[step] for i in r["samples"])
        assert records[0]["loss"] == pytest.approx(expected[step][0]["loss"], rel=1e-5), step
    for replica_pids in (*replaced.pids().values(), *stopped.pids().values(), *resumed.pids().values()):
        assert not any(alive(pid) for pid in replica_pids)


def test_the_last_holder_dying_mid_heal_stops_the_job_naming_the_newest_complete_checkpoint(titan_run):
    """Both procs of the only replica holding the run's state die serving the replacement's heal, shard by shard:
    the job stops (torchtitan's checkpoints are loaded on the next start, not mid-run), naming the newest complete
    `step-N`, and the replacement never trained from its own weights."""
    run = titan_run().start("--monarch.min_replicas", "1", "--checkpoint.enable", "--checkpoint.interval", "2",
                            "--checkpoint.no-last-save-model-only", "--probe.step_sleep", "0.2",
                            "--monarch.fault", "sigkill:replica=1:step=4,sigkill:replica=0:at=heal_donor:step=1")
    assert run.wait(timeout=200) == 1, run.output
    folder = run.out / "checkpoint"
    complete = sorted(int(p.name.split("-")[1]) for p in folder.glob("step-*") if (p / ".metadata").exists())
    assert complete, "no complete checkpoint was written before the holder died"
    [give_up] = run.events("give_up")
    assert give_up["checkpoint"] is None and give_up["resume_from"] == str(folder / f"step-{complete[-1]}"), give_up
    assert f"resume from {folder / f'step-{complete[-1]}'}, the newest checkpoint" in run.output
    assert not [e for e in run.events("first_commit") if e["replica"] == 2], "the replacement trained from nothing"
    for replica_pids in run.pids().values():
        assert not any(alive(pid) for pid in replica_pids)


@pytest.mark.timeout(480)
def test_lost_controller_costs_at_most_the_step_in_flight_and_checkpoint_enable_goes_on_from_the_saved_step(
        titan_run):
    """`python -m torchtitan.train`, the controller, is SIGKILLed between two checkpoints of `--checkpoint.interval`:
    its procs do not end with it. They stop at the next step boundary, and the generation's first replica (both its
    procs, as DCP needs) writes the last committed step as torchtitan's own `step-N`, whole (the optimizer too, though
    the job sets `last_save_model_only`, as torchtitan's llama3 8B and 70B configs do: a model-only `step-N` is the
    newest that `--checkpoint.enable` finds, and it cannot resume it), so the relaunch takes it as the newest complete
    checkpoint: at most the step in flight is lost, not the steps since the interval's last. The relaunch runs
    on one replica instead of two; torchtitan's global batch is by default one micro-batch of every replica, so it
    names it (`--training.global_batch_size 8`: two micro-batches of accumulation on one replica). Every step, before
    the kill and after, has the losses of a job on one replica that never stopped."""
    checkpointing = ("--checkpoint.enable", "--checkpoint.interval", "3", "--checkpoint.last-save-model-only",
                     "--debug.deterministic")
    killed = titan_run().start(*checkpointing, "--probe.step_sleep", "0.4")
    killed.wait_for(lambda: killed.progress(0) >= 7, timeout=300, what="replica 0 to commit step 7")
    killed.kill_controller()  # the procs end once the writer has written (`worker.orphan`)
    committed = {r["step"]: r for r in killed.steps()[0, 0]}
    # Lane 1 wrote its shards too; lane 0 names the folder.
    writer = saved_on_controller_loss(killed.events("controller_lost"), range(2), lanes=2)
    held = writer["step"]
    # DCP writes a checkpoint's .metadata last; torchtitan loads the highest step-N folder that has it.
    folder = killed.out / "checkpoint"
    assert writer["checkpoint"] == str(folder / f"step-{held}"), writer
    complete = sorted(int(p.name.split("-")[1]) for p in folder.glob("step-*") if (p / ".metadata").exists())
    assert complete[:2] == [3, 6] and complete[-1] == held and held < STEPS, (complete, held)

    resumed = titan_run().start(*checkpointing, "--monarch.replicas", "1", "--training.global_batch_size",
                                str(GLOBAL_BATCH), "--checkpoint.folder", str(folder))
    clean = titan_run().start("--debug.deterministic", "--monarch.replicas", "1", "--training.global_batch_size",
                              str(GLOBAL_BATCH))  # the relaunch's layout (its FSDP mesh seeds the model), never stopped
    assert resumed.wait(timeout=200) == 0, resumed.output
    assert clean.wait(timeout=200) == 0, clean.output
    final = _final_records(resumed.steps())
    assert sorted(final) == list(range(held + 1, STEPS + 1))
    # It went on from the saved step: what the kill cost is at most the step in flight.
    assert min(e["step"] for e in resumed.events("first_commit")) == held + 1
    assert max(committed) - held <= 1, (sorted(committed), held)
    for step, records in final.items():
        assert {r["replicas"] for r in records} == {1}
        assert sorted(i for r in records for i in r["samples"]) == list(range((step - 1) * GLOBAL_BATCH,
                                                                            step * GLOBAL_BATCH))
    # The same losses as the job that never stopped: the steps committed before the kill (on two replicas), the
    # one in flight if it was committed and lost, and the relaunch's.
    expected = _final_records(clean.steps())
    for step in range(1, STEPS + 1):
        loss = final[step][0]["loss"] if step in final else committed[step]["loss"]
        assert loss == pytest.approx(expected[step][0]["loss"], rel=1e-5), step
    for step in set(committed) & set(final):
        assert final[step][0]["loss"] == pytest.approx(committed[step]["loss"], rel=1e-5), step
    outcome = resumed.outcome()
    assert set(outcome) == {(0, 0), (0, 1)} and {o["step"] for o in outcome.values()} == {STEPS}
    assert {o["ntokens_seen"] for o in outcome.values()} == {STEPS * GLOBAL_BATCH * SEQ_LEN}
    for replica_pids in (*killed.pids().values(), *resumed.pids().values()):
        assert not any(alive(pid) for pid in replica_pids)


def _parse(*args: str) -> MonarchTrainer.Config:
    return ConfigManager().parse_args(["--module", "monarch_plugin.integrations.torchtitan", *args])


def test_monarch_section_parses_from_the_command_line():
    config = _parse("--config", "llama3_debugmodel_cpu", "--monarch.enable", "--monarch.replicas", "3",
                    "--monarch.min_replicas", "2", "--monarch.max_replicas", "4", "--monarch.procs_per_replica", "2",
                    "--monarch.spares", "1", "--monarch.fault", "sigkill:replica=1:step=5",
                    "--monarch.hosts", "tcp://127.0.0.1:26600,tcp://127.0.0.1:26601", "--monarch.host_timeout_s", "4",
                    "--monarch.heal_donors", "1", "--monarch.crash_loop_limit", "5")
    assert isinstance(config, MonarchTrainer.Config)
    assert config.monarch == MonarchConfig(enable=True, replicas=3, min_replicas=2, max_replicas=4,
                                           procs_per_replica=2, spares=1, fault="sigkill:replica=1:step=5",
                                           hosts=["tcp://127.0.0.1:26600", "tcp://127.0.0.1:26601"],
                                           host_timeout_s=4.0, heal_donors=1, crash_loop_limit=5)
    settings = elastic_config(config)  # every field reaches the runtime, those the copies had lost included
    assert (settings.heal_donors, settings.crash_loop_limit, settings.max_replicas) == (1, 5, 4)
    assert settings.checkpoint_dir == os.path.join(config.dump_folder, config.checkpoint.folder)  # torchtitan's own
    assert not _parse("--config", "llama3_debugmodel_cpu").monarch.enable
    assert _parse("--config", "llama3_debugmodel_elastic").monarch.procs_per_replica == 2
    # In the launching process an enabled job builds the controller, not a Trainer.
    assert isinstance(config.build(), ElasticLauncher)


@pytest.mark.parametrize("change, message", [
    ({"parallelism": ParallelismConfig(pipeline_parallel_degree=2, spmd_backend="partial_dtensor")},
     r"--monarch.enable does not support pipeline parallelism \(--parallelism.pipeline_parallel_degree 2\)"),
    ({"parallelism": ParallelismConfig(context_parallel_degree=2, tensor_parallel_degree=2,
                                       spmd_backend="partial_dtensor")},
     r"--parallelism.context_parallel_degree 2 x --parallelism.tensor_parallel_degree 2 does not divide "
     r"--monarch.procs_per_replica 2"),
    ({"parallelism": ParallelismConfig(expert_parallel_degree=2, spmd_backend="partial_dtensor")},
     r"expert parallelism \(--parallelism.expert_parallel_degree 2\)"),
    ({"parallelism": ParallelismConfig(tensor_parallel_degree=4, spmd_backend="partial_dtensor")},
     r"^--parallelism.tensor_parallel_degree 4 does not divide --monarch.procs_per_replica 2"),
    ({"parallelism": ParallelismConfig(tensor_parallel_degree=2, data_parallel_shard_degree=2,
                                       spmd_backend="partial_dtensor")},
     r"does not match --parallelism.data_parallel_shard_degree 2 x --parallelism.tensor_parallel_degree 2"),
    ({"parallelism": ParallelismConfig(data_parallel_shard_degree=4, spmd_backend="partial_dtensor")},
     r"--monarch.procs_per_replica 2 does not match --parallelism.data_parallel_shard_degree 4"),
    ({"parallelism": ParallelismConfig(data_parallel_replicate_degree=2, spmd_backend="partial_dtensor")},
     r"--parallelism.data_parallel_replicate_degree 2 .* use --monarch.replicas"),
    ({"parallelism": ParallelismConfig(spmd_backend="spmd_types")}, r"--parallelism.spmd_backend spmd_types"),
    ({"monarch": MonarchConfig(enable=True, replicas=2, min_replicas=3)},
     r"--monarch.min_replicas \(3\) is larger than --monarch.max_replicas \(2\)"),
    ({"monarch": MonarchConfig(enable=True, procs_per_replica=0)}, r"--monarch.procs_per_replica must be a positive"),
    ({"monarch": MonarchConfig(enable=True, fault="sigkill:step=x")}, r"--monarch.fault: bad fault field"),
    ({"monarch": MonarchConfig(enable=True, hosts=["10.0.0.2:26600"])}, r"--monarch.hosts: '10.0.0.2:26600' is not"),
    ({"monarch": MonarchConfig(enable=True, procs_per_replica=2, max_replicas=8)},
     r"leaves some of up to 16 data-parallel procs .* raise --training.local_batch_size"),
    ({"monarch": MonarchConfig(enable=True, procs_per_replica=2, max_replicas=5),
      "parallelism": ParallelismConfig(tensor_parallel_degree=2, spmd_backend="partial_dtensor")},
     r"a micro-batch of 4 samples .* 1 data-parallel procs .* up to 5 data-parallel procs "
     r"\(--monarch.max_replicas x --monarch.procs_per_replica / --parallelism.tensor_parallel_degree\)"),
])
def test_bad_monarch_settings_fail_at_parse_time_naming_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(llama3_debugmodel_elastic(), **change)


def test_global_batch_must_be_whole_micro_batches_of_the_live_group():
    training = dataclasses.replace(llama3_debugmodel_elastic().training, global_batch_size=12)
    with pytest.raises(ValueError, match=r"--training.global_batch_size 12 is not a multiple of .* = 8"):
        dataclasses.replace(llama3_debugmodel_elastic(), training=training)
    # The same settings are fine without --monarch.enable: plain torchtitan checks its own.
    assert not dataclasses.replace(llama3_debugmodel_cpu(), training=training).monarch.enable


def test_command_line_errors_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        _parse("--config", "llama3_debugmodel_elastic", "--parallelism.pipeline_parallel_degree", "2")
    err = re.sub(r"[│\s]+", " ", capsys.readouterr().err)  # tyro boxes and wraps the message
    assert "--monarch.enable does not support pipeline parallelism" in err


@pytest.mark.timeout(420)
def test_sigterm_drains_a_tp_fsdp_replica_whole_and_sigusr1_stops_with_a_checkpoint_resumed_on_another_replica_count(
        titan_run):
    """2 replicas, each a 2 FSDP x 2 TP mesh of 4 procs. SIGTERM to proc 1 of replica 1: its whole replica leaves at
    the next step boundary (no step dropped, no death), a replacement joins. SIGUSR1 to `python -m torchtitan.train`,
    the controller (SLURM's `--signal=USR1@N`): the job exits with status 138 after torchtitan's checkpointer (DCP,
    written by one replica's 4 procs) saved the last committed step. `--checkpoint.enable` resumes it on 1 replica of
    the same mesh, the same global batch taken as 2 micro-batches: every later step once, on the global batches a job
    never stopped trains."""
    layout = ("--monarch.procs_per_replica", "4", "--parallelism.tensor_parallel_degree", "2",
              "--training.global_batch_size", str(GLOBAL_BATCH))
    checkpointing = ("--checkpoint.enable", "--checkpoint.interval", "1000", "--checkpoint.no-last-save-model-only",
                     "--debug.deterministic")
    run = titan_run().start(*layout, *checkpointing, "--probe.step_sleep", "0.4")
    run.wait_for(lambda: run.progress(0) >= 2, timeout=300, what="replica 0 to commit step 2")
    os.kill(run.pids()[1][1], signal.SIGTERM)
    run.wait_for(lambda: any(2 in q["members"] for q in run.events("quorum")), timeout=300,
                 what="the replacement to join")
    os.kill(run.proc.pid, signal.SIGUSR1)
    assert run.wait(timeout=200) == 138, run.output
    [drain] = run.events("drain")
    assert (drain["replicas"], drain["members"]) == ([1], [0])
    assert not run.events("death") and [d["replica"] for d in run.events("drained")] == [1]
    [give_up] = run.events("give_up")
    saved = int(give_up["checkpoint"].rsplit("-", 1)[1])
    assert f"checkpoint written to {give_up['checkpoint']}" in run.output and Path(give_up["checkpoint"]).is_dir()
    committed = _final_records(run.steps())
    assert sorted(committed) == list(range(1, saved + 1))  # nothing committed past the checkpoint: nothing lost

    resumed = titan_run().start(*layout, "--monarch.replicas", "1", *checkpointing,
                                "--checkpoint.folder", str(run.out / "checkpoint"))
    assert resumed.wait(timeout=200) == 0, resumed.output
    final = _final_records(resumed.steps())
    assert sorted(final) == list(range(saved + 1, STEPS + 1))
    for step, records in final.items():
        assert _trained(records, group=2) == list(range((step - 1) * GLOBAL_BATCH, step * GLOBAL_BATCH))
    outcome = resumed.outcome()
    assert set(outcome) == {(0, k) for k in range(4)} and {o["step"] for o in outcome.values()} == {STEPS}
    assert {o["ntokens_seen"] for o in outcome.values()} == {STEPS * GLOBAL_BATCH * SEQ_LEN}
    for replica_pids in (*run.pids().values(), *resumed.pids().values()):
        assert not any(alive(pid) for pid in replica_pids)
