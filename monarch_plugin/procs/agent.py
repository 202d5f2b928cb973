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

An agent that serves one run only: `--run-store tcp://IP:PORT` (what `procs.slurm` starts each node's agent step
with) names that run's store, which lives in its controller's process. Such an agent ends once the run's controller
is gone, so that nothing of a SIGKILLed `monarch-run` outlives it in its allocation (`_outlive_run`): when every
connection to the store has been refused for the run's lease (`--host-timeout`, as the run's own), the controller's
process is gone while its machine is up; the agent then waits for the procs it started, which save the run's last
committed step and end by themselves (`worker.orphan`), at most `--controller-loss-save` seconds and a margin, ends
whatever is left, and exits: its SLURM step ends with it. A store that does not answer at all (a cut link, a lost
machine) is not judged: the replicas end by their leases, and under SLURM a lost controller's machine is the batch
script's, whose loss ends the job. An agent started without `--run-store` stays for the next run, as before.

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
import threading
import time

from monarch_plugin.net import parse_host
from monarch_plugin.errors import ConfigError
from monarch_plugin.procs.lease import AGENT_PROBE_S, ORPHAN_MARGIN_S, outlive_bound_s

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


def _below(pid: int) -> dict[int, int]:
    """Every live process below `pid` (zombies are ended already), each with its depth: 1 for its children."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it ended meanwhile
        if fields[0] != "Z":
            parents.setdefault(int(fields[1]), []).append(int(entry))
    found, level, depth = {}, parents.get(pid, []), 1
    while level:
        found.update((p, depth) for p in level)
        level, depth = [c for p in level for c in parents.get(p, [])], depth + 1
    return found


def _pass_on(name: str) -> bool:
    """Send the signal to every process this agent started (Monarch's procs: the replicas and the host's watcher)."""
    for pid, depth in _below(os.getpid()).items():
        if depth == 1:
            try:
                os.kill(pid, signal.Signals[name])
            except ProcessLookupError:
                pass
    print(f"monarch-plugin host: {name}: passed on to this host's procs, which drain", file=sys.stderr, flush=True)
    return False  # a second signal is passed on too


def _outlive_run(store: tuple[str, int], lease: float, save_s: float) -> None:
    """Exit this agent once the run whose store is `store` has lost its controller (see the module's docstring).

    Only a refusal counts: the store lives in the controller's process, so a machine that answers with a reset has
    no controller on that port any more. A connection that succeeds starts the count again; one that hangs or finds
    no route stops it (that is a link or a machine, judged by the procs' leases, not by the agent). A firewall that
    resets connections to the store's port reads as a refusal: the run's procs need that port open anyway."""
    refused_since = None
    while True:
        try:
            with socket.create_connection(store, timeout=2.0):
                pass
            refused_since = None
        except ConnectionRefusedError:
            now = time.monotonic()
            refused_since = refused_since or now
            if now - refused_since >= lease:
                break
        except OSError:
            refused_since = None
        time.sleep(AGENT_PROBE_S)
    procs = [p for p, depth in _below(os.getpid()).items() if depth == 1]
    _say(f"the run's store {store[0]}:{store[1]} has refused connections for {lease:g} s: its controller is gone; "
         f"waiting for this host's {len(procs)} proc(s) to save the run and end (at most "
         f"{save_s + ORPHAN_MARGIN_S:g} s), then exiting")
    deadline = time.monotonic() + save_s + ORPHAN_MARGIN_S
    while any(depth == 1 for depth in _below(os.getpid()).values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _below(os.getpid())
    for pid in left:  # past the bound: whatever is still here ends with the agent (a step's end would kill it too)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _say("exiting: the run's controller is gone" + (f"; killed {len(left)} process(es) still here past the bound"
                                                      if left else ""))
    os._exit(0)


def _say(message: str) -> None:
    print(f"monarch-plugin host: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()


def serve(address: str | None, hosts_file: str | None = None, token_file: str | None = None,
          run_store: str | None = None, host_timeout_s: float = 5.0, controller_loss_save_s: float = 60.0) -> int:
    """Run the agent on `address` until it is killed; 2 after saying why on stderr if it cannot listen there, or
    cannot read its token. None: in a SLURM job, the node's own (`procs.slurm`). `run_store`: the one run this agent
    serves, whose controller's loss ends it, with that run's `host_timeout_s` and `controller_loss_save_s`
    (`_outlive_run`); None: it serves every run, until it is killed."""
    from monarch_plugin.procs.admission import host_line, read_token
    from monarch_plugin.procs.lease import lease_s

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
        store = None
        if run_store:
            try:
                store = parse_host(run_store)
            except ConfigError:
                raise ConfigError(f"--run-store {run_store!r}: write tcp://IP:PORT, the run's store") from None
            if host_timeout_s < 3 or controller_loss_save_s < 0:
                raise ConfigError("--host-timeout must be 3 seconds or more, --controller-loss-save 0 or more")
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
    if store is not None:
        print(f"monarch-plugin host: serving the run whose store is {run_store} only: exiting once its controller is "
              f"gone and this host's procs have saved the run, at most "
              f"{outlive_bound_s(host_timeout_s, controller_loss_save_s):g} s after", flush=True)
        threading.Thread(target=_outlive_run, args=(store, lease_s(host_timeout_s), controller_loss_save_s),
                         name="monarch-plugin-outlive-run", daemon=True).start()
    if hosts_file:  # one write of the whole line: agents appending at once never interleave
        fd = os.open(hosts_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, (host_line(address, token) + "\n").encode())
        finally:
            os.close(fd)
    serving.get()
    return 0

