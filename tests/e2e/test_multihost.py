"""End to end across machines: replicas on Monarch host agents in separate network namespaces.

Each host is a Linux network namespace with its own network stack and a real `monarch-plugin host` agent in it
(`tests/support/netns.py`); the controller (`monarch-run --hosts-file`) runs in the root namespace, and the replicas'
gloo groups cross the bridge between them. A host is lost the way a machine dies: the test SIGKILLs every
process in its namespace, or its link is cut. Also here: no process of a multi-host job listens on a wildcard
address (a single-host job's listeners are checked in test_elastic_run.py), and a hosts-file line without the HMAC
of its address under the job's token is never contacted. Lightning, HF and torchtitan across machines run under a
real SLURM (test_slurm.py).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from support import netns
from support.procs import WILDCARDS, alive, descendants, listeners
from support.runs import REPO, WORKLOADS, saved_on_controller_loss

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))]

EPOCHS, SAMPLES, BATCH = 8, 256, 24
STEPS = EPOCHS * -(-SAMPLES // BATCH)
STEPS_14 = 14 * -(-SAMPLES // BATCH)


def _lose_host_and_bring_it_back(run, net: netns.NetnsHosts, i: int) -> None:
    """SIGKILL every process of host i (a dead machine), wait until the run declares it lost, and start its agent
    again on a new port (Monarch will not attach the lost address again)."""
    lost = len(run.events("host_lost"))
    net.kill_host(i)
    run.wait_for(lambda: len(run.events("host_lost")) > lost, timeout=60, what=f"host {i} declared lost")
    net.start_agent(i, port=netns.AGENT_PORT + 1)


def _nothing_outlives(run) -> None:
    """No worker and no host's watcher outlived the run, on any host."""
    pids = [pid for pids in run.pids().values() for pid in pids] + [e["watcher_pid"] for e in run.events("host_up")]
    pids += [e["pid"] for e in run.events("watcher_replaced")]
    assert not [pid for pid in pids if alive(pid)], pids


