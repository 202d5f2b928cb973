"""Where replicas run, and how the controller learns that they died: this machine, or Monarch host agents.

Without `hosts` every replica is a proc mesh on this machine (`this_host()`), and the controller holds a pidfd
of each worker process: a death is seen in milliseconds. With `hosts`, each address is a Monarch host agent
(`monarch-plugin host`) on another machine, attached once (`attach_to_workers`); a replica is one proc mesh on
one host (its procs reduce among themselves on that host), and a `HostWatcher` proc on each host reports its
deaths and beats through the controller's store, as its workers' leases beat too. A host whose beats stop for
`host_timeout_s` is lost: its replicas are gone together, in one generation change. A watcher whose own beat
stops while its host beats on is a helper lost, not a host: another is started there (`Hosts._rewatch`).
Monarch's `monarch.job` launchers (SLURM, Kubernetes) attach a fixed set of hosts once; here hosts can also come
later, from `hosts_file`, which is re-read every second: a machine added to it, or an agent restarted on a new
port (Monarch does not re-attach an address it has marked lost), joins the run. A line is attached only if
`admission` admits it (a hosts file no one else can write; with `token_file`, a line carrying the HMAC of its
address under the job's token): any other is refused with a `host_refused` event and its address is never
contacted.

Every death or loss becomes one typed report on the controller's queue (`protocol.Died`, `HostLost`, `HostUp`).
"""

from __future__ import annotations

import datetime
import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from monarch_plugin.procs import forkserver, notice, slurm
from monarch_plugin.procs.admission import check_hosts_file, read_hosts_file, read_token
from monarch_plugin.backend import accelerator_kind
from monarch_plugin.config import ElasticConfig
from monarch_plugin.net import parse_host
from monarch_plugin.procs.hostfacts import HostCheck, clock_offset, findings, format_table, report, unreached
from monarch_plugin.procs.devices import GpuPlan, plan_gpus
from monarch_plugin.errors import ConfigError
from monarch_plugin.events import EventLog, logger
from monarch_plugin.procs.pidwatch import PidWatch
from monarch_plugin.wire.protocol import CONTROLLER_PID_ENV, ORPHAN_ENV, Died, HostLost, HostUp, Key, watcher_names
from monarch_plugin.procs.lease import BEAT_S, lease_s
from monarch_plugin.wire.signing import Forged

__all__ = ["Host", "Hosts", "heard", "slots", "watcher_stuck"]

_CALL_S = 5.0
"""Bound on a call to a host's watcher: an unreachable host must not stall the controller."""

_REWATCH_S = 4 * BEAT_S
"""A watcher silent for this long while its host beats on (its workers' leases) is gone: another is started there."""


@dataclass
class Host:
    index: int
    address: str | None
    """The agent's `tcp://IP:PORT`; None for this machine."""
    slots: int
    """Replicas it may hold at once."""
    gpus: GpuPlan | None = None
    mesh: Any = None
    watcher: Any = None
    watcher_procs: Any = None
    watcher_pid: int | None = None
    watchers: int = 1
    """How many watchers were started here: a watcher that stops beating is replaced (`Hosts._rewatch`)."""
    rewatching: bool = False
    rewatch_failures: int = 0
    watched: dict[int, list[int]] = field(default_factory=dict)
    """replica -> its procs' pids, which a watcher started in place of another watches again."""
    live: bool = True
    leaving: bool = False
    """Told to go (a signal to its agent, passed on to its procs): its replicas drain, and none is placed here."""
    returning: bool = False
    """Another agent on this machine's IP was attached before (it came back, or restarted on a new port)."""
    held: dict[int, int] = field(default_factory=dict)
    """replica -> the slot it holds."""
    beats: int = -1
    heard_at: float = 0.0
    watcher_beats: int = -1
    watcher_heard_at: float = 0.0
    deaths_seen: int = 0
    unrecorded_since: float | None = None
    """When its watcher's death counter first stood ahead of the records it had written (else None)."""
    check: HostCheck | None = None
    """What its watcher reported of the machine, and the doctor's findings from it (`preflight`)."""

    @property
    def ip(self) -> str:
        return parse_host(self.address)[0] if self.address else "127.0.0.1"

    @property
    def name(self) -> str:
        return self.address or "this machine"


