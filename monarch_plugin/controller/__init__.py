"""The single controller: spawns replica groups on Monarch, decides every generation, replaces the dead.

It lives in the user's process and knows nothing about any training framework. Its whole vocabulary is
replicas (one Monarch ProcMesh each), generations (numbered plans in a TCPStore it hosts) and policies
(min/max replicas, restarts, crash loops). Deaths reach it three ways, whichever is first: a pidfd that
becomes readable when a local worker process exits (milliseconds), Monarch supervision (the replaced
`unhandled_fault_hook`, ~0.5 s), and a failed call to the replica's actor. An exception in a replica's
training code reaches it as the report its proc writes to the store (`Raised`): that replica is replaced as a
dead one is, unless another replica raised the same at the same step. A member that reports a stalled reduction
gets its peers' phases checked, and the one stuck outside the reduction is killed.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Callable, Iterator, NoReturn


from monarch_plugin.controller import policies
from monarch_plugin.backend import resolve_backend
from monarch_plugin.config import ElasticConfig
from monarch_plugin.errors import ConfigError, ElasticRunAborted, ReplicaCodeError, RunStopped
from monarch_plugin.events import EventLog, read_events
from monarch_plugin.wire.handshake import FORMATION_BOUND_S, passed, supersede
from monarch_plugin.procs import slurm
from monarch_plugin.procs.apart import in_child
from monarch_plugin.procs.hosts import Hosts
from monarch_plugin.procs.stores import AGENT_STORE_ENV, serve
from monarch_plugin.procs.notice import NOTICE_SIGNALS
from monarch_plugin.storage.runlock import RunLock, hold, holds_checkpoints
from monarch_plugin.wire.signing import SECRET_ENV, Forged, SignedStore, forged_reporter, new_secret
from monarch_plugin.wire.protocol import (
    START_METHOD_ENV,
    WAITING_ON_PEERS,
    Action,
    Died,
    Drain,
    HostLost,
    HostUp,
    Key,
    Outcome,
    Phase,
    Plan,
    Probed,
    Raised,
    ReplicaState,
    Report,
    Returned,
    Spawned,
    mesh_names,
    replica_of_mesh,
    spawned_by_controller,
    unfit_members,
)
from monarch_plugin.target import Target
from monarch_plugin.storage.checkpoint import clean_stale, damage, newest, newest_written, step_of

__all__ = ["ElasticController", "RunResult"]

logger = logging.getLogger("monarch_plugin")

_STALL_GRACE_S = 0.5
_DRAIN_SETTLE_S = 0.25
"""How long the controller gathers the first notices of a drain before it decides: a scheduler signals a whole job
within milliseconds, and every replica told to go at once means a stop with a checkpoint, not a drain each."""
_PROBE_TIMEOUT_S = 5.0
"""How long a probed control actor may take to say what its proc is doing; a frozen (SIGSTOPped) proc never does."""


class _EndedFirst(Exception):
    """A stop found the run's training already ended: its end barrier passed before the stop could close it."""


class _FaultRouter:
    """Monarch's `unhandled_fault_hook`, for the rest of the process once a controller has run in it.

    Monarch's default hook exits the process (a KeyboardInterrupt in the main thread) on any failure nobody
    handled. During a run a worker's death is news for the controller. After a run it is stale news: a replica
    killed as the run ended can be reported seconds after the shutdown, and restoring the default hook there
    turned a finished run into exit status 1. So the failures of meshes a controller spawned belong to the
    controller for the life of the process; any other mesh's failure goes to the hook that was there before."""

    def __init__(self, outer) -> None:
        self.outer = outer
        self.active: ElasticController | None = None

    def __call__(self, failure) -> None:
        active = self.active
        if active is not None:
            active._on_mesh_failure(failure)
        elif spawned_by_controller(str(getattr(failure, "mesh_name", ""))):
            logger.debug("after the run: %s", _first_line(failure))
        else:
            self.outer(failure)

    @classmethod
    def installed(cls) -> _FaultRouter:
        import monarch.actor

        if not isinstance(monarch.actor.unhandled_fault_hook, cls):
            monarch.actor.unhandled_fault_hook = cls(monarch.actor.unhandled_fault_hook)
        return monarch.actor.unhandled_fault_hook


def _first_line(failure) -> str:
    """Monarch's own words for a failure it supervised: the first line of its report (the rest is a stack dump)."""
    text = str(failure).strip()
    return text.splitlines()[0][:200] if text else type(failure).__name__


Launch = Callable[[int, int, dict], tuple[Any, Any, Any]]
"""`launch(replica, procs, env)` -> (proc mesh, `ControlActor` mesh, `ReplicaActor` mesh) of a new replica."""


@dataclass
class RunResult:
    """What `ElasticController.run` returns once every member finished training."""

    values: dict[int, list[Any]]
    """Return value of the target per finishing replica id (one entry per proc of the replica)."""
    generations: int
    replicas_spawned: int
    deaths: int
    events_path: str
    seconds: float