def test_new_host_grows_the_run_then_remote_death_lost_host_and_cut_link_each_one_generation_change(elastic_run,
                                                                                                     hosts):
    net = hosts(3)
    for i in (0, 1):
        net.start_agent(i)
    net.wait_listed(2)
    run = elastic_run()
    run.start("--hosts-file", str(net.hosts_file), "--store-host", net.controller_ip, "--replicas", "2",
              "--max-replicas", "3", "--replicas-per-host", "1", "--host-timeout", "4", "--join-timeout", "120",
              script=WORKLOADS / "held_loop.py",
              script_args=("--epochs", str(EPOCHS), "--samples", str(SAMPLES), "--batch", str(BATCH),
                           "--replicas", "3", "--hold-for-regrow-from", "10", "--out", str(run.out)))
    run.wait_for(lambda: all(run.progress(r) >= 3 for r in range(2)), timeout=150, what="two replicas training")

    # 0. A new machine joins mid-run (its agent lists itself): the run grows onto it, up to --max-replicas.
    net.start_agent(2)
    run.wait_for(lambda: len(run.events("quorum")) == 2, timeout=120, what="the grow onto host 2")
    assert [(e["host"], e["replicas"]) for e in run.events("grow")] == [(net.address(2), 3)]
    run.wait_for(lambda: run.progress(2) >= 3, timeout=60, what="the third replica training")
    on_host = {s["host"]: s["replica"] for s in run.events("spawn")}
    assert sorted(on_host) == sorted(net.address(i) for i in range(3)), on_host  # one replica per host

    # Nothing listens beyond need: the controller on the bridge address only, each host on its own address.
    controller = listeners(descendants(run.proc.pid))
    assert controller and not [a for a, _ in controller if a in WILDCARDS], controller
    for ns in net.names:
        found = listeners(ns=ns)
        assert found and not [a for a, _ in found if a in WILDCARDS], (ns, found)

    # A process on the job network without the run's secret (in host 0's namespace) forges three deaths on host 0,
    # with their records and count, and host 1's loss: none is acted on (the generations below stay as counted).
    attacker = REPO / "tests" / "support" / "attacker.py"
    forged = subprocess.run(["ip", "netns", "exec", net.names[0], sys.executable, str(attacker),
                             "--host", net.controller_ip, "--port", str(run.events("run_start")[0]["store_port"]),
                             "hosts"], capture_output=True, text=True, timeout=60)
    assert forged.returncode == 0, forged.stderr[-2000:]
    run.wait_for(lambda: {"host/0/death/1", "host/0/deaths"} & {e["key"] for e in run.events("forged_value")},
                 timeout=30, what="the controller's watch to find the forged deaths")

    # 1. A worker on another host dies: its host's watcher reports it; the replacement goes where room freed.
    dead_worker = on_host[net.address(2)]
    os.kill(next(s["pids"][0] for s in run.events("spawn") if s["replica"] == dead_worker), signal.SIGKILL)
    run.wait_for(lambda: len(run.events("quorum")) == 4, timeout=120, what="the regrow after the worker death")

    # 2. A host dies whole: one generation change; no room until its agent is back (on a new port: Monarch will
    # not attach the lost address again), then the run regrows onto it.
    lost_whole = on_host[net.address(1)]
    _lose_host_and_bring_it_back(run, net, 1)
    run.wait_for(lambda: len(run.events("quorum")) == 6, timeout=120, what="the regrow onto host 1")

    # 3. A host's link is cut: lost, and behind the cut its procs (the replacement worker from 1., the watcher)
    # end themselves before the link is back, so they can change nothing after it.
    cut_off = max(s["replica"] for s in run.events("spawn") if s["host"] == net.address(2))
    watcher = next(e["watcher_pid"] for e in run.events("host_up") if e["address"] == net.address(2))
    stale = {*next(s["pids"] for s in run.events("spawn") if s["replica"] == cut_off), watcher}
    net.link(2, up=False)
    run.wait_for(lambda: len(run.events("host_lost")) == 2, timeout=60, what="the cut-off host declared lost")
    run.wait_for(lambda: not any(alive(pid) for pid in stale), timeout=30,
                 what=f"the cut-off procs {stale} to end (in the namespace: {net.pids(2)})")
    relinked = time.time()
    net.link(2, up=True)
    net.start_agent(2, port=netns.AGENT_PORT + 1)
    assert run.wait(timeout=240) == 0, run.output

    deaths = run.events("death")
    # Its host's watcher reports it within tens of milliseconds; Monarch's supervision sometimes comes first.
    assert deaths[0]["replica"] == dead_worker, deaths
    assert deaths[0]["detected_by"].startswith(("watcher on ", "supervision")), deaths
    lost = run.events("host_lost")
    assert [e["replicas"] for e in lost][0] == [lost_whole], lost
    # Behind the cut, Monarch's supervision may see the replica's proc agent fail before the beats run out: then the
    # replacement placed on the host's freed seat was still spawning when the host was lost, and never joined.
    first_seen = next(d for d in deaths if d["replica"] == cut_off)
    if first_seen["detected_by"].startswith("supervision"):
        [pending] = lost[1]["replicas"]
        assert next(d for d in deaths if d["replica"] == pending)["was_member"] is False, deaths
    else:
        assert lost[1]["replicas"] == [cut_off], lost
    assert [e["host"] for e in lost] == [f"tcp://{net.ip(i)}:{netns.AGENT_PORT}" for i in (1, 2)]
    quorums = run.events("quorum")
    assert [len(q["members"]) for q in quorums] == [2, 3, 2, 3, 2, 3, 2, 3], quorums
    assert all(q["interrupt"] for q in quorums[2::2]) and len(run.events("no_room")) >= 2
    assert [e["returning"] for e in run.events("host_up")] == [False, False, False, True, True]
    spawned = [(s["replica"], s["host"]) for s in run.events("spawn")][3:]
    assert [host for _, host in spawned] == [f"tcp://{net.ip(2)}:{netns.AGENT_PORT}",
                                             f"tcp://{net.ip(1)}:{netns.AGENT_PORT + 1}",
                                             f"tcp://{net.ip(2)}:{netns.AGENT_PORT + 1}"], spawned
    assert not [e for e in run.events() if e.get("source", "").startswith(f"replica{cut_off}.")
                and e["ts"] >= relinked]

    results = run.results()
    assert set(results) == set(quorums[-1]["members"]), run.output
    assert {r["checksum"] for r in results.values()} == {results[spawned[-1][0]]["checksum"]}
    assert {r["step"] for r in results.values()} == {STEPS}
    survivor = on_host[net.address(0)]  # in every generation: it trained every sample of every epoch
    for epoch, counts in enumerate(results[survivor]["seen"]):
        assert set(counts) == {1.0}, f"replica {survivor} epoch {epoch}"
    _nothing_outlives(run)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_hosts_watcher_lost_is_replaced_and_its_replicas_train_on(elastic_run, hosts, how):
    """A host's watcher is a helper: SIGKILLed (the OOM killer's pick) or SIGSTOPped, it takes none of its host's
    replicas. Its beats stop while the host's workers beat on, so the controller starts another there, which ends a
    stopped one, watches the replica's procs, and serves the next spawn there: the replica killed after it is
    replaced on the same host. The host is never lost, and nothing outlives the run."""
    net = hosts(2)
    net.start_agents()
    run = elastic_run()
    run.start("--hosts-file", str(net.hosts_file), "--store-host", net.controller_ip, "--replicas", "2",
              "--replicas-per-host", "1", "--host-timeout", "4", "--join-timeout", "120",
              script=WORKLOADS / "held_loop.py",
              script_args=("--epochs", str(EPOCHS), "--samples", str(SAMPLES), "--batch", str(BATCH),
                           "--replicas", "2", "--hold-for-regrow-from", "0", "--out", str(run.out)))
    run.wait_for(lambda: all(run.progress(r) >= 3 for r in range(2)), timeout=150, what="two replicas training")
    on_host = {s["host"]: s["replica"] for s in run.events("spawn")}
    [up] = [e for e in run.events("host_up") if e["address"] == net.address(1)]
    os.kill(up["watcher_pid"], how)
    run.wait_for(lambda: run.events("watcher_replaced"), timeout=60, what="host 1's watcher replaced")
    [replaced] = run.events("watcher_replaced")
    assert (replaced["host"], replaced["was"]) == (up["host"], up["watcher_pid"]), replaced
    run.wait_for(lambda: not alive(up["watcher_pid"]), timeout=10, what="the old watcher to end")
    assert not run.events("death") and not run.events("host_lost"), run.output

    victim = on_host[net.address(1)]
    os.kill(run.pids()[victim][0], signal.SIGKILL)
    assert run.wait(timeout=240) == 0, run.output
    assert [d["replica"] for d in run.events("death")] == [victim], run.events("death")
    assert not run.events("host_lost") and not run.events("host_watch_error"), run.output
    replacement = max(run.pids())
    assert next(s["host"] for s in run.events("spawn") if s["replica"] == replacement) == net.address(1)
    quorums = run.events("quorum")
    assert [len(q["members"]) for q in quorums] == [2, 1, 2], quorums
    results = run.results()
    assert set(results) == set(quorums[-1]["members"]) and {r["step"] for r in results.values()} == {STEPS}
    assert len({r["checksum"] for r in results.values()}) == 1
    survivor = on_host[net.address(0)]  # trained from the first step to the last: every sample once an epoch
    for epoch, counts in enumerate(results[survivor]["seen"]):
        assert set(counts) == {1.0}, f"epoch {epoch}"
    _nothing_outlives(run)