class Hosts:
    """The run's hosts: placing replicas on them, spawning their proc meshes, and watching for deaths."""

    def __init__(self, config: ElasticConfig, events: EventLog, report: queue.Queue, paths: list[str],
                 imports: list[str], agents: slurm.Agents | None = None):
        """`agents`: under SLURM, the allocation's agents, which `start` starts and `close` ends (`procs.slurm`)."""
        self.config = config
        self._agents = agents
        self.paths = paths
        """What every host must see at the same path (a shared filesystem): a host that does not is refused."""
        self.events = events
        self._report = report
        self.hosts: list[Host] = []
        self._store = None
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._watch: threading.Thread | None = None
        self._local: PidWatch | None = None  # this machine's worker procs
        self._where: dict[int, int] = {}  # replica -> host index
        self._tried: set[str] = set()  # addresses attached, or tried
        self._failures: list[tuple[str, str]] = []  # (address, why) of the hosts that could not be used
        self._forkserver: forkserver.ForkServer | None = None  # this machine's procs start from it
        self._forkserver_serves: bool | None = None  # whether it started this run's first procs (None: none yet)
        self._imports = imports  # what the target imports: the forkserver loads the frameworks among them
        self._lease = lease_s(config.host_timeout_s)
        self._orphan_s = config.controller_loss_save_s  # how long this machine's procs outlive a lost controller
        self._here: dict | None = None  # this machine's `hostfacts.report`, what each host's is checked against
        self._token: bytes | None = None  # the job's token: a hosts-file line is attached only if it carries its HMAC
        self._refused: set[tuple[str, str]] = set()  # (line, why) of each refusal reported: reported once
        if config.hosts_file:  # refused now, before anything is spawned, if others may write it (`admission`)
            check_hosts_file(config.hosts_file)
            if config.token_file:
                self._token = read_token(config.token_file)
        if not config.multi_host:  # planned now, so a shortage of GPUs is a ConfigError before anything starts
            slots = config.replicas + config.spares
            gpus = plan_gpus(accelerator_kind(), torch.cuda.device_count(), os.environ, slots,
                             config.procs_per_replica)
            self.hosts.append(Host(0, None, slots, gpus))

    # -- start and stop -------------------------------------------------------------------------------------

    def start(self, store, secret: str) -> None:
        """Attach the hosts (or take this machine) and start watching; before the first replica is spawned. `store`
        is the run's (a `SignedStore`), `secret` what it signs with: each host's watcher gets it."""
        self._store, self._secret = store, secret
        if not self.config.multi_host:
            self._local = PidWatch(lambda replica, pid: self._report.put(Died(replica, f"pidfd (pid {pid} exited)")))
            self._forkserver = forkserver.for_run(self.config, self._imports)
            return
        from monarch.actor import enable_transport

        enable_transport(f"tcp://{self.config.store_host}:0")  # before any other Monarch call
        if self._agents is not None:  # for this run only: they end once it has lost its controller (`procs.slurm`)
            self._agents.start(f"tcp://{self.config.store_host}:{store.port}")
            self._agents.wait_listed(self.config.join_timeout_s)
        addresses = list(dict.fromkeys(self.config.hosts + self._listed()))
        self._tried.update(addresses)
        if not addresses and self._refused:
            raise ConfigError(f"`hosts_file` {self.config.hosts_file} admits no host and `hosts` is empty ("
                              f"{'; '.join(why for _, why in sorted(self._refused))}): start each agent with "
                              "`monarch-plugin host --hosts-file` (and `--token-file`, the run's `token_file`)",
                              "hosts_file")
        if not addresses:
            raise ConfigError(f"`hosts_file` {self.config.hosts_file} lists no host yet and `hosts` is empty: "
                              "start `monarch-plugin host --address tcp://IP:PORT` on each machine and list them",
                              "hosts")
        self._here = report(self.paths, self.config.store_host, store.port)
        attachers = [threading.Thread(target=self._attach, args=(a,), daemon=True) for a in addresses]
        for t in attachers:
            t.start()
        for t in attachers:
            t.join()
        checks = [h.check for h in self.hosts if h.check is not None]
        if checks:
            logger.info("hosts checked (`preflight`; `monarch-plugin doctor` prints the same):\n%s",
                        "\n".join(format_table(checks)))
        if not any(h.live for h in self.hosts):
            raise ConfigError(
                f"no host could be used ({'; '.join(f'{a}: {why}' for a, why in self.failures)}): start "
                "`monarch-plugin host --address tcp://IP:PORT` on each machine, with the address this controller "
                "reaches it by", "hosts"
            )
        self._watch = threading.Thread(target=self._watch_hosts, name="monarch-plugin-hosts", daemon=True)
        self._watch.start()

    def close(self) -> None:
        """Stop watching, and stop the watchers: none outlives the run (a cut-off one ends by its lease).

        The watch ends first, while the run's store still serves it: a thread left inside a store call when the
        process exits is ended mid-call by the interpreter, and torch's C++ then aborts the process ("exception not
        rethrown", seen once: exit status -6 after a finished run)."""
        self._closing.set()
        if self._watch is not None:
            self._watch.join(timeout=_CALL_S)
        if self._local is not None:
            self._local.close()
        stoppers = [threading.Thread(target=_stop, args=(h.watcher_procs,), daemon=True)
                    for h in self.hosts if h.live and h.watcher_procs is not None]
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join(timeout=_CALL_S)
        self._store = None
        if self._agents is not None:
            self._agents.stop()

    # -- placement ------------------------------------------------------------------------------------------

    @property
    def failures(self) -> list[tuple[str, str]]:
        """(address, why) of each host that could not be used: unreachable, or refused."""
        return list(self._failures)

    def rooms(self) -> dict[int, tuple[int, set[int]]]:
        """Each live host's (slots, held slots), what `policies.place` decides from."""
        return {h.index: (h.slots, set(h.held.values())) for h in self.hosts if h.live and not h.leaving}

    def take(self, replica: int, host: int, slot: int) -> None:
        self.hosts[host].held[replica] = slot
        self._where[replica] = host

    def release(self, replica: int) -> None:
        host = self._where.get(replica)
        if host is not None:
            self.hosts[host].held.pop(replica, None)

    def host_of(self, replica: int) -> Host:
        return self.hosts[self._where[replica]]

    def env_for(self, replica: int) -> dict[str, str]:
        """What a replica's procs need to know of their host: its GPUs, the address its groups bind to."""
        host = self.host_of(replica)
        env = {"MONARCH_PLUGIN_BIND_ADDR": host.ip}
        if host.watcher is not None:  # on another machine: a cut-off proc ends itself (`worker.lease`)
            env.update(MONARCH_PLUGIN_HOST=str(host.index), MONARCH_PLUGIN_LEASE_S=str(self._lease))
        else:  # on this one: the controller's end is its loss (`worker.orphan`)
            env[CONTROLLER_PID_ENV] = str(os.getpid())
        if host.gpus is not None:
            env.update(host.gpus.env_for_slot(host.held[replica]))
        return env

    def free_port(self, replica: int) -> int:
        """A loopback port free on the replica's host, for its own rendezvous."""
        from monarch_plugin.procs.watcher import loopback_port

        host = self.host_of(replica)
        return loopback_port() if host.watcher is None else host.watcher.free_port.call_one().get(timeout=_CALL_S)

    def spawn_procs(self, replica: int, procs: int, name: str):
        host = self.host_of(replica)
        if host.mesh is None:
            from monarch.actor import this_host

            return this_host().spawn_procs(per_host={"procs": procs}, name=name,
                                           bootstrap_command=self._bootstrap_command())
        return host.mesh.spawn_procs(per_host={"procs": procs}, name=name, bootstrap_command=notice.bootstrap_command())

    def _bootstrap_command(self):
        """How this machine's procs start: through the forkserver once it is ready (the first spawn of a run waits
        for its imports, and says in an event how long), else as fresh interpreters; either way catching the signals
        with notice (`notice`), and outliving a lost controller by `controller_loss_save_s` (`ORPHAN_ENV`)."""
        command = self._start_command()
        command.env = {**command.env, ORPHAN_ENV: str(self._orphan_s)}  # Monarch's `env` reads as a copy
        return command

    def _start_command(self):
        if self._forkserver is None:
            return notice.bootstrap_command()
        t0 = time.time()
        command = self._forkserver.bootstrap_command()
        with self._lock:
            if self._forkserver_serves is None:
                self._forkserver_serves = command is not None
                self.events.emit("forkserver", pid=self._forkserver.pid, preload=self._forkserver.preload,
                                 ready=command is not None, waited_s=round(time.time() - t0, 3),
                                 **({} if command is not None else {"unused": self._forkserver.unused}))
            elif self._forkserver_serves and command is None:  # it went mid-run (its procs did not)
                self._forkserver_serves = False
                self.events.emit("forkserver_lost", pid=self._forkserver.pid, reason=self._forkserver.unused)
        return command or notice.bootstrap_command()

    # -- deaths ---------------------------------------------------------------------------------------------

    def watch(self, replica: int, pids: list[int]) -> None:
        """Report the exit of any of the replica's procs from now on."""
        host = self.host_of(replica)
        if host.watcher is None:
            self._local.watch(replica, pids)
        else:
            host.watched[replica] = list(pids)
            host.watcher.watch.call_one(replica, pids).get(timeout=_CALL_S)

    def unwatch(self, replica: int) -> None:
        if self._local is not None:
            self._local.forget(replica)
        if replica in self._where:
            self.host_of(replica).watched.pop(replica, None)

    def kill(self, replica: int) -> None:
        """SIGKILL the replica's procs (through pidfds, immune to pid reuse), on whichever host they run. On another
        host the order is sent and not waited for: a host cut off from the controller never answers, and the
        controller's next decision (the survivors' new generation) must not wait `_CALL_S` for it."""
        host = self._where.get(replica)
        if host is None:
            return
        host = self.hosts[host]
        if host.watcher is None:
            self._local.kill(replica)
        elif host.live:
            try:
                sent = host.watcher.kill.call_one(replica)
            except Exception:  # noqa: BLE001 - an unreachable host is declared lost by its missing beats
                return
            threading.Thread(target=_settle, args=(sent,), name="monarch-plugin-kill", daemon=True).start()

    # -- other machines -------------------------------------------------------------------------------------

    def _listed(self) -> list[str]:
        """The addresses `hosts_file` admits now (`admission`): none if others may write the file; with a token,
        those whose line carries the HMAC of the address. Each refusal is reported once (`host_refused`), and a
        refused address is never contacted."""
        if not self.config.hosts_file:
            return []
        addresses, refused = read_hosts_file(self.config.hosts_file, self._token)
        for line, address, why in refused:
            self._refuse(line, address, why)
        return addresses

    def _refuse(self, line: str, address: str | None, why: str) -> None:
        if (line, why) in self._refused:
            return
        self._refused.add((line, why))
        self.events.emit("host_refused", address=address or line or None, line=line or None,
                         hosts_file=self.config.hosts_file, reason=why)

    def _attach(self, address: str) -> Host | None:
        """Attach the agent at `address` and start its watcher; the host joins live, or not at all."""
        from monarch.actor import attach_to_workers

        from monarch_plugin.procs.watcher import HostWatcher

        t0 = time.monotonic()
        with self._lock:
            index = len(self.hosts)
            host = Host(index, address, slots=0, live=False)
            self.hosts.append(host)
        procs = None
        try:
            mesh = attach_to_workers(workers=[address], ca="trust_all_connections", name=f"host{index}")
            mesh.initialized.get(timeout=min(self.config.join_timeout_s, 30.0))
            procs_name, actor_name = watcher_names(index)
            procs = mesh.spawn_procs(per_host={"procs": 1}, name=procs_name, bootstrap_command=notice.bootstrap_command())
            watcher = procs.spawn(actor_name, HostWatcher, self.config.store_host, self._store.port, index,
                                  self._lease, self._secret)
            machine = watcher.machine.call_one(self.paths).get(timeout=self.config.join_timeout_s)
            offset = clock_offset(watcher)
        except Exception as e:  # noqa: BLE001 - an agent that cannot be reached is reported; the run goes on
            why = unreached(address, self.config.store_host, e)  # off the controller's thread, as the attach is
            self._failures.append((address, why))
            self.events.emit("host_unreachable", host=index, address=address, error=f"{type(e).__name__}: {e}",
                             reason=why)
            if procs is not None:  # a watcher that answered once, then not: it must not beat on
                _stop(procs)
            return None
        store = f"{self.config.store_host}:{self._store.port}"
        host.check = HostCheck(address, machine, offset, findings(self._here, machine, offset, store))
        # Without `preflight`, only a host that lacks the run's paths is refused: a run cannot start there.
        errors = [f.message for f in host.check.findings if f.severity == "error"
                  and (self.config.preflight or "not found there" in f.message)]
        if errors:
            why = "; ".join(errors)
            self._failures.append((address, why))
            self.events.emit("host_refused", host=index, address=address, reason=why)
            _stop(procs)
            return None
        host.mesh, host.watcher, host.watcher_procs, host.watcher_pid = mesh, watcher, procs, machine["pid"]
        host.slots, host.gpus = slots(machine, self.config)
        host.heard_at = host.watcher_heard_at = time.monotonic()
        host.live = True
        host.returning = any(h.ip == host.ip and h.watcher is not None for h in self.hosts[:index])
        warnings = [f.message for f in host.check.findings if f.severity == "warning"]
        self.events.emit("host_up", host=index, address=address, slots=host.slots, watcher_pid=machine["pid"],
                         returning=host.returning, seconds=round(time.monotonic() - t0, 3),
                         **({"warnings": warnings} if warnings else {}))
        return host

    def _watch_hosts(self) -> None:
        """Deaths and beats of every attached host, and new hosts from `hosts_file`. Over a store connection of its
        own: a call that waits on the network never holds up the controller's other store calls, nor theirs this
        watch. One host's trouble is reported and the watch goes on with the others; only the end of the run ends
        it."""
        import torch.distributed as dist

        store = None
        listed_at = 0.0
        while not self._closing.wait(0.02):
            now = time.monotonic()
            try:
                if store is None:
                    store = self._store.like(dist.TCPStore(
                        self.config.store_host, self._store.port, is_master=False, wait_for_workers=False,
                        timeout=datetime.timedelta(seconds=_CALL_S)))
                for host in [h for h in self.hosts if h.live and h.watcher is not None]:
                    self._poll(store, host, now)
            except Exception as e:  # noqa: BLE001 - a broken connection is made again; a closing run stops here
                if self._closing.is_set():
                    return
                self.events.emit("host_watch_error", error=f"{type(e).__name__}: {e}")
                store = None
            if now - listed_at >= 1.0:
                listed_at = now
                self._look_for_hosts()

    def _poll(self, store, host: Host, now: float) -> None:
        """A host is lost when its beats stop, or when a death its watcher counted stays without its record (the
        watcher writes the record before counting it), for `host_timeout_s`: whichever way its link was cut."""
        silent = heard(host, store.add(Key.host_beat(host.index), 0), now, self.config.host_timeout_s)
        if silent:
            self.lose(host, silent)
            return
        if watcher_stuck(host, store.add(Key.watcher_beat(host.index), 0), now):
            host.rewatching = True
            threading.Thread(target=self._rewatch, args=(host, host.deaths_seen), name="monarch-plugin-rewatch",
                             daemon=True).start()
        try:
            deaths = int(store.peek(Key.host_deaths(host.index)) or 0)
        except Forged:  # reported (`forged_value`); the watcher's next count replaces it
            deaths = host.deaths_seen
        while host.deaths_seen < deaths:
            key = Key.host_death(host.index, host.deaths_seen + 1)
            if not store.check([key]):  # never a blocking get: a record that never comes would stop the watch
                host.unrecorded_since = host.unrecorded_since or now
                if now - host.unrecorded_since > self.config.host_timeout_s:
                    self.lose(host, f"a death its watcher counted has had no record for "
                                    f"{now - host.unrecorded_since:.1f} s")
                return
            host.unrecorded_since = None
            host.deaths_seen += 1
            try:
                death = json.loads(store.get(key))
            except Forged:  # reported (`forged_value`); a real death is seen by supervision as well
                continue
            self._report.put(Died(death["replica"], f"watcher on {host.name} (pid {death['pid']} exited)"))

    def _rewatch(self, host: Host, reported: int) -> None:
        """Start a watcher on `host` in place of the one that stopped beating while the host's workers beat on: the
        watcher is a helper, and its loss (the OOM killer's pick, a stray kill, a stopped process) must not be its
        replicas' loss. The new one ends the old if it is only stuck, counts deaths on from `reported` (those the
        controller has read), and watches every replica's procs again (one that exited meanwhile is reported at
        once). A try the agent does not answer is tried again `_REWATCH_S` later (reported once); a host that stops
        beating meanwhile is lost by its beats as before."""
        t0, was = time.monotonic(), host.watcher_pid
        try:
            pid = self._replace_watcher(host, reported)
        except Exception as e:  # noqa: BLE001 - the agent did not answer: tried again, unless the host is lost
            pid = None
            host.rewatch_failures += 1
            if host.rewatch_failures == 1:
                self.events.emit("watcher_unreplaced", host=host.index, address=host.address, was=was,
                                 error=f"{type(e).__name__}: {e}")
        finally:
            host.watcher_heard_at = time.monotonic()  # the next try, or the new watcher's first beat, from now
            host.rewatching = False
        if pid is not None:
            host.rewatch_failures = 0
            self.events.emit("watcher_replaced", host=host.index, address=host.address, pid=pid, was=was,
                             seconds=round(time.monotonic() - t0, 3))

    def _replace_watcher(self, host: Host, reported: int) -> int | None:
        """The new watcher's pid, once it watches the host's replicas; None if the host was lost meanwhile."""
        from monarch_plugin.procs.watcher import HostWatcher

        procs_name, actor_name = watcher_names(host.index, host.watchers)
        host.watchers += 1  # a name each try: a failed try's procs may still be stopping
        procs = host.mesh.spawn_procs(per_host={"procs": 1}, name=procs_name,
                                      bootstrap_command=notice.bootstrap_command())
        try:
            watcher = procs.spawn(actor_name, HostWatcher, self.config.store_host, self._store.port, host.index,
                                  self._lease, self._secret, reported, host.watcher_pid)
            pid = watcher.pid.call_one().get(timeout=self.config.join_timeout_s)
        except BaseException:
            _stop(procs)
            raise
        with self._lock:
            old, live = host.watcher_procs, host.live
            if live:
                host.watcher, host.watcher_procs, host.watcher_pid = watcher, procs, pid
        if not live:
            _stop(procs)
            return None
        try:
            for replica, pids in list(host.watched.items()):
                watcher.watch.call_one(replica, pids).get(timeout=_CALL_S)
        except Exception:  # noqa: BLE001 - lost meanwhile: its beats say so
            pass
        threading.Thread(target=_stop, args=(old,), daemon=True).start()
        return pid

    def lose(self, host: Host, why: str) -> None:
        """Declare `host` lost (once, whoever finds it first): its procs that still run end at their next touch of
        the store, and the controller loses its replicas in one generation change."""
        with self._lock:
            if not host.live:
                return
            host.live = False
        try:
            self._store.set(Key.host_lost(host.index), "1")
        except Exception:  # noqa: BLE001 - the run is closing: the procs end by their leases
            pass
        self._report.put(HostLost(host.index, f"host {host.name} lost ({why})"))

    def gone(self, replica: int) -> bool:
        """After a failed spawn of `replica`: whether its host is gone, declared lost now if its watcher does not
        answer (the spawn then failed for the host's sake, not the replica's)."""
        host = self.host_of(replica)
        if host.watcher is None or host.rewatching:  # a watcher being replaced answers nothing; its host beats on
            return False
        if host.live:
            try:
                host.watcher.free_port.call_one().get(timeout=_CALL_S)
                return False
            except Exception as e:  # noqa: BLE001 - no answer is the answer
                self.lose(host, f"a spawn on it failed and its watcher does not answer ({type(e).__name__})")
        return True

    def _look_for_hosts(self) -> None:
        """Attach every listed address not tried yet: a new machine, or an agent restarted on a new port. An
        address is tried once: Monarch does not attach again an address it has marked lost."""
        for address in self.config.hosts + self._listed():
            if address not in self._tried:
                self._tried.add(address)
                threading.Thread(target=self._attach_late, args=(address,), daemon=True).start()

    def _attach_late(self, address: str) -> None:
        host = self._attach(address)
        if host is not None:
            self._report.put(HostUp(host.index, host.returning))


