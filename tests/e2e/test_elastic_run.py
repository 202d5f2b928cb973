"""End to end: a plain PyTorch loop under `monarch-run`, a worker SIGKILLed from outside mid-epoch.

Real Monarch proc meshes, real gloo groups, a real SIGKILL sent by this test to the worker's pid.
"""

from __future__ import annotations

import os
import signal
import time
import subprocess
import sys

import pytest

from support.procs import alive, descendants, listeners, parent
from support.runs import WORKLOADS

pytestmark = pytest.mark.timeout(240)

EPOCHS, SAMPLES, BATCH = 10, 512, 32  # long enough after the kill at step 8 for the replacement to join
STEPS = EPOCHS * SAMPLES // BATCH


def test_sigkill_mid_epoch_shrinks_regrows_and_finishes_identical(elastic_run):
    run = elastic_run()
    run.start("--replicas", "3", "--min-replicas", "2", "--join-timeout", "120",
              script_args=("--epochs", str(EPOCHS), "--samples", str(SAMPLES), "--batch", str(BATCH),
                           "--step-sleep", "0.08", "--batchnorm", "--out", str(run.out)))
    run.wait_for(lambda: run.progress(1) >= 8, timeout=120, what="replica 1 to reach step 8")
    # Nothing listens beyond need: on one machine, every listener of the job (store, groups) is on loopback.
    found = listeners(descendants(run.proc.pid))
    assert found and {address for address, _ in found} <= {"127.0.0.1", "[::1]"}, found
    pids = run.pids()
    victim = pids[1][0]
    os.kill(victim, signal.SIGKILL)

    assert run.wait(timeout=180) == 0, run.output

    # The survivors were never restarted; exactly one replacement was spawned.
    results = run.results()
    assert set(results) == {0, 2, 3}, run.output
    assert results[0]["pid"] == pids[0][0] and results[2]["pid"] == pids[2][0]
    assert results[3]["initial"] is False
    # Every replica holds bitwise-identical weights and BatchNorm statistics at the right global step.
    assert {r["checksum"] for r in results.values()} == {results[0]["checksum"]}
    assert {r["step"] for r in results.values()} == {STEPS}
    # Every sample of every epoch took part in exactly one committed step.
    for survivor in (0, 2):
        for epoch, counts in enumerate(results[survivor]["seen"]):
            assert set(counts) == {1.0}, f"replica {survivor} epoch {epoch}: {counts}"

    # The events file shows each phase, in order.
    death = run.events("death")
    assert [d["replica"] for d in death] == [1]
    quorums = run.events("quorum")
    assert [q["members"] for q in quorums] == [[0, 1, 2], [0, 2], [0, 2, 3]], quorums
    assert quorums[1]["interrupt"] is True and quorums[2]["interrupt"] is False
    spawn_of_3 = [s for s in run.events("spawn") if s["replica"] == 3]
    heal = [h for h in run.events("heal") if 3 in h["recipients"]]
    joins_of_3 = [j for j in run.events("join") if j["replica"] == 3]
    assert spawn_of_3 and heal and joins_of_3
    assert death[0]["ts"] < quorums[1]["ts"] < spawn_of_3[0]["ts"] <= heal[0]["ts"]
    assert run.events("run_end")
    # No orphans: every worker process the run spawned is gone.
    for replica_pids in run.pids().values():
        assert not any(alive(pid) for pid in replica_pids)


