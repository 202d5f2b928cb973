"""End to end: `ElasticLoop` trained semi-synchronously under `monarch-run --sync-every 4` (DiLoCo; LocalSGD where
named), with replicas SIGKILLed from outside between syncs and by a fault inside a sync, one drained by SIGTERM, and the
controller stopped mid-round.

Real Monarch procs, real gloo groups, real signals. After every sync each replica logs its parameters' checksum and
the samples the sync's summed metrics say the synced model learned (`workloads/semi_sync_loop.py`): every replica
holds the same parameters after each sync, the run counts the same syncs everywhere, and every sample of every epoch is
learned exactly once, however the replicas came and went.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter, defaultdict

import pytest

from support.procs import alive

from monarch_plugin.storage.checkpoint import step_path
from support.runs import WORKLOADS, saved_on_controller_loss

pytestmark = pytest.mark.timeout(300)

SAMPLES, BATCH, EPOCHS, H = 192, 24, 3, 4  # 8 steps an epoch: two rounds of 4
STEPS = EPOCHS * SAMPLES // BATCH
SYNCS = STEPS // H
LOOP = ("--samples", str(SAMPLES), "--batch", str(BATCH), "--epochs", str(EPOCHS), "--step-sleep", "0.05")
SCRIPT = WORKLOADS / "semi_sync_loop.py"


def _syncs(run) -> dict[int, list[dict]]:
    return {int(p.stem.split("-")[1]): [json.loads(line) for line in p.read_text().splitlines()]
            for p in run.out.glob("syncs-*.jsonl")}


def _check_syncs(run, survivor: int) -> dict[int, dict]:
    """Every replica logged the same parameters at each step it synced at; every step of the schedule was synced once
    (the survivor saw them all); every sample of every epoch was learned once. The syncs by committed step."""
    by_step: dict[int, set] = defaultdict(set)
    for lines in _syncs(run).values():
        for line in lines:
            by_step[line["step"]].add(line["checksum"])
    assert {step: len(sums) for step, sums in by_step.items()} == {s: 1 for s in range(H, STEPS + 1, H)}
    mine = _syncs(run)[survivor]
    assert [line["sync"] for line in mine] == list(range(1, SYNCS + 1))
    learned: dict[int, Counter] = defaultdict(Counter)
    for line in mine:
        assert line["counts"] == [0.0, 1.0]  # no sample twice in one sync
        learned[line["epoch"]].update(line["learned"])
    for epoch in range(EPOCHS):
        assert sorted(learned[epoch].elements()) == list(range(SAMPLES)), epoch
    return {line["step"]: line for line in mine}


def _no_orphans(run) -> None:
    for pids in run.pids().values():
        assert not any(alive(p) for p in pids), run.pids()


def _held(run, step: int, replicas: int) -> None:
    """Until every replica is held at the start of `step` (`--pause`): each wrote the step before as its progress."""
    run.wait_for(lambda: all(run.progress(r) == step - 1 for r in range(replicas)), timeout=120,
                 what=f"every replica at step {step}")


def _signal_mid_round(run, sig: int, heard: str, spare: bool = False) -> None:
    """Three replicas held at step 6, mid-round (steps 4 and 5 trained locally since the sync at step 4): `sig` to
    replica 1's proc, from outside; released once the controller recorded `heard`; the run ends well. `spare`: with a
    hot spare (replica 3), ready before the signal."""
    hold = run.tmp / "hold"
    hold.touch()
    run.start("--replicas", "3", "--min-replicas", "2", "--sync-every", str(H), *(("--spares", "1") if spare else ()),
              script=SCRIPT, script_args=(*LOOP, "--pause", f"6:{hold}", "--out", str(run.out)))
    _held(run, 6, 3)
    if spare:
        run.wait_for(lambda: [e for e in run.events("ready") if e["replica"] == 3], timeout=120, what="the spare")
    [pid] = run.pids()[1]
    os.kill(pid, sig)
    run.wait_for(lambda: run.events(heard), timeout=60, what=heard)
    hold.unlink()
    assert run.wait(timeout=180) == 0, run.output


def test_sigkill_between_syncs_costs_only_the_dead_replicas_steps_which_the_survivors_train_before_syncing(elastic_run):
    """With a hot spare: it is healed into the sync after the death, mid-round, and takes its part of the dead
    replica's samples with the survivors."""
    run = elastic_run()
    _signal_mid_round(run, signal.SIGKILL, "death", spare=True)

    syncs = _check_syncs(run, survivor=0)
    # The sync after the death: the survivors and the spare, the dead replica's samples of steps 4-7 learned the same.
    assert syncs[8]["world"] == 3 and len(syncs[8]["learned"]) == H * BATCH
    assert [line["step"] for line in _syncs(run)[3]] == list(range(8, STEPS + 1, H))  # the spare: from that sync on
    # The survivors dropped no step of their own: at most the sync, when they reached it before the controller's word
    # of the death reached them (a loaded machine), and redid it without the dead replica.
    assert {d["step"] for d in run.events("dropped_step")} <= {7}
    assert [q["members"] for q in run.events("quorum")] == [[0, 1, 2], [0, 2, 3]]
    assert [h["recipients"] for h in run.events("heal") if h["gen"] == 1] in ([[3]], [[3], [3]])  # one per donor
    results = run.results()
    assert set(results) == {0, 2, 3} and {r["syncs"] for r in results.values()} == {SYNCS}
    assert len({r["checksum"] for r in results.values()}) == 1 and results[3]["initial"] is False
    _no_orphans(run)


