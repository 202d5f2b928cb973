"""The `monarch` section of a torchtitan config (`--monarch.*`), and the checks that tie it to the rest.

A plain dataclass in torchtitan's config style (every field documented inline, parsed by tyro), so
elasticity is one more section of the job config rather than a launcher's flags. `validate` runs when the
config is built (`MonarchTrainer.Config.__post_init__`, so at parse time, before anything is spawned) and
names the field to change in every message: the runtime's own `ElasticConfig` checks the replica counts,
and the cross-section rules live here (a replica's procs are its FSDP group, so the parallel dims must fit
them; pipeline, tensor, context and expert parallelism are refused).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from monarch_plugin.config import ElasticConfig, spell_fields
from monarch_plugin.errors import ConfigError

if TYPE_CHECKING:
    from monarch_plugin.integrations.torchtitan.trainer import MonarchTrainer

__all__ = ["MonarchConfig", "elastic_config", "global_batch_size", "micro_batch_size", "validate"]


@dataclass(kw_only=True, slots=True)
class MonarchConfig:
    enable: bool = False
    """
    Train elastically under PyTorch Monarch: the launching process becomes the controller and spawns
    `replicas` replicas of `procs_per_replica` procs each (one FSDP group per replica). A SIGKILLed worker
    costs the survivors the step in flight; its replica is replaced and healed from a live one.
    Off: torchtitan trains as usual (under torchrun).
    """

    replicas: int = 2
    """Replicas spawned at start, and the size the run regrows to after a death."""

    min_replicas: int = 1
    """
    Fewest live replicas that may keep training. Below it the run stops (with a checkpoint when
    `--checkpoint.enable` is set) instead of waiting.
    """

    max_replicas: int | None = None
    """Most replicas trained on at once; with `hosts`, a machine that joins mid-run grows the run up to it (None:
    `replicas`)."""

    procs_per_replica: int = 1
    """
    Procs in one replica: its FSDP group (`--parallelism.data_parallel_shard_degree`, which defaults to
    it). When one of them dies the whole replica is replaced.
    """

    spares: int = 0
    """
    Hot spare replicas: they build the model and wait, so a death is answered by healing a spare into
    the shrunken group at once rather than by starting a process.
    """

    forkserver: bool | None = None
    """
    Fork the replicas' processes from a server that imported torch and torchtitan once (10 s of CPU each here)
    instead of starting fresh interpreters. None: on for CPU runs, off on GPU builds (`docs/runtime.md`).
    """

    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Backend of the cross-replica gradient reduction: auto picks nccl (RCCL on ROCm) on GPUs, gloo on CPU."""

    max_restarts: int = 10
    """Replacement replicas spawned over the whole run before the controller gives up."""

    join_timeout_s: float = 2 * ElasticConfig.join_timeout_s
    """
    How long a (re)spawned replica may take to build its Trainer and reach the first step: twice the runtime's
    default, because a torchtitan replica builds, parallelizes and (with `--checkpoint.enable`) loads its model
    before it can join.
    """

    collective_timeout_s: float = 2 * ElasticConfig.collective_timeout_s
    """
    A cross-replica reduction slower than this is a hang: the controller finds the stuck replica and
    replaces it. Twice the runtime's default: keep it above the longest gap between steps, and torchtitan
    validates and saves checkpoints between steps.
    """

    fault: str | None = None
    """
    Opt-in fault injection for demos and tests, e.g. "sigkill:replica=1:step=5": every proc of replica 1
    SIGKILLs itself at the start of torchtitan step 5. Only replicas spawned at the start are hit.
    """

    events_path: str | None = None
    """JSON-lines file of spawns, deaths, generations, dropped steps and heals (None: <dump_folder>/monarch_events.jsonl)."""

    hosts: list[str] = field(default_factory=list)
    """
    Monarch host agents to run the replicas on, one per machine, as `tcp://IP:PORT,...` (start one on each with
    `monarch-plugin host --address tcp://IP:PORT`). Empty: every replica on this machine. A replica's procs (its
    FSDP group) are always on one host; the job's script and environment must be at the same paths on every host.
    See docs/multihost.md.
    """

    hosts_file: str | None = None
    """A file of host agent addresses, one per line, re-read every second: a machine listed mid-run joins the run."""

    replicas_per_host: int | None = None
    """Most replicas on one host (None: as many as its GPUs hold, `procs_per_replica` each; on CPU no limit)."""

    host_timeout_s: float = ElasticConfig.host_timeout_s
    """A host not heard from for this long (dead, or its link down) is lost with all its replicas, in one change."""

    store_host: str | None = None
    """This machine's address on the job's network, which the controller listens on (None: the route to the first host)."""


def micro_batch_size(config: "MonarchTrainer.Config") -> int:
    """Samples in one global micro-batch: what the replicas started with take in one forward,
    `local_batch_size x procs_per_replica x replicas`; the same samples are cut over fewer replicas after a death."""
    return config.training.local_batch_size * config.monarch.procs_per_replica * config.monarch.replicas


