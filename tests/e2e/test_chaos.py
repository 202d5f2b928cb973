"""Seeded chaos: one run, several failures drawn from every kind a cluster throws (`tests/chaos.py`), injected into
real Monarch procs by PID from this test or at protocol points inside them. The run must finish every step with
identical replicas, the witness (a replica that trained from the start) must have trained every sample once per
epoch, the events must tell exactly what was injected, and no process may be left.

Each run draws a fresh seed and prints it; `CHAOS_SEED=<seed>` replays a draw.
"""

from __future__ import annotations

import pytest

from chaos import Chaos, seed_from_env
from conftest import alive

pytestmark = pytest.mark.timeout(300)


def test_plain_loop_survives_a_seeded_draw_of_failures(elastic_run):
    samples, batch, epochs = 240, 8, 8  # 30 steps an epoch
    total = epochs * samples // batch
    chaos = Chaos(seed_from_env(), total=total, replicas=3)
    print(chaos)
    run = elastic_run()
    faults = ("--fault", chaos.faults()) if chaos.faults() else ()
    run.start("--replicas", "3", "--min-replicas", "1", "--collective-timeout", "5", "--join-timeout", "120", *faults,
              script_args=("--epochs", str(epochs), "--samples", str(samples), "--batch", str(batch),
                           "--step-sleep", "0.1", "--out", str(run.out)))
    chaos.inject(run, lambda: run.progress(chaos.witness))
    assert run.wait(timeout=180) == 0, f"{chaos}\n{run.output}"

    chaos.check_events(run)
    results = run.results()
    witness = results[chaos.witness]
    assert witness["initial"] and witness["pid"] == run.pids()[chaos.witness][0], chaos
    for epoch, counts in enumerate(witness["seen"]):
        assert set(counts) == {1.0}, f"epoch {epoch}: {counts} [{chaos}]"
    assert {r["step"] for r in results.values()} == {total}, (results, str(chaos))
    assert len({r["checksum"] for r in results.values()}) == 1, (results, str(chaos))
    assert not any(alive(pid) for pids in run.pids().values() for pid in pids), chaos