def test_a_replica_killed_inside_a_sync_has_the_sync_redone_by_the_survivors(elastic_run):
    run = elastic_run()
    run.start("--replicas", "3", "--min-replicas", "2", "--sync-every", str(H), "--semi-sync", "local_sgd",
              "--fault", "sigkill:replica=1:at=sync:step=8", script=SCRIPT, script_args=(*LOOP, "--out", str(run.out)))
    assert run.wait(timeout=180) == 0, run.output

    syncs = _check_syncs(run, survivor=2)
    assert syncs[12]["world"] == 2 and len(syncs[12]["learned"]) == H * BATCH
    # Only the sync of steps 8-11 was dropped, by the survivors already in it when the victim died (none, when both
    # reached the sync after the controller's word of the death).
    assert {(d["replica"], d["step"]) for d in run.events("dropped_step")} <= {(0, 11), (2, 11)}
    [death] = run.events("death")
    assert death["replica"] == 1
    assert {r["syncs"] for r in run.results().values()} == {SYNCS}
    _no_orphans(run)


def test_sigterm_drains_a_replica_at_the_next_sync_with_its_local_steps_learned(elastic_run):
    run = elastic_run()
    _signal_mid_round(run, signal.SIGTERM, "notice")

    syncs = _check_syncs(run, survivor=0)
    assert syncs[8]["world"] == 3  # it trained to the sync, and the sync counted its steps
    [drained] = run.events("drained")
    assert drained["replica"] == 1
    assert not run.events("dropped_step") and not run.events("death")
    assert not [q for q in run.events("quorum") if q["interrupt"]]
    _no_orphans(run)


