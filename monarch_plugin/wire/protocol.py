"""The wire protocol between the controller and the workers, named in one place.

The two sides talk through the controller's TCPStore (plans, counters, the groups' rendezvous) and through
Monarch actor calls (interrupts, status probes, each proc's outcome). Every store key, plan field, phase, replica
state, mesh name and outcome shape is defined here, so the sides cannot drift apart, and what a new dimension
adds to the protocol (a host, for multi-host runs) is written once.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "Action",
    "Drain",
    "Key",
    "Outcome",
    "Phase",
    "Plan",
    "Raised",
    "ReplicaState",
    "START_METHOD_ENV",
    "ORPHAN_ENV",
    "CONTROLLER_PID_ENV",
    "WAITING_ON_PEERS",
    "mesh_names",
    "replica_of_mesh",
    "spawned_by_controller",
    "unfit_line",
    "unfit_members",
    "watcher_names",
]


class Phase(str, enum.Enum):
    """What a worker's training thread is doing, as its control actor reports it to the controller's probes."""

    STARTING = "starting"
    JOIN = "join"
    COMPUTE = "compute"
    REDUCE = "reduce"
    FINISH = "finish"


WAITING_ON_PEERS = frozenset({Phase.JOIN, Phase.REDUCE, Phase.FINISH})
"""Phases in which a worker waits on its peers: however long it sits there, it is not the one that hangs."""

START_METHOD_ENV = "MONARCH_PLUGIN_START_METHOD"
"""The multiprocessing start method the user's process chose, for the training code in the replicas (`ReplicaActor`);
empty: Python's default."""

ORPHAN_ENV = "MONARCH_PLUGIN_ORPHAN_S"
"""`controller_loss_save_s`, in the environment of a replica's actor and of the command that starts its proc: how long
the proc, and whatever stands in for it (its forkserver client, its watchdog), outlive a lost controller."""

CONTROLLER_PID_ENV = "MONARCH_PLUGIN_CONTROLLER_PID"
"""The controller's pid, for the procs on its machine: its exit is how they learn of its loss (`worker.orphan`)."""


class Action(str, enum.Enum):
    """What the members of a generation do in it."""

    TRAIN = "train"
    CHECKPOINT = "checkpoint"
    """The controller gave up: write one durable checkpoint of the last committed step, then stop."""
    RESTORE = "restore"
    """No member holds the run's trained state (the last replica that did died before another had healed from it):
    every member loads `Plan.checkpoint`, the run's newest complete checkpoint, then trains on from it."""
    WAIT = "wait"
    """Training now would take fewer replicas than the run may train on (a replica ran out of memory, and on fewer
    each would take a larger share of the global batch: `policies.oom_floor`): the members keep their state and
    wait, training nothing, for the generation that brings the replacements."""


class ReplicaState(str, enum.Enum):
    """A replica's life in the controller: spawning -> waiting -> member -> finished | dead | stopped."""

    SPAWNING = "spawning"
    WAITING = "waiting"
    """Started and ready (every proc counted itself in `Key.ready`): a newcomer or hot spare not yet admitted."""
    MEMBER = "member"
    DRAINING = "draining"
    """Told to go (a signal with notice to one of its procs, `Drain`) and left out of the newest generation: it trains
    with the others up to the step boundary where that generation starts, then returns."""
    FINISHED = "finished"
    DEAD = "dead"
    STOPPED = "stopped"
    """Returned without finishing: the controller stopped it, or gave up."""

    @property
    def live(self) -> bool:
        """Its procs run (or are starting): it holds a GPU slot, and a shutdown must stop it."""
        return self in (ReplicaState.SPAWNING, ReplicaState.WAITING, ReplicaState.MEMBER, ReplicaState.DRAINING)


