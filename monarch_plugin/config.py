"""The elastic run's settings, validated before anything is spawned.

One dataclass, shared by the controller, `monarch-run` and the framework front ends, so that every way in
checks the same rules and fails with the same messages.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from monarch_plugin.errors import ConfigError

__all__ = ["ElasticConfig", "BATCH_POLICIES", "BACKENDS"]

BATCH_POLICIES = ("constant_global", "constant_local")
BACKENDS = ("auto", "gloo", "nccl")


@dataclass
class ElasticConfig:
    replicas: int = 2
    """Replica groups spawned at start; also the size regrown to after a death."""

    min_replicas: int = 1
    """Fewest live replicas that may keep training. Below it the run stops with a checkpoint and a
    message instead of waiting or respawning (torchrun's --nnodes MIN)."""

    max_replicas: int | None = None
    """Most replicas ever live at once. None means ``replicas``."""

    procs_per_replica: int = 1
    """Processes in one replica group (1 for DDP; k for FSDP sharded over k procs inside a replica).
    When one proc dies its whole replica is replaced."""

    intra_backend: str = "auto"
    """torch.distributed backend inside a replica: "auto" (nccl on CUDA and ROCm builds, gloo on CPU),
    "gloo" or "nccl"."""

    cross_backend: str = "auto"
    """Backend of the cross-replica gradient reduction; same choices as ``intra_backend``."""

    batch_policy: str = "constant_global"
    """What a shrink does to the global batch. "constant_global": the global batch and learning rate stay
    fixed and each survivor takes a larger share, so a step is the same maths at any replica count.
    "constant_local": each replica keeps its local batch, so the global batch shrinks with the group."""

    scale_lr_with_replicas: bool = False
    """Only with "constant_local": scale the optimizer's learning rates by live/max replicas (linear
    scaling rule) while the group is smaller than ``max_replicas``."""

    spares: int = 0
    """Hot spare replica groups: they run the training code up to the point of joining and wait there,
    so a death is answered at once by healing a spare into the shrunken generation (no process start,
    no model build on the critical path). Each holds its memory but little CPU; a new spare is spawned
    to replace the one used."""

    max_restarts: int = 10
    """Replacements spawned over the whole run before the controller gives up (torchrun's --max-restarts)."""

    crash_loop_limit: int = 3
    """Consecutive replacements that die before committing a step; then the run stops instead of
    respawning forever (a bug that kills every new replica)."""

    restart_backoff_s: float = 1.0
    """A replacement that dies before joining delays the next one by this much, doubling with each
    further early death (capped at 30 s). The first replacement after a death is never delayed."""

    join_timeout_s: float = 300.0
    """How long a new replica may take from spawn to being ready to join (imports, model build)."""

    collective_timeout_s: float = 60.0
    """A cross-replica reduction that has not finished after this long reports itself to the controller,
    which finds and replaces the replica that stopped making progress (a hang)."""

    store_host: str = "127.0.0.1"
    """Address the controller's rendezvous store listens on; workers connect to it."""

    events_path: str | None = None
    """JSON-lines file for structured events (spawn, death, quorum, dropped step, heal, give-up),
    emptied when a run starts. None: ``$MONARCH_PLUGIN_EVENTS`` or ``./monarch_events.jsonl``."""

    checkpoint_dir: str = "monarch_checkpoints"
    """Where the durable checkpoint is written when the run gives up (one writer)."""

    fault: str | None = None
    """Opt-in fault injection for demos, tests and benchmarks, e.g. "sigkill:replica=1:step=20", or several
    joined by commas, at steps or at points of the recovery ("sigkill:replica=3:at=construct"); see
    ``monarch_plugin.faults``. None: ``$MONARCH_PLUGIN_FAULT`` or no fault."""

    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables set in every worker before the training code runs."""

    def __post_init__(self) -> None:
        if self.max_replicas is None:
            self.max_replicas = self.replicas
        if self.events_path is None:
            self.events_path = os.environ.get("MONARCH_PLUGIN_EVENTS", "monarch_events.jsonl")
        if self.fault is None:
            self.fault = os.environ.get("MONARCH_PLUGIN_FAULT") or None
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError naming the field and the fix; runs before any spawn."""
        for name in ("replicas", "min_replicas", "max_replicas", "procs_per_replica"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}: set it to 1 or more")
        if self.min_replicas > self.max_replicas:
            raise ConfigError(
                f"min_replicas ({self.min_replicas}) is larger than max_replicas ({self.max_replicas}): "
                "lower min_replicas or raise max_replicas"
            )
        if not self.min_replicas <= self.replicas <= self.max_replicas:
            raise ConfigError(
                f"replicas ({self.replicas}) must lie between min_replicas ({self.min_replicas}) and "
                f"max_replicas ({self.max_replicas}): change one of the three"
            )
        for name in ("intra_backend", "cross_backend"):
            if getattr(self, name) not in BACKENDS:
                raise ConfigError(
                    f"unknown {name} {getattr(self, name)!r}: choose one of {', '.join(BACKENDS)}"
                )
        if self.batch_policy not in BATCH_POLICIES:
            raise ConfigError(
                f"unknown batch_policy {self.batch_policy!r}: choose one of {', '.join(BATCH_POLICIES)}"
            )
        if self.scale_lr_with_replicas and self.batch_policy != "constant_local":
            raise ConfigError(
                "scale_lr_with_replicas only applies to batch_policy='constant_local' (with "
                "'constant_global' the global batch, and so the right learning rate, never changes)"
            )
        for name in ("max_restarts", "crash_loop_limit", "spares"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be 0 or more, got {getattr(self, name)}")
        for name in ("restart_backoff_s",):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be 0 or more seconds, got {getattr(self, name)}")
        for name in ("join_timeout_s", "collective_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {getattr(self, name)}")
        if self.fault:
            from monarch_plugin.faults import parse_faults

            parse_faults(self.fault)

    def to_env(self) -> dict[str, str]:
        """The settings a worker needs, as environment variables (they cross the process boundary)."""
        return {"MONARCH_PLUGIN_CONFIG": _encode(self)}

    @classmethod
    def from_env(cls) -> "ElasticConfig | None":
        raw = os.environ.get("MONARCH_PLUGIN_CONFIG")
        return _decode(raw) if raw else None


def _encode(cfg: ElasticConfig) -> str:
    import json

    return json.dumps(dataclasses.asdict(cfg))


def _decode(raw: str) -> ElasticConfig:
    import json

    return ElasticConfig(**json.loads(raw))