@dataclass
class _Replica:
    rid: int
    initial: bool
    host: int = 0
    state: ReplicaState = ReplicaState.SPAWNING
    mesh: Any = None
    control: Any = None
    actor: Any = None
    pids: list[int] = field(default_factory=list)
    spawned_at: float = 0.0
    results: list[Any] | None = None
    admitted: bool = False
    mesh_stopped: bool = False
    holds: bool = False
    """It holds the run's trained state (`Plan.holders`): a member of the first generation, or every proc of it
    counted in `Key.holds` since."""
    raised: Raised | None = None
    """Its training code raised (the first of its procs to report it)."""
    kept: bool = False
    """Its training code raised while its one proc held the run's state untouched: the proc is kept until the run's
    decision is taken, in case the run stops with no replica in training left to write the give-up checkpoint."""
    ended: bool = False
    """Its procs were killed after its death (`ElasticController._end`)."""
    leaving: Drain | None = None
    """A proc of it received a signal with notice (its first report): it drains at the next step boundary."""
    leaving_at: float = 0.0
    drain_gen: int = -1
    """The generation published without it (`ReplicaState.DRAINING`)."""


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
        self.replicas: dict[int, _Replica] = {}
        self.gen = -1
        self.members: list[int] = []
        self.plans: dict[int, list[int]] = {}
        self.finished_gen: int | None = None
        """The generation whose members all reached the end of training together: once set, training is over, and no
        death, drain, signal or host loss is the run's failure any more (`_ended`)."""
        self._open_ends: list[int] = []
        """Generations whose end-of-training barrier this controller has not superseded: one of them may still pass."""
        self._stop_by: float | None = None
        """Told to stop after training ended: when the replicas still in their code after training are stopped."""
        self.deaths = 0
        self.restarts = 0
        self.early_deaths = 0
        self.wanted = config.replicas
        """The size the run trains at when it can: `replicas`, grown up to `max_replicas` by machines that join."""
        self._q: queue.Queue = queue.Queue()
        self._launch = launch or self._launch_on_monarch
        self._apart = launch is None and not in_place
        # On one machine: plans its GPUs now (ConfigError if short). On several: each must see these paths.
        shared = [os.getcwd(), os.path.dirname(os.path.abspath(config.events_path or "x"))]
        if target.kind == "script":
            shared.append(os.path.abspath(target.entry))
        self.hosts = Hosts(config, self.events, self._q, shared, target.imports, agents)
        self._closing = threading.Event()
        self._respawn_at: list[tuple[float, bool]] = []  # (when, whether it replaces a loss: counts as a restart)
        self._no_room = False
        self.store: SignedStore | None = None
        self._secret = new_secret()
        """What every value in the run's store is signed with (`signing`); its processes get it in their environment."""
        self._last_death = ""
        self._spawners: dict[int, threading.Thread] = {}  # replica -> the thread that starts it, then awaits it
        self._stalls_seen: dict[int, float] = {}  # generation -> when its stall report was first seen
        self._stall_counts: dict[int, int] = {}  # generation -> its `Key.stalled` count when last looked at
        self._announced_at = 0.0
        self._wedge_checked = -1  # the last generation probed for members wedged in an older formation
        self._stall_probed = -1  # the last generation probed for the member its stall waits on
        self.action = Action.TRAIN
        """What the current generation's members do."""
        self._raises: list[tuple[int, Raised]] = []  # (replica, report) of every training code that raised
        self._formed_gens: set[int] = set()  # generations every member's every proc said it formed (`Key.formed`)
        self._read: dict[str, int] = {}  # lines handled of each appended key (`Key.RAISED`, `Key.DRAINS`)
        self._unhandled: Report | None = None  # taken from the queue, not handled yet (`_next_report`)
        self._told_to_stop: str | None = None  # the signal with notice this process received (its name)
        self._write_error: str | None = None  # why the last writer of a stop's checkpoint could not write it
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
        faults = _FaultRouter.installed()
        faults.active = self
        # A signal with notice to this process (a preemption, `scancel`, `kill`) stops the run with a checkpoint.
        # Python sets handlers only from the main thread, where the controller runs under every front end.
        stopped: RunStopped | None = None
        previous = ({sig: signal.signal(sig, self._on_signal) for sig in NOTICE_SIGNALS}
                    if threading.current_thread() is threading.main_thread() else {})
        try:
            self.store = SignedStore(serve(self.config.store_host, 0, self.config.join_timeout_s),
                                     bytes.fromhex(self._secret), on_forged=forged_reporter(self.events))
            self.store.set(Key.LATEST, "-1")
            if self.config.events_path:  # one file per run, so reports never mix runs
                open(self.config.events_path, "w").close()
            if holds_checkpoints(self.config):  # this run holds the checkpoint directory: what a killed run left half-written goes
                stale = clean_stale(self.config.checkpoint_dir)
                if stale:
                    self.events.emit("checkpoint_cleaned", paths=stale)
            damaged = self._resume_from()
            self.events.emit(
                "run_start", target=self.target.describe(), replicas=self.config.replicas,
                min_replicas=self.config.min_replicas, max_replicas=self.config.max_replicas,
                procs_per_replica=self.config.procs_per_replica, store_port=self.store.port,
            )
            for path, why in damaged:
                self._damaged(path, why)
            if self._resume_asked:
                self.events.emit("resume", path=self.config.resume, message=(
                    f"resuming from {self.config.resume}" if self.config.resume else
                    f"no complete checkpoint in {self.config.checkpoint_dir} yet: starting from scratch"))
            self.hosts.start(self.store, self._secret)
            self._check_room()
            for _ in range(self.config.replicas):
                self._spawn(initial=True)
            for _ in range(self.config.spares):
                self._spawn(initial=False, restart=False)  # hot spares: they wait, ready, to be admitted
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

    def _resume_from(self) -> list[tuple[str, str]]:
        """The checkpoint the replicas resume (`resume`), checked against the digests written with it: "auto" takes the
        newest intact one, passing over damaged ones (returned as (path, why), to report); a damaged one named, or only
        damaged ones there, is a ConfigError before anything is spawned."""
        if self.config.resume is None:
            return []
        if self.config.resume != "auto":
            why = damage(self.config.resume)
            if why:
                raise ConfigError(f"`resume`: the checkpoint {self.config.resume} is damaged: {why}; resume another "
                                  "one, or 'auto' for the newest intact one in `checkpoint_dir`", "resume")
            return []
        damaged: list[tuple[str, str]] = []
        path = newest(self.config.checkpoint_dir, skipped=lambda p, why: damaged.append((p, why)))
        if path is None and damaged:
            raise ConfigError(f"`resume` auto: every complete checkpoint in {self.config.checkpoint_dir} is damaged (the "
                              f"newest, {damaged[0][0]}: {damaged[0][1]}): resume one by its path if you trust it, or "
                              "give this run another `checkpoint_dir` to start from scratch", "resume")
        self.config = replace(self.config, resume=path)  # the replicas all load the same one, found once here
        return damaged

    def _damaged(self, path: str, why: str) -> None:
        """A damaged checkpoint passed over for an older one (`checkpoint.damage`)."""
        self.events.emit("checkpoint_damaged", path=path, why=why)
        logger.warning("the checkpoint %s is damaged: %s; it is passed over for an older one", path, why)

    # -- spawning ------------------------------------------------------------------------------------------

    def _check_room(self) -> None:
        """The hosts must hold the replicas a run starts with (later ones may wait for room)."""
        room = sum(slots for slots, _ in self.hosts.rooms().values())
        wanted = self.config.replicas + self.config.spares
        if room < wanted:
            gpus = f"{self.config.procs_per_replica} GPU(s) each, " if any(h.gpus for h in self.hosts.hosts) else ""
            failed = "; ".join(f"{address}: {why}" for address, why in self.hosts.failures)
            refused = f"; not used: {failed}" if failed else ""
            raise ConfigError(
                f"the hosts hold {room} replica(s) at once ({gpus}`replicas_per_host` "
                f"{self.config.replicas_per_host}{refused}) but the run starts {wanted} (`replicas` + "
                "`spares`): add hosts, raise `replicas_per_host`, or start fewer", "replicas"
            )

    def _spawn(self, initial: bool, restart: bool = True) -> bool:
        """Start a replica on the host with the most room; False if no host has room (nothing is started).
        `restart`: it replaces a lost one (a spare, or growth onto a new machine, is not a restart)."""
        spot = policies.place(self.hosts.rooms())
        if spot is None:
            return False
        rid = len(self.replicas)
        replica = _Replica(rid=rid, initial=initial, host=spot[0], spawned_at=time.time())
        self.replicas[rid] = replica
        self.hosts.take(rid, *spot)
        if not initial and restart:
            self.restarts += 1
        spawner = threading.Thread(target=self._spawn_worker, args=(replica,), daemon=True, name=f"spawn-{rid}")
        self._spawners[rid] = spawner
        spawner.start()
        return True

    def _launch_on_monarch(self, rid: int, procs: int, env: dict[str, str]) -> tuple[Any, Any, Any]:
        from monarch_plugin.worker.actors import ControlActor, ReplicaActor

        mesh_name, control_name, actor_name = mesh_names(rid)
        mesh = self.hosts.spawn_procs(rid, procs, mesh_name)
        return mesh, mesh.spawn(control_name, ControlActor), mesh.spawn(actor_name, ReplicaActor, env)

    def _spawn_worker(self, replica: _Replica) -> None:
        k = self.config.procs_per_replica
        env = {
            **self.config.env,
            **self.config.to_env(),
            "MONARCH_PLUGIN_REPLICA_ID": str(replica.rid),
            "MONARCH_PLUGIN_INITIAL": "1" if replica.initial else "0",
            "MONARCH_PLUGIN_STORE_HOST": self.config.store_host,
            "MONARCH_PLUGIN_STORE_PORT": str(self.store.port),
            SECRET_ENV: self._secret,
            # The replica's own group stays on its host's loopback, gloo's sockets and its store included (served by
            # its first proc: `ReplicaActor`).
            "MASTER_ADDR": "127.0.0.1",
            **AGENT_STORE_ENV,
            "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
            "WORLD_SIZE": str(k),
            "LOCAL_WORLD_SIZE": str(k),
            # torchrun's default: replicas share the host's cores, and a thread pool per core each thrashes.
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            START_METHOD_ENV: multiprocessing.get_start_method(allow_none=True) or "",
            **self.hosts.env_for(replica.rid),
        }
        try:
            env["MASTER_PORT"] = str(self.hosts.free_port(replica.rid))  # free there, not here
            replica.mesh, replica.control, replica.actor = self._launch(replica.rid, k, env)
            infos = list(replica.control.info.call().get(timeout=self.config.join_timeout_s).values())
            replica.pids = [i["pid"] for i in infos]
            self.hosts.watch(replica.rid, replica.pids)
            if self._closing.is_set():  # the run ended while this replica started: it must not outlive it
                self.hosts.kill(replica.rid)
                self._stop_mesh(replica)
                return
            future = replica.actor.run.call(self.target)
        except Exception as e:  # noqa: BLE001 - a failed spawn is reported as a death of that replica
            if not self.hosts.gone(replica.rid):  # else its host's loss takes it, and it is no crash of its own
                self._q.put(Died(replica.rid, f"spawn failed: {type(e).__name__}: {e}"))
            return
        self.events.emit("spawn", replica=replica.rid, pids=replica.pids, initial=replica.initial,
                         host=self.hosts.host_of(replica.rid).name, seconds=round(time.time() - replica.spawned_at, 3))
        self._q.put(Spawned(replica.rid))
        while True:
            try:
                results = list(future.get(timeout=_PROBE_TIMEOUT_S).values())
                break
            except TimeoutError:  # training goes on; but a lost host's procs never answer, nor does Monarch for them
                if not self.hosts.hosts[replica.host].live:  # its loss took the replica (`HostLost`)
                    return
            except Exception as e:  # noqa: BLE001 - supervision errors mean the process died
                self._q.put(Died(replica.rid, f"supervision ({type(e).__name__}: {_first_line(e)})"))
                return
        self._q.put(Returned(replica.rid, results))

    def _wait_for_initial(self) -> None:
        deadline = time.monotonic() + self.config.join_timeout_s
        while True:
            self._drain(timeout=0.02)
            if self._closing.is_set():
                return
            self._check_told()
            ready = [r.rid for r in self.replicas.values() if r.state == ReplicaState.WAITING and r.initial]
            # A target that never joins a generation (Lightning's test stage, a plain script) may return
            # before it would have been ready: it started all the same.
            done = [r.rid for r in self.replicas.values() if r.state == ReplicaState.FINISHED and r.initial]
            pending = [r for r in self.replicas.values() if r.state == ReplicaState.SPAWNING and r.initial]
            if not pending or time.monotonic() > deadline:
                break
        if len(ready) + len(done) < self.config.min_replicas:
            why = f"; last error: {self._last_death}" if self._last_death else ""
            self._give_up(
                f"only {len(ready)} of {self.config.replicas} replicas started (`min_replicas` "
                f"{self.config.min_replicas}, `join_timeout_s` {self.config.join_timeout_s:.0f}){why}"
            )
        if ready:
            first = ready[: self.config.max_replicas]
            for rid in first:  # each at the run's first step (or the checkpoint it resumed): the run's state
                self.replicas[rid].holds = True
            self._announce(first, reason="start", interrupt=False)

    # -- the supervision loop ------------------------------------------------------------------------------

    def _supervise(self) -> None:
        while not self._closing.is_set():
            try:
                self._drain(timeout=0.02)
                if self._closing.is_set():
                    return
                self._check_told()
                if self.finished_gen is None:  # the run's decisions: none is taken once training is over
                    self._respawn_due()
                    self._check_drains()
                    self._admit_ready()
                    self._check_starting()
                    self._check_stalled()
                    self._check_wedged()
                    self._check_floor()
            except _EndedFirst as e:
                logger.warning("the run's training ended before it could be stopped (%s): it is complete", e)
            stopped = self._stop_by is not None and time.monotonic() > self._stop_by
            if self._training_over() or stopped:
                left = [m for m in self._finishers() if self.replicas[m].state != ReplicaState.FINISHED]
                if stopped and any(self.replicas[m].state.live for m in left):
                    logger.warning("replicas %s had not returned from their code after training within `drain_grace_s` "
                                   "%g of %s: they are stopped; the run's training is complete", left,
                                   self.config.drain_grace_s, self._told_to_stop)
                self.events.emit("run_end", gen=self.finished_gen, members=self._finishers(),
                                 **({"unfinished": left} if left else {}))
                return

    def _finishers(self) -> list[int]:
        """Who must return before the run is over: the members of the generation that finished."""
        if self.finished_gen is not None and self.finished_gen >= 0:
            return self.plans[self.finished_gen]
        return self.members  # a target that never joined a generation: everyone it ran on

    def _ended(self) -> bool:
        """Training is over: every member of a generation reached the end of training together. A replica that returned
        from training says so (`_on_return`); before one has, the store does, once that generation's end barrier passed
        in every lane (`handshake.passed`): its members may still be running their own code after training (an
        evaluation, an upload, a slow exit), and whatever happens to them then is no failure of the run's. Asked where a
        decision is taken, not on every turn of the supervision loop."""
        if self.finished_gen is None and self.store is not None:
            formed = max(self._formed_gens, default=-1)  # members that formed it left every older generation's end
            self._open_ends = [g for g in self._open_ends if g >= formed]
            lanes = range(self.config.procs_per_replica)
            self.finished_gen = next((g for g in self._open_ends
                                      if all(passed(self.store, Key.finished(g, lane)) for lane in lanes)), None)
        return self.finished_gen is not None

    def _close_ends(self) -> bool:
        """Supersede every end barrier still open, so that no member passes one from now on: whether training ended
        before (one had passed already: `finished_gen` is then set). The supersede is the moment that decides a race
        between the last member arriving at the end and a decision to replace or stop its generation."""
        for g in self._open_ends:
            for lane in range(self.config.procs_per_replica):
                supersede(self.store, Key.finished(g, lane))
        return self._ended()

    def _training_over(self) -> bool:
        """Every replica that must return from training did (or died after it ended): the run is done."""
        if self.finished_gen is None:
            return False
        # Anyone else (a spare, a replacement admitted after that generation closed) has nothing left to
        # do; the shutdown that follows stops them.
        return all(self.replicas[m].state in (ReplicaState.FINISHED, ReplicaState.DEAD) for m in self._finishers())

    def _drain(self, timeout: float) -> None:
        try:
            self._unhandled = self._q.get(timeout=timeout)
        except queue.Empty:
            pass
        # What raised, first: a proc that raised may exit soon after its report (a CUDA error's abort), and its death
        # would otherwise be taken for one that says nothing of the training code (out of memory, a repetition).
        # The report taken above stays `_unhandled` meanwhile: a give-up that what raised leads to waits for it.
        self._read_raised()
        self._read_drains()
        while (item := self._next_report(0)) is not None:
            self._handle(item)
        for r in self.replicas.values():
            if r.state == ReplicaState.SPAWNING and r.pids and self._is_ready(r):
                r.state = ReplicaState.WAITING

    def _next_report(self, timeout: float) -> Report | None:
        """The next report from the monitors: the one `_drain` took first, then the queue's (None: none came)."""
        if self._unhandled is not None:
            report, self._unhandled = self._unhandled, None
            return report
        try:
            return self._q.get(timeout=timeout)
        except queue.Empty:
            return None

    def _handle(self, report: Report) -> None:
        match report:
            case Probed(gen=gen) if gen != self.gen or self._closing.is_set():
                pass
            case Probed(statuses=statuses, wedged=wedged):
                (self._judge_wedged if wedged else self._judge_stall)(statuses)
            case HostLost(host=host, why=why):
                self._on_host_lost(host, why)
            case HostUp(host=host, returning=returning):
                self._on_host_up(host, returning=returning)
            case Died(replica=rid, how=how) if rid in self.replicas:
                self._on_death(self.replicas[rid], how)
            case Returned(replica=rid, outcomes=outcomes) if rid in self.replicas:
                self._on_return(self.replicas[rid], outcomes)

    def _is_ready(self, replica: _Replica) -> bool:
        return self._verified([Key.ready(replica.rid, lane) for lane in range(self.config.procs_per_replica)])

    def _verified(self, keys: list[str]) -> bool:
        """Every key is set to a value signed with the run's secret (one that is not was reported: `forged_value`)."""
        try:
            return self.store.verified(keys)
        except Forged:
            return False

    def _on_return(self, replica: _Replica, outcomes: list[Outcome]) -> None:
        errors = [o.raised for o in outcomes if o.status == "error"]
        if errors:
            self._on_raised(replica, errors[0])
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
            self._end(replica)
        elif replica.state != ReplicaState.DEAD:
            replica.state = ReplicaState.STOPPED

    def _read_raised(self) -> None:
        """What the store says raised: a proc of a replica of several tells it there at once, while its siblings may
        be stuck in a collective with it, so that the replica's actor call never returns."""
        for raised in self._appended(Raised, Key.RAISED, Key.RAISED_COUNT):
            if raised.replica in self.replicas:
                self._on_raised(self.replicas[raised.replica], raised)

    def _appended(self, kind, key: str, count: str) -> Iterator:
        """The `kind` reports appended under `key` since the last read (`count` says how many are in place), each
        counted read as it is handed out: one left when handling another gave up is read by the give-up's wait."""
        read = self._read.get(key, 0)
        if self.store is None or self.store.add(count, 0) <= read:
            return
        for line in self.store.lines(key)[read:]:
            self._read[key] = self._read.get(key, 0) + 1
            yield kind(**json.loads(line))

    def _on_raised(self, replica: _Replica, raised: Raised) -> None:
        """A replica's training code raised (a CUDA, NCCL or out-of-memory error, a flaky disk), or the runtime's own
        part of it failed: that replica's failure, replaced as after a death. Unless it is the code's own bug, which
        no replacement fixes: raised by the target's load, by an initial replica before its first step (set-up, which
        every replica runs alike: Lightning's sanity check and `MisconfigurationException`s), after the end of
        training, or the same exception at the same step as another replica raised (on other data). The runtime's
        own failures (`Raised.runtime`) are never the code's."""
        if replica.raised is not None or not replica.state.live:
            return  # one report a replica: its first proc's
        replica.raised = raised
        code = not raised.runtime
        if raised.stage == "load" or (code and (raised.finished or (raised.step < 0 and replica.initial))):
            self._stop_on_code_error(replica, raised)
        where = f"at step {raised.step}" if raised.step >= 0 else "before its first step"
        self._raises.append((replica.rid, raised))
        replica.kept = raised.held is not None and self.config.procs_per_replica == 1 and self._holds(replica)
        if raised.runtime == "store":  # someone steers the run from outside: nothing the store says can be trusted
            replica.state = ReplicaState.STOPPED
            self._give_up(policies.forged(replica.rid, raised.error, f"{self.config.store_host}:{self.store.port}"))
        twin = None if not code or raised.step < 0 else next(
            ((r, o) for r, o in self._raises[:-1] if r != replica.rid and not o.runtime
             and (o.kind, o.step) == (raised.kind, raised.step)), None)
        if twin is not None:
            replica.state = ReplicaState.STOPPED
            first, other = twin
            tracebacks = "".join(f"\n--- replica {r} traceback ---\n{o.traceback.rstrip()}"
                                 for r, o in ((first, other), (replica.rid, raised)))
            self._give_up(policies.same_error(first, replica.rid, raised), tracebacks, ReplicaCodeError)
        logger.warning("replica %d raised %s: %s\n--- replica %d traceback ---\n%s", replica.rid, where, raised.error,
                       replica.rid, raised.traceback.rstrip())
        if raised.oom and replica.state == ReplicaState.MEMBER:  # sized by the generation it ran out of memory in
            world = len(self.plans.get(raised.gen, self.members))
            self.oom_floor = max(self.oom_floor, policies.oom_floor(world, self.config))
        how = f"its monarch-plugin {raised.runtime} failed" if raised.runtime else f"raised {raised.kind.rsplit('.')[-1]}"
        self._on_deaths([replica], f"{how} {where}")

    def _stop_on_code_error(self, replica: _Replica, raised: Raised) -> NoReturn:
        """The code fails wherever it runs: stop the run at once, respawning nobody."""
        replica.state = ReplicaState.DEAD
        self.events.emit("user_error", replica=replica.rid, error=raised.error, stage=raised.stage)
        self._stop_everything()
        if raised.stage == "load":
            what = (
                f"replica {replica.rid} could not load the target ({raised.error}): replicas run in the "
                "controller's working directory with its sys.path, and what the target imports must be "
                "importable from there; install the module or keep it in a directory the replicas can read"
            )
        elif raised.finished:
            what = f"the training code raised in replica {replica.rid} after training ended: {raised.error}"
        else:
            what = (f"the training code raised in replica {replica.rid} before its first step, while setting up "
                    f"(every replica runs the same set-up): {raised.error}")
        raise ReplicaCodeError(f"{what}\n--- replica traceback ---\n{raised.traceback}")

    # -- signals with notice --------------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame) -> None:
        """SIGTERM or SIGUSR1 to this process, on its main thread: acted on by the supervision loop (`_check_told`)."""
        self._told_to_stop = self._told_to_stop or signal.Signals(signum).name

    def _check_told(self) -> None:
        """This process was told to stop: the run stops with a checkpoint of its last committed step (the step in
        flight is dropped), whatever the replicas are doing, and `RunStopped` says how to resume."""
        if self._told_to_stop is None or self._closing.is_set() or self._stop_by is not None:
            return
        name = self._told_to_stop
        if self._ended():  # nothing to save: the replicas still in their own code after training get a drain's grace
            self._stop_by = time.monotonic() + self.config.drain_grace_s
            logger.warning("%s received after training ended: the run's training is complete; replicas still in their "
                           "code after training may take `drain_grace_s` %g to return", name, self.config.drain_grace_s)
            return
        logger.warning("%s received: the run stops with a checkpoint of its last committed step", name)
        self._give_up(f"{name} received", error=partial(RunStopped, signal=name))

    def _read_drains(self) -> None:
        """The signals with notice the replicas' procs received (`procs.notice` tells them through the store)."""
        for drain in self._appended(Drain, Key.DRAINS, Key.DRAIN_COUNT):
            if drain.replica in self.replicas:
                self._on_drain(self.replicas[drain.replica], drain)
            elif drain.replica < 0 and 0 <= drain.host < len(self.hosts.hosts):
                self._on_host_drain(drain)

    def _on_drain(self, replica: _Replica, drain: Drain) -> None:
        """A proc of the replica was told to go: its replacement starts now, and the replica leaves at a step boundary
        (`_check_drains`)."""
        if replica.leaving is not None or not replica.state.live or self._closing.is_set():
            return
        replica.leaving, replica.leaving_at = drain, time.monotonic()
        self.events.emit("notice", replica=replica.rid, signal=drain.signal, pid=drain.pid, lane=drain.lane,
                         state=replica.state.value)
        if self._ended():
            logger.warning("replica %d got %s (proc %d) after training ended: its own code after training goes on; the "
                           "run's training is complete", replica.rid, drain.signal, drain.pid)
            return
        logger.warning("replica %d got %s (proc %d): it leaves at the next step boundary", replica.rid, drain.signal,
                       drain.pid)
        self._schedule_respawn(restart=False)

    def _on_host_drain(self, drain: Drain) -> None:
        """A host told to go (its agent passed the signal on to its procs, and its watcher told us): none of the run's
        replicas is placed there any more, and all of its replicas drain together, in one generation change."""
        host = self.hosts.hosts[drain.host]
        if host.leaving or not host.live or self._closing.is_set():
            return
        host.leaving = True
        going = [r for r in self.replicas.values() if r.host == drain.host and r.state.live]
        self.events.emit("host_drain", host=host.name, signal=drain.signal, replicas=[r.rid for r in going])
        for replica in going:
            self._on_drain(replica, replace(drain, replica=replica.rid))

    def _check_drains(self) -> None:
        """Replicas told to go leave at the next step boundary, in one generation change for all told at once: the
        generation without them is published as a grow is (no step dropped: every member commits the step in flight,
        agreeing inside it to move), once the current one has formed. One not yet a member just goes. Past
        `drain_grace_s` a replica still there is treated as dead. Every replica told to go, or fewer than
        `min_replicas` left, stops the run with a checkpoint instead (`policies.drain_stop`)."""
        now = time.monotonic()
        told = [r for r in self.replicas.values() if r.leaving is not None and r.state.live]
        if not told or self._closing.is_set() or self._ended():
            return
        late = [r for r in told if now - r.leaving_at > self.config.drain_grace_s]
        if late:
            for r in late:
                self.hosts.kill(r.rid)
            self._on_deaths(late, f"no step boundary within `drain_grace_s` {self.config.drain_grace_s:g} after "
                                  f"{late[0].leaving.signal}")
            return
        for r in told:
            if r.state in (ReplicaState.SPAWNING, ReplicaState.WAITING):  # it trained nothing: it just goes
                r.state = ReplicaState.STOPPED
                self.events.emit("drained", replica=r.rid, gen=-1, seconds=round(now - r.leaving_at, 3))
                self._end(r)
        pending = [r for r in told if r.state == ReplicaState.MEMBER]
        if not pending or now - min(r.leaving_at for r in pending) < _DRAIN_SETTLE_S:
            return
        leaving = [r.rid for r in pending]
        staying = [m for m in self.members if self.replicas[m].state == ReplicaState.MEMBER and m not in leaving]
        name = pending[0].leaving.signal
        stop = policies.drain_stop(len(staying), leaving, name, self.config)
        if stop:
            logger.warning("the run stops: %s", stop)
            self._give_up(stop, error=partial(RunStopped, signal=name))
        if self.action != Action.WAIT and not self._formed(self.gen):
            return  # members leaving a half-formed generation would strand their peers in it: at its first boundary
        who = f"replica {leaving[0]}" if len(leaving) == 1 else f"replicas {leaving}"
        reason = f"{who} drained ({name})"
        if self.action == Action.WAIT:  # nobody trains: nothing in flight to finish
            self._replan(staying, reason, reason)
        else:
            self._announce(staying, reason=reason, interrupt=False)
        for r in pending:
            r.state, r.drain_gen = ReplicaState.DRAINING, self.gen
        self.events.emit("drain", replicas=leaving, gen=self.gen, members=staying, signal=name)
        logger.warning("%s leave(s) at the next step boundary (%s): training goes on with replicas %s", who, name,
                       staying)

    def _on_death(self, replica: _Replica, how: str, why: str = "") -> None:
        self._on_deaths([replica], how, why)

    def _on_host_lost(self, host: int, how: str) -> None:
        """Every replica on the host is gone at once: one generation change, not one per replica."""
        lost = [r for r in self.replicas.values() if r.host == host and r.state.live]
        self.events.emit("host_lost", host=self.hosts.hosts[host].name, replicas=[r.rid for r in lost], reason=how)
        self._on_deaths(lost, how, host_lost=True)

    def _on_host_up(self, host: int, returning: bool) -> None:
        """A host joined: replicas waiting for room can go there; a new machine (not one that came back) also
        grows the run, up to `max_replicas`."""
        if self._closing.is_set():
            return
        if not returning:
            grown = policies.grown(self.wanted, self.hosts.hosts[host].slots, self.config)
            if grown > self.wanted:
                self.events.emit("grow", host=self.hosts.hosts[host].name, replicas=grown, was=self.wanted)
                self._respawn_at += [(time.monotonic(), False)] * (grown - self.wanted)
                self.wanted = grown
        self._schedule_respawn()

    def _on_deaths(self, replicas: list[_Replica], how: str, why: str = "", host_lost: bool = False) -> None:
        """`how`: what noticed it (the events' `detected_by`); `why`: what the probe found in a hung one.
        `host_lost`: they went with their host, which says nothing of the training code: a replacement still
        starting there does not count towards the crash loop."""
        dead = [r for r in replicas if r.state not in (ReplicaState.DEAD, ReplicaState.FINISHED, ReplicaState.STOPPED)]
        if not dead:
            return
        spawning = len(self._respawn_at)
        lost_members = []
        for replica in dead:
            # One draining was a member while the generation without it has not formed: its peers may be in a step
            # with it.
            was_member = replica.state == ReplicaState.MEMBER or (
                replica.state == ReplicaState.DRAINING and not self._formed(replica.drain_gen))
            replica.state = ReplicaState.DEAD
            self._last_death = how
            self.deaths += 1
            self.events.emit("death", replica=replica.rid, pids=replica.pids, detected_by=how,
                             gen=self.gen, was_member=was_member, host=self.hosts.host_of(replica.rid).name)
            self.hosts.unwatch(replica.rid)
            if not replica.kept:  # a kept one goes once the run's decision is taken, below
                self._end(replica)
            if not replica.initial and not replica.admitted and not host_lost:
                self.early_deaths += 1
            if was_member:
                lost_members.append(replica.rid)
        if self._closing.is_set():
            return
        ids = [r.rid for r in dead]
        what = (f"replica {ids[0]}" if len(ids) == 1 else f"replicas {ids}") + (
            f" {how}" if dead[0].raised else f" died ({how}{': ' + why if why else ''})")
        where = sorted({self.hosts.host_of(r).name for r in ids})
        if (self.config.hosts or self.config.hosts_file) and not all(w in how for w in where):
            what += f" on {', '.join(where)}"
        if self._ended():
            logger.warning("%s after training ended, in its own code after training: the run's training is complete",
                           what)
            return
        if lost_members:
            survivors = [m for m in self.members if self.replicas[m].state == ReplicaState.MEMBER]
            members = policies.next_members(survivors, self._ready_waiting(), self.wanted)
            # Who can train: the survivors and the ready replicas that heal from them.
            stop = policies.below_min(len(members), self.config)
            if stop:
                logger.warning("%s: the run stops (%s)", what, stop)
                # What raised, with its traceback: the stop's cause, which the message would otherwise not name.
                tracebacks = "".join(f"\n--- replica {r.rid} traceback ---\n{r.raised.traceback.rstrip()}"
                                     for r in dead if r.raised is not None)
                self._give_up(f"{what}: {stop}", tracebacks)
                return
            who = f"replica {lost_members[0]}" if len(lost_members) == 1 else f"replicas {lost_members}"
            restoring = self._replan(members, f"{who} died", what)
            spares = [m for m in members if m not in survivors]
            what += restoring or (f": training goes on with replicas {members}"
                                  + (f" (hot spare {spares} admitted)" if spares else ""))
        else:
            what += " before it trained"
        stop = policies.crash_loop(self.early_deaths, self.config)
        if stop:
            logger.warning("%s; the run stops (%s)", what, stop)
            self._give_up(stop)
            return
        for replica in dead:
            if replica.kept:  # the run goes on: the state it kept is not needed
                replica.kept = False
                self._end(replica)
            self._schedule_respawn()
        started = len(self._respawn_at) - spawning
        logger.warning("%s%s", what, f"; {started} replacement(s) starting" if started > 0 else "")
        self._check_floor()

    def _end(self, replica: _Replica) -> None:
        """A dead replica's procs go, and its slot with them: the rest of its group would only block its peers now."""
        replica.ended = True
        self.hosts.kill(replica.rid)
        self.hosts.release(replica.rid)
        threading.Thread(target=self._stop_mesh, args=(replica,), daemon=True).start()

    def _schedule_respawn(self, restart: bool = True) -> None:
        """`restart`: it replaces a failed replica (counted against `max_restarts`), not a drained one."""
        if self.finished_gen is not None:
            return
        live = sum(r.state.live and r.leaving is None for r in self.replicas.values())
        if not policies.respawn_wanted(live, len(self._respawn_at), self.wanted, self.config):
            return
        why = policies.respawn_refused(self.restarts, sum(r for _, r in self._respawn_at), self.config)
        if why:
            self.events.emit("no_respawn", reason=why)
            return
        delay = policies.respawn_delay(self.early_deaths, self.config)
        self._respawn_at.append((time.monotonic() + delay, restart))
        self.events.emit("respawn_scheduled", delay=delay, restarts=self.restarts, early_deaths=self.early_deaths)

    def _respawn_due(self) -> None:
        now = time.monotonic()
        for due in [due for due in self._respawn_at if due[0] <= now]:
            if not self._spawn(initial=False, restart=due[1]):
                if not self._no_room:
                    self._no_room = True
                    self.events.emit("no_room", waiting=len(self._respawn_at),
                                     reason="every live host is full: the run trains on fewer replicas (or, after "
                                            "an out-of-memory, waits) until a host joins or comes back")
                return  # it stays due: tried again when a host has room
            self._no_room = False
            self._respawn_at.remove(due)

    def _ready_waiting(self) -> list[int]:
        return [r.rid for r in self.replicas.values() if r.state == ReplicaState.WAITING]

    def _admit_ready(self) -> None:
        if not self.members or self.finished_gen is not None:
            return
        current = [m for m in self.members if self.replicas[m].state == ReplicaState.MEMBER]
        if len(current) != len(self.members):
            return  # the generation is finishing or changing; admit at the next one
        newcomers = policies.admit(current, self._ready_waiting(), self.wanted)
        if self.action == Action.WAIT:  # nobody trains: the waiting members take replacements once there are enough
            if newcomers and len(current) + len(newcomers) >= self.oom_floor:
                self._announce(current + newcomers, reason=f"replica(s) {newcomers} ready", interrupt=False)
            return
        if newcomers and self._formed(self.gen):  # a grow moves members only at a step boundary they share
            self._announce(current + newcomers, reason=f"replica(s) {newcomers} ready", interrupt=False)

    def _formed(self, g: int) -> bool:
        """Every proc of generation g's members formed its group (workers count `formed/<g>`)."""
        if g not in self._formed_gens and self._verified(
                [Key.formed(g, m, lane) for m in self.plans[g] for lane in range(self.config.procs_per_replica)]):
            self._formed_gens.add(g)
        return g in self._formed_gens

    def _statuses(self, replicas: list[_Replica]) -> dict[int, list[dict] | None]:
        """What each proc of each replica is doing, from its control actor (None: it did not answer). Every replica
        is asked at once and waited for under one deadline: frozen members cost `_PROBE_TIMEOUT_S` together, not
        each."""
        asked = {}
        for replica in replicas:
            try:
                asked[replica.rid] = replica.control.status.call()
            except Exception:  # noqa: BLE001 - an unreachable control actor is itself the answer
                asked[replica.rid] = None
        deadline = time.monotonic() + _PROBE_TIMEOUT_S
        answers: dict[int, list[dict] | None] = {}
        for rid, future in asked.items():
            try:
                answers[rid] = list(future.get(timeout=max(deadline - time.monotonic(), 0.01)).values())
            except Exception:  # noqa: BLE001 - as above
                answers[rid] = None
        return answers

    def _treat_as_hung(self, suspects: dict[int, str], how: str, probed: dict | None = None) -> None:
        """`suspects`: each replica found hung and what the probe found in it; `probed`: what every member was doing
        then, so the events show causally which member was suspected and why the others were not. They are lost
        together, in one generation change."""
        for rid, why in suspects.items():
            replica = self.replicas[rid]
            self.events.emit("hang", replica=rid, pids=replica.pids, gen=self.gen, detected_by=how, why=why,
                             probed=probed)
            self.hosts.kill(rid)
        self._on_deaths([self.replicas[rid] for rid in suspects], how, "; ".join(dict.fromkeys(suspects.values())))

    def _check_starting(self) -> None:
        """A replica not ready `join_timeout_s` after its spawn began (a replacement, a spare, an initial one the
        run started without) is stuck before its training loop: treated as hung, as the initial replicas are
        bounded by the same setting, instead of holding a slot and a restart forever."""
        bound = self.config.join_timeout_s
        stuck = {r.rid: f"not ready {bound:g} s after its spawn began (`join_timeout_s`): stuck before its training "
                        "loop" for r in self.replicas.values()
                 if r.state == ReplicaState.SPAWNING and time.time() - r.spawned_at > bound}
        if stuck:
            self._treat_as_hung(stuck, "hang (never ready)")

    def _probe(self, wedged: bool) -> None:
        """Ask the current generation's members what they are doing, on a thread of its own: the answers come back
        on the queue (`Probed`), and meanwhile the controller goes on noticing deaths and host losses
        (a probe of a frozen member takes `_PROBE_TIMEOUT_S`, and one of a cut-off host's never answers)."""
        g = self.gen
        members = [self.replicas[m] for m in self.members if self.replicas[m].state == ReplicaState.MEMBER]
        threading.Thread(target=lambda: self._q.put(Probed(g, self._statuses(members), wedged)), daemon=True,
                         name=f"monarch-plugin-probe-{g}").start()

    def _check_stalled(self) -> None:
        """A member's proc said its collective or formation in the current generation failed (`Key.stalled_by`, signed):
        its peers are probed. The count it moves first only says when to look: anyone can move it."""
        g = self.gen
        if g < 0 or self._stall_probed == g:
            return
        if g not in self._stalls_seen:
            count = self.store.add(Key.stalled(g), 0)
            if count <= self._stall_counts.get(g, 0):
                return
            self._stall_counts[g] = count
            lanes = range(self.config.procs_per_replica)
            if not any(self._verified([Key.stalled_by(g, m, lane)]) for m in self.plans[g] for lane in lanes):
                return  # only the count moved: nothing any member said
            self._stalls_seen[g] = time.monotonic()
        # A peer's death is what usually breaks a collective, and it reaches us by pidfd or supervision
        # within milliseconds of the survivors' report: let it, rather than probe a dead member.
        if time.monotonic() - self._stalls_seen[g] < _STALL_GRACE_S:
            return
        self._stall_probed = self.gen
        self._probe(wedged=False)

    def _judge_stall(self, answers: dict[int, list[dict] | None]) -> None:
        """The current generation stalled and its members answered (or did not): the one stuck outside the
        reduction, or that answered nothing, is hung; with none, a member reported unfit goes; with none of
        those either, the same members form the generation again."""
        suspects: dict[int, str] = {}  # replica -> why
        probed: dict[int, str] = {}  # replica -> what each of its procs was doing, and for how long
        bound = self.config.collective_timeout_s
        for m, statuses in answers.items():
            if self.replicas[m].state != ReplicaState.MEMBER:
                continue  # it died while the probe was out: already dealt with
            if statuses is None:
                probed[m] = suspects[m] = f"no answer from its control actor in {_PROBE_TIMEOUT_S:.0f} s (frozen)"
                continue
            probed[m] = ", ".join(f"{s['phase']} for {s['now'] - s['since']:.1f} s at step {s['step']}"
                                  for s in statuses)
            stuck = [s for s in statuses if s["phase"] not in WAITING_ON_PEERS and s["now"] - s["since"] > bound]
            if stuck:
                s = stuck[0]
                suspects[m] = (f"{s['phase']} at step {s['step']} for {s['now'] - s['since']:.1f} s, "
                               f"past collective_timeout_s {bound:g}, while its peers waited on it")
        how = "hang"
        if not suspects and self.store.check([Key.unfit(self.gen)]):
            # Every member answers, and some were found unable to go on (the recipients of a heal past its bound,
            # a replica whose procs disagree): they go (and are replaced), the others keep training.
            how = "reported unfit"
            suspects = {r: why for r, why in unfit_members("\n".join(self.store.lines(Key.unfit(self.gen)))).items()
                        if self.replicas[r].state == ReplicaState.MEMBER}
        if not suspects:
            self._replan(list(self.members), "stalled reduction, all members responsive",
                         f"generation {self.gen} stalled with every member responsive")
            return
        self._treat_as_hung(suspects, how, probed)

    def _check_wedged(self) -> None:
        """A generation still not formed well past the formation bound: probe its members once, and treat as
        hung any member still inside the formation of an older generation. Its training thread is stuck
        where it could neither see the newer plan nor give up (its control actor still answers), and the
        others would wait for it at every barrier it never reaches."""
        g = self.gen
        if g < 0 or g == self._wedge_checked or self.finished_gen is not None or self.action == Action.WAIT:
            return
        if time.monotonic() - self._announced_at < FORMATION_BOUND_S + 2 * _STALL_GRACE_S:
            return
        self._wedge_checked = g
        if not self._formed(g):
            self._probe(wedged=True)

    def _judge_wedged(self, answers: dict[int, list[dict] | None]) -> None:
        g = self.gen
        wedged = {m: f"still forming generation {min(s['forming'] for s in statuses)} in generation {g}"
                  for m, statuses in answers.items() if self.replicas[m].state == ReplicaState.MEMBER
                  and statuses and any(s["phase"] == Phase.JOIN and s["forming"] < g for s in statuses)}
        if wedged:  # the deaths publish a new generation; it is checked in its own turn
            self._treat_as_hung(wedged, "hang (wedged)")

    # -- generations ---------------------------------------------------------------------------------------

    def _announce(self, members: list[int], reason: str, interrupt: bool, action: Action = Action.TRAIN,
                  checkpoint: str | None = None) -> None:
        """Publish generation gen+1. `interrupt` aborts the steps in flight (a death); otherwise members
        move at the next step boundary they all agree on (a grow). `checkpoint`: what a RESTORE generation loads."""
        holders = [] if action == Action.RESTORE else [m for m in members if self._holds(self.replicas[m])]
        if not holders and action != Action.RESTORE:
            raise RuntimeError(f"generation {self.gen + 1} of {members} would have no member holding the run's "
                               "trained state: a bug in monarch-plugin")
        self.gen += 1
        g = self.gen
        previous = [m for m in self.members if self.replicas[m].state == ReplicaState.MEMBER]
        # A draining replica is in its last step with the members until the generation without it forms: it is told as
        # they are (an interrupt left it in a step with a dead peer until `drain_grace_s`).
        previous += [r.rid for r in self.replicas.values() if r.state == ReplicaState.DRAINING]
        self.members = list(members)
        self.action = action
        self.plans[g] = self.members
        self.store.set(Key.plan(g), Plan(gen=g, members=self.members, action=action, reason=reason,
                                         target=self.wanted, holders=holders, checkpoint=checkpoint).dumps())
        self.store.set(Key.LATEST, str(g))
        self._announced_at = time.monotonic()
        for m in self.members:
            replica = self.replicas[m]
            if replica.state == ReplicaState.WAITING and not replica.initial:
                replica.admitted = True
                self.early_deaths = 0
            replica.state = ReplicaState.MEMBER
        # Formations of the generation this one replaces end now: their waiting members block on the store.
        lanes = range(self.config.procs_per_replica)
        for lane in lanes if g > 0 else ():
            supersede(self.store, Key.group(g - 1, lane))
            for share in range(self.config.heal_donors):
                supersede(self.store, Key.heal_group(g - 1, lane, share))
        if interrupt:  # so does every end barrier still open (a grow or a drain leaves members that reached it there)
            self._close_ends()
            self._open_ends.clear()
        self._open_ends.append(g)
        # Each proc concerned is told as a message: a waiting one then reads the plan, never polls for it.
        for m in dict.fromkeys(previous + self.members):
            control = self.replicas[m].control
            tell = control.plan if m not in previous else control.abort if interrupt else control.regroup
            try:
                tell.broadcast(g)
            except Exception:  # noqa: BLE001 - a member that cannot be told is about to be found dead
                pass
        self.events.emit("quorum", gen=g, members=self.members, reason=reason, interrupt=interrupt,
                         action=action.value, holders=holders, **({"checkpoint": checkpoint} if checkpoint else {}))

    def _holds(self, replica: _Replica) -> bool:
        """Whether the replica holds the run's trained state: once every one of its procs has said so, it does."""
        if not replica.holds and self._verified([Key.holds(replica.rid, lane)
                                                 for lane in range(self.config.procs_per_replica)]):
            replica.holds = True
        return replica.holds

    def _run_checkpoint(self) -> str | None:
        """The newest complete checkpoint of this run's own (every file recorded by its `checkpoint` events and
        still on disk), else the one it resumed from: what a generation left without a holder restores. Never
        another run's: a checkpoint in the same directory that this run did not write was never its state. Checked
        by its files' sizes only: this runs on the supervision loop, which must not read the whole checkpoint."""
        paths = [e["path"] for e in read_events(self.config.events_path or "") if e["event"] == "checkpoint"]
        return newest_written(paths, skipped=self._damaged, hashed=False) or self.config.resume

    def _newest_checkpoint(self, live: list[int]) -> str | None:
        """The checkpoint to resume a stopped run from, when none was written on the way out: the newest one the
        front end's own checkpointing holds (Lightning's, HF's, torchtitan's), as a live replica's control actor
        names it; else this run's own (`ElasticLoop`'s)."""
        for m in live:
            try:
                found = self.replicas[m].control.newest_checkpoint.call().get(timeout=_PROBE_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - an unreachable replica names nothing; ask the next
                continue
            path = next((p for p in found.values() if p), None)
            if path:
                return path
        return self._run_checkpoint()

    def _replan(self, members: list[int], reason: str, what: str) -> str:
        """Publish the generation that goes on after a loss, dropping the steps in flight: with its members that
        hold the run's trained state, whom the others heal from. When none holds it (the last that did died before
        another had healed from it), they restore the run's newest checkpoint instead, and without one the run
        stops: never does a generation train from weights the run never trained. Returns what a restore costs, to
        log (empty when training simply goes on)."""
        if any(self._holds(self.replicas[m]) for m in members):
            if len(members) < self.oom_floor:
                self._announce(members, reason=f"{reason}; waiting for replacements: {policies.WAIT_WHY}",
                               interrupt=True, action=Action.WAIT)
                return (f": replicas {members} wait, training nothing, for {self.oom_floor - len(members)} "
                        f"replacement(s) ({policies.WAIT_WHY})")
            self._announce(members, reason=reason, interrupt=True)
            return ""
        checkpoint = self._run_checkpoint()
        stop = policies.state_lost(checkpoint)
        if stop:
            logger.warning("%s: the run stops (%s)", what, stop)
            self._give_up(stop)
        self._announce(members, reason=f"{reason}; no replica holds the run's trained state: restoring {checkpoint}",
                       interrupt=True, action=Action.RESTORE, checkpoint=checkpoint)
        self.events.emit("restore", members=members, path=checkpoint, step=step_of(checkpoint), gen=self.gen)
        return (f", and no live replica holds the run's trained state any more: replicas {members} restore "
                f"{checkpoint} and train again what the run trained after its step {step_of(checkpoint)}")

    def _give_up(self, reason: str, detail: str = "",
                 error: Callable[[str, str | None], ElasticRunAborted] = ElasticRunAborted) -> NoReturn:
        """Stop the run on purpose: the live members that hold the run's state write one durable checkpoint, then
        everything stops; with none in training, a replica whose training code raised writes it from the state it
        held untouched (`_Replica.kept`). With none holding it, nothing is written (a replica's own weights would be
        a checkpoint the run never trained) and the message names the newest checkpoint on disk to resume from.
        `detail` follows the message (the tracebacks of a bug); `error` is what is raised. Training that ended
        before the stop could close its end (`_close_ends`) is not stopped: `_EndedFirst`, and the run ends as any
        finished run does."""
        if self._close_ends():
            raise _EndedFirst(reason)
        self._closing.set()  # what happens from here is recorded, and decides nothing but who writes
        checkpoint = self._stop_checkpoint(reason) or self._checkpoint_held()
        # Replicas whose training code raised still answer, unless ended: even one whose sibling is stuck.
        resume_from = checkpoint or self._newest_checkpoint(
            [r.rid for r in self.replicas.values()
             if (r.state.live or (r.raised is not None and not r.ended)) and r.control is not None])
        self.events.emit("give_up", reason=reason, checkpoint=checkpoint, resume_from=resume_from)
        self._stop_everything()
        lost = (f"its checkpoint could not be written ({self._write_error})" if self._write_error else
                "no live replica held the run's trained state to write")
        if checkpoint:
            where = f"checkpoint written to {checkpoint}"
        elif resume_from:
            where = f"{lost}: resume from {resume_from}, the newest checkpoint"
        else:
            where = f"{lost}, and no checkpoint of it was found"
        stopped = error(f"monarch-plugin stopped the run: {reason}; {where}{detail}", resume_from)
        if isinstance(stopped, RunStopped):  # a `SystemExit`: uncaught, it ends the process without a word
            if resume_from:
                stopped.args = (f"{stopped}; relaunch with your front end's resume option to go on from it "
                                "(docs/runtime.md, \"Stopping a run\")",)
            logger.warning("%s", stopped)
        raise stopped

    def _stop_checkpoint(self, reason: str) -> str | None:
        """The checkpoint of a run that stops: the live members that hold its state form a generation to write it
        (`Action.CHECKPOINT`), whose first member (its rank 0) writes while the others wait. A writer lost before it
        returns one (dead, its host lost, or its code raised) is replaced by the next holder, in a generation of the
        holders left, until one is written, none is left, or `join_timeout_s` has passed. None: nothing written."""
        holders = [m for m in self.members if self.replicas[m].state == ReplicaState.MEMBER
                   and self._holds(self.replicas[m])]
        deadline = time.monotonic() + self.config.join_timeout_s
        while holders and time.monotonic() < deadline:
            self._announce(holders, reason=f"giving up: {reason}", interrupt=True, action=Action.CHECKPOINT)
            writer = self.replicas[holders[0]]
            while writer.state == ReplicaState.MEMBER and time.monotonic() < deadline:
                for raised in self._appended(Raised, Key.RAISED, Key.RAISED_COUNT):  # raised instead of writing
                    if raised.replica in holders:
                        self._raised_holding(self.replicas[raised.replica], raised)
                report = self._next_report(0.05)
                if not isinstance(report, Returned):
                    if report is not None:
                        self._handle(report)  # a death or a host's loss, recorded (`_closing`: nothing re-planned)
                    continue
                replica = self.replicas[report.replica]
                # The first proc that wrote one (a replica writes one per proc when each holds its own state).
                path = next((o.checkpoint for o in report.outcomes if o.checkpoint), None)
                raised = next((o.raised for o in report.outcomes if o.status == "error"), None)
                if raised is not None:
                    self._raised_holding(replica, raised)
                replica.state = ReplicaState.STOPPED
                if replica is writer and (path or raised is None):
                    return path  # None: the front end writes no checkpoint of its own
            if writer.raised is not None:
                self._write_error = writer.raised.error
            holders = [m for m in holders if self.replicas[m].state == ReplicaState.MEMBER]
            if holders and (writer.raised is None or self.config.procs_per_replica > 1):
                self.hosts.kill(writer.rid)  # its other procs may still be writing the files the next one writes
            if holders:
                why = f"raised {writer.raised.error}" if writer.raised else writer.state.value
                logger.warning("replica %d did not write the checkpoint (%s): replica %d writes it instead", writer.rid,
                               why, holders[0])
        return None

    def _raised_holding(self, replica: _Replica, raised: Raised) -> None:
        """A holder asked for the give-up checkpoint raised instead of writing it: it is waited for no longer, and
        writes it from the state it kept untouched (`_checkpoint_held`) if that was a committed step's."""
        if replica.raised is None:
            replica.raised = raised
            replica.kept = raised.held is not None and self.config.procs_per_replica == 1
        replica.state = ReplicaState.STOPPED

    def _checkpoint_held(self) -> str | None:
        """The give-up checkpoint when no replica in training wrote one: from a replica whose training code raised
        while its state was still a committed step's, kept for this (None: there is none, or it wrote nothing)."""
        for replica in self.replicas.values():
            if not replica.kept or replica.control is None:
                continue
            try:
                found = replica.control.checkpoint_held.call().get(timeout=self.config.join_timeout_s)
            except Exception as e:  # noqa: BLE001 - a proc that cannot write it leaves the others to
                logger.warning("replica %d could not write the give-up checkpoint: %s", replica.rid, _first_line(e))
                continue
            path = next((p for p in found.values() if p), None)
            if path:
                return path
        return None

    def _check_floor(self) -> None:
        """Members waiting for replacements (`Action.WAIT`) that can no longer all come (restarts used up, or the
        replacements died): the run stops, as below `min_replicas`, with the waiting members' checkpoint."""
        if self.action != Action.WAIT or self._closing.is_set():
            return
        coming = len(self._respawn_at) + sum(r.state in (ReplicaState.SPAWNING, ReplicaState.WAITING)
                                             for r in self.replicas.values())
        waited = time.monotonic() - self._announced_at
        stop = policies.short_of_floor(len(self.members), coming, self.oom_floor, waited, self.config)
        if stop:
            logger.warning("the run stops: %s", stop)
            self._give_up(stop)

    # -- liveness --------------------------------------------------------------------------------------------

    def _on_mesh_failure(self, failure) -> None:
        """A failure nobody handled, during this run (`_FaultRouter`): a replica's death, or nothing of ours."""
        rid = replica_of_mesh(str(getattr(failure, "mesh_name", "")))
        if rid is not None:  # Monarch's own per-mesh actors (its logger) also fail; the replica's actors report it
            self._q.put(Died(rid, f"supervision ({_first_line(failure)})"))

    # -- shutdown --------------------------------------------------------------------------------------------

    def _stop_everything(self) -> None:
        self._closing.set()
        for replica in self.replicas.values():
            if replica.state.live and replica.control is not None:
                try:
                    replica.control.shutdown.broadcast()
                except Exception:  # noqa: BLE001 - it is being torn down either way
                    pass

    def _shutdown(self) -> None:
        self._stop_everything()
        threads = [threading.Thread(target=self._stop_mesh, args=(r,), daemon=True) for r in self.replicas.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=15)
        # A replica still starting cleans itself up (above) before we go, and the stop above ends the others' wait
        # for their return; but not on a lost host, which never answers (waiting for those spawners cost every run
        # that lost a host 10 s at its end).
        deadline = time.monotonic() + 10
        for rid, spawner in self._spawners.items():
            if self.hosts.hosts[self.replicas[rid].host].live:
                spawner.join(timeout=max(0.0, deadline - time.monotonic()))
        for replica in self.replicas.values():
            self.hosts.kill(replica.rid)  # whatever a stop left behind
        self.hosts.close()
        self.store = None  # with the hosts' reference (closed above), the last: the store stops listening now

    def _stop_mesh(self, replica: _Replica) -> None:
        if replica.mesh is None or replica.mesh_stopped or not self.hosts.hosts[replica.host].live:
            return  # a lost host's meshes cannot be reached
        replica.mesh_stopped = True
        try:
            replica.mesh.stop().get(timeout=10)
        except Exception:  # noqa: BLE001 - a mesh holding a dead proc may refuse; the kill follows
            pass