def test_multi_proc_replica_is_replaced_whole(elastic_run):
    """Kill one proc of a 2-proc replica: its sibling is killed too and the whole replica is replaced.

    The survivor's two procs see the abort at different moments (the workload keeps them out of phase): they
    still drop and retry the same steps in the same generations, so every sample is trained once and all four
    procs end with the same weights."""
    run = elastic_run()
    run.start("--replicas", "2", "--procs-per-replica", "2", "--min-replicas", "1", "--join-timeout", "120",
              script=WORKLOADS / "two_procs_per_replica.py",
              script_args=(str(run.out), "60"))
    run.wait_for(lambda: run.progress(1) >= 5, timeout=120, what="replica 1 to train")
    # The replicas' own stores (their `init_process_group`), which torch's rank 0 would serve on every interface,
    # listen on loopback like everything else of the job.
    found = listeners(descendants(run.proc.pid))
    assert len(found) >= 3 and {address for address, _ in found} <= {"127.0.0.1", "[::1]"}, found
    pids = run.pids()
    assert len(pids[1]) == 2
    os.kill(pids[1][1], signal.SIGKILL)  # local rank 1 only
    assert run.wait(timeout=180) == 0, run.output

    import json

    results = [json.loads(p.read_text()) for p in run.out.glob("result-*.json")]
    assert sorted((r["replica"], r["local_rank"]) for r in results) == [(0, 0), (0, 1), (2, 0), (2, 1)]
    assert {r["checksum"] for r in results} == {results[0]["checksum"]}
    assert {r["step"] for r in results} == {60}
    # Replica 0 trained from the start: its two procs together saw each sample of the 60 steps once.
    survivor = [r for r in results if r["replica"] == 0]
    counts = [[a + b for a, b in zip(*epoch)] for epoch in zip(*(r["seen"] for r in survivor))]
    for epoch in counts[:3]:  # 16 steps of 16 make an epoch of the 256 samples
        assert set(epoch) == {1.0}, counts
    assert sorted(set(counts[3])) == [0.0, 1.0] and sum(counts[3]) == 12 * 16, counts
    lanes = [[(e["gen"], e["step"]) for e in run.events("first_commit") if e["source"] == f"replica0.{lane}"]
             for lane in (0, 1)]
    assert lanes[0] == lanes[1], lanes
    assert [d["replica"] for d in run.events("death")] == [1]
    assert not any(alive(pid) for pid in pids[1])


def test_hot_spare_takes_a_dead_replicas_place_at_once(elastic_run):
    run = elastic_run()
    run.start("--replicas", "2", "--min-replicas", "1", "--spares", "1", "--join-timeout", "120",
              script_args=("--epochs", "8", "--samples", "256", "--batch", "16", "--step-sleep", "0.05",
                           "--out", str(run.out)))
    run.wait_for(lambda: run.progress(0) >= 5 and any(e["replica"] == 2 for e in run.events("ready")),
                 timeout=120, what="training with a spare waiting")
    assert [q["members"] for q in run.events("quorum")] == [[0, 1]]  # the spare waits, not admitted
    os.kill(run.pids()[0][0], signal.SIGKILL)
    assert run.wait(timeout=180) == 0, run.output
    quorums = run.events("quorum")
    assert quorums[1]["members"] == [1, 2] and quorums[1]["interrupt"] is True  # shrink and refill at once
    assert any(2 in h["recipients"] for h in run.events("heal"))
    results = run.results()
    assert {1, 2} <= set(results)
    assert results[1]["checksum"] == results[2]["checksum"] and results[2]["step"] == 8 * 256 // 16
    assert "hot spare replica 2 took its place" in run.output
    for replica_pids in run.pids().values():
        assert not any(alive(pid) for pid in replica_pids)


def test_module_target_without_failures(elastic_run):
    """`monarch-run -m pkg.module`, resolved from the working directory as `python -m` does."""
    from support.runs import REPO

    run = elastic_run()
    run.start("--replicas", "2", "-m", script="recipes.elastic_loop", cwd=REPO,
              script_args=("--epochs", "1", "--step-sleep", "0", "--out", str(run.out)))
    assert run.wait(timeout=120) == 0, run.output
    results = run.results()
    assert set(results) == {0, 1} and results[0]["checksum"] == results[1]["checksum"]
    assert all(set(counts) == {1.0} for r in results.values() for counts in r["seen"])
    assert not run.events("death") and len(run.events("quorum")) == 1


def test_replacement_ready_after_the_end_is_stopped_not_stranded(elastic_run):
    """A replacement admitted while the others sit in the finish barrier must not hang the run."""
    run = elastic_run()
    run.start("--replicas", "3", "--min-replicas", "1", "--join-timeout", "60", "--collective-timeout", "30",
              script=WORKLOADS / "slow_last_step.py",
              script_args=(str(run.out), "40", "8"))
    run.wait_for(lambda: run.progress(1) >= 38, timeout=120, what="replica 1 near the end")
    os.kill(run.pids()[1][0], signal.SIGKILL)
    assert run.wait(timeout=60) == 0, run.output
    results = run.results()
    assert {0, 2} <= set(results) and {r["step"] for r in results.values()} == {40}
    assert results[0]["weights"] == results[2]["weights"]
    assert run.events("run_end")
    for replica_pids in run.pids().values():
        assert not any(alive(pid) for pid in replica_pids)


