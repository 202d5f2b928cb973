"""A real SLURM cluster on this machine, for multi-host tests under a scheduler.

Debian's `slurmctld`, `slurmd`, `munge` and `slurm-client` (22.05): one `slurmctld` in the root namespace on the
bridge's address, and one `slurmd` per node, each in a network namespace of `NetnsHosts` (its own network stack on
the test bridge) and a UTS namespace of its own (its own hostname, `n0`, `n1`, ..., which is how a slurmd finds its
node). The job's processes run where SLURM starts them: the batch script on the allocation's first node, each `srun`
step's tasks in their node's namespace. Authentication is a `munged` of the cluster's own (its own socket and a
key made for it), so nothing of the machine's own munge or SLURM is touched.

`SlurmdTimeout` is short (`SLURMD_TIMEOUT`): a node whose slurmd stops answering is DOWN within seconds, as a dead
machine is on a real cluster after its (longer) timeout. Every daemon is started in the foreground and stopped by
its pid; `close()` (the fixture calls it on pass and on failure) kills every process in the nodes' namespaces,
the controller and munged, then deletes the namespaces, the bridge and the cluster's files. Needs root and the
packages (`available()` says).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from .netns import NetnsHosts
from .netns import available as netns_available

SLURMD_TIMEOUT = 3  # seconds before slurmctld marks a silent node DOWN (a real cluster: 300 by default)
KILL_WAIT = 5  # seconds between a job's SIGTERM and its SIGKILL (a real cluster: 30 by default)
MESSAGE_TIMEOUT = 4  # seconds an RPC to a node may take (a real cluster: 10): a dead node's pings fail sooner
_DAEMONS = ("slurmctld", "slurmd", "munged", "mungekey", "sbatch", "srun", "scontrol", "sinfo", "scancel")


def available() -> str | None:
    """None if a cluster can be built here, else why not."""
    if why := netns_available():
        return why
    missing = [name for name in (*_DAEMONS, "unshare") if shutil.which(name) is None]
    if missing:
        return f"needs {', '.join(missing)} (apt install slurmctld slurmd slurm-client munge)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    """`count` nodes, `n0`..`n{count-1}`, in one partition; `env` is what SLURM's commands need to reach it."""

    def __init__(self, count: int, tmp: Path):
        self.tmp = tmp
        self.net = NetnsHosts(count, tmp / "net")
        self.nodes = [f"n{i}" for i in range(count)]
        self.dir = tmp / "slurm"
        self.conf = self.dir / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.slurmd: dict[int, subprocess.Popen] = {}
        self._daemons: list[subprocess.Popen] = []
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        d = self.dir
        for sub in ("munge", "state", *(f"spool-{n}" for n in self.nodes)):
            (d / sub).mkdir(parents=True, exist_ok=True)
        (d / "munge").chmod(0o700)
        key = d / "munge" / "munge.key"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True, timeout=30)
        self.munge_socket = d / "munge" / "socket"
        self._daemons.append(subprocess.Popen(
            ["munged", "--foreground", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
             f"--pid-file={d / 'munge' / 'pid'}", f"--log-file={d / 'munge' / 'log'}",
             f"--seed-file={d / 'munge' / 'seed'}"],
            stdout=subprocess.DEVNULL, stderr=open(d / "munged.err", "w")))
        self._wait(lambda: self.munge_socket.exists(), 20, "munged to listen")
        nodes = "\n".join(f"NodeName={name} NodeAddr={self.net.ip(i)} CPUs=2 State=UNKNOWN"
                          for i, name in enumerate(self.nodes))
        self.conf.write_text(f"""\
ClusterName=mptest
SlurmctldHost={socket.gethostname()}({self.net.controller_ip})
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/linear
SchedulerType=sched/builtin
ReturnToService=2
SlurmdTimeout={SLURMD_TIMEOUT}
KillWait={KILL_WAIT}
InactiveLimit=0
MessageTimeout={MESSAGE_TIMEOUT}
MinJobAge=300
StateSaveLocation={d / 'state'}
SlurmctldPidFile={d / 'slurmctld.pid'}
SlurmctldLogFile={d / 'slurmctld.log'}
SlurmdSpoolDir={d}/spool-%n
SlurmdPidFile={d}/slurmd-%n.pid
SlurmdLogFile={d}/slurmd-%n.log
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
{nodes}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        (d / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
        self._daemons.append(subprocess.Popen(
            ["slurmctld", "-D", "-i", "-f", str(self.conf)], env=self.env,
            stdout=subprocess.DEVNULL, stderr=open(d / "slurmctld.err", "w")))
        for i in range(len(self.nodes)):
            self.start_node(i)
        self._wait(lambda: self.states() == {n: "idle" for n in self.nodes}, 60, "every node idle")

    def start_node(self, i: int) -> None:
        """Start node i's slurmd, in its namespaces (its hostname its node name)."""
        self.slurmd[i] = subprocess.Popen(
            ["ip", "netns", "exec", self.net.names[i], "unshare", "--uts", "sh", "-c",
             f'hostname {self.nodes[i]} && exec slurmd -D -f "{self.conf}"'],
            env=self.env, stdout=subprocess.DEVNULL, stderr=open(self.dir / f"slurmd-{self.nodes[i]}.err", "a"))

    def kill_node(self, i: int) -> list[int]:
        """Node i's machine dies: every process in its namespace SIGKILLed, its slurmd among them (so SLURM sees it
        go DOWN after `SLURMD_TIMEOUT`); the pids killed."""
        killed = self.net.kill_host(i)
        if i in self.slurmd:
            self.slurmd.pop(i).wait(timeout=10)
        return killed

    def run(self, *cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """A SLURM command (`sinfo`, `scontrol`, `sbatch`, ...) against this cluster, from the root namespace."""
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)

    def states(self) -> dict[str, str]:
        """Each node's state as `sinfo` prints it (`idle`, `alloc`, `down*`, ...)."""
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t").stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def sbatch(self, script: Path, *args: str) -> int:
        """Submit `script` (with sbatch's `args`); the job id."""
        done = self.run("sbatch", "--parsable", *args, str(script))
        if done.returncode != 0:
            raise AssertionError(f"sbatch failed: {done.stderr}")
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job`'s fields for the job (JobState, ExitCode, NodeList, ...)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job(self, job_id: int, timeout: float) -> dict[str, str]:
        """The job's fields once it has ended."""
        ended = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}
        fields: dict[str, str] = {}

        def over() -> bool:
            nonlocal fields
            fields = self.job(job_id)
            return fields.get("JobState") in ended

        self._wait(over, timeout, f"job {job_id} to end (now {fields.get('JobState')})")
        return fields

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                logs = " | ".join(f"{p.name}: {p.read_text()[-800:]}" for p in sorted(self.dir.glob("*.log"))
                                  + sorted(self.dir.glob("*.err")) if p.exists())
                raise AssertionError(f"timed out after {timeout}s waiting for {what}: {logs}")
            time.sleep(0.2)

    def close(self) -> None:
        self.net.close()  # every process in the nodes' namespaces: slurmd, its steps, the jobs' processes
        for popen in self.slurmd.values():
            popen.wait(timeout=10)
        for popen in reversed(self._daemons):
            if popen.poll() is None:
                popen.send_signal(signal.SIGKILL)
            popen.wait(timeout=10)
        self._daemons.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
