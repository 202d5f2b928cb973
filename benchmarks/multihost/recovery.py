"""Recovery across machines beside one machine, in one invocation: a worker SIGKILLed, and a whole host lost.

    python -m benchmarks.multihost.recovery --repeats 3      (as root: hosts are Linux network namespaces)

Scenarios, each `--repeats` times, 3 replicas of the plain loop (tests/workloads/held_loop.py, tiny model: the
numbers are the runtime's own costs, not a model's):
  local   one machine (`monarch-run --replicas 3`): one worker SIGKILLed by this script (seen by the
          controller's pidfd)
  remote  three namespace hosts with a real `monarch-plugin host` agent each, one replica per host: one remote
          worker SIGKILLed (seen by its host's watcher), then, in the same run once it regrew, a whole host
          SIGKILLed, agent and all (lost after --host-timeout), its agent started again on a new port
Reads the phases from the run's own events (monarch_plugin.tools.report): kill -> detected, kill -> next committed
step of the survivors, replacement spawn -> training. Writes <out>/multihost_recovery.json and prints a
markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness import REPO, add_out, finished, kill, median, progress, reap, spawned, wait_for, write_json
from monarch_plugin.events import EventLog, read_events
from monarch_plugin.tools.report import recoveries
from tests.support import netns  # the namespace hosts the multi-host tests make

WORKLOAD = REPO / "tests" / "workloads" / "held_loop.py"
HOST_TIMEOUT_S = 5.0


def _start(work: Path, extra: list[str], epochs: int) -> tuple[subprocess.Popen, Path, Path]:
    """No hold: the survivors train on while the replacement starts, as in production; the run is long enough
    (11 steps an epoch) to see the replacement join."""
    out = work / "out"
    out.mkdir(parents=True)
    events = work / "events.jsonl"
    cmd = [sys.executable, "-m", "monarch_plugin.tools.cli", "--events", str(events), "--replicas", "3",
           "--join-timeout", "120", *extra, str(WORKLOAD), "--epochs", str(epochs), "--samples", "256",
           "--batch", "24", "--step-sleep", "0.05", "--replicas", "3", "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=work, stdout=open(work / "run.log", "w"), stderr=subprocess.STDOUT)
    return proc, out, events


def _phases(events: list[dict]) -> list[dict]:
    return [{"detected_by": r.detected_by, **r.phases()} for r in recoveries(events)]


def run_local(work: Path) -> list[dict]:
    proc, out, events = _start(work, [], epochs=25)
    try:
        wait_for("three replicas training", lambda: all(progress(out, r) >= 5 for r in range(3)), proc, 180)
        for pid in spawned(events)[1]:
            kill(pid, events, replica=1)
        finished(proc, 300, "the local run", work)
    finally:
        reap(proc, spawned(events))
    return _phases(read_events(str(events)))


def run_remote(work: Path) -> list[dict]:
    net = netns.NetnsHosts(3, work / "hosts")
    proc = None
    try:
        net.start_agents()
        proc, out, events = _start(work, ["--hosts-file", str(net.hosts_file), "--store-host", net.controller_ip,
                                          "--replicas-per-host", "1", "--host-timeout", str(HOST_TIMEOUT_S)],
                                   epochs=60)
        wait_for("three replicas training", lambda: all(progress(out, r) >= 5 for r in range(3)), proc, 180)
        on_host = {e["host"]: e for e in read_events(str(events)) if e["event"] == "spawn"}
        worker = on_host[net.address(2)]
        for pid in worker["pids"]:
            kill(pid, events, replica=worker["replica"])
        wait_for("the regrow", lambda: sum(e["event"] == "quorum" for e in read_events(str(events))) == 3, proc, 120)
        time.sleep(1.0)
        lost = on_host[net.address(1)]["replica"]
        net.kill_host(1)
        EventLog(str(events), source="benchmark").emit("kill", replica=lost, pid=-1)
        wait_for("the host lost", lambda: any(e["event"] == "host_lost" for e in read_events(str(events))), proc, 60)
        net.start_agent(1, port=netns.AGENT_PORT + 1)
        finished(proc, 300, "the remote run", work)
        return _phases(read_events(str(events)))
    finally:
        if proc is not None:
            reap(proc)
        net.close()


def table(results: dict) -> str:
    def ms(x):
        return "n/a" if x is None else f"{x * 1000:.0f} ms"

    lines = ["| failure | seen by | kill -> detected | kill -> next committed step | replacement spawn -> training |",
             "|---|---|---|---|---|"]
    for name, rows in results.items():
        seen_by = rows[0]["detected_by"].split(" (")[0].split(" on ")[0].replace(" tcp://", " ")
        seen_by = "missing beats" if " lost" in seen_by else seen_by
        lines.append(f"| {name} (median of {len(rows)}) | {seen_by} | "
                     f"{ms(median(r.get('kill_to_detected') for r in rows))} | "
                     f"{ms(median(r.get('kill_to_next_commit') for r in rows))} | "
                     f"{ms(median(r.get('replace_to_participating') for r in rows))} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    add_out(p)
    p.add_argument("--work", default="/tmp/monarch_plugin_bench_multihost")
    args = p.parse_args()
    if netns.available():
        sys.exit(f"multihost_recovery: {netns.available()}")
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    results: dict[str, list[dict]] = {"worker SIGKILLed, one machine": [], "worker SIGKILLed on another host": [],
                                      "host lost (agent and workers SIGKILLed)": []}
    for i in range(args.repeats):
        results["worker SIGKILLed, one machine"] += run_local(work / f"local{i}")
        remote = run_remote(work / f"remote{i}")
        results["worker SIGKILLed on another host"].append(remote[0])
        results["host lost (agent and workers SIGKILLed)"].append(remote[1])
        print(json.dumps({"repeat": i, "local": results["worker SIGKILLed, one machine"][-1], "remote": remote}),
              flush=True)
    write_json(args.out, "multihost_recovery", results)
    print(table(results))


if __name__ == "__main__":
    main()