@pytest.mark.parametrize("towards", [True, False], ids=["towards-the-host", "from-the-host"])
def test_a_host_cut_off_in_one_direction_is_lost_within_the_host_timeout_and_the_run_goes_on(elastic_run, hosts,
                                                                                           towards):
    """Packets dropped one way only (the other way still delivers): its beats stop either way (a beat whose reply
    never comes is no beat), the host is declared lost within `--host-timeout`, in one generation change, and its
    procs end themselves behind the cut; the survivors train on, never waiting out the collective timeout."""
    net = hosts(3)
    net.start_agents()
    run = elastic_run()
    run.start("--hosts-file", str(net.hosts_file), "--store-host", net.controller_ip, "--replicas", "3",
              "--min-replicas", "2", "--replicas-per-host", "1", "--host-timeout", "4", "--join-timeout", "120",
              script_args=("--epochs", "14", "--samples", str(SAMPLES), "--batch", str(BATCH), "--step-sleep", "0.05",
                           "--out", str(run.out)))
    run.wait_for(lambda: all(run.progress(r) >= 3 for r in range(3)), timeout=150, what="three replicas training")
    on_host = {s["host"]: s["replica"] for s in run.events("spawn")}
    cut_off = on_host[net.address(2)]
    watcher = next(e["watcher_pid"] for e in run.events("host_up") if e["address"] == net.address(2))
    stale = {*next(s["pids"] for s in run.events("spawn") if s["replica"] == cut_off), watcher}
    cut_at = time.time()  # before the first drop: the times below are upper bounds
    net.cut(2, towards=towards)
    run.wait_for(lambda: run.events("host_lost"), timeout=30, what="the cut-off host declared lost")
    run.wait_for(lambda: not any(alive(pid) for pid in stale), timeout=30,
                 what=f"the cut-off procs {stale} to end (in the namespace: {net.pids(2)})")
    net.uncut(2, towards=towards)
    assert run.wait(timeout=200) == 0, run.output

    [lost] = run.events("host_lost")
    assert lost["host"] == net.address(2), lost
    assert lost["ts"] - cut_at < 4 + 3.0, f"declared lost {lost['ts'] - cut_at:.1f} s after the cut"
    # Its worker, ended by its lease, may be reported dead first over the way still open (by its watcher, or
    # Monarch's supervision), and a replacement sent to the slot it freed: the host's loss takes that one.
    deaths = run.events("death")
    assert deaths[0]["replica"] == cut_off and {d["host"] for d in deaths} == {net.address(2)}, deaths
    assert lost["replicas"] == [d["replica"] for d in deaths if d["detected_by"] == lost["reason"]], (deaths, lost)
    assert all(d["detected_by"] == lost["reason"] for d in deaths[1:]), deaths
    assert all(e["early_deaths"] == 0 for e in run.events("respawn_scheduled"))  # no crash loop counted
    assert not run.events("give_up") and not run.events("host_watch_error")
    quorums = run.events("quorum")
    assert [len(q["members"]) for q in quorums] == [3, 2], quorums  # no room for a replacement: one per host
    resumed = next(e["ts"] for e in run.events("first_commit") if e["gen"] == quorums[1]["gen"])
    assert resumed - cut_at < 4 + 6.0, "the survivors waited for more than the host's loss"
    results = run.results()
    assert set(results) == set(quorums[-1]["members"]) and {r["step"] for r in results.values()} == {STEPS_14}
    assert len({r["checksum"] for r in results.values()}) == 1
    for replica in results:  # both trained from the start to the end
        for epoch, counts in enumerate(results[replica]["seen"]):
            assert set(counts) == {1.0}, f"replica {replica} epoch {epoch}"
    _nothing_outlives(run)