@dataclass(frozen=True)
class Plan:
    """Generation `gen`: who trains together, and what they do. Published as `Key.plan(gen)`, then `Key.LATEST`."""

    gen: int
    members: list[int]
    action: Action = Action.TRAIN
    reason: str = ""
    target: int = 0
    """The replicas the controller is keeping the run at (`replicas`, more once a new machine grew it): what a
    shrunk generation is short of."""
    holders: list[int] = field(default_factory=list)
    """The members that hold the run's trained state: only they may serve a heal. The first generation's members
    (every replica at the run's first step, or at the checkpoint it resumed) and any replica whose every proc
    joined a generation since (`Key.holds`). A generation to train always has one; RESTORE's has none."""
    checkpoint: str | None = None
    """RESTORE: lane 0's file of the checkpoint every member loads."""

    def dumps(self) -> str:
        return json.dumps({**asdict(self), "action": self.action.value})

    @classmethod
    def loads(cls, text: str | bytes) -> "Plan":
        raw = json.loads(text)
        return cls(gen=raw["gen"], members=list(raw["members"]), action=Action(raw["action"]), reason=raw["reason"],
                   target=raw["target"], holders=list(raw["holders"]), checkpoint=raw["checkpoint"])


class Key:
    """The store's keys. Every value is signed with the run's secret (`signing.SignedStore`); what several procs each
    say (ready, formed, holds, arrived, stalled) is a key per proc, since a sum of `add`s carries no signature. The
    counters left (`stalled`, the appended reports' counts, the host watchers' beats) only make a reader look sooner, or
    later, for what the signed keys and lines say."""

    LATEST = "latest"
    """The newest generation's number, set after its plan."""

    @staticmethod
    def plan(gen: int) -> str:
        return f"plan/{gen}"

    @staticmethod
    def arrived(barrier: str, rank: int) -> str:
        """Set by the member of rank `rank` once it reached the arrival barrier named `barrier` (`handshake.barrier`)."""
        return f"{barrier}/arrived/{rank}"

    @staticmethod
    def decision(barrier: str) -> str:
        """The barrier's outcome, set once by compare-and-set: go, superseded or timed out."""
        return f"{barrier}/decision"

    @staticmethod
    def ready(replica: int, lane: int) -> str:
        """Set by the replica's proc `lane` once it started and formed its replica's own group."""
        return f"ready/{replica}/{lane}"

    @staticmethod
    def formed(gen: int, replica: int, lane: int) -> str:
        """Set by proc `lane` of the generation's member `replica` once it formed the group and holds its state."""
        return f"formed/{gen}/{replica}/{lane}"

    @staticmethod
    def stalled(gen: int) -> str:
        """Counter: procs whose collective or formation in the generation timed out or failed, counted after each set its
        `stalled_by` key. Anyone can move it: it only makes the controller look for those keys."""
        return f"stalled/{gen}"

    @staticmethod
    def stalled_by(gen: int, replica: int, lane: int) -> str:
        """Set by proc `lane` of member `replica` whose collective or formation in the generation timed out or failed:
        what the controller acts on (it probes the members)."""
        return f"stalled/{gen}/{replica}/{lane}"

    @staticmethod
    def unfit(gen: int) -> str:
        """Members that cannot go on in the generation although their procs answer, and must be replaced: appended
        to by whoever finds one, a line each (`unfit_line`, read back by `unfit_members`). The recipients of a heal
        abandoned past its bound; a replica whose procs healed to different steps, or whose own vote timed out."""
        return f"stalled/{gen}/unfit"

    @staticmethod
    def holds(replica: int, lane: int) -> str:
        """Set by the replica's proc `lane` after the first join that left it holding the run's trained state (it
        healed from a holder, or was one). The controller counts a replica a holder once every proc has said so: a
        replica half healed holds nothing it can serve."""
        return f"holds/{replica}/{lane}"

    @staticmethod
    def pick(replica: int, n: int) -> str:
        """The plan local rank 0 of a multi-proc replica picked for its n-th join attempt (its siblings follow)."""
        return f"pick/{replica}/{n}"

    @staticmethod
    def finished(gen: int, lane: int) -> str:
        """The barrier (`collectives.barrier`) where the generation's procs `lane` meet at the end of training."""
        return f"fin/{gen}/{lane}"

    RAISED = "raised"
    """Every `Raised` report of the run, a line each (appended: `Raised.line`, read back by `Raised.parse`)."""

    RAISED_COUNT = "raised/count"
    """Counter: `Raised` lines appended so far, counted after each is in place: what the controller polls."""

    DRAINS = "drains"
    """Every `Drain` report of the run, a line each (appended: `Drain.line`, read back by `Drain.parse`)."""

    DRAIN_COUNT = "drains/count"
    """Counter: `Drain` lines appended so far, counted after each is in place: what the controller polls."""

    @staticmethod
    def host_beat(host: int) -> str:
        """Counter: beats of every proc on the host that holds a lease (its watcher, its workers); the controller
        declares a host lost when it stops moving."""
        return f"host/{host}/beat"

    @staticmethod
    def watcher_beat(host: int) -> str:
        """Counter: beats of the host's watcher alone; when it stops while the host's beat goes on, the watcher is
        gone (a helper, killed or stuck) and the controller starts another there."""
        return f"host/{host}/watcher_beat"

    @staticmethod
    def host_lost(host: int) -> str:
        """Set when the controller declares the host lost: its procs' leases end them at their next touch."""
        return f"host/{host}/lost"

    @staticmethod
    def host_deaths(host: int) -> str:
        """How many worker procs the host's watcher saw exit, set by it after each record (signed, not a counter: a
        count raised by someone else would have the controller wait for a record that never comes, and lose the host
        for it); the n-th is `host_death(host, n)`."""
        return f"host/{host}/deaths"

    @staticmethod
    def host_death(host: int, n: int) -> str:
        """JSON {"replica", "pid"} of the n-th (from 1) worker proc the host's watcher saw exit."""
        return f"host/{host}/death/{n}"

    # Prefixes of the groups' own rendezvous (`collectives.new_group` adds its keys under them).

    @staticmethod
    def group(gen: int, lane: int) -> str:
        """The generation's cross-replica group of the procs with local rank `lane`."""
        return f"pg/{gen}/{lane}"

    @staticmethod
    def heal_group(gen: int, lane: int, share: int) -> str:
        """The group over which one donor serves its share of a heal (`heal.shares`) to the generation's receivers."""
        return f"heal/{gen}/{lane}/{share}"

    @staticmethod
    def replica_group(replica: int) -> str:
        """The replica's own procs (their votes), formed once: they die together."""
        return f"intra/{replica}"


