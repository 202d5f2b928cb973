"""End to end across machines: replicas on Monarch host agents in separate network namespaces.

Each host is a Linux network namespace with its own network stack and a real `monarch-plugin host` agent in it
(`tests/netns.py`); the controller (`monarch-run --hosts-file`) runs in the root namespace, and the replicas'
gloo groups cross the bridge between them. A host is lost the way a machine dies: the test SIGKILLs every
process in its namespace. Also here: no process of a job, single-host or multi-host, listens on a wildcard address.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

import netns
from conftest import RECIPE, WORKLOADS, alive, run_factory

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))]

EPOCHS, SAMPLES, BATCH = 8, 256, 24
STEPS = EPOCHS * -(-SAMPLES // BATCH)
WILDCARDS = ("0.0.0.0", "*", "[::]", "::", "[::ffff:0.0.0.0]")


@pytest.fixture
def hosts(tmp_path):
    made: list[netns.NetnsHosts] = []

    def make(count: int) -> netns.NetnsHosts:
        made.append(netns.NetnsHosts(count, tmp_path / f"hosts{len(made)}"))
        return made[-1]

    yield make
    for net in made:
        net.close()


def listeners(pids: set[int] | None = None, ns: str | None = None) -> list[tuple[str, str]]:
    """(local address, process) of every TCP listener of `pids` (in the root namespace), or of namespace `ns`."""
    cmd = ["ss", "-ltnpH"] if ns is None else ["ip", "netns", "exec", ns, "ss", "-ltnpH"]
    found = []
    for line in subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=30).stdout.splitlines():
        fields = line.split()
        local, process = fields[3], " ".join(fields[5:])
        owners = {int(part.split("=")[1].rstrip(",)")) for part in process.split(",") if part.startswith("pid=")}
        if pids is None or owners & pids:
            found.append((local.rsplit(":", 1)[0], process))
    return found


def descendants(pid: int) -> set[int]:
    """`pid` and every process below it."""
    children: dict[int, list[int]] = {}
    for stat in subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout.splitlines():
        child, parent = map(int, stat.split())
        children.setdefault(parent, []).append(child)
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        found.add(p)
        todo += children.get(p, [])
    return found


def test_remote_death_and_lost_host_each_one_generation_change_and_the_host_back_on_a_new_port_regrows(elastic_run,
                                                                                                       hosts):
    net = hosts(3)
    for i in range(3):
        net.start_agent(i)
    net.wait_listed(3)
    run = elastic_run()
    run.start("--hosts-file", str(net.hosts_file), "--store-host", net.controller_ip, "--replicas", "3",
              "--replicas-per-host", "1", "--host-timeout", "3", "--join-timeout", "120",
              script=WORKLOADS / "multihost_loop.py",
              script_args=("--epochs", str(EPOCHS), "--samples", str(SAMPLES), "--batch", str(BATCH),
                           "--replicas", "3", "--hold-for-regrow-from", "10", "--out", str(run.out)))
    run.wait_for(lambda: all(run.progress(r) >= 3 for r in range(3)), timeout=150, what="three replicas training")
    spawns = {s["replica"]: s for s in run.events("spawn")}
    assert sorted(s["host"] for s in spawns.values()) == sorted(net.address(i) for i in range(3))  # one per host

    # Nothing listens beyond need: the controller on the bridge address only, each host on its own address.
    controller = listeners(descendants(run.proc.pid))
    assert controller and not [a for a, _ in controller if a in WILDCARDS], controller
    for ns in net.names:
        on_host = listeners(ns=ns)
        assert on_host and not [a for a, _ in on_host if a in WILDCARDS], (ns, on_host)

    # A worker on another host dies: its host's watcher reports it, and the replacement goes where room freed.
    dead_worker = next(r for r, s in spawns.items() if s["host"] == net.address(2))
    os.kill(spawns[dead_worker]["pids"][0], signal.SIGKILL)
    run.wait_for(lambda: len(run.events("quorum")) == 3, timeout=120, what="the run regrown after the worker death")

    victim = next(r for r, s in {s["replica"]: s for s in run.events("spawn")}.items()
                  if s["host"] == net.address(1))
    net.kill_host(1)
    run.wait_for(lambda: run.events("host_lost"), timeout=60, what="host 1 declared lost")
    net.start_agent(1, port=netns.AGENT_PORT + 1)  # Monarch will not attach the lost address again
    assert run.wait(timeout=240) == 0, run.output

    deaths = run.events("death")
    assert deaths[0]["replica"] == dead_worker and deaths[0]["detected_by"].startswith("watcher on "), deaths
    # One generation change for the lost host; no room for a replacement until the host came back; then it
    # regrew onto that host.
    lost = run.events("host_lost")
    assert [e["replicas"] for e in lost] == [[victim]] and lost[0]["host"] == f"tcp://{net.ip(1)}:{netns.AGENT_PORT}"
    quorums = run.events("quorum")
    assert [len(q["members"]) for q in quorums] == [3, 2, 3, 2, 3], quorums
    assert victim not in quorums[3]["members"] and quorums[3]["interrupt"] is True
    assert run.events("no_room")
    spawned = {s["replica"]: s["host"] for s in run.events("spawn")}
    assert spawned[3] == net.address(2)  # the dead worker's replacement, where its slot freed
    replacement = 4
    assert spawned[replacement] == net.address(1), spawned
    assert [e["address"] for e in run.events("host_up")][-1] == net.address(1)

    results = run.results()
    assert set(results) == set(quorums[4]["members"]), run.output
    assert {r["checksum"] for r in results.values()} == {results[replacement]["checksum"]}
    assert {r["step"] for r in results.values()} == {STEPS}
    assert results[replacement]["host"] == net.ip(1)
    for survivor in set(quorums[1]["members"]) & set(quorums[3]["members"]):
        for epoch, counts in enumerate(results[survivor]["seen"]):
            assert set(counts) == {1.0}, f"replica {survivor} epoch {epoch}"
    for pids in run.pids().values():  # no worker outlived the run, on any host
        assert not any(alive(pid) for pid in pids)


def test_a_cut_off_host_is_lost_its_procs_end_themselves_and_the_run_regrows_there_once_it_is_back(elastic_run,
                                                                                                     hosts):
    net = hosts(3)
    for i in range(3):
        net.start_agent(i)
    net.wait_listed(3)
    run = elastic_run()
    run.start("--hosts-file", str(net.hosts_file), "--store-host", net.controller_ip, "--replicas", "3",
              "--replicas-per-host", "1", "--host-timeout", "3", "--join-timeout", "120",
              script=WORKLOADS / "multihost_loop.py",
              script_args=("--epochs", str(EPOCHS), "--samples", str(SAMPLES), "--batch", str(BATCH),
                           "--replicas", "3", "--hold-for-regrow-from", "10", "--out", str(run.out)))
    run.wait_for(lambda: all(run.progress(r) >= 3 for r in range(3)), timeout=150, what="three replicas training")
    victim, workers = next((s["replica"], s["pids"]) for s in run.events("spawn") if s["host"] == net.address(1))
    watcher = next(e["watcher_pid"] for e in run.events("host_up") if e["address"] == net.address(1))
    stale = {*workers, watcher}

    net.link(1, up=False)
    run.wait_for(lambda: run.events("host_lost"), timeout=60, what="the cut-off host declared lost")
    # Fenced: behind the cut link every proc of the run ends itself (its lease), before the link is back.
    run.wait_for(lambda: not any(alive(pid) for pid in stale), timeout=30,
                 what=f"the cut-off procs {stale} to end (in the namespace: {net.pids(1)})")
    relinked = time.time()
    net.link(1, up=True)
    net.start_agent(1, port=netns.AGENT_PORT + 1)
    assert run.wait(timeout=240) == 0, run.output

    assert [e["replicas"] for e in run.events("host_lost")] == [[victim]]
    quorums = run.events("quorum")
    assert [len(q["members"]) for q in quorums] == [3, 2, 3], quorums
    assert victim not in quorums[1]["members"] + quorums[2]["members"]
    # The stale replica wrote nothing once the link was back (it could not: it had ended), and the run
    # regrew onto that host through its agent's new address.
    assert not [e for e in run.events() if e.get("source", "").startswith(f"replica{victim}.")
                and e["ts"] >= relinked]
    spawned = {s["replica"]: s["host"] for s in run.events("spawn")}
    assert spawned[max(spawned)] == net.address(1), spawned
    results = run.results()
    assert set(results) == set(quorums[2]["members"]), run.output
    assert {r["checksum"] for r in results.values()} == {results[max(spawned)]["checksum"]}
    assert {r["step"] for r in results.values()} == {STEPS}
    for survivor in quorums[1]["members"]:
        for epoch, counts in enumerate(results[survivor]["seen"]):
            assert set(counts) == {1.0}, f"replica {survivor} epoch {epoch}"


@pytest.fixture
def lightning_run(tmp_path):
    pytest.importorskip("lightning")
    from test_lightning import LightningRun

    yield from run_factory(tmp_path, LightningRun)


def test_lightning_fit_on_two_hosts_survives_losing_one_and_regrows_onto_it(lightning_run, hosts):
    from test_lightning import _every_sample_once_per_epoch

    net = hosts(2)
    for i in range(2):
        net.start_agent(i)
    net.wait_listed(2)
    epochs, samples, batch = 6, 96, 8  # Trainer(devices=1, num_nodes=2): a global batch of 16, 6 steps an epoch
    run = lightning_run().start("--devices", "1", "--num-nodes", "2", "--hosts-file", str(net.hosts_file),
                                "--store-host", net.controller_ip, "--epochs", str(epochs), "--samples", str(samples),
                                "--batch", str(batch), "--step-sleep", "0.1", "--hold-for-regrow-from", "12")
    run.wait_for(lambda: run.progress(0) >= 3 and run.progress(1) >= 3, timeout=150, what="both replicas training")
    victim = next(s["replica"] for s in run.events("spawn") if s["host"] == net.address(1))
    net.kill_host(1)
    run.wait_for(lambda: run.events("host_lost"), timeout=60, what="host 1 declared lost")
    net.start_agent(1, port=netns.AGENT_PORT + 1)
    assert run.wait(timeout=240) == 0, run.output

    result = run.result()
    assert result["state"] == "finished" and result["global_step"] == epochs * samples // (2 * batch)
    assert len(result["replica_checksums"]) == 2 and set(result["replica_checksums"].values()) == {result["checksum"]}
    assert str(victim) not in result["replica_checksums"]
    _every_sample_once_per_epoch(result)
    assert [len(q["members"]) for q in run.events("quorum")] == [2, 1, 2]
    assert [e["replicas"] for e in run.events("host_lost")] == [[victim]]
    spawned = {s["replica"]: s["host"] for s in run.events("spawn")}
    assert spawned[max(spawned)] == net.address(1), spawned


def test_a_single_host_job_listens_on_loopback_only(elastic_run):
    run = elastic_run()
    run.start("--replicas", "2", "--join-timeout", "120", script=RECIPE,
              script_args=("--epochs", "20", "--samples", "64", "--batch", "16", "--step-sleep", "0.05",
                           "--out", str(run.out)))
    run.wait_for(lambda: all(run.progress(r) >= 2 for r in range(2)), timeout=120, what="two replicas training")
    time.sleep(0.5)
    found = listeners(descendants(run.proc.pid))
    assert found, "the job's store should be listening"
    assert {address for address, _ in found} <= {"127.0.0.1", "[::1]"}, found
    assert run.wait(timeout=120) == 0, run.output
