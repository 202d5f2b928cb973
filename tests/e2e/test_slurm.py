"""Under a real SLURM: `monarch-run` (and a Lightning script) in a batch script, on a cluster of slurmd nodes in
network namespaces.

The cluster is Debian's slurmctld and one slurmd per node, each node a network namespace with its own hostname
(`tests/support/slurm.py`); the batch script runs on the allocation's first node, as on a real cluster, and the run
started in it finds the allocation itself: SLURM starts a host agent on every node as a step of its own. A node fails
the way a machine does: every process in its namespace is SIGKILLed, its slurmd among them, and SLURM marks it DOWN.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from support import slurm
from support.procs import alive, parent
from support.runs import WORKLOADS, saved_on_controller_loss

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


class Job:
    """A batch job of the test's, in its own directory (`out/` for the run's outputs), and the run it starts."""

    def __init__(self, cluster: slurm.SlurmCluster, where: Path, script: str, *sbatch: str):
        self.cluster, self.dir, self.out = cluster, where, where / "out"
        self.out.mkdir(parents=True)
        (where / "job.sbatch").write_text(script)
        self.log = where / "slurm.out"
        self.id = cluster.sbatch(where / "job.sbatch", f"--output={self.log}", f"--chdir={where}", *sbatch)
        self.run_dir = where / f"monarch-slurm-{self.id}"
        """The run's token, hosts file and agents' outputs (`procs.slurm`)."""

    def events(self, kind: str, name: str = "monarch_events.jsonl") -> list[dict]:
        path = self.dir / name
        if not path.exists():
            return []
        return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == kind]

    def output(self) -> str:
        return self.log.read_text()[-3000:] if self.log.exists() else ""

    def wait_for(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {self.cluster.job(self.id)} " \
                                                f"{self.output()}"
            time.sleep(0.3)

    def progress(self, replica: int) -> int:
        try:
            return int((self.out / f"progress-{replica}").read_text() or -1)
        except (FileNotFoundError, ValueError):
            return -1

    def completed(self, timeout: float) -> None:
        fields = self.cluster.wait_job(self.id, timeout)
        assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", (fields, self.output())

    def nothing_outlives(self, nodes: list[int]) -> None:
        """No worker or watcher of the run is left, and nothing but slurmd on the nodes'."""
        pids = [pid for s in self.events("spawn") for pid in s["pids"]] + [
            e["watcher_pid"] for e in self.events("host_up")]
        deadline = time.monotonic() + 30
        net, slurmd = self.cluster.net, self.cluster.slurmd
        while any(alive(p) for p in pids) or any(net.pids(i) != [slurmd[i].pid] for i in nodes):
            assert time.monotonic() < deadline, ([p for p in pids if alive(p)], {i: net.pids(i) for i in nodes})
            time.sleep(0.2)


def _lose_node(cluster: slurm.SlurmCluster, job: Job, i: int, meanwhile: Callable[[], Any] = lambda: None) -> Any:
    """Node i's machine dies mid-run: the run loses the host; SLURM sees its slurmd silent, marks it DOWN and takes it
    out of the job, which under `--no-kill` goes on. `meanwhile` (a replacement node's job, say) runs once the run
    has lost the host, while SLURM is still finding out; what it returns is returned."""
    cluster.kill_node(i)
    job.wait_for(lambda: len(job.events("host_lost")) == 1, 60, f"n{i} declared lost")
    made = meanwhile()
    job.wait_for(lambda: cluster.states().get(f"n{i}", "").startswith("down"), 60, f"SLURM to mark n{i} DOWN")
    fields = cluster.job(job.id)
    assert fields["JobState"] == "RUNNING", fields
    left = cluster.run("scontrol", "show", "hostnames", fields["NodeList"]).stdout.split()
    assert f"n{i}" not in left and left, fields
    return made


