"""Inside a SLURM allocation: its nodes are the run's hosts, and SLURM starts a host agent on each.

    #SBATCH --nodes=4 --no-kill
    monarch-run --replicas 4 --min-replicas 2 train.py

Started in a batch script (or an `salloc` shell) of an allocation of two or more nodes, with no ``hosts`` and no
``hosts_file`` (or with ``slurm`` set), the controller runs each node's agent as a job step of its own:
`srun --nodes=1 --ntasks=1 --nodelist=NODE --overlap --whole`, so that one node can be signalled, or lost, alone
(SLURM's `scancel --signal=TERM JOB.STEP`, or its node failing), and the step holds the node's whole share of the
allocation, which the agent's procs (the replicas) inherit. Each agent listens on the node's `NodeAddr` (what
`scontrol show node` says SLURM reaches it by) at `AGENT_PORT`; the controller's store listens on this machine's
address on the route to the first node. The agents are admitted as any others: a token made for the run
(`admission`, 0600) and a hosts file, in `<events file's directory>/monarch-slurm-<job id>/` (0700), which also
holds each step's output; a node from another job joins the run by starting its agent with the same two files
(docs/multihost.md).

The steps end with the run: each srun is told twice within a second (SIGINT), which is SLURM's way of aborting a
step (its tasks are killed, wherever they are). A node's step that ends before (its node failed) is logged and
left: the controller learns of the node's loss from its watcher's silence, as for any host.

A `monarch-run` that is SIGKILLed (its node's OOM killer, a user's `kill -9`) tells no srun anything, and its steps
would serve on until the job ends, their agents holding the node's `AGENT_PORT`, so that a relaunch in the same
allocation could start none. So each agent is started for this run only (`--run-store`, the run's store, which lives
in the controller's process; `procs.agent`): once that store has refused connections for the run's lease (the
controller's process is gone, its machine is up), the agent waits for its procs, which write the run's last
committed step and end by themselves (`worker.orphan`), and exits, and its step ends with it. The bound, from the
kill to the last step's end: `lease.outlive_bound_s`, the lease (`host_timeout_s` less 2 s) and a probe, plus
`controller_loss_save_s`, plus 5 s, about 69 s by default; in practice the lease plus the time to finish the step in
flight and write it. The step is not aborted from outside (a PR_SET_PDEATHSIG on srun, say): SLURM's abort kills the
tasks at once, the replicas among them, before they could save. A batch script that `exec`s `monarch-run` ends the
job with it: SLURM then gives the steps only `KillWait` (30 s by default) between SIGTERM and SIGKILL.

A relaunch in the same allocation (`monarch-run ... || monarch-run --resume auto ...` in the batch script) finds the
steps the killed run left still there while they save: it waits for them to end before it takes the run's files
(`await_earlier_agents`), so that the save is not refused for a run holding them and its own agents can listen,
and resumes from what they wrote. Agents a user started (`monarch-plugin host`, no `--run-store`) are not this
allocation's run steps: they stay for the next run, as before.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from monarch_plugin.config import ElasticConfig
from monarch_plugin.net import route_address
from monarch_plugin.errors import ConfigError, RunStopped
from monarch_plugin.events import EventLog

__all__ = ["AGENT_PORT", "Allocation", "Agents", "await_earlier_agents", "for_run", "requeue"]

log = logging.getLogger(__name__)

AGENT_PORT = 26600
"""Where each node's agent listens (on the node's `NodeAddr`)."""


def for_run(config: ElasticConfig) -> tuple[ElasticConfig, Agents]:
    """The run's config on this allocation (its hosts file, token and store address filled in where not given)
    and its agents, their files made and not started yet."""
    allocation = Allocation.from_env()
    directory = os.path.join(os.path.dirname(os.path.abspath(config.events_path)), f"monarch-slurm-{allocation.job_id}")
    config = replace(config, hosts_file=config.hosts_file or os.path.join(directory, "hosts"),
                     token_file=config.token_file or os.path.join(directory, "token"),
                     store_host=config.store_host or route_address(allocation.agent(next(iter(allocation.nodes)))))
    await_earlier_agents(config)  # `monarch-run` waited already, before taking the run's files; a front end waits here
    agents = Agents(allocation, config.hosts_file, config.token_file, config.host_timeout_s,
                    config.controller_loss_save_s)
    agents.prepare()
    return config, agents


_STEP_PREFIX = "monarch-agent-"
"""How each node's agent step is named (`--job-name`): what `squeue -s` lists it by."""