@pytest.mark.parametrize("stop", ["sigterm", "controller_lost"])
def test_a_stop_mid_round_checkpoints_the_synced_state_and_periodic_ones_hold_the_outer_optimizer_both_resume_exactly(
        elastic_run, stop):
    """Plain SGD inside the replicas (no state of a replica's own) on a decaying learning rate, DiLoCo's Nesterov
    momentum outside: the controller
    told to stop (SIGTERM), or SIGKILLed, while the replicas are two steps into a round. The replicas learn of the stop
    at the round's sync, of the loss at their next step, and the generation's first replica writes the last synced
    state (a stop's checkpoint, or the one a lost controller leaves). A relaunch from it, and one from a periodic checkpoint, end with the parameters of
    the run never stopped."""
    exact = (*LOOP, "--inner", "sgd", "--scheduler")
    clean = elastic_run()
    clean.start("--replicas", "2", "--sync-every", str(H), "--checkpoint-steps", "8", script=SCRIPT,
                script_args=(*exact, "--out", str(clean.out)))
    first = elastic_run()
    hold = first.tmp / "hold"
    hold.touch()
    first.start("--replicas", "2", "--sync-every", str(H), script=SCRIPT,
                script_args=(*exact, "--pause", f"10:{hold}", "--out", str(first.out)))
    _held(first, 10, 2)
    synced = step_path(str(first.tmp / "ckpt"), 8)  # the synced state: steps 8 to 11 were local
    if stop == "sigterm":
        os.kill(first.proc.pid, signal.SIGTERM)
        first.wait_for(lambda: "SIGTERM received" in (first.tmp / "run.log").read_text(), timeout=60,
                       what="the stop")
        hold.unlink()
        assert first.wait(timeout=120) == 143, first.output
        [give_up] = first.events("give_up")
        assert give_up["checkpoint"] == synced
    else:
        os.kill(first.proc.pid, signal.SIGKILL)
        # Held until the loss is known (a killed process's end takes the kernel a moment, longer on a loaded machine):
        # released at once, the replicas could sync twice more before they heard of it, which is not this test.
        deadline = time.monotonic() + 30
        while not [e for e in first.events("controller_lost") if e["replica"] == 1]:
            assert time.monotonic() < deadline, "replica 1 never heard its controller was lost"
            time.sleep(0.05)
        hold.unlink()
        first.kill_controller(within=30)
        writer = saved_on_controller_loss(first.events("controller_lost"), (0, 1))
        assert writer["checkpoint"] == synced
    _no_orphans(first)

    assert clean.wait(timeout=180) == 0, clean.output
    final = {r["checksum"] for r in clean.results().values()}
    assert len(final) == 1
    for source, resume in ((first, "auto"), (clean, step_path(str(clean.tmp / "ckpt"), 16))):
        again = elastic_run()
        again.start("--replicas", "2", "--sync-every", str(H), "--checkpoint-dir", str(source.tmp / "ckpt"),
                    "--resume", resume, script=SCRIPT, script_args=(*exact, "--out", str(again.out)))
        assert again.wait(timeout=180) == 0, again.output
        assert {r["checksum"] for r in again.results().values()} == final, resume
        assert {r["syncs"] for r in again.results().values()} == {SYNCS}


@pytest.mark.parametrize("method", ["diloco", "local_sgd"])
def test_with_no_failure_the_parameters_after_each_sync_are_torchfts_own(elastic_run, tmp_path, method):
    """The same model, data order and shares, inner Adam, outer optimizer (DiLoCo's Nesterov SGD, lr 0.7, momentum 0.9)
    and H: after each of three syncs the parameters equal those of torchft 0.2.0's `DiLoCo` (one fragment, no sync
    delay) or `LocalSGD`, two replica groups under its lighthouse, to 1e-5 relative."""
    pytest.importorskip("torchft")
    import torch

    from support.torchft_ref import run_torchft_reference

    samples, batch, syncs = 128, 16, 3  # 8 steps an epoch: our rounds end at an epoch's end, torchft's need not
    reference = run_torchft_reference(tmp_path, method, H, syncs, samples=samples, batch=batch)
    run = elastic_run()
    run.start("--replicas", "2", "--sync-every", str(H), "--semi-sync", method, script=SCRIPT,
              script_args=("--samples", str(samples), "--batch", str(batch), "--steps", str(H * syncs), "--params",
                           "--out", str(run.out)))
    assert run.wait(timeout=180) == 0, run.output
    for sync in range(1, syncs + 1):
        ours = torch.load(run.out / f"params-0-{sync}.pt")
        assert ours.keys() == reference[sync].keys()
        for name, value in ours.items():
            expected = reference[sync][name]
            rel = ((value - expected).norm() / expected.norm()).item()
            assert rel < 1e-5, (sync, name, rel)
