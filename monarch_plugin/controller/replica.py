"""The controller's record of one replica, and of a finished run: the vocabulary its modules share.

It decides nothing. Each field says who writes it; what reads it is the rest of `controller/`, never a worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from monarch_plugin.wire.protocol import Drain, Raised, ReplicaState

__all__ = ["Launch", "Replica", "RunResult"]

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
class Replica:
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
    """Its procs were killed after its death (`deaths.end`)."""
    leaving: Drain | None = None
    """A proc of it received a signal with notice (its first report): it drains at the next step boundary."""
    leaving_at: float = 0.0
    drain_gen: int = -1
    """The generation published without it (`ReplicaState.DRAINING`)."""
