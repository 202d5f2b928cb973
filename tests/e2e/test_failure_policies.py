"""Failures the run cannot or should not survive stop cleanly, with a message and a checkpoint.

Real Monarch procs and real deaths; each test bounds its time and the fixture kills leftovers by pid.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from support.procs import alive
from support.runs import WORKLOADS
from monarch_plugin.storage.checkpoint import step_of
from monarch_plugin.worker.dcp_io import read_metadata

pytestmark = pytest.mark.timeout(240)
SLOW = ("--step-sleep", "0.05")


def _no_orphans(run) -> None:
    for pids in run.pids().values():
        assert not any(alive(p) for p in pids)


def test_below_min_replicas_stops_with_checkpoint(elastic_run):
    run = elastic_run()
    run.start("--replicas", "2", "--min-replicas", "2",
              script_args=("--epochs", "20", *SLOW, "--out", str(run.out)))
    run.wait_for(lambda: run.progress(1) >= 5, timeout=120, what="training to start")
    os.kill(run.pids()[1][0], signal.SIGKILL)
    assert run.wait(timeout=120) == 1
    assert "below --min-replicas 2" in run.output and "lower --min-replicas to keep training" in run.output
    give_up = run.events("give_up")
    assert len(give_up) == 1 and give_up[0]["checkpoint"]
    held = read_metadata(give_up[0]["checkpoint"]).state_dict_metadata  # DCP's index of what it holds
    assert step_of(give_up[0]["checkpoint"]) >= 5 and {"loop.step", "loop.sampler.cursor", "lane0.torch"} <= set(held)
    assert any(k.startswith("model.") for k in held) and any(k.startswith("optimizer.state.") for k in held)
    assert [s["replica"] for s in run.events("spawn")] in ([0, 1], [1, 0])  # nothing respawned
    _no_orphans(run)


def test_crash_loop_of_replacements_gives_up(elastic_run):
    run = elastic_run()
    run.start("--replicas", "2", "--min-replicas", "1", "--fault", "sigkill:replica=1:step=3",
              script=WORKLOADS / "dies_when_replaced.py",
              script_args=("--epochs", "200", *SLOW, "--out", str(run.out)))
    assert run.wait(timeout=180) == 1
    assert "crash loop" in run.output
    spawned = [s["replica"] for s in run.events("spawn")]
    assert len(spawned) <= 2 + 3  # the initial two, then at most crash_loop_limit replacements
    delays = [e["delay"] for e in run.events("respawn_scheduled")]
    assert delays == [0.0, 1.0, 2.0][: len(delays)] and len(delays) >= 2  # backoff only on early deaths
    assert run.events("give_up")[0]["checkpoint"]
    _no_orphans(run)


def test_hung_and_frozen_replicas_are_found_by_what_they_were_doing_and_a_straggler_is_left_alone(elastic_run):
    """Three kinds of slow, in one run: replica 0 straggles (0.8 s more per step, 3.75x inside the bound), replica 1
    deadlocks in its own code at step 5 (it sleeps; its process answers), and replica 2 is SIGSTOPped from outside in
    the middle of a step (it answers nothing). The events say which member was suspected, and why the others not."""
    samples, batch, epochs, bound = 240, 24, 3, 3.0  # 10 steps an epoch
    total = epochs * samples // batch
    run = elastic_run()
    run.start("--replicas", "3", "--min-replicas", "1", "--collective-timeout", str(bound),
              "--fault", "hang:replica=1:step=5", script=WORKLOADS / "logged_loop.py",
              script_args=("--samples", str(samples), "--batch", str(batch), "--epochs", str(epochs),
                           "--straggler", "0", "--straggle", "0.8", "--straggle-until", "20", "--out", str(run.out)))
    run.wait_for(lambda: run.events("hang") and len(_steps(run)) >= 9, timeout=150, what="the hang found, step 9")
    frozen = run.pids()[2][0]
    os.kill(frozen, signal.SIGSTOP)
    stopped_at = time.time()
    assert run.wait(timeout=180) == 0, run.output

    # The deadlocked replica: computing step 5 past the bound, while its peers waited on it in the reduction.
    hangs = {h["replica"]: h for h in run.events("hang")}
    assert hangs[1]["why"].startswith("compute at step 5 for "), hangs[1]
    # The straggler, probed at the same moment, was waiting on its peers, or computing for less than the bound.
    phase, _, seconds = hangs[1]["probed"]["0"].split()[:3]
    assert phase == "reduce" or (phase == "compute" and float(seconds) < bound), hangs[1]["probed"]
    # The frozen one: found because it answered nothing (or by Monarch's supervision of its process).
    frozen_found = [e for e in run.events("hang") + run.events("death") if e["replica"] == 2]
    assert frozen_found and (frozen_found[0].get("why", "").startswith("no answer")
                             or "supervision" in frozen_found[0]["detected_by"]), frozen_found
    assert frozen_found[0]["ts"] > stopped_at
    print(f"frozen replica found {frozen_found[0]['ts'] - stopped_at:.2f} s after its SIGSTOP, "
          f"by {frozen_found[0]['detected_by']}")
    # Nobody else was suspected: the straggler trained every step, in every generation, in its first process.
    assert {e["replica"] for e in run.events("hang") + run.events("death")} == {1, 2}
    assert all(0 in q["members"] for q in run.events("quorum"))
    assert [s["replica"] for s in run.events("spawn") if s["replica"] == 0] == [0]
    steps = _steps(run)
    assert [r["step"] for r in steps] == list(range(total))
    for epoch in range(epochs):
        assert sorted(i for r in steps if r["epoch"] == epoch for i in r["batch"]) == list(range(samples)), epoch
    results = run.results()
    assert set(results) == {0, 3, 4} and {r["step"] for r in results.values()} == {total}
    assert len({r["checksum"] for r in results.values()}) == 1
    _no_orphans(run)


def _steps(run) -> list[dict]:
    path = run.out / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