def unfit_line(replica: int, why: str) -> str:
    """One entry of `Key.unfit`: appended, so several finders of one generation never overwrite each other."""
    return json.dumps({"replica": replica, "why": why}) + "\n"


def unfit_members(raw: str | bytes) -> dict[int, str]:
    """The members named in a `Key.unfit` value, each with the first reason given for it."""
    found: dict[int, str] = {}
    for line in (raw.decode() if isinstance(raw, bytes) else raw).splitlines():
        if line.strip():
            entry = json.loads(line)
            found.setdefault(entry["replica"], entry["why"])
    return found


class _Appended:
    """A report a worker appends to a store key, a JSON line each, which the controller reads back in order."""

    def line(self) -> str:
        return json.dumps(asdict(self)) + "\n"

    @classmethod
    def parse(cls, raw: str | bytes) -> list:
        """Every report in the key's value, in the order they were appended."""
        return [cls(**json.loads(line)) for line in (raw.decode() if isinstance(raw, bytes) else raw).splitlines()
                if line.strip()]


@dataclass(frozen=True)
class Raised(_Appended):
    """A worker proc's training code raised (or could not even be loaded): what the proc tells the controller at once
    through the store (`Key.RAISED`), and returns as its `Outcome`. The controller replaces the replica, as after a
    death, or stops the run when another replica raised the same at the same step (`kind`, `step`)."""

    replica: int
    lane: int
    error: str
    """`Type: message`, as a traceback's last line says it."""
    kind: str
    """The exception's qualified type (`torch.OutOfMemoryError`): what a repetition is matched on."""
    traceback: str
    stage: str = "run"
    """"load": the target could not be loaded in the replica; "run": the training code raised."""
    step: int = -1
    """The front end's step in flight (the number `--fault ...:step=N` names); -1 before its first."""
    gen: int = -1
    """The generation the proc was in; -1: it never joined one (an error while setting up)."""
    finished: bool = False
    """It raised after its replicas had finished training together."""
    phase: str = ""
    """What the proc was doing (a `Phase`)."""
    runtime: str = ""
    """The runtime's own part that failed (`errors.ProtocolError`: join, heal, reduce, vote, barrier); empty when
    the training code raised."""
    oom: bool = False
    """It ran out of memory (`torch.OutOfMemoryError`, `MemoryError`)."""
    held: int | None = None
    """The committed steps the proc's state still holds untouched (`StepTransaction.held`), from which it can write
    the run's give-up checkpoint; None when it raised while that state changed (an optimizer step, a heal)."""