def slots(machine: dict, config: ElasticConfig) -> tuple[int, GpuPlan | None]:
    """How many replicas a host holds at once, and its GPU plan, from what its watcher reports of the machine: on
    a CPU host `replicas_per_host` (else room for the whole run), on a GPU host as many replicas as its GPUs fit
    (`procs_per_replica` each), at most `replicas_per_host`."""
    k, cap = config.procs_per_replica, config.replicas_per_host
    if machine["kind"] == "cpu":
        return cap or config.max_replicas + config.spares, None
    fits = machine["devices"] // k
    room = min(cap, fits) if cap else fits
    return room, plan_gpus(machine["kind"], machine["devices"], machine["environ"], room, k) if room else None


def heard(host: Host, beats: int, now: float, timeout_s: float) -> str | None:
    """Why `host` is lost, if it is: its beat count (its watcher's and its workers' leases together) has not moved
    for `timeout_s`. A count that moved is noted as heard `now`."""
    if beats != host.beats:
        host.beats, host.heard_at = beats, now
        return None
    return f"no beat for {now - host.heard_at:.1f} s" if now - host.heard_at > timeout_s else None


def watcher_stuck(host: Host, watcher_beats: int, now: float) -> bool:
    """Whether `host`'s watcher is to be replaced: its own beat has not moved for `_REWATCH_S` while the host beats
    on (its workers' leases heard within half that), and no replacement is under way. A count that moved is noted
    as heard `now`."""
    if watcher_beats != host.watcher_beats:
        host.watcher_beats, host.watcher_heard_at = watcher_beats, now
        return False
    return now - host.watcher_heard_at > _REWATCH_S and now - host.heard_at < _REWATCH_S / 2 and not host.rewatching


def _settle(future) -> None:
    """Wait for a call's answer off the controller's thread, and let an unreachable host's silence go."""
    try:
        future.get(timeout=_CALL_S)
    except Exception:  # noqa: BLE001 - an unreachable host is declared lost by its missing beats
        pass


def _stop(procs) -> None:
    try:
        procs.stop().get(timeout=_CALL_S)
    except Exception:  # noqa: BLE001 - an unreachable host's watcher ends by its lease
        pass