def _agent_job(cluster: slurm.SlurmCluster, where: Path, run: Job, node: str, setup: str = "") -> Job:
    """A one-node job on `node` that starts an agent with `run`'s hosts file and token, after `setup` (the run's
    environment: the agent's replicas run in this job's)."""
    return Job(cluster, where, f"""#!/bin/bash
{setup}
exec {BIN / 'monarch-plugin'} host --hosts-file {run.run_dir / 'hosts'} --token-file {run.run_dir / 'token'}
""", "--nodes=1", f"--nodelist={node}")


def test_a_batch_script_runs_on_the_allocation_survives_a_node_failure_and_regrows_from_a_one_node_job(cluster,
                                                                                                     tmp_path):
    """`#SBATCH --nodes=3 --no-kill` and one `monarch-run` line: an agent on each node, one replica each; node n2 dies
    (its slurmd with it: SLURM marks it DOWN and, under `--no-kill`, keeps the job without it); the run shrinks to
    two, and regrows onto n3 when a one-node job starts an agent there with the run's hosts file and token; it
    trains to the end with identical replicas and every sample once, and the job completes."""
    job = Job(cluster, tmp_path / "run", f"""#!/bin/bash
#SBATCH --nodes=3 --no-kill
exec {BIN / 'monarch-run'} --replicas 3 --min-replicas 2 --replicas-per-host 1 --host-timeout 4 --join-timeout 120 \\
    {WORKLOADS / 'held_loop.py'} --epochs {EPOCHS} --samples {SAMPLES} --batch {BATCH} --replicas 3 \\
    --hold-for-regrow-from 10 --out out
""")
    job.wait_for(lambda: len(job.events("spawn")) == 3 and all(job.progress(r) >= 3 for r in range(3)), 150,
                 "three replicas training")
    node = {f"tcp://{cluster.net.ip(i)}:26600": name for i, name in enumerate(cluster.nodes)}
    on = {node[s["host"]]: s["replica"] for s in job.events("spawn")}
    assert sorted(on) == ["n0", "n1", "n2"], on  # one replica per node of the allocation
    assert oct(job.run_dir.stat().st_mode & 0o777) == "0o700"
    assert oct((job.run_dir / "token").stat().st_mode & 0o777) == "0o600"

    # A replacement node: a one-node job starts an agent on it with the run's hosts file and token.
    joiner = _lose_node(cluster, job, 2, meanwhile=lambda: _agent_job(cluster, tmp_path / "join", job, "n3"))
    try:
        job.wait_for(lambda: len(job.events("quorum")) >= 3 and len(job.events("quorum")[-1]["members"]) == 3, 120,
                     "the regrow onto n3")
        job.completed(180)
    finally:
        cluster.run("scancel", str(joiner.id))

    assert [node[e["host"]] for e in job.events("host_lost")] == ["n2"]
    assert [len(q["members"]) for q in job.events("quorum")] == [3, 2, 3], job.events("quorum")
    assert job.events("spawn")[-1]["host"] == f"tcp://{cluster.net.ip(3)}:26600", job.events("spawn")
    results = {r["replica"]: r for r in (json.loads(p.read_text()) for p in job.out.glob("result-*.json"))}
    assert set(results) == set(job.events("quorum")[-1]["members"]), job.output()
    assert len({r["checksum"] for r in results.values()}) == 1 and {r["step"] for r in results.values()} == {STEPS}
    for epoch, counts in enumerate(results[on["n0"]]["seen"]):
        assert set(counts) == {1.0}, f"epoch {epoch}"
    job.nothing_outlives([0, 1, 3])


