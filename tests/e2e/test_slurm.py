"""Under a real SLURM: `monarch-run` in a batch script, on a cluster of slurmd nodes in network namespaces.

The cluster is Debian's slurmctld and one slurmd per node, each node a network namespace with its own hostname
(`tests/slurm.py`); the batch script runs on the allocation's first node, as on a real cluster, and `monarch-run`
started in it finds the allocation itself: SLURM starts a host agent on every node as a step of its own. A node
fails the way a machine does: every process in its namespace is SIGKILLed, its slurmd among them, and SLURM marks
it DOWN.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

import slurm
from conftest import WORKLOADS, alive

pytestmark = [pytest.mark.timeout(300), pytest.mark.skipif(slurm.available() is not None,
                                                             reason=str(slurm.available()))]

EPOCHS, SAMPLES, BATCH = 8, 256, 24
STEPS = EPOCHS * -(-SAMPLES // BATCH)
BIN = Path(sys.executable).parent
"""Where `monarch-run` and `monarch-plugin` are installed: the batch scripts call them as a user's would."""


@pytest.fixture
def cluster(tmp_path):
    made = slurm.SlurmCluster(4, tmp_path / "cluster")
    yield made
    made.close()


def test_a_batch_script_runs_on_the_allocation_survives_a_node_failure_and_regrows_from_a_one_node_job(cluster,
                                                                                                     tmp_path):
    """`#SBATCH --nodes=3 --no-kill` and one `monarch-run` line: an agent on each node, one replica each; node n2 dies
    (its slurmd with it: SLURM marks it DOWN and, under `--no-kill`, keeps the job without it); the run shrinks to
    two, and regrows onto n3 when a one-node job starts an agent there with the run's hosts file and token; it
    trains to the end with identical replicas and every sample once, and the job completes."""
    run = tmp_path / "run"
    out = run / "out"
    out.mkdir(parents=True)
    events = run / "monarch_events.jsonl"
    script = run / "train.sbatch"
    script.write_text(f"""#!/bin/bash
#SBATCH --nodes=3 --no-kill
exec {BIN / 'monarch-run'} --replicas 3 --min-replicas 2 --replicas-per-host 1 --host-timeout 4 \\
    --join-timeout 120 --events {events} {WORKLOADS / 'held_loop.py'} --epochs {EPOCHS} --samples {SAMPLES} \\
    --batch {BATCH} --replicas 3 --hold-for-regrow-from 10 --out {out}
""")
    job = cluster.sbatch(script, f"--output={run}/slurm-%j.out", f"--chdir={run}")
    log = run / f"slurm-{job}.out"

    def read(kind: str) -> list[dict]:
        if not events.exists():
            return []
        return [e for e in map(json.loads, events.read_text().splitlines()) if e["event"] == kind]

    def wait_for(predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            state = cluster.job(job).get("JobState")
            assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"job {state} before {what}: {log.read_text()}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {log.read_text()[-3000:]}"
            time.sleep(0.3)

    def progress(replica: int) -> int:
        try:
            return int((out / f"progress-{replica}").read_text() or -1)
        except (FileNotFoundError, ValueError):
            return -1

    wait_for(lambda: len(read("spawn")) == 3 and all(progress(r) >= 3 for r in range(3)), 150,
             "three replicas training")
    node = {f"tcp://{cluster.net.ip(i)}:26600": name for i, name in enumerate(cluster.nodes)}
    on = {node[s["host"]]: s["replica"] for s in read("spawn")}
    assert sorted(on) == ["n0", "n1", "n2"], on  # one replica per node of the allocation
    run_dir = run / f"monarch-slurm-{job}"
    assert oct(run_dir.stat().st_mode & 0o777) == "0o700" and oct((run_dir / "token").stat().st_mode & 0o777) == "0o600"

    # n2's machine dies: SLURM sees its slurmd silent, marks it DOWN and takes it out of the job, which under
    # --no-kill goes on.
    cluster.kill_node(2)
    wait_for(lambda: len(read("host_lost")) == 1, 60, "n2 declared lost")
    wait_for(lambda: cluster.states().get("n2", "").startswith("down"), 60, "SLURM to mark n2 DOWN")
    fields = cluster.job(job)
    assert fields["JobState"] == "RUNNING", fields
    assert cluster.run("scontrol", "show", "hostnames", fields["NodeList"]).stdout.split() == ["n0", "n1"], fields

    # A replacement node: a one-node job starts an agent on it with the run's hosts file and token.
    joiner = run / "join.sbatch"
    joiner.write_text(f"""#!/bin/bash
exec {BIN / 'monarch-plugin'} host --hosts-file {run_dir / 'hosts'} --token-file {run_dir / 'token'}
""")
    agent_job = cluster.sbatch(joiner, "--nodes=1", "--nodelist=n3", f"--output={run}/join-%j.out")
    try:
        wait_for(lambda: len(read("quorum")) >= 3 and len(read("quorum")[-1]["members"]) == 3, 120,
                 "the regrow onto n3")
        assert cluster.wait_job(job, 180)["JobState"] == "COMPLETED", log.read_text()[-3000:]
    finally:
        cluster.run("scancel", str(agent_job))
    assert cluster.job(job)["ExitCode"] == "0:0", log.read_text()[-3000:]

    lost = read("host_lost")
    assert [node[e["host"]] for e in lost] == ["n2"], lost
    assert [len(q["members"]) for q in read("quorum")] == [3, 2, 3], read("quorum")
    spawned = read("spawn")
    assert spawned[-1]["host"] == f"tcp://{cluster.net.ip(3)}:26600", spawned
    results = {json.loads(p.read_text())["replica"]: json.loads(p.read_text()) for p in out.glob("result-*.json")}
    assert set(results) == set(read("quorum")[-1]["members"]), log.read_text()[-3000:]
    assert len({r["checksum"] for r in results.values()}) == 1 and {r["step"] for r in results.values()} == {STEPS}
    for epoch, counts in enumerate(results[on["n0"]]["seen"]):
        assert set(counts) == {1.0}, f"epoch {epoch}"
    # Nothing outlives the job: its workers, the agents' steps, the joiner's agent.
    pids = [pid for s in spawned for pid in s["pids"]] + [e["watcher_pid"] for e in read("host_up")]
    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids) or any(cluster.net.pids(i) != [cluster.slurmd[i].pid] for i in (0, 1, 3)):
        assert time.monotonic() < deadline, ([p for p in pids if alive(p)],
                                             {i: cluster.net.pids(i) for i in (0, 1, 3)})
        time.sleep(0.2)
