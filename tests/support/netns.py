"""Hosts for multi-host tests: Linux network namespaces, each with its own network stack and a Monarch host agent.

Each host is a namespace joined to a bridge in the root namespace by a veth pair, on a private test subnet
(10.231.K.0/24, K from this process's pid so parallel runs do not meet); the controller (the test's
`monarch-run`) runs in the root namespace on the bridge's address. Everything created is named after this
process and removed by `close()`, which the fixture calls on pass and on failure: the processes inside the
namespaces (all started by the test) are killed by pid, then the namespaces and the bridge are deleted.
Needs root; `available()` says whether this machine can run them. With `token=True` the job has a token
(`monarch-plugin token`, in `token_file`), and every agent signs its hosts-file line with it (`--token-file`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

AGENT_PORT = 26600


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=30)


def _tc(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [*(["ip", "netns", "exec", ns] if ns else []), "tc", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=30)


def available() -> str | None:
    """None if network namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    if shutil.which("ip") is None or shutil.which("ss") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, ss, tc)"
    return None


class NetnsHosts:
    def __init__(self, count: int, tmp: Path, token: bool = False):
        tag = f"mp{os.getpid() % 100000}"
        self.tag = tag
        self.subnet = 20 + os.getpid() % 200
        self.bridge = f"{tag}br"
        self.names = [f"{tag}h{i}" for i in range(count)]
        tmp.mkdir(parents=True, exist_ok=True)
        self.hosts_file = tmp / "hosts"
        self.hosts_file.write_text("")
        self.hosts_file.chmod(0o644)  # whatever the umask: a run refuses a hosts file others may write
        self.token_file: Path | None = None
        if token:
            from monarch_plugin.procs.admission import make_token

            self.token_file = tmp / "token"
            make_token(str(self.token_file))
        self.tmp = tmp
        self.agents: dict[int, subprocess.Popen] = {}
        self.ports: dict[int, int] = {}
        self._made: list[str] = []
        self._black_holed = False  # `black_hole_controller`
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append("bridge")
            _ip("addr", "add", f"{self.controller_ip}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, ns in enumerate(self.names):
                _ip("netns", "add", ns)
                self._made.append(ns)
                outside, inside = f"{tag}v{i}", f"{tag}p{i}"
                _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
                _ip("link", "set", inside, "netns", ns)
                _ip("link", "set", outside, "master", self.bridge)
                _ip("link", "set", outside, "up")
                _ip("addr", "add", f"{self.ip(i)}/24", "dev", inside, ns=ns)
                _ip("link", "set", inside, "up", ns=ns)
                _ip("link", "set", "lo", "up", ns=ns)
        except BaseException:
            self.close()
            raise

    @property
    def controller_ip(self) -> str:
        return f"10.231.{self.subnet}.1"

    def ip(self, i: int) -> str:
        return f"10.231.{self.subnet}.{10 + i}"

    def address(self, i: int) -> str:
        return f"tcp://{self.ip(i)}:{self.ports[i]}"

    def start_agent(self, i: int, port: int = AGENT_PORT, env: dict[str, str] | None = None,
                    hide: Path | None = None) -> str:
        """Start host i's agent (on `port`), which adds itself to `hosts_file` once listening; its address. `env`:
        variables added to its environment; `hide`: a directory this host does not see (an empty tmpfs over it, in
        a mount namespace of the agent's own), as a machine without the shared filesystem."""
        self.ports[i] = port
        log = open(self.tmp / f"agent{i}-{port}.log", "w")
        token = ["--token-file", str(self.token_file)] if self.token_file else []
        agent = [sys.executable, "-m", "monarch_plugin", "host", "--address", f"tcp://{self.ip(i)}:{port}",
                 "--hosts-file", str(self.hosts_file), *token]
        if hide is not None:
            agent = ["unshare", "--mount", "sh", "-c", f'mount -t tmpfs none "{hide}" && exec "$@"', "sh", *agent]
        self.agents[i] = subprocess.Popen(["ip", "netns", "exec", self.names[i], *agent], stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True,
                                          env={**os.environ, **(env or {})})
        return self.address(i)

    def start_agents(self) -> None:
        """Start every host's agent, and return once all of them listen."""
        for i in range(len(self.names)):
            self.start_agent(i)
        self.wait_listed(len(self.names))

    def wait_listed(self, count: int, timeout: float = 60.0) -> list[str]:
        """The first `count` addresses in the hosts file, once that many agents are listening."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = [line.split()[0] for line in self.hosts_file.read_text().split("\n") if line.strip()]
            if len(lines) >= count:
                return lines[:count]
            time.sleep(0.1)
        raise AssertionError(f"{count} host agents did not start in {timeout}s: "
                             + " | ".join(p.read_text()[-500:] for p in self.tmp.glob("agent*.log")))

    def link(self, i: int, up: bool) -> None:
        """Cut host i off the network (its veth down, as when its link fails), or connect it again."""
        _ip("link", "set", f"{self.tag}v{i}", "up" if up else "down")

    def cut(self, i: int, towards: bool) -> None:
        """Drop every packet in one direction only: towards host i (`towards`) or from it, while the other direction
        still delivers. A `pfifo` queue of length 0 on the sending end of its veth drops all it is given (this
        kernel has no netem); `uncut` takes it away."""
        dev, ns = (f"{self.tag}v{i}", None) if towards else (f"{self.tag}p{i}", self.names[i])
        _tc("qdisc", "add", "dev", dev, "root", "pfifo", "limit", "0", ns=ns)

    def uncut(self, i: int, towards: bool) -> None:
        dev, ns = (f"{self.tag}v{i}", None) if towards else (f"{self.tag}p{i}", self.names[i])
        _tc("qdisc", "del", "dev", dev, "root", ns=ns, check=False)

    def black_hole_controller(self, on: bool = True) -> None:
        """Drop everything between the controller's machine and the hosts, silently (its network black-holed), while
        the hosts still reach each other across the bridge: iptables rules in the root namespace on the bridge's own
        device, which only the root namespace's traffic enters and leaves by. `close` takes them away too."""
        for rule in (("INPUT", "-i"), ("OUTPUT", "-o")):
            subprocess.run(["iptables", "-I" if on else "-D", rule[0], rule[1], self.bridge, "-j", "DROP"],
                           capture_output=True, text=True, check=on, timeout=30)
        self._black_holed = on

    def wall_off(self, i: int) -> None:
        """Reject every connection host i opens to the controller's machine (a firewall there, or on the way back),
        while connections the controller opens to it still work: an iptables rule in its namespace, gone with it."""
        subprocess.run(["ip", "netns", "exec", self.names[i], "iptables", "-A", "OUTPUT", "-d", self.controller_ip,
                        "-p", "tcp", "--syn", "-j", "REJECT", "--reject-with", "tcp-reset"],
                       capture_output=True, text=True, check=True, timeout=30)

    def pids(self, i: int) -> list[int]:
        """Every process in host i's namespace: its agent and everything the agent started."""
        out = _ip("netns", "pids", self.names[i], check=False).stdout
        return [int(p) for p in out.split()]

    def kill_host(self, i: int) -> list[int]:
        """SIGKILL every process of host i, as when its machine dies; the pids killed."""
        killed = []
        for _ in range(3):  # a process forking while we kill: go round again
            pids = self.pids(i)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        if i in self.agents:
            self.agents.pop(i).wait(timeout=10)
        return killed

    def close(self) -> None:
        if self._black_holed:
            self.black_hole_controller(on=False)
        for i in range(len(self.names)):
            if self.names[i] in self._made:
                self.kill_host(i)
        for agent in self.agents.values():
            agent.wait(timeout=10)
        for ns in self.names:
            if ns in self._made:
                _ip("netns", "delete", ns, check=False)
        if "bridge" in self._made:
            _ip("link", "delete", self.bridge, check=False)
        self._made.clear()
