"""`HostWatcher`: the controller's eyes on another machine.

On its own machine the controller holds a pidfd of every worker process and learns of a death in milliseconds.
A pid means nothing on another machine, and Monarch reports a remote death only after 0.5-3 s, and the loss of a
whole host (its agent gone, or its link down) never: a call to it fails ~60 s later. So each host runs one small
proc with this actor. It holds pidfds of that host's worker procs and writes each exit into the controller's
store at once (`Key.host_death`), and it beats (`Key.host_beat`, as its host's workers do, and `Key.watcher_beat`)
every `BEAT_S` through its `Lease`: a host whose beats stop for `host_timeout_s` is lost, whatever the cause, since a
dead agent, a dead machine and a cut link all stop them (and a cut-off watcher ends itself, as its host's workers
do). A watcher whose own beat stops while its host's go on is replaced by another on that host.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import signal
import socket
import threading
import time

from monarch.actor import Actor, endpoint

from monarch_plugin.procs.hostfacts import report
from monarch_plugin.procs import notice
from monarch_plugin.procs.pidwatch import PidWatch
from monarch_plugin.wire.protocol import Drain, Key
from monarch_plugin.procs.lease import Lease
from monarch_plugin.wire.signing import SignedStore

__all__ = ["HostWatcher", "Probe", "loopback_port"]


_HANDED_S = 60.0
_handed: dict[int, float] = {}  # port -> when it was handed out: not handed again for `_HANDED_S`
_handed_lock = threading.Lock()


def _ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The first port of the kernel's ephemeral range, from which it picks outgoing connections' local ports."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def loopback_port() -> int:
    """A port free on this machine's loopback now: a replica's own rendezvous (`MASTER_PORT`) listens there. Ask
    the replica's host, not the controller's: a port free on one machine may be taken on another.

    Taken below the kernel's ephemeral range. A port from that range (what binding port 0 gives) that is free when
    asked can be the local port of any outgoing connection (the survivors' gloo sockets open many) before the
    replica binds it, which once killed a replacement at its start (EADDRINUSE); below the range only an explicit
    bind takes a port. Not handed out twice within a minute (two replicas starting at once)."""
    low = _ephemeral_low()
    floor = max(1024, low - 16384)
    with _handed_lock:
        now = time.monotonic()
        for port in [p for p, at in _handed.items() if now - at > _HANDED_S]:
            del _handed[port]
        for _ in range(64 if low - floor >= 256 else 0):
            port = random.randrange(floor, low)
            if port in _handed:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _handed[port] = now
            return port
    with socket.socket() as s:  # no room below the range (or none free there): the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Probe(Actor):
    """A host's report on its machine (`hostfacts.report`) and its clock: the one actor `monarch-plugin doctor` spawns
    on a host, and the base of the watcher a run spawns there, so both check a host the same way."""

    @endpoint
    def report(self, paths: list[str], store_host: str, store_port: int, gpus: bool = False) -> dict:
        return report(paths, store_host, store_port, gpus)

    @endpoint
    def clock(self) -> float:
        return time.time()


class HostWatcher(Probe):
    """Also the doctor's `Probe`: its `clock`, and its report on the machine inside `machine`."""

    def __init__(self, store_host: str, store_port: int, host: int, lease: float, secret: str, reported: int = 0,
                 replaces: int | None = None):
        """`secret`: the run's (`signing`), which signs what this watcher writes to the run's store. It stays out of
        this proc's environment, which `machine` reports. A watcher started in place of one that stopped beating
        (`replaces`: its pid) goes on counting deaths from `reported`, and ends that one first if it is only stuck:
        one writer of the host's deaths at a time."""
        import torch.distributed as dist

        if replaces is not None:
            _end_stuck(replaces)
        self._host = host
        self._store_address = (store_host, store_port)
        self._store = SignedStore(dist.TCPStore(store_host, store_port, is_master=False, wait_for_workers=False,
                                                timeout=datetime.timedelta(seconds=lease)), bytes.fromhex(secret))
        self._reported = reported  # deaths written so far: this watcher is its host's only writer of them
        self._report_lock = threading.Lock()
        self._pids = PidWatch(self._report, name="monarch-plugin-watch")
        self._lease = Lease(store_host, store_port, host, lease, f"the watcher of host {host}", secret,
                            beat_keys=(Key.host_beat(host), Key.watcher_beat(host)))
        notice.listen(self._going)  # its agent passes on a SIGTERM to every proc: the whole host is going

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def machine(self, paths: list[str]) -> dict:
        """The doctor's `report` on this host (its versions, which of `paths` it does not see, the accelerator and
        device count...; no GPU memory, which would hold a CUDA context for the run), and the environment the
        controller plans its GPU slots from."""
        return {**report(paths, *self._store_address), "environ": dict(os.environ), "pid": os.getpid()}

    @endpoint
    def watch(self, replica: int, pids: list[int]) -> None:
        self._pids.watch(replica, pids)

    @endpoint
    def free_port(self) -> int:
        return loopback_port()

    @endpoint
    def kill(self, replica: int) -> None:
        """SIGKILL the replica's procs on this host (the controller already counts it dead)."""
        self._pids.kill(replica)

    def _going(self, signal: str) -> None:
        """This host was told to go: the controller drains its replicas at once, and places none here any more."""
        with self._report_lock:
            try:
                self._store.append(Key.DRAINS, Drain(-1, -1, signal, os.getpid(), host=self._host).line())
                self._store.add(Key.DRAIN_COUNT, 1)
            except Exception:  # noqa: BLE001 - unreachable controller: its replicas' own reports may reach it
                pass

    def _report(self, replica: int, pid: int) -> None:
        """The record first, then the counter: the controller reads the n-th record once the counter says n, so a
        link that drops between the two leaves a record nobody counted, never a count with no record behind it."""
        with self._report_lock:
            n = self._reported + 1
            try:
                self._store.set(Key.host_death(self._host, n), json.dumps({"replica": replica, "pid": pid}))
                self._store.set(Key.host_deaths(self._host), str(n))
            except Exception:  # noqa: BLE001 - unreachable controller: the host will be declared lost
                return
            self._reported = n


def _end_stuck(pid: int) -> None:
    """SIGKILL the watcher `pid` if it still runs (stopped, or stuck): only when it runs this proc's own command line,
    so a pid reused meanwhile by anything else is left alone."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:  # gone: what usually happened to it
        return
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f, open("/proc/self/cmdline", "rb") as own:
            if f.read() == own.read():
                signal.pidfd_send_signal(fd, signal.SIGKILL)
    except OSError:
        pass
    finally:
        os.close(fd)