def test_sigterm_to_a_hosts_agent_drains_all_its_replicas_in_one_generation_change_with_nothing_dropped(elastic_run,
                                                                                                       hosts):
    """SLURM preempting or draining a node signals its processes: SIGTERM to host 1's agent is passed on to the procs
    it started, both of its replicas leave at the same step boundary (its watcher tells the controller the whole host
    is going), and their replacements go to the machine that joins next, never back to the host that is going.

    The job has a token (`--token-file`): the agents' lines carry the HMAC of their addresses, and two lines the run's
    own user wrote without it (one before the run, one appended mid-run) point at a socket the test listens on: both
    are refused with a `host_refused` event, and nothing ever connects to that socket."""
    net = hosts(3, token=True)
    for i in (0, 1):
        net.start_agent(i)
    net.wait_listed(2)
    bait = socket.create_server(("127.0.0.1", 0))  # what a refused line points at: never contacted
    bait.setblocking(False)
    unsigned = f"tcp://127.0.0.1:{bait.getsockname()[1]}"
    forged = f"{unsigned} hmac={'0' * 64}"
    with open(net.hosts_file, "a") as f:
        f.write(unsigned + "\n")
    run = elastic_run()
    samples, batch, epochs = 240, 24, 16  # 160 steps, paused at step 100 until the replacements are ready (below)
    paused = run.tmp / "paused"
    run.start("--hosts-file", str(net.hosts_file), "--token-file", str(net.token_file), "--store-host",
              net.controller_ip, "--replicas", "4",
              "--min-replicas", "2", "--replicas-per-host", "2", "--host-timeout", "4", "--join-timeout", "120",
              script=WORKLOADS / "logged_loop.py",
              script_args=("--epochs", str(epochs), "--samples", str(samples), "--batch", str(batch),
                           "--step-sleep", "0.1", "--pause", f"100:{paused}", "--out", str(run.out)))
    steps_file = run.out / "steps.jsonl"
    run.wait_for(lambda: steps_file.exists() and len(steps_file.read_text().splitlines()) >= 4, timeout=150,
                 what="four committed steps")
    going = sorted(s["replica"] for s in run.events("spawn") if s["host"] == net.address(1))
    assert len(going) == 2, run.events("spawn")
    with open(net.hosts_file, "a") as f:  # mid-run, re-read within a second
        f.write(forged + "\n")
    run.wait_for(lambda: len(run.events("host_refused")) == 2, timeout=30, what="the forged line refused")
    net.agents[1].send_signal(signal.SIGTERM)
    run.wait_for(lambda: run.events("drained") and len(run.events("drained")) == 2, timeout=60,
                 what="host 1's replicas to leave")
    paused.touch()  # the members wait at step 100 until both replacements are ready: the regrow comes before the end
    net.start_agent(2)
    run.wait_for(lambda: len([e for e in run.events("ready") if e["replica"] >= 4]) == 2, timeout=180,
                 what="both replacements ready on host 2")
    paused.unlink()
    assert run.wait(timeout=240) == 0, run.output

    [host_drain] = run.events("host_drain")
    assert host_drain["host"] == net.address(1) and host_drain["replicas"] == going
    [drain] = run.events("drain")
    assert drain["replicas"] == going and len(drain["members"]) == 2
    assert not run.events("death") and not run.events("dropped_step") and not run.events("host_lost")
    quorums = run.events("quorum")
    sizes = [len(q["members"]) for q in quorums]  # the replacements join in one grow, or one each
    assert sizes[:2] == [4, 2] and sizes[-1] == 4 and not [q for q in quorums if q["interrupt"]], quorums
    assert {s["host"] for s in run.events("spawn")[4:]} == {net.address(2)}
    steps = [json.loads(line) for line in steps_file.read_text().splitlines()]
    assert [r["step"] for r in steps] == list(range(epochs * samples // batch))
    results = run.results()
    assert len(results) == 4 and len({r["checksum"] for r in results.values()}) == 1
    _nothing_outlives(run)

    refused = run.events("host_refused")
    assert [(e["address"], e["line"]) for e in refused] == [(unsigned, unsigned), (unsigned, forged)], refused
    assert "carries no HMAC" in refused[0]["reason"] and "does not verify" in refused[1]["reason"]
    assert unsigned not in {e.get("address") for e in run.events("host_up") + run.events("host_unreachable")}
    with pytest.raises(BlockingIOError):  # no connection ever came: none waits to be accepted
        bait.accept()
    bait.close()
    assert sorted(e["address"] for e in run.events("host_up")) == [net.address(i) for i in range(3)]


def _steps(run) -> list[dict]:
    path = run.out / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _start_logged(run, net, *args: str, epochs: int = 4):
    return run.start("--hosts-file", str(net.hosts_file), "--store-host", net.controller_ip, "--replicas", "2",
                     "--replicas-per-host", "1", "--host-timeout", "4", "--join-timeout", "120",
                     "--checkpoint-steps", "5", *args, script=WORKLOADS / "logged_loop.py",
                     script_args=("--epochs", str(epochs), "--samples", "240", "--batch", "24", "--step-sleep", "0.1",
                                  "--out", str(run.out)))


def _training_on_two_hosts(elastic_run, hosts, *args: str):
    """Two namespace hosts with their agents, and a run of two replicas on them (`args` added), 17 steps in."""
    net = hosts(2)
    net.start_agents()
    net.wait_listed(2)
    run = elastic_run()
    _start_logged(run, net, *args)
    run.wait_for(lambda: len(_steps(run)) >= 17, timeout=150, what="17 committed steps")
    return net, run


def _resumes_exactly(elastic_run, net, killed, before: list[dict], start: int) -> None:
    """A relaunch on the same agents with --resume auto goes on from `start` on the same batches, to the last step."""
    resumed = elastic_run()
    _start_logged(resumed, net, "--checkpoint-dir", str(killed.tmp / "ckpt"), "--resume", "auto")
    assert resumed.wait(timeout=240) == 0, resumed.output
    [resume] = resumed.events("resume")
    assert resume["path"].endswith(f"step{start:08d}"), (resume, start)
    after = _steps(resumed)
    assert [r["step"] for r in after] == list(range(start, 40))
    for old, new in zip(before[start:], after):
        assert old["batch"] == new["batch"] and new["loss"] == pytest.approx(old["loss"], rel=1e-5), (old, new)
    for epoch in range(4):  # every sample once per epoch, over both runs
        assert sorted(i for r in before[:start] + after if r["epoch"] == epoch for i in r["batch"]) == list(range(240))
    results = resumed.results()
    assert len(results) == 2 and len({r["checksum"] for r in results.values()}) == 1
    _nothing_outlives(resumed)


@pytest.mark.parametrize("machine_lost", [False, True], ids=["process-killed", "machine-lost"])
def test_a_killed_controller_whose_replicas_are_on_other_hosts_has_them_save_the_held_step_and_the_agents_stay(
        elastic_run, hosts, machine_lost):
    """`monarch-run` SIGKILLed with its two replicas on two namespace hosts: each proc's lease on the controller's
    store runs out (host timeout 4 s: 2 s), the generation's first replica writes the step it holds, every proc ends,
    and the agents stay up for the next run, which resumes that step on them. `machine-lost`: its network black-holed
    first, so nothing it sends (the resets of its dead sockets) reaches the hosts, as when its machine dies: a call to
    its store then waits for an answer that never comes, and the writer's training thread, held up in one, writes
    from another thread of its proc (`orphan._save_if_held_up`)."""
    net, killed = _training_on_two_hosts(elastic_run, hosts)
    if machine_lost:
        net.black_hole_controller()
    try:
        os.kill(killed.proc.pid, signal.SIGKILL)
        assert killed.wait(timeout=30) == -signal.SIGKILL
        t0 = time.monotonic()
        deadline = t0 + 30
        while any(alive(p) for pids in killed.pids().values() for p in pids):
            assert time.monotonic() < deadline, killed.pids()
            time.sleep(0.1)
        gone_s = time.monotonic() - t0
    finally:
        net.black_hole_controller(on=False)
    before = _steps(killed)
    writer = saved_on_controller_loss(killed.events("controller_lost"), range(2))
    assert "controller" in writer["reason"], writer
    assert len(before) <= writer["step"] <= len(before) + 1, (writer, len(before))
    # The save is the step held, a checkpoint of its own, whether or not that step is also a periodic one's.
    [saved] = [e for e in killed.events("checkpoint") if not e.get("periodic")]
    assert (saved["step"], saved["path"]) == (writer["step"], writer["checkpoint"]), saved
    assert 1.5 < gone_s < 10, gone_s  # the lease, then the save
    assert all(agent.poll() is None for agent in net.agents.values())  # stayed for the next run
    _resumes_exactly(elastic_run, net, killed, before, writer["step"])


def test_a_controller_black_holed_from_its_hosts_stops_and_its_cut_off_replicas_write_nothing_over_its_files(
        elastic_run, hosts):
    """The controller's machine black-holed (it sends nothing, so hears nothing) while its hosts still reach each other:
    a partition, not a loss. The controller loses both hosts to silence and stops, naming the newest periodic
    checkpoint. Behind the cut the replicas' leases run out first and they stop training; the one that is not the
    generation's first ends at once; the first, the writer, finds the run's files held by the live controller and
    writes nothing, or is held in a store call that gets no answer until its bound (8 s) ends it. Either way nothing
    is written while the controller holds the files, so the two sides never both write; the relaunch (the network
    back) goes on exactly from the newest checkpoint there."""
    net, cut = _training_on_two_hosts(elastic_run, hosts, "--controller-loss-save", "8")
    net.black_hole_controller()
    try:
        assert cut.wait(timeout=120) == 1, cut.output
        deadline = time.monotonic() + 8 + 5
        while any(alive(p) for pids in cut.pids().values() for p in pids):
            assert time.monotonic() < deadline, cut.pids()
            time.sleep(0.1)
    finally:
        net.black_hole_controller(on=False)
    before = _steps(cut)
    [give_up] = cut.events("give_up")
    assert len(cut.events("host_lost")) == 2 and "below --min-replicas" in cut.output, cut.output
    lost = cut.events("controller_lost")
    assert [e["skipped"] for e in lost if e["replica"] == 1] == ["another replica writes it"], lost
    written = [e for e in lost if e["checkpoint"]]
    assert all(e["ts"] > give_up["ts"] for e in written), (written, give_up)  # never while the controller held them
    assert all("held" in e["skipped"] for e in lost if e["replica"] == 0 and not e["checkpoint"]), lost
    start = written[0]["step"] if written else max(e["step"] for e in cut.events("checkpoint"))
    assert start <= len(before) + 1
    net.wait_listed(2)
    _resumes_exactly(elastic_run, net, cut, before, start)