def global_batch_size(config: "MonarchTrainer.Config") -> int:
    """Samples in one optimizer step across all replicas, as torchtitan's HSDP counts them (the replicas are its
    replicate dimension): `--training.global_batch_size`, by default one micro-batch (no accumulation)."""
    return config.training.global_batch_size if config.training.global_batch_size > 0 else micro_batch_size(config)


def elastic_config(config: "MonarchTrainer.Config") -> ElasticConfig:
    """The runtime's settings for this job; raises ConfigError naming the runtime field."""
    monarch = config.monarch
    return ElasticConfig(
        replicas=monarch.replicas, min_replicas=monarch.min_replicas, max_replicas=monarch.max_replicas,
        procs_per_replica=monarch.procs_per_replica, spares=monarch.spares, forkserver=monarch.forkserver,
        cross_backend=monarch.backend,
        max_restarts=monarch.max_restarts, join_timeout_s=monarch.join_timeout_s,
        collective_timeout_s=monarch.collective_timeout_s, fault=monarch.fault,
        events_path=monarch.events_path or os.path.join(config.dump_folder, "monarch_events.jsonl"),
        checkpoint_dir=os.path.join(config.dump_folder, config.checkpoint.folder),
        hosts=monarch.hosts, hosts_file=monarch.hosts_file, replicas_per_host=monarch.replicas_per_host,
        host_timeout_s=monarch.host_timeout_s, store_host=monarch.store_host,
    )


def flag(field: str) -> str:
    """A runtime setting as this section spells it: `--monarch.<field>` (`backend` for the cross-replica one)."""
    return "--monarch.backend" if field == "cross_backend" else f"--monarch.{field}"


def validate(config: "MonarchTrainer.Config") -> None:
    """Raise ValueError naming the field and the fix, for a job that enables `--monarch.enable`."""
    monarch, parallelism, training = config.monarch, config.parallelism, config.training
    for name in ("replicas", "min_replicas", "procs_per_replica"):
        value = getattr(monarch, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"--monarch.{name} must be a positive integer, got {value!r}")
    try:
        elastic_config(config)
    except ConfigError as e:
        raise ValueError(spell_fields(str(e), flag)) from e
    k = monarch.procs_per_replica
    unsupported = {
        "pipeline_parallel_degree": "pipeline parallelism",
        "tensor_parallel_degree": "tensor parallelism",
        "context_parallel_degree": "context parallelism",
        "expert_parallel_degree": "expert parallelism",
    }
    for field_name, what in unsupported.items():
        if getattr(parallelism, field_name) != 1:
            raise ValueError(
                f"--monarch.enable does not support {what} (--parallelism.{field_name} "
                f"{getattr(parallelism, field_name)}): a replica is one FSDP group of --monarch.procs_per_replica "
                f"procs; set --parallelism.{field_name} 1"
            )
    if parallelism.data_parallel_replicate_degree != 1:
        raise ValueError(
            f"--parallelism.data_parallel_replicate_degree {parallelism.data_parallel_replicate_degree} with "
            "--monarch.enable: the replicas are the replicate dimension; set it to 1 and use --monarch.replicas"
        )
    if parallelism.data_parallel_shard_degree not in (-1, k):
        raise ValueError(
            f"--monarch.procs_per_replica {k} does not match --parallelism.data_parallel_shard_degree "
            f"{parallelism.data_parallel_shard_degree}: a replica's procs are its FSDP group; make them equal "
            "(or leave the shard degree at -1)"
        )
    if parallelism.spmd_backend == "spmd_types" and k > 1:
        raise ValueError(
            "--parallelism.spmd_backend spmd_types cannot shard a replica over procs with torch 2.13's FSDP "
            "(it expects DTensor parameters that backend does not create): pass --parallelism.spmd_backend "
            "partial_dtensor, or --monarch.procs_per_replica 1"
        )
    if config.checkpoint.create_seed_checkpoint:
        raise ValueError(
            "--checkpoint.create_seed_checkpoint runs in a single process: drop --monarch.enable for it"
        )
    if config.comm.mode in ("fake_backend", "local_tensor"):
        raise ValueError(f"--comm.mode {config.comm.mode} has no real processes to fail: drop --monarch.enable")
    per_step = micro_batch_size(config)
    total = global_batch_size(config)
    if total % per_step:
        raise ValueError(
            f"--training.global_batch_size {total} is not a multiple of --training.local_batch_size x "
            f"--monarch.procs_per_replica x --monarch.replicas = {per_step}: each accumulation micro-batch "
            "is one such global batch cut over the live replicas"
        )
    max_replicas = monarch.max_replicas or monarch.replicas
    if per_step < max_replicas * k:
        raise ValueError(
            f"a micro-batch of {per_step} samples (--training.local_batch_size {training.local_batch_size} x "
            f"{k} procs x {monarch.replicas} replicas) leaves some of up to {max_replicas * k} procs "
            f"(--monarch.max_replicas x --monarch.procs_per_replica) without a sample: raise "
            "--training.local_batch_size"
        )