@dataclass(frozen=True)
class Drain(_Appended):
    """A worker proc received a signal with notice (SIGTERM, SIGUSR1: a scheduler's preemption, `scancel`, a node being
    drained), told to the controller through the store (`Key.DRAINS`) by the proc's notice thread
    (`procs.notice`): its replica leaves at the next step boundary, or the run stops with a checkpoint."""

    replica: int
    """-1: the whole host is going (its watcher got the signal, which its agent passes to every proc it started)."""
    lane: int
    signal: str
    """The signal's name (`SIGTERM`)."""
    pid: int
    host: int = -1
    """The host going, when `replica` is -1."""



@dataclass
class Outcome:
    """What one proc's `ReplicaActor.run` returns to the controller."""

    status: str
    """"ok" (trained to the end), "stopped" (the controller ended its part) or "error" (the target raised)."""
    seconds: float
    value: Any = None
    """ok: the target's return value."""
    gen: int = -1
    """ok: the generation whose members all reached the end together (-1: the target never joined one)."""
    reason: str = ""
    """stopped: why."""
    checkpoint: str | None = None
    """stopped after a give-up: the checkpoint this proc wrote, if it was the one that wrote it."""
    raised: Raised | None = None
    """error: what raised, where."""


_MESH = re.compile(r"r(\d+)_(control|replica)")


def mesh_names(replica: int) -> tuple[str, str, str]:
    """The replica's proc mesh, and its two actors (control, training)."""
    return f"replica{replica}", f"r{replica}_control", f"r{replica}_replica"


def watcher_names(host: int, n: int = 0) -> tuple[str, str]:
    """A host's watcher proc mesh and its actor; `n` counts the watchers started there after the first."""
    suffix = f"_{n}" if n else ""
    return f"host{host}_watch{suffix}", f"host{host}_watcher{suffix}"


_SPAWNED = re.compile(r"(replica\d+|r\d+_(control|replica)|host\d+_watch(er)?(_\d+)?|logger)(-|$)")


def spawned_by_controller(name: str) -> bool:
    """A failed mesh is one a controller spawned: a replica's or a host watcher's, or the logger Monarch puts on
    each of their procs (`logger-<id>`, which names no proc mesh)."""
    return _SPAWNED.match(name) is not None


def replica_of_mesh(name: str) -> int | None:
    """The replica a failed actor mesh belongs to; None for Monarch's own per-mesh actors (its logger)."""
    match = _MESH.match(name)
    return int(match.group(1)) if match else None


# -- reports on the controller's queue: what its threads (spawns, probes) and the hosts' watchers saw -------------


@dataclass(frozen=True)
class Spawned:
    """A replica's procs and actors are up (it is not ready until it counts itself in `Key.ready`)."""

    replica: int


@dataclass(frozen=True)
class Died:
    """A proc of the replica died, or its spawn failed; `how` says what saw it (pidfd, watcher, supervision)."""

    replica: int
    how: str


@dataclass(frozen=True)
class Returned:
    """The replica's procs returned from the training code, each with its `Outcome`."""

    replica: int
    outcomes: list


@dataclass(frozen=True)
class HostLost:
    """The host (its index) stopped answering, with all its replicas; `why` says how it was seen."""

    host: int
    why: str


@dataclass(frozen=True)
class HostUp:
    """An agent attached: new capacity, or (`returning`) a machine of the run that came back."""

    host: int
    returning: bool


@dataclass(frozen=True)
class Probed:
    """A probe's answers from generation `gen`'s members (stale once another is published): of a stalled
    generation, or (`wedged`) of one whose members stopped reporting progress."""

    gen: int
    statuses: dict
    wedged: bool


Report = Spawned | Died | Returned | HostLost | HostUp | Probed
"""One item on the controller's queue."""
