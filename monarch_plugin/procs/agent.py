"""`monarch-plugin host`: this machine's Monarch host agent for multi-host runs.

    monarch-plugin host --address tcp://10.0.0.2:26600 [--hosts-file /shared/run1/hosts --token-file /shared/run1/token]

Start one on each machine, then point the controller at them: `monarch-run --hosts tcp://10.0.0.2:26600,...` or
`--hosts-file`. In a SLURM job `--address` defaults to the node's `NodeAddr`, port 26600; `monarch-run` started by a
batch script starts one on each node of the allocation itself (`procs.slurm`). The agent listens on the one address
given, never on a wildcard: it serves Monarch's plain `tcp` transport and takes any controller, so anyone who
reaches that address can run code as this user. Keep it on the job's private network. When the controller goes
away the agent kills the work it started and waits for the next controller. SIGTERM or SIGUSR1 to the agent (SLURM
preempting or draining the node) is passed on to every proc it started: the controller drains this host's replicas
at the next step boundary and places no more here; the agent goes on serving until it is killed, so that the
controller can still stop them.

With `--token-file` (the job's token, `monarch-plugin token`), the line the agent appends to the hosts file carries
an HMAC of its address under the token (`admission.host_line`): a run started with the same `--token-file` attaches
only lines that carry one, so whoever can append to the file but lacks the token cannot bring a machine into the
run. The hosts file is created 0644 if it is not there: a run refuses one that others can write.
"""

from __future__ import annotations

import os
import signal
import socket
import sys

from monarch_plugin.net import parse_host
from monarch_plugin.errors import ConfigError

__all__ = ["serve"]


def _check_local(ip: str) -> None:
    """The agent must listen on an address of this machine (a typo would otherwise hang every attach)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, 0))
        except OSError as e:
            raise ConfigError(f"{ip} is not an address of this machine ({e.strerror}): give --address this "
                              "machine's own IP on the network the controller reaches it through") from e


def _pass_on(name: str) -> bool:
    """Send the signal to every process this agent started (Monarch's procs: the replicas and the host's watcher)."""
    me = str(os.getpid())
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = f.read().rsplit(")", 1)[1].split()[1]
        except OSError:
            continue  # it ended meanwhile
        if parent == me:
            try:
                os.kill(int(entry), signal.Signals[name])
            except ProcessLookupError:
                pass
    print(f"monarch-plugin host: {name}: passed on to this host's procs, which drain", file=sys.stderr, flush=True)
    return False  # a second signal is passed on too


def serve(address: str | None, hosts_file: str | None = None, token_file: str | None = None) -> int:
    """Run the agent on `address` until it is killed; 2 after saying why on stderr if it cannot listen there, or
    cannot read its token. None: in a SLURM job, the node's own (`procs.slurm`)."""
    from monarch_plugin.procs.admission import host_line, read_token

    try:
        if address is None:
            if not os.environ.get("SLURMD_NODENAME"):
                raise ConfigError("give --address tcp://IP:PORT: this machine's IP on the job's network (only in a "
                                  "SLURM job is it found without: the node's NodeAddr)")
            from monarch_plugin.procs.slurm import Allocation

            address = Allocation.from_env().agent(os.environ["SLURMD_NODENAME"])
        ip, _ = parse_host(address)
        _check_local(ip)
        if token_file and not hosts_file:
            raise ConfigError("--token-file signs the line this agent appends to --hosts-file: give --hosts-file too")
        token = read_token(token_file, "--token-file") if token_file else None
    except ConfigError as e:
        message = str(e).replace("`hosts`", "--address").replace("`--token-file`", "--token-file")
        print(f"monarch-plugin host: error: {message}", file=sys.stderr)
        return 2
    from monarch.actor import start_worker_loop_forever

    from monarch_plugin.procs import notice

    notice.install(act=_pass_on)

    serving = start_worker_loop_forever(ca="trust_all_connections", address=address)
    print(f"monarch-plugin host: agent listening on {address} (no TLS: keep this address on a private network)",
          flush=True)
    if hosts_file:  # one write of the whole line: agents appending at once never interleave
        fd = os.open(hosts_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, (host_line(address, token) + "\n").encode())
        finally:
            os.close(fd)
    serving.get()
    return 0