def test_what_a_replica_started_ends_with_it_when_it_is_killed_and_when_the_run_ends(elastic_run):
    """A process the training code started from multiprocessing's forkserver (a child of that forkserver, which
    watches only the forkserver) does not outlive its replica: not when the replica is SIGKILLed, not when the run
    ends. Monarch's procs default to that start method; the forkserver's subreaper ends what a dead proc left."""
    import json
    import time

    run = elastic_run()
    run.start("--replicas", "2", "--min-replicas", "1", "--max-restarts", "0",
              script=WORKLOADS / "spawns_children.py", script_args=(str(run.out),))
    pids = {r: run.wait_for(lambda r=r: (run.out / f"pids-{r}.json").exists(), 60, f"replica {r}'s child")
            and json.loads((run.out / f"pids-{r}.json").read_text()) for r in (0, 1)}
    left = {r: descendants(p["replica"]) - {p["replica"]} for r, p in pids.items()}
    assert all(p["child"] in left[r] and len(left[r]) >= 2 for r, p in pids.items()), left  # forkserver and child
    try:
        os.kill(pids[1]["replica"], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(alive(p) for p in left[1]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in left[1] if alive(p)]
        assert run.wait(timeout=60) == 0, run.output
        assert not [p for p in left[0] if alive(p)]
    finally:  # what a failure of this test would leave behind
        for p in {*left[0], *left[1]}:
            if alive(p):
                os.kill(p, signal.SIGKILL)


def test_a_death_reported_after_the_run_ends_does_not_take_the_process_down():
    """Monarch reports a proc's death up to seconds after the pidfd does: a replica killed at the last step was
    reported after the run's shutdown, and Monarch's default hook turned the finished run into exit status 1.
    Real proc meshes, SIGKILLed with a call in flight: a replica's report is dropped, a user mesh's is passed on."""
    done = subprocess.run([sys.executable, str(WORKLOADS / "late_fault.py")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == ["user_actor"], done.stdout + done.stderr


def test_the_forkserver_killed_takes_no_replica_and_a_replacement_starts_as_a_fresh_interpreter(elastic_run):
    """The forkserver is a helper: SIGKILLed mid-training (the OOM killer's pick), it takes none of the procs forked
    from it, and the next replacement starts the usual way, saying so in an event."""
    run = elastic_run()
    run.start("--replicas", "3", "--min-replicas", "2", script=WORKLOADS / "held_loop.py",
              script_args=("--replicas", "3", "--hold-for-regrow-from", "0", "--epochs", "4", "--out", str(run.out)))
    run.wait_for(lambda: run.progress(0) >= 3, timeout=120, what="step 3")
    [server] = run.events("forkserver")
    pids = run.pids()
    os.kill(server["pid"], signal.SIGKILL)
    at = run.progress(0)
    run.wait_for(lambda: run.progress(0) >= at + 5, timeout=60, what="5 more steps")
    assert all(alive(p) for ps in pids.values() for p in ps) and not run.events("death"), run.output
    os.kill(pids[1][0], signal.SIGKILL)
    [replacement] = run.wait_for(lambda: [s for s in run.events("spawn") if s["replica"] == 3], 60, "the replacement")
    assert parent(replacement["pids"][0]) != server["pid"]
    assert run.wait(timeout=180) == 0, run.output
    [lost] = run.events("forkserver_lost")
    assert lost["pid"] == server["pid"] and "killed by SIGKILL" in lost["reason"]
    assert [d["replica"] for d in run.events("death")] == [1]
    results = run.results()
    assert set(results) == {0, 2, 3} and len({r["checksum"] for r in results.values()}) == 1
    assert {r["step"] for r in results.values()} == {4 * -(-256 // 24)}  # 11 steps an epoch, the last one short
    assert all(set(epoch) == {1.0} for epoch in results[0]["seen"])
    assert not any(alive(p) for ps in run.pids().values() for p in ps)


def test_replicas_that_outlived_their_forkserver_still_end_after_a_lost_controller(elastic_run):
    """Once the forkserver is gone nothing of it ends the procs it forked: their stand-ins (Monarch's processes) watch
    the controller's process, give their proc `--controller-loss-save` to save the run when it goes, and SIGKILL it
    then, one wedged holding the GIL too."""
    run = elastic_run()
    run.start("--replicas", "2", "--controller-loss-save", "3", "--fault", "gil:replica=0:step=6",
              script=WORKLOADS / "held_loop.py", script_args=("--replicas", "2", "--epochs", "40", "--out", str(run.out)))
    run.wait_for(lambda: run.progress(0) >= 3, timeout=120, what="step 3")
    [server] = run.events("forkserver")
    os.kill(server["pid"], signal.SIGKILL)
    run.wait_for(lambda: run.events("fault_injected"), timeout=60, what="replica 0 wedged")
    t0 = time.monotonic()
    run.kill_controller(within=10)
    assert time.monotonic() - t0 > 2.5, "the wedged proc was given the bound"
