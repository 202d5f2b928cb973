"""Seeded chaos: one run, several failures drawn from every kind a cluster throws (`tests/support/chaos.py`),
injected into real Monarch procs by PID from this test or at protocol points inside them. The run must finish every step
with identical replicas, the witness (a replica that trained from the start) must have trained every sample once per
epoch, the events must tell exactly what was injected, and no process may be left.

Each run draws a fresh seed and prints it; `CHAOS_SEED=<seed>` replays a draw. The default run (CI) runs the plain
loop's; Lightning's, HF's and torchtitan's (~70-120 s each) are `soak` tests, left out for the suite's time:
`python -m pytest -m soak tests/e2e/test_chaos.py` runs them, `python -m benchmarks.soak.chaos`
runs them on many seeds.
"""

from __future__ import annotations

import pytest
import torch

from support.chaos import KINDS, Chaos, seed_from_env
from support.runs import WORKLOADS, front_end_runs

IN_THE_LOOP = tuple(k for k in KINDS if k != "after_end")
"""What the front ends' workloads can be hit with: they stay in no code of their own after training."""

pytestmark = pytest.mark.timeout(300)


def test_plain_loop_survives_a_seeded_draw_of_failures(elastic_run):
    samples, batch, epochs = 240, 8, 8  # 30 steps an epoch
    total = epochs * samples // batch
    chaos = Chaos(seed_from_env(), total=total, replicas=3)
    print(chaos)
    run = elastic_run()
    run.start("--replicas", "3", "--min-replicas", "1", "--collective-timeout", "5", "--join-timeout", "120",
              *chaos.fault_args(), script=WORKLOADS / "held_loop.py",
              script_args=("--replicas", "3", "--epochs", str(epochs), "--samples", str(samples), "--batch", str(batch),
                           "--step-sleep", "0.1", "--linger", "1", "--out", str(run.out)))
    chaos.survive(run, lambda: run.progress(chaos.witness))
    results = run.results()
    witness = results[chaos.witness]
    assert witness["initial"] and witness["pid"] == run.pids()[chaos.witness][0], chaos
    for epoch, counts in enumerate(witness["seen"]):
        assert set(counts) == {1.0}, f"epoch {epoch}: {counts} [{chaos}]"
    assert {r["step"] for r in results.values()} == {total}, (results, str(chaos))
    assert len({r["checksum"] for r in results.values()}) == 1, (results, str(chaos))


@pytest.fixture
def lightning_run(tmp_path):
    yield from front_end_runs(tmp_path, "lightning", "test_lightning", "LightningRun")


@pytest.mark.soak
def test_lightning_fit_survives_a_seeded_draw_of_failures(lightning_run):
    from test_lightning import _every_sample_once_per_epoch

    samples, batch, devices, epochs = 480, 8, 3, 10  # a global batch of 24: 20 steps an epoch
    total = epochs * samples // (batch * devices)
    chaos = Chaos(seed_from_env(), total=total, replicas=devices, kinds=IN_THE_LOOP)
    print(chaos)
    # A replacement takes 10-15 s to start here: a hot spare refills at once, and the compute of a step grows with
    # a replica's share (as a real model's), so a shrunk group trains slower and lasts until its replacements join.
    run = lightning_run().start("--devices", str(devices), "--min-replicas", "1", "--collective-timeout", "5",
                                "--spares", "1", "--epochs", str(epochs), "--samples", str(samples),
                                "--batch", str(batch), "--sample-sleep", "0.0125", *chaos.fault_args())
    chaos.survive(run, lambda: run.progress(chaos.witness))
    result = run.result()
    assert result["state"] == "finished" and result["global_step"] == total, (result, str(chaos))
    assert str(chaos.witness) in result["replica_checksums"], chaos
    assert set(result["replica_checksums"].values()) == {result["checksum"]}, (result, str(chaos))
    _every_sample_once_per_epoch(result)  # counted by the gradients, in weights every finisher holds