def _agent_steps(job: str) -> list[str]:
    """The job's agent steps still running (`JOB.STEP`); none if squeue cannot say."""
    try:
        done = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i %j"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.debug("squeue failed (%s): not looking for an earlier run's agent steps", e)
        return []
    if done.returncode != 0:
        log.debug("squeue failed (%s): not looking for an earlier run's agent steps", done.stderr.strip())
        return []
    return [line.split()[0] for line in done.stdout.splitlines()
            if len(line.split()) == 2 and line.split()[1].startswith(_STEP_PREFIX)]


def await_earlier_agents(config: ElasticConfig) -> None:
    """Before a run in a SLURM allocation starts (and before it takes its files): wait for the agent steps that an
    earlier run of this job left running to end, at most for their bound (from this run's settings, and 10 s).

    A run's agent steps outlive its `monarch-run` only when that was killed (a run that ends stops them): they are
    still saving its last committed step, which this run resumes from, and they end by themselves once that is
    written (module docstring). Taking the run's files meanwhile would make the save refuse to write (`worker.orphan`
    writes only while it can hold them), and their agents still hold the nodes' `AGENT_PORT`. Said in the log; if
    they outlast the wait, this run goes on and says how to end them."""
    from monarch_plugin.procs.lease import outlive_bound_s

    job = os.environ.get("SLURM_JOB_ID")
    steps = _agent_steps(job) if job and config.slurm else []
    if not steps:
        return
    bound = outlive_bound_s(config.host_timeout_s, config.controller_loss_save_s) + 10.0
    log.warning("SLURM job %s still has %d host agent step(s) of an earlier run whose controller is gone (%s): "
                "waiting up to %.0f s for them to end; their replicas write its last committed step first, which "
                "`resume` \"auto\" goes on from", job, len(steps), ", ".join(steps), bound)
    t0 = time.monotonic()
    while steps and time.monotonic() - t0 < bound:
        time.sleep(0.5)
        steps = _agent_steps(job)
    if steps:
        log.error("the earlier run's agent step(s) %s still run after %.0f s: going on; if this run's agents cannot "
                  "listen, end those with `scancel %s`", ", ".join(steps), bound, " ".join(steps))
    else:
        log.warning("the earlier run's agent steps ended after %.1f s", time.monotonic() - t0)


def _scontrol(*args: str) -> str:
    try:
        done = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError(f"`slurm`: scontrol {' '.join(args)} failed ({e}): run inside a SLURM allocation with "
                          "SLURM's commands on PATH, or set `slurm` off and give `hosts`", "slurm") from e
    if done.returncode != 0:
        raise ConfigError(f"`slurm`: scontrol {' '.join(args)} failed: {done.stderr.strip()}: run inside a SLURM "
                          "allocation, or set `slurm` off and give `hosts`", "slurm")
    return done.stdout


@dataclass(frozen=True)
class Allocation:
    job_id: str
    nodes: dict[str, str]
    """Node name -> the address SLURM reaches it by (its `NodeAddr`), in the allocation's order."""

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Allocation:
        env = os.environ if environ is None else environ
        job_id, nodelist = env.get("SLURM_JOB_ID"), env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not job_id or not nodelist:
            raise ConfigError("`slurm` is set but this is not inside a SLURM allocation (no SLURM_JOB_ID / "
                              "SLURM_JOB_NODELIST): start the run from a batch script (`sbatch`) or an `salloc` "
                              "shell, or set `slurm` off", "slurm")
        names = _scontrol("show", "hostnames", nodelist).split()
        addresses = dict(re.findall(r"NodeName=(\S+) .*?NodeAddr=(\S+)", _scontrol("show", "node", "-o",
                                                                                       ",".join(names))))
        missing = [n for n in names if n not in addresses]
        if missing:
            raise ConfigError(f"`slurm`: scontrol shows no NodeAddr for {missing}", "slurm")
        return cls(job_id, {name: _resolve(addresses[name]) for name in names})

    def agent(self, node: str) -> str:
        return f"tcp://{self.nodes[node]}:{AGENT_PORT}"


def _resolve(address: str) -> str:
    import socket

    try:
        return socket.gethostbyname(address)
    except OSError as e:
        raise ConfigError(f"`slurm`: the node address {address!r} does not resolve ({e})", "slurm") from e