def test_lightning_fit_in_a_batch_script_of_two_nodes_survives_losing_one(cluster, tmp_path):
    """`Trainer(devices=1, num_nodes=2, strategy=MonarchStrategy())` run as a SLURM batch script of two nodes: one
    replica on each; n1 dies, the run trains on, its replacement starts on n0 (CPU hosts hold as many replicas as
    the run has), and fit ends with the exact global step, identical replicas and every sample once per epoch."""
    from test_lightning import WORKLOAD, _every_sample_once_per_epoch

    epochs, samples, batch = 6, 96, 8  # a global batch of 16: 6 steps an epoch
    job = Job(cluster, tmp_path / "run", f"""#!/bin/bash
#SBATCH --nodes=2 --no-kill
exec {sys.executable} {WORKLOAD} --devices 1 --num-nodes 2 --epochs {epochs} --samples {samples} --batch {batch} \\
    --step-sleep 0.1 --hold-for-regrow-from 12 --events monarch_events.jsonl --out out
""")
    job.wait_for(lambda: job.progress(0) >= 3 and job.progress(1) >= 3, 150, "both replicas training")
    on = {s["host"]: s["replica"] for s in job.events("spawn")}
    victim = on[f"tcp://{cluster.net.ip(1)}:26600"]
    _lose_node(cluster, job, 1)
    job.completed(180)

    result = json.loads((job.out / "result.json").read_text())
    assert result["state"] == "finished" and result["global_step"] == epochs * samples // (2 * batch)
    assert len(result["replica_checksums"]) == 2 and set(result["replica_checksums"].values()) == {result["checksum"]}
    assert str(victim) not in result["replica_checksums"]
    _every_sample_once_per_epoch(result)
    assert [len(q["members"]) for q in job.events("quorum")] == [2, 1, 2], job.events("quorum")
    assert "srun" not in job.output()  # Lightning's own SLURM detection stayed out of the controller
    job.nothing_outlives([0])


def test_a_node_preempted_drains_and_sigusr1_before_the_time_limit_requeues_the_job_with_no_step_lost(cluster,
                                                                                                   tmp_path):
    """`#SBATCH --signal=B:USR1@N --requeue`, and `exec monarch-run --resume auto`. First SIGTERM to one node's agent
    step (SLURM preempting that node) drains its replica at a step boundary. Then SLURM's notice before the time limit
    (sent here as SLURM sends it, to the batch shell: `scancel --signal=USR1 --batch`) stops the run with a
    checkpoint of its last committed step and requeues the job; its next start (SLURM_RESTART_COUNT=1) resumes from
    that checkpoint and trains to the end: every step once across the two starts, identical replicas."""
    job = Job(cluster, tmp_path / "run", f"""#!/bin/bash
#SBATCH --nodes=2 --no-kill --requeue --signal=B:USR1@60 --open-mode=append
exec {BIN / 'monarch-run'} --replicas 2 --checkpoint-dir ckpt --resume auto \\
    --events events-${{SLURM_RESTART_COUNT:-0}}.jsonl {WORKLOADS / 'logged_loop.py'} --samples 240 --batch 24 \\
    --epochs 10 --step-sleep $( ((SLURM_RESTART_COUNT)) && echo 0.02 || echo 0.15) --out out
""")  # 100 steps of 0.15 s or more: time for the drain, the replacement and SIGUSR1 before the end; the requeued
    # start waits for nothing

    def steps() -> list[dict]:
        path = job.out / "steps.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    job.wait_for(lambda: len(steps()) >= 5, 120, "step 5")
    # SLURM preempting one node signals its step: n1's agent passes SIGTERM on, and its replica drains at a step
    # boundary; the replacement starts on n0.
    listed = cluster.run("squeue", "-h", "-s", "-j", str(job.id), "-o", "%i %j").stdout.split("\n")
    step = next(line.split()[0] for line in listed if line.endswith(" monarch-agent-n1"))
    # (SLURM 22.05's scancel signals the step, which it then cancels, and exits 225 "Invalid job id specified".)
    cluster.run("scancel", "--signal=TERM", step)
    job.wait_for(lambda: len(job.events("quorum", "events-0.jsonl")) >= 3, 120, "n1's replica drained and replaced")
    assert cluster.run("scancel", "--signal=USR1", "--batch", str(job.id)).returncode == 0
    job.wait_for(lambda: cluster.job(job.id).get("Restarts") == "1", 60, "the job requeued")
    # SLURM holds a requeued job for two minutes before it may start again; an admin's `StartTime=now` lifts it. Not
    # at once: the requeue revokes the job's credential on its nodes to the second, and a start credentialed within
    # that second is refused ("Job credential revoked": the job FAILs with exit code 1, seen once in CI).
    time.sleep(2)
    cluster.run("scontrol", "update", f"JobId={job.id}", "StartTime=now")
    job.wait_for(lambda: (job.dir / "events-1.jsonl").exists(), 60, "the requeued job to start")
    job.completed(180)

    [drain] = job.events("host_drain", "events-0.jsonl")
    assert drain["host"] == f"tcp://{cluster.net.ip(1)}:26600" and drain["signal"] == "SIGTERM", drain
    assert not job.events("death", "events-0.jsonl")  # drained, not lost: no step dropped
    [give_up] = job.events("give_up", "events-0.jsonl")
    [requeued] = job.events("requeue", "events-0.jsonl")
    assert give_up["checkpoint"] and requeued["checkpoint"] == give_up["checkpoint"] and "SIGUSR1" in give_up["reason"]
    [resumed] = job.events("resume", "events-1.jsonl")
    assert resumed["path"] == give_up["checkpoint"], resumed
    # Every step once across the two starts: the stop dropped only the step in flight, which the requeued job trained.
    assert [r["step"] for r in steps()] == list(range(100)), [r["step"] for r in steps()]
    results = {r["replica"]: r for r in (json.loads(p.read_text()) for p in job.out.glob("result-*.json"))}
    assert len(results) == 2 and len({r["checksum"] for r in results.values()}) == 1
    assert "requeueing SLURM job" in job.output()


