"""The elastic run's settings, validated before anything is spawned.

One dataclass, shared by the controller, `monarch-run` and the framework front ends, so that every way in
checks the same rules and fails with the same messages. It is also the one source of the front ends' settings:
`monarch-run`'s flags are built from its fields (`cli_flag`, help from `field_docs`), the Lightning strategies take
their defaults from it, and every front end renders a message about a field in its own spelling (`spell_fields`:
`--min-replicas` for `monarch-run`, `min_replicas` for Lightning, `--monarch.min_replicas` for torchtitan).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import os
import re
import textwrap
import typing
from dataclasses import dataclass, field
from typing import Callable

from monarch_plugin.errors import ConfigError
from monarch_plugin.net import parse_host, route_address, wildcard

__all__ = ["ElasticConfig", "BATCH_POLICIES", "BACKENDS", "LOOP_ONLY", "SEMI_SYNC", "cli_flag", "field_default", "field_docs",
           "front_end_fields", "front_end_settings", "given", "in_slurm_allocation", "spell_fields"]

BATCH_POLICIES = ("constant_global", "constant_local")
BACKENDS = ("auto", "gloo", "nccl")
SEMI_SYNC = ("diloco", "local_sgd")
LOOP_ONLY = ("batch_policy", "scale_lr_with_replicas", "checkpoint_steps", "checkpoint_interval_s", "checkpoint_keep",
             "resume", "sync_every", "semi_sync")
"""`ElasticLoop`'s own settings: its batch policy, its durable checkpoints and, for now, semi-synchronous training.
The framework front ends keep the global batch constant (their steps per epoch are fixed when training starts) and
checkpoint the framework's way (Lightning's `ModelCheckpoint`, HF's `save_steps`, torchtitan's `--checkpoint.*`), so
they do not take these; nor do they train semi-synchronously yet (their strategies reduce gradients every step)."""


@dataclass
class ElasticConfig:
    replicas: int = 2
    """Replica groups spawned at start; also the size regrown to after a death."""

    min_replicas: int = 1
    """Fewest live replicas that may keep training. Below it the run stops with a checkpoint and a
    message instead of waiting or respawning (torchrun's --nnodes MIN)."""

    max_replicas: int | None = None
    """Most replicas the run trains on at once; the global batch is planned for it. With ``hosts``, a machine that
    joins mid-run grows the run from ``replicas`` up to it. None means ``replicas``."""

    procs_per_replica: int = 1
    """Processes in one replica group (1 for DDP; k for FSDP sharded over k procs inside a replica).
    When one proc dies its whole replica is replaced."""

    backend: str = "auto"
    """torch.distributed backend of the cross-replica gradient reduction: "auto" (nccl on CUDA and ROCm builds,
    where it is RCCL; gloo on CPU), "gloo" or "nccl". Inside a replica the training code's own group uses
    whichever backend it initialises (the Lightning strategies use this one for both)."""

    batch_policy: str = "constant_global"
    """What a shrink does to the global batch. "constant_global": the global batch and learning rate stay
    fixed and each survivor takes a larger share, so a step is the same maths at any replica count.
    "constant_local": each replica keeps its local batch, so the global batch shrinks with the group."""

    scale_lr_with_replicas: bool = False
    """Only with "constant_local": scale the optimizer's learning rates by live/max replicas (linear
    scaling rule) while the group is smaller than ``max_replicas``."""

    sync_every: int = 1
    """Each replica takes this many optimizer steps on its own shares of the global batches, then the replicas sync
    (``semi_sync``): semi-synchronous training, as torchft's DiLoCo and LocalSGD ``sync_every`` (torchtitan's
    ``sync_steps``). A death between syncs costs only the dead replica's steps since the last sync: the survivors
    train its samples before they sync. 1: synchronous, the gradients reduced at every step."""

    semi_sync: str = "diloco"
    """What a sync does, with ``sync_every`` above 1: "diloco" steps an outer optimizer (Nesterov SGD, lr 0.7, momentum
    0.9, unless ``ElasticLoop(outer_optimizer=...)``) with the replicas' mean pseudo-gradient, the synced parameters
    minus the local ones (DiLoCo); "local_sgd" averages the parameters (LocalSGD)."""

    spares: int = 0
    """Hot spare replica groups: they run the training code up to the point of joining and wait there,
    so a death is answered at once by healing a spare into the shrunken generation (no process start,
    no model build on the critical path). Each holds its memory but little CPU; a new spare is spawned
    to replace the one used."""

    heal_donors: int = 2
    """Most healthy replicas that serve one heal (a newcomer, or a member that dropped a committed step) at once,
    each a disjoint share of the state over a connection of its own: one stream is bound by the kernel's copies,
    and two moved a 100M model's 1.2 GB in 0.73-0.89x one's time on a 2-core machine, at the two-stream limit in
    one invocation of two (docs/benchmarks.md). 1: one donor serves all of it."""

    forkserver: bool | None = None
    """Start the replica processes on this machine by forking a server that has imported torch and the training
    code's framework (Lightning, transformers, torchtitan) once, instead of as fresh interpreters that each import
    them again: a replacement's process is ready in under a second (`monarch_plugin.procs.forkserver`). None: on for CPU
    runs, off on GPU builds (untested there; a library that touched the CUDA driver at import would leave every
    forked child without CUDA). The hosts of a multi-host run start theirs the usual way."""

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

    drain_grace_s: float = 25.0
    """How long a replica told to go (SIGTERM or SIGUSR1 to one of its procs: a preemption) may take to reach the step
    boundary where it leaves; past it, it is treated as dead (its step dropped). Under SLURM keep it below the
    cluster's `KillWait` (30 s by default), after which SLURM sends SIGKILL."""

    controller_loss_save_s: float = 60.0
    """When the controller itself is lost (its process killed, its machine gone), the replicas do not end with it: the
    generation's first replica writes the last committed step as a checkpoint (the front end's own, as when the run
    gives up) and every proc ends within this many seconds, written or not. 60 s: a shard of several GB at a shared
    filesystem's few hundred MB/s, and below the 70 s after which a host agent ends the procs of a controller it lost.
    0: the replicas end with their controller, and every step since the last periodic checkpoint is lost."""

    hosts: list[str] = field(default_factory=list)
    """Monarch host agents to run the replicas on, one per machine, as ``tcp://IP:PORT`` (start one with
    ``monarch-plugin host --address tcp://IP:PORT``). Empty: every replica runs on this machine, no agent needed.
    The training script and its environment must be at the same paths on every host, as with torchrun."""

    hosts_file: str | None = None
    """A file of host agent addresses, one per line, re-read every second while the run goes on: a machine
    added to it (or an agent restarted on a new port) joins the run, which places replacements and grows onto
    it. Used with or instead of ``hosts``. It must be the run's user's and writable by no one else (else it is
    refused): without ``token_file`` every line of it is trusted."""

    token_file: str | None = None
    """The job's token (made once with ``monarch-plugin token PATH``; mode 0600, readable by this user only): a line
    of ``hosts_file`` is attached only if it carries an HMAC of its address under this token, as
    ``monarch-plugin host --token-file PATH`` writes it; any other line is refused (a ``host_refused`` event) and its
    address never contacted. None: every line of ``hosts_file`` is trusted."""

    slurm: bool | None = None
    """Run on the SLURM allocation this is started in: its nodes are the hosts, and each node's agent is started
    by SLURM as a job step of its own (`monarch_plugin.procs.slurm`), with ``hosts_file`` and ``token_file`` made for
    the run in `monarch-slurm-<job id>/` beside the events file. Submit with `--no-kill`: without it SLURM ends the
    whole job when one node fails. None: on when started by the batch script (or `salloc` shell) of an allocation of
    two or more nodes, with neither ``hosts`` nor ``hosts_file`` given; never inside an `srun` step."""

    requeue: bool = True
    """In a SLURM job, SIGUSR1 to the controller (`#SBATCH --signal=B:USR1@120`: SLURM's notice before the time
    limit) stops the run with a checkpoint, then requeues the job (`scontrol requeue`), as Lightning's
    `SLURMEnvironment(auto_requeue=True)` does; with ``resume`` at ``"auto"`` its next start goes on from that
    checkpoint. SIGTERM (`scancel`, a preemption) never requeues. False: SIGUSR1 only stops the run."""

    replicas_per_host: int | None = None
    """Most replicas one host holds at once. None: as many as its GPUs hold (``procs_per_replica`` GPUs each);
    on CPU hosts, no limit. Replicas are spread over the hosts either way."""

    host_timeout_s: float = 5.0
    """A host none of whose procs (its watcher, its workers) has been heard from for this long (its machine or
    agent died, or its link is down) is declared lost, with all its replicas, in one generation change. Monarch's
    own detection takes about 60 s and never reaches the fault hook."""

    preflight: bool = True
    """Check each host as it is attached (with ``hosts``), as `monarch-plugin doctor` does (versions, paths, the
    store's port, backend, clock, interface), log the table, and refuse a host with an error (a `host_refused`
    event naming it and the fix); the run starts on the hosts that remain. Off: only a host that lacks the run's
    paths is refused."""

    store_host: str | None = None
    """The address the controller listens on (its rendezvous store; with ``hosts``, also Monarch's transport);
    workers connect to it. Never a wildcard (0.0.0.0, ::). None: 127.0.0.1 on one machine; with ``hosts``, this
    machine's address on the interface that routes to the first host."""

    events_path: str | None = None
    """JSON-lines file for structured events (spawn, death, quorum, dropped step, heal, give-up),
    emptied when a run starts, and held by the run until it ends (a second run pointed at it is refused). None:
    ``$MONARCH_PLUGIN_EVENTS`` or ``./monarch_events.jsonl``."""

    checkpoint_dir: str | None = None
    """Where durable checkpoints are written (a ``step<N>`` directory each, torch.distributed.checkpoint): when the
    run gives up, and every ``checkpoint_steps`` / ``checkpoint_interval_s`` (one writer; `monarch_plugin.storage.checkpoint`).
    A run that writes or resumes them holds the directory until it ends: a second one is refused. An fsspec URL
    (``s3://bucket/run``, with fsspec and its filesystem installed) is written the same way, but not held. None:
    ``checkpoints`` beside the events file, in the run's own directory."""

    checkpoint_steps: int = 0
    """An `ElasticLoop` run writes a durable checkpoint every this many committed steps, from one replica, while
    training goes on: what a relaunch resumes from if the controller itself is lost. 0: only when the run gives
    up. (Lightning, HF and torchtitan runs use their own checkpointing.)"""

    checkpoint_interval_s: float = 0.0
    """Also write one every this many seconds (at the next committed step), as ``checkpoint_steps`` does; 0: off."""

    checkpoint_keep: int = 3
    """Periodic checkpoints kept (as HF's ``save_total_limit``): once one is complete, all but the newest this many
    complete ones are deleted, never the newest complete one. 0: keep every one."""

    resume: str | None = None
    """Start from a durable checkpoint: "auto" for the newest complete one in ``checkpoint_dir`` (from scratch if
    there is none yet), or the path of one (its ``step<N>`` directory). Any number of replicas, of any number of
    procs, may resume it. None: from scratch."""

    share_files: bool = False
    """Create the events file, the lock files and the checkpoint directories readable by others (0644 files, 0755
    directories, as the umask allows). False: readable by the run's user only (0600 / 0700): the events file names
    the run's store and processes, and checkpoints hold the model."""

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
        self._check_types()
        if self.checkpoint_dir is None:  # what the run writes stays together, where its user put the run's events
            self.checkpoint_dir = os.path.join(os.path.dirname(self.events_path), "checkpoints")
        self.hosts = list(self.hosts)
        if self.slurm is None:
            self.slurm = not (self.hosts or self.hosts_file) and in_slurm_allocation(os.environ)
        self.validate()
        if self.store_host is None and not self.slurm:  # under SLURM: found from the allocation's nodes
            self.store_host = route_address(self.hosts[0]) if self.hosts else "127.0.0.1"

    @property
    def multi_host(self) -> bool:
        """Replicas run on host agents (`hosts`, `hosts_file`, a SLURM allocation's nodes), not on this machine."""
        return bool(self.hosts or self.hosts_file or self.slurm)

    def _check_types(self) -> None:
        """Every field of the type it is declared with (ints where a float is asked are fine)."""
        for f in dataclasses.fields(self):
            value, declared = getattr(self, f.name), f.type
            if value is None and declared.endswith(" | None"):
                continue
            kind = declared.removesuffix(" | None")
            accepted, spoken = _TYPES[kind]
            ok = isinstance(value, accepted) and not (kind in ("int", "float") and isinstance(value, bool))
            if ok and kind == "list[str]":
                ok = all(isinstance(item, str) for item in value)
            if ok and kind == "dict[str, str]":
                ok = all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
            if not ok:
                none = " (or None)" if declared.endswith(" | None") else ""
                raise ConfigError(f"`{f.name}` must be {spoken}{none}, got {value!r} ({type(value).__name__})",
                                  f.name)
            if kind == "float" and not math.isfinite(value):  # every comparison with NaN is False: none would fail
                raise ConfigError(f"`{f.name}` must be a finite number, got {value!r}: give it in seconds, e.g. "
                                  f"{f.default!r} (its default)", f.name)

    def validate(self) -> None:
        """Raise ConfigError naming the field and the fix; runs before any spawn."""
        self._check_types()
        for name in ("replicas", "min_replicas", "max_replicas", "procs_per_replica", "heal_donors"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"`{name}` must be a positive integer, got {value!r}: set it to 1 or more", name)
        if self.min_replicas > self.max_replicas:
            raise ConfigError(
                f"`min_replicas` ({self.min_replicas}) is larger than `max_replicas` ({self.max_replicas}): "
                "lower `min_replicas` or raise `max_replicas`", "min_replicas"
            )
        if not self.min_replicas <= self.replicas <= self.max_replicas:
            raise ConfigError(
                f"`replicas` ({self.replicas}) must lie between `min_replicas` ({self.min_replicas}) and "
                f"`max_replicas` ({self.max_replicas}): change one of the three", "replicas"
            )
        if self.backend not in BACKENDS:
            raise ConfigError(
                f"unknown `backend` {self.backend!r}: choose one of {', '.join(BACKENDS)}", "backend"
            )
        if self.batch_policy not in BATCH_POLICIES:
            raise ConfigError(
                f"unknown `batch_policy` {self.batch_policy!r}: choose one of {', '.join(BATCH_POLICIES)}",
                "batch_policy",
            )
        if self.scale_lr_with_replicas and self.batch_policy != "constant_local":
            raise ConfigError(
                "`scale_lr_with_replicas` only applies to `batch_policy`='constant_local' (with "
                "'constant_global' the global batch, and so the right learning rate, never changes)",
                "scale_lr_with_replicas",
            )
        if self.sync_every < 1:
            raise ConfigError(f"`sync_every` must be 1 (synchronous) or more local steps between syncs, got "
                              f"{self.sync_every}", "sync_every")
        if self.semi_sync not in SEMI_SYNC:
            raise ConfigError(f"unknown `semi_sync` {self.semi_sync!r}: choose one of {', '.join(SEMI_SYNC)}",
                              "semi_sync")
        if self.sync_every > 1 and self.procs_per_replica > 1:
            raise ConfigError(f"`sync_every` {self.sync_every} trains each replica on its own between syncs, which "
                              "ElasticLoop does for replicas of one proc only: set `procs_per_replica` 1, or "
                              "`sync_every` 1 (synchronous)", "sync_every")
        for name in ("max_restarts", "crash_loop_limit", "spares", "checkpoint_steps", "checkpoint_keep"):
            if getattr(self, name) < 0:
                raise ConfigError(f"`{name}` must be 0 or more, got {getattr(self, name)}", name)
        for name in ("restart_backoff_s", "checkpoint_interval_s", "controller_loss_save_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"`{name}` must be 0 or more seconds, got {getattr(self, name)}", name)
        for name in ("join_timeout_s", "collective_timeout_s", "drain_grace_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"`{name}` must be a positive number of seconds, got {getattr(self, name)}", name)
        if self.host_timeout_s < 3:
            raise ConfigError(f"`host_timeout_s` must be 3 seconds or more, got {self.host_timeout_s}: the procs of a "
                              "cut-off host end themselves 2 s before it is declared lost, and need a second's lease "
                              "to tell a cut link from a slow moment", "host_timeout_s")
        if self.replicas_per_host is not None and self.replicas_per_host < 1:
            raise ConfigError(f"`replicas_per_host` must be 1 or more, got {self.replicas_per_host}: or leave it "
                              "unset", "replicas_per_host")
        for address in self.hosts:
            parse_host(address)
        if self.store_host is not None and wildcard(self.store_host):
            raise ConfigError(f"`store_host` {self.store_host!r} is a wildcard address: the run's store (and, with "
                              "`hosts`, Monarch's transport) would listen on every interface; give this machine's own "
                              "IP on the network the hosts share, or leave it unset", "store_host")
        if self.token_file is not None and not self.hosts_file:
            raise ConfigError("`token_file` admits the lines of `hosts_file`: give `hosts_file` too, or drop "
                              "`token_file`", "token_file")
        if self.checkpoint_interval_s and self.procs_per_replica > 1:
            raise ConfigError("`checkpoint_interval_s` needs `procs_per_replica` 1 (each proc of a replica would "
                              "go by its own clock and write its shard at another step): use `checkpoint_steps`",
                              "checkpoint_interval_s")
        if self.resume not in (None, "auto") and "://" not in self.resume and \
                not os.path.isfile(os.path.join(self.resume, ".metadata")):
            raise ConfigError(f"`resume`: {self.resume} is not a complete checkpoint (a step<N> directory with DCP's "
                              "`.metadata` in it): give one, or 'auto' for the newest in `checkpoint_dir`", "resume")
        if self.fault:
            from monarch_plugin.faults import parse_faults

            try:
                parse_faults(self.fault)
            except ConfigError as e:
                raise ConfigError(f"`fault`: {e}", "fault") from e

    def to_env(self) -> dict[str, str]:
        """The settings a worker needs, as environment variables (they cross the process boundary)."""
        return {"MONARCH_PLUGIN_CONFIG": _encode(self)}

    @classmethod
    def from_env(cls) -> "ElasticConfig | None":
        raw = os.environ.get("MONARCH_PLUGIN_CONFIG")
        return _decode(raw) if raw else None


_FLAGS = {"events_path": "--events"}

_TYPES = {
    "int": (int, "a whole number"), "float": ((int, float), "a number"), "str": (str, "a string"),
    "bool": (bool, "True or False"), "list[str]": ((list, tuple), "a list of strings"),
    "dict[str, str]": (dict, "a dict of strings to strings"),
}
"""What each declared field type accepts, and how a message names it."""

def in_slurm_allocation(environ) -> bool:
    """Started by the batch script (or `salloc` shell) of a SLURM allocation of two or more nodes, not inside one of
    its steps (`srun` sets ``SLURM_STEP_ID``: under it, every task would be a controller of its own)."""
    try:
        nodes = int(environ.get("SLURM_JOB_NUM_NODES", "1"))
    except ValueError:
        return False
    return bool(environ.get("SLURM_JOB_ID")) and "SLURM_STEP_ID" not in environ and nodes > 1


def cli_flag(name: str) -> str:
    """`monarch-run`'s flag for the field `name`: torchrun's style, `--min-replicas`, seconds without `_s`."""
    return _FLAGS.get(name) or "--" + name.removesuffix("_s").replace("_", "-")


@functools.cache
def field_docs() -> dict[str, str]:
    """Each field's docstring (the string under it in the class body), one line each: Python keeps none."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(ElasticConfig)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def field_default(f: dataclasses.Field) -> object:
    """A field's default value (a fresh one for a list or dict)."""
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def front_end_fields(owned: tuple[str, ...] = ()) -> list[dataclasses.Field]:
    """The settings a framework's front end takes in its own spelling (the Lightning strategies' keyword arguments,
    torchtitan's `--monarch.*` section): every field but those its framework's own arguments set (`owned`) and
    `LOOP_ONLY`. Each keeps the field's name, type, default and docstring."""
    return [f for f in dataclasses.fields(ElasticConfig) if f.name not in owned and f.name not in LOOP_ONLY]


def front_end_settings(owned: tuple[str, ...], notes: dict[str, str], spell: Callable[[str], str] | None = None,
                       ) -> list[tuple[dataclasses.Field, object, str]]:
    """`front_end_fields(owned)` as a front end shows them (a Lightning strategy's signature and docstring,
    torchtitan's `--monarch.*` help): each field with its type and its help, which is the front end's note where its
    framework fills the setting in (`notes`), else the field's docstring with the fields it names in the front end's
    spelling (`spell`, as `spell_fields` takes it; as they are without one)."""
    hints, docs = typing.get_type_hints(ElasticConfig), field_docs()
    settings = []
    for f in front_end_fields(owned):
        text = docs[f.name].replace("``", "`")
        settings.append((f, hints[f.name], notes.get(f.name) or (spell_fields(text, spell) if spell else text)))
    return settings


def given(config: ElasticConfig) -> dict[str, object]:
    """The settings of `config` its caller chose: those that differ from a config of the same `replicas` and
    `hosts` left at its defaults, so the defaults resolved from them (`max_replicas`, `store_host`) and from the
    environment (`events_path`, `fault`) count as unset, and a front end can put its framework's in their place.
    `replicas` is always in it: the baseline shares it, so a front end that sets its own can check they agree."""
    baseline = ElasticConfig(replicas=config.replicas, hosts=config.hosts)
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(ElasticConfig)
            if f.name == "replicas" or getattr(config, f.name) != getattr(baseline, f.name)}


def spell_fields(text: str, spell: Callable[[str], str]) -> str:
    """`text`, a message of the runtime's, with each field it names (in backticks: `` `min_replicas` ``) written as
    a front end spells that setting, e.g. `spell_fields(str(error), cli_flag)`."""
    names = {f.name for f in dataclasses.fields(ElasticConfig)}
    return re.sub(r"`(\w+)`", lambda m: spell(m.group(1)) if m.group(1) in names else m.group(0), text)


def _encode(cfg: ElasticConfig) -> str:
    import json

    return json.dumps(dataclasses.asdict(cfg))


def _decode(raw: str) -> ElasticConfig:
    import json

    return ElasticConfig(**json.loads(raw))
