"""The run loop and its state: `ElasticController`, which owns everything the controller knows of a run.

It starts the run (the store, the checkpoint resumed, the first replicas, this process's signal handlers), takes
the reports (deaths, returns, probes, host changes from the queue; what raised and the drains from the store) and
hands each to the module whose job it is, turns the checks of the supervision loop, and shuts everything down.
It decides only when the run is over (every finisher returned, or the grace after a late stop passed); every
other decision is its collaborators' (`spawning`, `deaths`, `drains`, `generations`, with `hangs`, `triage` and
`policies` for the pure ones), which read and write the state below through the controller they are handed, each
the part its docstring names. It may not take one of their decisions itself: it records a return, and hands on the rest.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import threading
import time
from functools import partial
from typing import Iterator

from monarch_plugin.backend import resolve_backend
from monarch_plugin.config import ElasticConfig
from monarch_plugin.controller import bootstrap, deaths, drains, generations, spawning
from monarch_plugin.controller.faults import FaultRouter
from monarch_plugin.controller.generations import EndedFirst, announce, give_up, stop_everything, verified
from monarch_plugin.controller.replica import Launch, Replica, RunResult
from monarch_plugin.errors import RunStopped
from monarch_plugin.events import EventLog
from monarch_plugin.procs import slurm
from monarch_plugin.procs.apart import in_child
from monarch_plugin.procs.hosts import Hosts
from monarch_plugin.procs.notice import NOTICE_SIGNALS
from monarch_plugin.storage.runlock import RunLock, hold
from monarch_plugin.target import Target
from monarch_plugin.wire.protocol import (
    Action,
    Died,
    HostLost,
    HostUp,
    Key,
    Outcome,
    Probed,
    Raised,
    ReplicaState,
    Report,
    Returned,
)
from monarch_plugin.wire.signing import SignedStore, new_secret

__all__ = ["ElasticController"]

logger = logging.getLogger("monarch_plugin")


class ElasticController:
    """Runs `target` on `config.replicas` replica groups and keeps it running through worker deaths."""

    def __init__(self, config: ElasticConfig, target: Target, launch: Launch | None = None,
                 held: list[RunLock] | None = None, in_place: bool = False):
        """`launch` starts a replica's procs and its two actors; Monarch's proc meshes unless given (a benchmark
        gives its own, to drive this controller with more simulated replicas than a machine holds processes).
        `held`: the run's files, already held by its caller (`runlock.hold`, which `run` calls otherwise).
        `in_place`: supervise from this process, which Monarch's runtime then stays in (`monarch-run`, a process
        of its own); otherwise a run on Monarch is supervised from a child process (`procs.apart`)."""
        config.validate()
        resolve_backend(config.backend)
        agents = None
        if config.slurm:  # the allocation's nodes are the hosts, their agents started by SLURM
            config, agents = slurm.for_run(config)
        self._resume_asked = config.resume is not None
        self._held = held
        self.config = config
        self.target = target
        self.events = EventLog(config.events_path, source="controller", share=config.share_files)
        self.replicas: dict[int, Replica] = {}
        self.gen = -1
        self.members: list[int] = []
        self.plans: dict[int, list[int]] = {}
        self.finished_gen: int | None = None
        """The generation whose members all reached the end of training together: once set, training is over, and no
        death, drain, signal or host loss is the run's failure any more (`generations.ended`)."""
        self.open_ends: list[int] = []
        """Generations whose end-of-training barrier this controller has not superseded: one of them may still pass."""
        self.stop_by: float | None = None
        """Told to stop after training ended: when the replicas still in their code after training are stopped."""
        self.deaths = 0
        self.restarts = 0
        self.early_deaths = 0
        self.wanted = config.replicas
        """The size the run trains at when it can: `replicas`, grown up to `max_replicas` by machines that join."""
        self.reports: queue.Queue = queue.Queue()
        """What the monitors report (`Report`): spawns, deaths, returns, probes' answers, hosts lost and joined."""
        # On one machine: plans its GPUs now (ConfigError if short). On several: each must see these paths.
        shared = [os.getcwd(), os.path.dirname(os.path.abspath(config.events_path or "x"))]
        if target.kind == "script":
            shared.append(os.path.abspath(target.entry))
        self.hosts = Hosts(config, self.events, self.reports, shared, target.imports, agents)
        self.launch: Launch = launch or partial(spawning.launch_on_monarch, self.hosts)
        self._apart = launch is None and not in_place
        self.closing = threading.Event()
        """Set once the run stops: from then on what happens is recorded, and decides nothing but who writes."""
        self.respawn_at: list[tuple[float, bool]] = []  # (when, whether it replaces a loss: counts as a restart)
        self.no_room = False
        self.store: SignedStore | None = None
        self.secret = new_secret()
        """What every value in the run's store is signed with (`signing`); its processes get it in their environment."""
        self.last_death = ""
        self.spawners: dict[int, threading.Thread] = {}  # replica -> the thread that starts it, then awaits it
        self.stalls_seen: dict[int, float] = {}  # generation -> when its stall report was first seen
        self.stall_counts: dict[int, int] = {}  # generation -> its `Key.stalled` count when last looked at
        self.announced_at = 0.0
        self.wedge_checked = -1  # the last generation probed for members wedged in an older formation
        self.stall_probed = -1  # the last generation probed for the member its stall waits on
        self.action = Action.TRAIN
        """What the current generation's members do."""
        self.raises: list[tuple[int, Raised]] = []  # (replica, report) of every training code that raised
        self.formed_gens: set[int] = set()  # generations every member's every proc said it formed (`Key.formed`)
        self._read: dict[str, int] = {}  # lines handled of each appended key (`Key.RAISED`, `Key.DRAINS`)
        self._unhandled: Report | None = None  # taken from the queue, not handled yet (`_drain`)
        self.told_to_stop: str | None = None  # the signal with notice this process received (its name)
        self.write_error: str | None = None  # why the last writer of a stop's checkpoint could not write it
        self.oom_floor = 0
        """The fewest replicas the run may train on since one ran out of memory (`policies.oom_floor`); 0: no floor."""

    # -- public ------------------------------------------------------------------------------------------

    def run(self) -> RunResult:
        """Train to the end: the finishing replicas' return values. A run on Monarch is supervised from a child
        of this process (unless `in_place`), so this process keeps only the result: Monarch's runtime, once
        started in a process, stays in it (`procs.apart`)."""
        locks = hold(self.config) if self._held is None else []  # before anything is spawned, in this process
        try:
            return in_child(self._run) if self._apart else self._run()
        finally:
            for lock in locks:
                lock.release()

    def _run(self) -> RunResult:
        t0 = time.time()
        faults = FaultRouter.installed()
        faults.active = self.reports
        # A signal with notice to this process (a preemption, `scancel`, `kill`) stops the run with a checkpoint.
        # Python sets handlers only from the main thread, where the controller runs under every front end.
        stopped: RunStopped | None = None
        previous = ({sig: signal.signal(sig, partial(drains.on_signal, self)) for sig in NOTICE_SIGNALS}
                    if threading.current_thread() is threading.main_thread() else {})
        try:
            self.store = bootstrap.open_store(self.config, self.secret, self.events)
            bootstrap.start_files(self.config, self.events)  # a killed run's half-written checkpoints go
            self.config, damaged = bootstrap.resume_from(self.config)
            self.events.emit(
                "run_start", target=self.target.describe(), replicas=self.config.replicas,
                min_replicas=self.config.min_replicas, max_replicas=self.config.max_replicas,
                procs_per_replica=self.config.procs_per_replica, store_port=self.store.port,
            )
            for path, why in damaged:
                bootstrap.damaged(self.events, path, why)
            if self._resume_asked:
                self.events.emit("resume", path=self.config.resume, message=(
                    f"resuming from {self.config.resume}" if self.config.resume else
                    f"no complete checkpoint in {self.config.checkpoint_dir} yet: starting from scratch"))
            self.hosts.start(self.store, self.secret)
            spawning.check_room(self)
            for _ in range(self.config.replicas):
                spawning.spawn(self, initial=True)
            for _ in range(self.config.spares):
                spawning.spawn(self, initial=False, restart=False)  # hot spares: they wait, ready, to be admitted
            self._wait_for_initial()
            self._supervise()
            return RunResult(
                values={r.rid: r.results for r in self.replicas.values() if r.state == ReplicaState.FINISHED},
                generations=self.gen + 1,
                replicas_spawned=len(self.replicas),
                deaths=self.deaths,
                events_path=self.config.events_path,
                seconds=time.time() - t0,
            )
        except RunStopped as e:
            stopped = e  # under SLURM the job may go back to the queue, once all below is done (`slurm.requeue`)
            raise
        finally:
            self._shutdown()
            faults.active = None
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if stopped is not None:
                slurm.requeue(stopped, self.config, self.events)

    def _wait_for_initial(self) -> None:
        deadline = time.monotonic() + self.config.join_timeout_s
        while True:
            self._drain(timeout=0.02)
            if self.closing.is_set():
                return
            drains.check_told(self)
            ready = [r.rid for r in self.replicas.values() if r.state == ReplicaState.WAITING and r.initial]
            # A target that never joins a generation (Lightning's test stage, a plain script) may return
            # before it would have been ready: it started all the same.
            done = [r.rid for r in self.replicas.values() if r.state == ReplicaState.FINISHED and r.initial]
            pending = [r for r in self.replicas.values() if r.state == ReplicaState.SPAWNING and r.initial]
            if not pending or time.monotonic() > deadline:
                break
        if len(ready) + len(done) < self.config.min_replicas:
            why = f"; last error: {self.last_death}" if self.last_death else ""
            give_up(self, f"only {len(ready)} of {self.config.replicas} replicas started (`min_replicas` "
                          f"{self.config.min_replicas}, `join_timeout_s` {self.config.join_timeout_s:.0f}){why}")
        if ready:
            first = ready[: self.config.max_replicas]
            for rid in first:  # each at the run's first step (or the checkpoint it resumed): the run's state
                self.replicas[rid].holds = True
            announce(self, first, reason="start", interrupt=False)

    # -- the supervision loop ------------------------------------------------------------------------------

    def _supervise(self) -> None:
        while not self.closing.is_set():
            try:
                self._drain(timeout=0.02)
                if self.closing.is_set():
                    return
                drains.check_told(self)
                if self.finished_gen is None:  # the run's decisions: none is taken once training is over
                    deaths.respawn_due(self)
                    drains.check_drains(self)
                    deaths.admit_ready(self)
                    deaths.check_starting(self)
                    deaths.check_stalled(self)
                    deaths.check_wedged(self)
                    generations.check_floor(self)
            except EndedFirst as e:
                logger.warning("the run's training ended before it could be stopped (%s): it is complete", e)
            stopped = self.stop_by is not None and time.monotonic() > self.stop_by
            if self._training_over() or stopped:
                left = [m for m in self._finishers() if self.replicas[m].state != ReplicaState.FINISHED]
                if stopped and any(self.replicas[m].state.live for m in left):
                    logger.warning("replicas %s had not returned from their code after training within `drain_grace_s` "
                                   "%g of %s: they are stopped; the run's training is complete", left,
                                   self.config.drain_grace_s, self.told_to_stop)
                self.events.emit("run_end", gen=self.finished_gen, members=self._finishers(),
                                 **({"unfinished": left} if left else {}))
                return

    def _finishers(self) -> list[int]:
        """Who must return before the run is over: the members of the generation that finished."""
        if self.finished_gen is not None and self.finished_gen >= 0:
            return self.plans[self.finished_gen]
        return self.members  # a target that never joined a generation: everyone it ran on

    def _training_over(self) -> bool:
        """Every replica that must return from training did (or died after it ended): the run is done."""
        if self.finished_gen is None:
            return False
        # Anyone else (a spare, a replacement admitted after that generation closed) has nothing left to
        # do; the shutdown that follows stops them.
        return all(self.replicas[m].state in (ReplicaState.FINISHED, ReplicaState.DEAD) for m in self._finishers())

    # -- reports ---------------------------------------------------------------------------------------------

    def _drain(self, timeout: float) -> None:
        try:
            self._unhandled = self.reports.get(timeout=timeout)
        except queue.Empty:
            pass
        # What raised, first: a proc that raised may exit soon after its report (a CUDA error's abort), and its death
        # would otherwise be taken for one that says nothing of the training code (out of memory, a repetition).
        # The report taken above stays `_unhandled` meanwhile: a give-up that what raised leads to waits for it.
        deaths.read_raised(self)
        drains.read_drains(self)
        while (item := self.next_report(0)) is not None:
            self.handle(item)
        for r in self.replicas.values():
            if r.state == ReplicaState.SPAWNING and r.pids and self._is_ready(r):
                r.state = ReplicaState.WAITING

    def next_report(self, timeout: float) -> Report | None:
        """The next report from the monitors: the one `_drain` took first, then the queue's (None: none came)."""
        if self._unhandled is not None:
            report, self._unhandled = self._unhandled, None
            return report
        try:
            return self.reports.get(timeout=timeout)
        except queue.Empty:
            return None

    def handle(self, report: Report) -> None:
        """Hand a monitor's report to the module whose job it is."""
        match report:
            case Probed(gen=gen) if gen != self.gen or self.closing.is_set():
                pass
            case Probed():
                deaths.on_probed(self, report)
            case HostLost(host=host, why=why):
                deaths.on_host_lost(self, host, why)
            case HostUp(host=host, returning=returning):
                deaths.on_host_up(self, host, returning=returning)
            case Died(replica=rid, how=how) if rid in self.replicas:
                deaths.on_deaths(self, [self.replicas[rid]], how)
            case Returned(replica=rid, outcomes=outcomes) if rid in self.replicas:
                self._on_return(self.replicas[rid], outcomes)

    def appended(self, kind, key: str, count: str) -> Iterator:
        """The `kind` reports appended under `key` since the last read (`count` says how many are in place), each
        counted read as it is handed out: one left when handling another gave up is read by the give-up's wait."""
        read = self._read.get(key, 0)
        if self.store is None or self.store.add(count, 0) <= read:
            return
        for line in self.store.lines(key)[read:]:
            self._read[key] = self._read.get(key, 0) + 1
            yield kind(**json.loads(line))

    def _is_ready(self, replica: Replica) -> bool:
        return verified(self.store, [Key.ready(replica.rid, lane) for lane in range(self.config.procs_per_replica)])

    def _on_return(self, replica: Replica, outcomes: list[Outcome]) -> None:
        errors = [o.raised for o in outcomes if o.status == "error"]
        if errors:
            deaths.on_raised(self, replica, errors[0])
        elif all(o.status == "ok" for o in outcomes):
            replica.state = ReplicaState.FINISHED
            replica.results = [o.value for o in outcomes]
            if self.finished_gen is None:
                self.finished_gen = outcomes[0].gen
            self.events.emit("finished", replica=replica.rid, gen=outcomes[0].gen)
        elif replica.state == ReplicaState.DRAINING:
            replica.state = ReplicaState.STOPPED
            self.events.emit("drained", replica=replica.rid, gen=replica.drain_gen,
                             seconds=round(time.monotonic() - replica.leaving_at, 3))
            deaths.end(self, replica)
        elif replica.state != ReplicaState.DEAD:
            replica.state = ReplicaState.STOPPED

    # -- shutdown --------------------------------------------------------------------------------------------

    def _shutdown(self) -> None:
        stop_everything(self)
        threads = [threading.Thread(target=spawning.stop_mesh, args=(self.hosts, r), daemon=True)
                   for r in self.replicas.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=15)
        # A replica still starting cleans itself up (above) before we go, and the stop above ends the others' wait
        # for their return; but not on a lost host, which never answers (waiting for those spawners cost every run
        # that lost a host 10 s at its end).
        deadline = time.monotonic() + 10
        for rid, spawner in self.spawners.items():
            if self.hosts.hosts[self.replicas[rid].host].live:
                spawner.join(timeout=max(0.0, deadline - time.monotonic()))
        for replica in self.replicas.values():
            self.hosts.kill(replica.rid)  # whatever a stop left behind
        self.hosts.close()
        self.store = None  # with the hosts' reference (closed above), the last: the store stops listening now