def test_hf_trainer_under_monarch_run_in_a_batch_script_survives_losing_a_node(cluster, tmp_path):
    """HF `Trainer.train()` under `monarch-run`, the batch script of two nodes: n1 dies mid-epoch, the replacement
    starts on n0 and is admitted while the survivor holds step 8; both end at the exact step with the same weights,
    every sample of every epoch in exactly one committed step."""
    pytest.importorskip("transformers")
    from test_hf import WORKLOAD as HF

    epochs, samples = 3, 96  # 2 replicas x 4 samples a global micro-batch, 2 micro-batches a step: 6 steps an epoch
    steps = epochs * samples // (4 * 2 * 2)
    job = Job(cluster, tmp_path / "run", f"""#!/bin/bash
#SBATCH --nodes=2 --no-kill
exec {BIN / 'monarch-run'} --replicas 2 --join-timeout 120 {HF} --out out --replicas 2 --count --max-grad-norm 0 \\
    --batch 4 --accumulate 2 --samples {samples} --epochs {epochs} --step-sleep 0.1 --pause-at 8
""")
    job.wait_for(lambda: job.progress(0) >= 2 and job.progress(1) >= 2, 150, "both replicas training")
    on = {s["host"]: s["replica"] for s in job.events("spawn")}
    victim, survivor = on[f"tcp://{cluster.net.ip(1)}:26600"], on[f"tcp://{cluster.net.ip(0)}:26600"]
    _lose_node(cluster, job, 1)
    job.wait_for(lambda: len(job.events("quorum")) >= 3 and len(job.events("quorum")[-1]["members"]) == 2, 150,
                 "the replacement admitted")
    (job.out / "release").touch()
    job.completed(150)

    newcomer = next(m for m in job.events("quorum")[-1]["members"] if m != survivor)
    results = {p.stem.removeprefix("result-"): json.loads(p.read_text()) for p in job.out.glob("result-*.json")}
    assert set(results) == {str(survivor), str(newcomer)} and str(victim) not in results, job.output()
    assert len({r["checksum"] for r in results.values()}) == 1
    assert {(r["global_step"], r["train_output_step"]) for r in results.values()} == {(steps, steps)}
    for r in results.values():  # every sample of every epoch in exactly one committed step
        counts = torch.tensor(r["counts"])
        torch.testing.assert_close(counts, torch.ones_like(counts), atol=1e-4, rtol=0)
    job.nothing_outlives([0])