class Agents:
    """One `srun` step per node of the allocation, each running that node's agent; `stop()` ends them. Started for a
    run (`start(run_store)`), each agent also ends by itself once the run's controller is gone, with the run's
    `host_timeout_s` and `controller_loss_save_s` (module docstring)."""

    def __init__(self, allocation: Allocation, hosts_file: str, token_file: str, host_timeout_s: float = 5.0,
                 controller_loss_save_s: float = 60.0):
        self.allocation = allocation
        self.hosts_file, self.token_file = hosts_file, token_file
        self.host_timeout_s, self.controller_loss_save_s = host_timeout_s, controller_loss_save_s
        self.dir = Path(hosts_file).parent
        self.steps: dict[str, subprocess.Popen] = {}

    def prepare(self) -> None:
        """The run's directory (0700), its token (0600, made once) and an empty hosts file only this user writes."""
        from monarch_plugin.procs.admission import make_token

        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        make_token(self.token_file)
        fd = os.open(self.hosts_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        os.fchmod(fd, 0o644)  # whatever the umask: a run refuses a hosts file others may write
        os.close(fd)

    def start(self, run_store: str | None = None) -> None:
        """A step on each node. `run_store` (`tcp://IP:PORT`): the run's store, whose end ends the agents (without
        it, as for the doctor's, they serve until `stop()`)."""
        serving = [] if run_store is None else [
            "--run-store", run_store, "--host-timeout", f"{self.host_timeout_s:g}",
            "--controller-loss-save", f"{self.controller_loss_save_s:g}"]
        for node in self.allocation.nodes:
            out = open(self.dir / f"agent-{node}.log", "ab")
            with out:
                self.steps[node] = subprocess.Popen(
                    ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--overlap", "--whole",
                     "--kill-on-bad-exit=0", f"--job-name={_STEP_PREFIX}{node}",
                     sys.executable, "-m", "monarch_plugin", "host",
                     "--address", self.allocation.agent(node), "--hosts-file", self.hosts_file,
                     "--token-file", self.token_file, *serving],
                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        log.info("started a host agent on each of the allocation's %d nodes (job %s): %s",
                 len(self.steps), self.allocation.job_id, ", ".join(self.steps))

    def wait_listed(self, timeout: float) -> None:
        """Until every node's agent has listed itself in the hosts file, or `timeout`; ConfigError if none did (or
        every step ended first), naming what the steps printed. A node whose agent is late joins when it lists."""
        deadline = time.monotonic() + timeout
        want = set(self.allocation.nodes)
        while True:
            listed = {line.split()[0] for line in Path(self.hosts_file).read_text().splitlines() if line.strip()}
            done = {n for n in want if self.allocation.agent(n) in listed}
            ended = {n for n, p in self.steps.items() if p.poll() is not None and n not in done}
            if done | ended == want or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if not done:
            outputs = "; ".join(f"{n}: {(self.dir / f'agent-{n}.log').read_text(errors='replace')[-300:].strip()}"
                                for n in sorted(want))
            raise ConfigError(f"`slurm`: no node's host agent started within {timeout:.0f} s ({outputs})", "slurm")
        for node in sorted(want - done):
            log.warning("the host agent on node %s has not started (%s): the run goes on without it; see %s", node,
                        "its step ended" if node in ended else f"not listening after {timeout:.0f} s",
                        self.dir / f"agent-{node}.log")

    def stop(self) -> None:
        """Abort every step still running (srun told twice within a second), then reap each srun."""
        live = [p for p in self.steps.values() if p.poll() is None]
        for _ in range(2):
            for p in live:
                try:
                    p.send_signal(signal.SIGINT)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        for node, p in self.steps.items():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                log.warning("srun for node %s did not end in 30 s after its step was aborted: killed", node)
                p.kill()
                p.wait()


def requeue(stopped: RunStopped, config: ElasticConfig, events: EventLog) -> None:
    """After a run SIGUSR1 stopped in a SLURM job (SLURM's notice before the time limit: `--signal=B:USR1@N`) has
    written its checkpoint and stopped everything: the job goes back to the queue (`config.requeue`), and its next
    start resumes from the checkpoint (``resume="auto"``). SLURM ends this process as it requeues the job."""
    job = os.environ.get("SLURM_JOB_ID")
    if not (config.requeue and job and stopped.signal == "SIGUSR1"):
        return
    events.emit("requeue", job=job, checkpoint=stopped.checkpoint)
    log.warning("requeueing SLURM job %s: its next start resumes from %s with `resume` \"auto\"", job,
                stopped.checkpoint)
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.error("scontrol requeue %s failed (%s): resubmit the job to go on from %s", job, e, stopped.checkpoint)
        return
    if done.returncode != 0:
        log.error("scontrol requeue %s failed: %s: resubmit the job (`sbatch --requeue` lets it be requeued) to "
                  "go on from %s", job, done.stderr.strip(), stopped.checkpoint)