@pytest.fixture
def hf_run(tmp_path):
    yield from front_end_runs(tmp_path, "transformers", "test_hf", "HFRun")


@pytest.mark.soak
def test_hf_train_survives_a_seeded_draw_of_failures(hf_run):
    samples, batch, replicas, epochs = 240, 4, 3, 8  # a global batch of 12: 20 steps an epoch
    total = epochs * samples // (batch * replicas)
    chaos = Chaos(seed_from_env(), total=total, replicas=replicas, kinds=IN_THE_LOOP)
    print(chaos)
    run = hf_run().start("--replicas", str(replicas), "--min-replicas", "1", "--collective-timeout", "5",
                         "--spares", "1", *chaos.fault_args(),
                         script_args=("--replicas", str(replicas), "--count", "--max-grad-norm", "0",
                                      "--batch", str(batch), "--samples", str(samples), "--epochs", str(epochs),
                                      "--sample-sleep", "0.025"))
    chaos.survive(run, lambda: run.progress(chaos.witness))
    results = run.results()
    witness = results[str(chaos.witness)]
    assert witness["initial"] and witness["pid"] == run.pids()[chaos.witness][0], chaos
    assert {r["checksum"] for r in results.values()} == {witness["checksum"]}, (results.keys(), str(chaos))
    assert {r["global_step"] for r in results.values()} == {total}, str(chaos)
    counts = torch.tensor(witness["counts"])  # counted by the gradients
    torch.testing.assert_close(counts, torch.ones_like(counts), atol=1e-4, rtol=0)


@pytest.fixture
def titan_run(tmp_path):
    yield from front_end_runs(tmp_path, "torchtitan", "test_torchtitan", "TitanRun")


@pytest.mark.soak
def test_torchtitan_train_survives_a_seeded_draw_of_failures(titan_run):
    from test_torchtitan import SEQ_LEN, _final_records

    steps, replicas, procs, local_batch = 60, 3, 2, 2
    batch = replicas * procs * local_batch  # the global batch, whatever the live replicas
    chaos = Chaos(seed_from_env(), total=steps, replicas=replicas, kinds=IN_THE_LOOP)
    print(chaos)
    run = titan_run().start("--training.steps", str(steps), "--monarch.replicas", str(replicas),
                            "--monarch.min_replicas", "1", "--monarch.spares", "1",
                            "--monarch.collective_timeout_s", "5", "--probe.step_sleep", "0.1",
                            *(("--monarch.fault", chaos.faults()) if chaos.faults() else ()))
    chaos.survive(run, lambda: run.progress(chaos.witness))
    outcome = run.outcome()
    finishers = sorted({replica for replica, _ in outcome})
    assert chaos.witness in finishers and {o["step"] for o in outcome.values()} == {steps}, (outcome, str(chaos))
    # Every finisher holds the witness's shards, and read the stream as far as every step's global batch.
    for local in range(procs):
        assert {outcome[r, local]["checksum"] for r in finishers} == {outcome[chaos.witness, local]["checksum"]}
    assert {o["ntokens_seen"] for o in outcome.values()} == {steps * batch * SEQ_LEN}, str(chaos)
    # Each step was committed once, on one loss, by a generation the witness was in, and trained no sample twice;
    # the witness (never hit) recorded its share of every step.
    witness = {r["step"] for records in (run.steps()[chaos.witness, k] for k in range(procs)) for r in records}
    assert witness == set(range(1, steps + 1)), str(chaos)
    for step, records in _final_records(run.steps()).items():
        samples = [i for r in records for i in r["samples"]]
        assert len(samples) == len(set(samples)), (step, records, str(chaos))
        assert set(samples) <= set(range((step - 1) * batch, step * batch)), (step, records, str(chaos))
        assert len({round(r["loss"], 9) for r in records}) == 1, (step, records, str(chaos))