def test_torchtitan_in_a_batch_script_survives_losing_a_node_and_heals_its_replacement_across_nodes(cluster,
                                                                                                 tmp_path):
    """`python -m torchtitan.train --monarch.enable ...` as the batch script of two nodes, each replica two FSDP procs
    on one node: n1 dies, the survivor trains on alone, and the replacement, on n2 from a one-node job's agent, is
    healed shard by shard from the survivor's two procs across the nodes; every step of the loss curve once,
    identical shards."""
    pytest.importorskip("torchtitan")
    from test_torchtitan import COMMON, GLOBAL_BATCH, SEQ_LEN, STEPS, _final_records

    job = Job(cluster, tmp_path / "run", f"""#!/bin/bash
#SBATCH --nodes=2 --no-kill
export PYTHONPATH={WORKLOADS}:$PYTHONPATH HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
exec {sys.executable} -m torchtitan.train --module torchtitan_probe --config llama3_probe --dump_folder out \\
    --monarch.events_path monarch_events.jsonl {' '.join(COMMON)} --monarch.replicas_per_host 1 \\
    --monarch.host_timeout_s 4 --probe.shrunk_steps 2
""")

    def progress(replica: int) -> int:
        path = job.out / "probe" / f"steps-{replica}-0.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    job.wait_for(lambda: progress(0) >= 2 and progress(1) >= 2, 200, "both replicas training")
    on = {s["host"]: s["replica"] for s in job.events("spawn")}
    victim, survivor = on[f"tcp://{cluster.net.ip(1)}:26600"], on[f"tcp://{cluster.net.ip(0)}:26600"]
    # The replacement node's job sets up the run's environment, as the batch script did: its replicas import the
    # probe from there.
    joiner = _lose_node(cluster, job, 1, meanwhile=lambda: _agent_job(
        cluster, tmp_path / "join", job, "n2",
        f"export PYTHONPATH={WORKLOADS}:$PYTHONPATH HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1"))
    try:
        job.completed(240)
    finally:
        cluster.run("scancel", str(joiner.id))

    quorums = job.events("quorum")
    newcomer = next(m for m in quorums[-1]["members"] if m != survivor)
    assert len(quorums) == 3 and victim != newcomer
    assert job.events("spawn")[-1]["host"] == f"tcp://{cluster.net.ip(2)}:26600"
    # Healed across nodes, shard by shard, from the survivor's two procs.
    assert {h["source"] for h in job.events("heal") if newcomer in h["recipients"]} == {f"replica{survivor}.{k}"
                                                                                         for k in (0, 1)}
    outcome = {tuple(map(int, p.stem.split("-")[1:])): json.loads(p.read_text())
               for p in (job.out / "probe").glob("result-*.json")}
    assert set(outcome) == {(survivor, 0), (survivor, 1), (newcomer, 0), (newcomer, 1)}, job.output()
    assert {o["step"] for o in outcome.values()} == {STEPS}
    for local in (0, 1):
        assert outcome[survivor, local]["checksum"] == outcome[newcomer, local]["checksum"]
    assert {o["ntokens_seen"] for o in outcome.values()} == {STEPS * GLOBAL_BATCH * SEQ_LEN}
    steps = {tuple(map(int, p.stem.split("-")[1:])): [json.loads(line) for line in p.read_text().splitlines() if line]
             for p in (job.out / "probe").glob("steps-*.jsonl")}
    pids = {s["replica"]: s["pids"] for s in job.events("spawn")}
    final = _final_records(steps)
    assert sorted(final) == list(range(1, STEPS + 1))
    for step, records in final.items():  # the survivor's records witness what each step trained
        mine = [i for r in records if r["pid"] in pids[survivor] for i in r["samples"]]
        batch = set(range((step - 1) * GLOBAL_BATCH, step * GLOBAL_BATCH))
        assert len(set(mine)) == len(mine) == GLOBAL_BATCH // records[0]["replicas"], (step, records)
        assert set(mine) <= batch, (step, records)
    job.nothing_outlives([0, 2])


def test_doctor_in_a_batch_script_checks_every_node_of_the_allocation_and_leaves_nothing_behind(cluster, tmp_path):
    """`monarch-plugin doctor` alone in a batch script of two nodes: an agent on each node as a run starts them, one
    row per node, no errors, and the agents' steps and files gone when it returns."""
    job = Job(cluster, tmp_path / "doctor", f"""#!/bin/bash
#SBATCH --nodes=2
exec {BIN / 'monarch-plugin'} doctor --timeout 60
""")
    job.completed(120)
    out = job.log.read_text()
    rows = [line.split() for line in out.splitlines() if line.startswith("tcp://")]
    assert sorted(r[0] for r in rows) == [f"tcp://{cluster.net.ip(i)}:26600" for i in (0, 1)], out
    assert {r[1] for r in rows} == {"ok"} and "2 host(s) checked" in out and "no errors" in out, out
    assert not list(job.dir.glob("monarch-doctor-*"))
    job.nothing_outlives([0, 1])


def _commands(cluster: slurm.SlurmCluster, i: int) -> dict[int, str]:
    """Every process in node i's namespace, with its command line."""
    found = {}
    for pid in cluster.net.pids(i):
        try:
            found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            pass  # it ended meanwhile
    return found


def test_a_sigkilled_monarch_run_leaves_no_agent_step_behind_once_its_replicas_saved_and_the_relaunch_resumes(
        cluster, tmp_path):
    """`monarch-run ... || monarch-run --resume auto ...` in a batch script of two nodes, and the first `monarch-run`
    SIGKILLed mid-training from outside (its node's OOM killer, say): it tells its agent steps nothing. Its replicas
    notice by their leases and the generation's first writes the last committed step; each node's agent, started for
    that run only, sees its store refuse connections, waits for its procs to end and exits, so both steps end within
    the bound (`lease.outlive_bound_s`) and nothing of the run is left on either node. The relaunch, started by the
    script at once, waits for those steps before taking the run's files (or the save would be refused), then attaches
    to both nodes and trains to the exact step count from the saved step: no committed step lost."""
    from monarch_plugin.procs.lease import outlive_bound_s
    from monarch_plugin.storage.checkpoint import step_path

    samples, batch, epochs, timeout, save = 240, 24, 10, 4, 20
    total = epochs * samples // batch  # 100 steps
    run = (f"{BIN / 'monarch-run'} --replicas 2 --replicas-per-host 1 --host-timeout {timeout} "
           f"--controller-loss-save {save} --checkpoint-dir ckpt --checkpoint-steps 50 --join-timeout 120")
    loop = f"{WORKLOADS / 'logged_loop.py'} --samples {samples} --batch {batch} --epochs {epochs}"
    job = Job(cluster, tmp_path / "run", f"""#!/bin/bash
#SBATCH --nodes=2 --no-kill
mkdir -p out1 out2
{run} --events events-1.jsonl {loop} --step-sleep 0.15 --out out1 || \\
    exec {run} --resume auto --events events-2.jsonl {loop} --step-sleep 0.02 --out out2
""")

    def steps(out: str) -> list[dict]:
        path = job.dir / out / "steps.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    job.wait_for(lambda: len(steps("out1")) >= 15, 200, "15 committed steps")
    agent_steps = [line.split()[0] for line in cluster.run("squeue", "-h", "-s", "-j", str(job.id), "-o",
                                                           "%i %j").stdout.splitlines() if " monarch-agent-" in line]
    assert len(agent_steps) == 2, agent_steps
    on = [_commands(cluster, i) for i in (0, 1)]
    [controller] = [p for p, cmd in on[0].items() if "monarch-run" in cmd and "events-1.jsonl" in cmd]
    sruns = [p for p, cmd in on[0].items() if cmd.startswith("srun ") and "--job-name=monarch-agent-" in cmd]
    agents = [p for node in on for p, cmd in node.items() if " -m monarch_plugin host " in cmd and p not in sruns]
    stepds = [p for node in on for p, cmd in node.items() if cmd.startswith("slurmstepd:")
              and any(f"[{s}]" in cmd for s in agent_steps)]
    assert len(agents) == 2 and len(sruns) >= 2 and len(stepds) == 2, "\n".join(
        f"{p} (parent {parent(p)}): {cmd}" for node in on for p, cmd in node.items())
    assert all("--run-store tcp://" in on[i][p] for i in (0, 1) for p in agents if p in on[i])
    workers = [pid for s in job.events("spawn", "events-1.jsonl") for pid in s["pids"]] + [
        e["watcher_pid"] for e in job.events("host_up", "events-1.jsonl")]
    assert len(workers) == 4 and all(alive(p) for p in workers), workers

    os.kill(controller, signal.SIGKILL)
    t0 = time.monotonic()
    bound = outlive_bound_s(timeout, save)
    left = [*agents, *sruns, *stepds, *workers]
    saved_s = gone_s = None
    while gone_s is None:
        now = time.monotonic() - t0
        if saved_s is None and [e for e in job.events("controller_lost", "events-1.jsonl") if e["checkpoint"]]:
            saved_s = now
        if not any(alive(p) for p in left):
            gone_s = now
        assert now < bound + 15, ({p: alive(p) for p in left}, job.output())
        time.sleep(0.1)
    print(f"\nSIGKILL -> checkpoint written: {saved_s:.1f} s; -> agents, steps and replicas gone: {gone_s:.1f} s "
          f"(bound {bound:g} s)")
    assert saved_s is not None and gone_s <= bound + 3, (saved_s, gone_s, bound)  # + the step's teardown

    # The generation's first replica wrote the step it held; every other proc says why it wrote none.
    writer = saved_on_controller_loss(job.events("controller_lost", "events-1.jsonl"), range(2))
    before = steps("out1")
    start = writer["step"]
    assert writer["checkpoint"] == step_path(str(job.dir / "ckpt"), start), writer
    assert len(before) <= start <= len(before) + 1, (start, len(before))  # at most the step in flight uncounted
    assert start < 50, "the save is the step held, not a periodic checkpoint's"

    job.completed(240)
    # The relaunch, started as the first `monarch-run` died, waited for the steps it left (unless they were gone
    # before it looked).
    out = job.log.read_text()
    waited = "host agent step(s) of an earlier run" in out
    assert not waited or "the earlier run's agent steps ended after" in out, out
    print(f"the relaunch {'waited for' if waited else 'found no'} agent steps of the killed run")
    [resume] = job.events("resume", "events-2.jsonl")
    assert resume["path"] == writer["checkpoint"], resume
    address = {f"tcp://{cluster.net.ip(i)}:26600" for i in (0, 1)}
    assert {e["address"] for e in job.events("host_up", "events-2.jsonl")} == address
    assert {s["host"] for s in job.events("spawn", "events-2.jsonl")} == address
    after = steps("out2")
    assert [r["step"] for r in after] == list(range(start, total)), [r["step"] for r in after]
    for old, new in zip(before[start:], after):  # a step trained before the kill and again after: the same
        assert old["batch"] == new["batch"] and new["loss"] == pytest.approx(old["loss"], rel=1e-5), (old, new)
    for epoch in range(epochs):
        trained = [i for r in before[:start] + after if r["epoch"] == epoch for i in r["batch"]]
        assert sorted(trained) == list(range(samples)), epoch
    results = [json.loads(p.read_text()) for p in (job.dir / "out2").glob("result-*.json")]
    assert len(results) == 2 and {r["step"] for r in results} == {total}, results
    assert len({r["checksum"] for r in results}) == 1
    assert not any(alive(p) for p in left)
    job.nothing_outlives([0, 1])
