"""The `monarch` section of a torchtitan config (`--monarch.*`), and the checks that tie it to the rest.

A dataclass in torchtitan's config style (every field documented, parsed by tyro), generated from the runtime's
`ElasticConfig` so that every setting is there with its one default and docstring: elasticity is one more section
of the job config rather than a launcher's flags, and the section is read straight into the runtime's config.
`validate` runs when the config is built (`MonarchTrainer.Config.__post_init__`, so at parse time, before anything
is spawned) and names the field to change in every message: the runtime's own `ElasticConfig` checks its settings,
and the cross-section rules live here (a replica's procs are its FSDP x CP x TP mesh, so the parallel dims must fit
them; pipeline, context and expert parallelism are refused, docs/torchtitan.md says why).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import field
from typing import TYPE_CHECKING, Annotated

import tyro

from monarch_plugin.config import ElasticConfig, front_end_fields, front_end_settings, spell_fields
from monarch_plugin.errors import ConfigError

if TYPE_CHECKING:
    from monarch_plugin.integrations.torchtitan.trainer import MonarchTrainer

__all__ = ["MonarchConfig", "data_parallel_procs", "elastic_config", "global_batch_size", "micro_batch_size",
           "validate"]


OWNED = {"checkpoint_dir": "`--checkpoint.folder` under `--dump_folder`"}
"""The settings torchtitan's own sections give. The `monarch` section has every other field of
`front_end_fields`, as `--monarch.<field>`; `LOOP_ONLY` are not torchtitan's (its checkpoints are `--checkpoint.*`)."""

STRUCTURED_LOGS_ENV = "TITAN_STRUCT_LOGGER_HANDLERS"
"""torchtitan's hook naming the handlers of its structured trace log; set for the replicas (unless the job sets
it) to `trainer.replica_structured_logs`, which keeps each replica's files in a folder of its own."""

ENABLE = ("Train elastically under PyTorch Monarch: the launching process becomes the controller and spawns "
          "`replicas` replicas of `procs_per_replica` procs each (one FSDP x CP x TP mesh per replica). A "
          "SIGKILLed worker costs the survivors the step in flight; its replica is replaced and healed from a live "
          "one. Off: torchtitan trains as usual (under torchrun).")
"""`--monarch.enable`: the one setting of the section that is not the runtime's."""

_NOTES = {
    "events_path": "JSON-lines file of spawns, deaths, generations, dropped steps and heals (None: "
                   "`<dump_folder>/monarch_events.jsonl`).",
}
"""Where a section field means more than the runtime's: torchtitan's `--dump_folder` fills it in."""


def flag(field: str) -> str:
    """A runtime setting as this section spells it: `--monarch.<field>`."""
    return f"--monarch.{field}"


def _section() -> type:
    """The `monarch` section: `enable`, then the runtime's settings, each with its field's type, default and
    docstring (tyro shows it under `--help`), as torchft's `FaultTolerance` section feeds its manager."""
    fields = [("enable", Annotated[bool, tyro.conf.arg(help=ENABLE)], field(default=False))]
    for f, kind, text in front_end_settings(tuple(OWNED), _NOTES, flag):
        default = field(default_factory=f.default_factory) if f.default is dataclasses.MISSING else field(
            default=f.default)
        fields.append((f.name, Annotated[kind, tyro.conf.arg(help=text)], default))
    section = dataclasses.make_dataclass("MonarchConfig", fields, kw_only=True, slots=True)
    section.__module__ = __name__  # where pickle and torchtitan's config tools find it
    return section


MonarchConfig = _section()


def data_parallel_procs(config: "MonarchTrainer.Config") -> int:
    """A replica's procs that read data of their own: its FSDP shard degree, `procs_per_replica` over the context
    and tensor parallel degrees (the procs of one CP x TP group read the same samples)."""
    return config.monarch.procs_per_replica // _model_parallel(config.parallelism)


_MODEL_PARALLEL = ("context_parallel_degree", "tensor_parallel_degree")
"""The dimensions of a replica's mesh whose procs read the same samples: context parallelism splits each sequence,
tensor parallelism each layer."""


def _model_parallel(parallelism) -> int:
    """Procs of a replica that read the same samples: the context x tensor parallel degree."""
    return parallelism.context_parallel_degree * parallelism.tensor_parallel_degree


def micro_batch_size(config: "MonarchTrainer.Config") -> int:
    """Samples in one global micro-batch: what the replicas started with take in one forward,
    `local_batch_size x data_parallel_procs x replicas`; the same samples are cut over fewer replicas after a death."""
    return config.training.local_batch_size * data_parallel_procs(config) * config.monarch.replicas


def global_batch_size(config: "MonarchTrainer.Config") -> int:
    """Samples in one optimizer step across all replicas, as torchtitan's HSDP counts them (the replicas are its
    replicate dimension): `--training.global_batch_size`, by default one micro-batch (no accumulation)."""
    return config.training.global_batch_size if config.training.global_batch_size > 0 else micro_batch_size(config)


def elastic_config(config: "MonarchTrainer.Config") -> ElasticConfig:
    """The runtime's settings for this job: the `monarch` section's, and torchtitan's folders; raises ConfigError
    naming the runtime field."""
    monarch = config.monarch
    settings = {f.name: getattr(monarch, f.name) for f in front_end_fields(tuple(OWNED))}
    settings["events_path"] = monarch.events_path or os.path.join(config.dump_folder, "monarch_events.jsonl")
    if STRUCTURED_LOGS_ENV not in os.environ:  # a job that names its own handlers keeps them
        handler = "monarch_plugin.integrations.torchtitan.trainer.replica_structured_logs"
        settings["env"] = {STRUCTURED_LOGS_ENV: handler, **settings.get("env", {})}
    return ElasticConfig(**settings, checkpoint_dir=os.path.join(config.dump_folder, config.checkpoint.folder))


def validate(config: "MonarchTrainer.Config") -> None:
    """Raise ValueError naming the field and the fix, for a job that enables `--monarch.enable`."""
    monarch, parallelism, training = config.monarch, config.parallelism, config.training
    try:
        elastic_config(config)
    except ConfigError as e:
        raise ValueError(spell_fields(str(e), flag)) from e
    k, mp = monarch.procs_per_replica, _model_parallel(parallelism)
    split = [name for name in _MODEL_PARALLEL if getattr(parallelism, name) > 1]
    splits = " x ".join(f"--parallelism.{name} {getattr(parallelism, name)}" for name in split)
    unsupported = {
        "pipeline_parallel_degree": "pipeline parallelism",
        "expert_parallel_degree": "expert parallelism",
    }
    for field_name, what in unsupported.items():
        if getattr(parallelism, field_name) != 1:
            raise ValueError(
                f"--monarch.enable does not support {what} (--parallelism.{field_name} "
                f"{getattr(parallelism, field_name)}): a replica is an FSDP x CP x TP mesh of "
                f"--monarch.procs_per_replica procs (docs/torchtitan.md says why); set --parallelism.{field_name} 1"
            )
    if k % mp:
        raise ValueError(
            f"{splits} does not divide --monarch.procs_per_replica {k}: a replica's procs are its FSDP x CP x TP "
            "mesh; make procs_per_replica a multiple of it"
        )
    if parallelism.data_parallel_replicate_degree != 1:
        raise ValueError(
            f"--parallelism.data_parallel_replicate_degree {parallelism.data_parallel_replicate_degree} with "
            "--monarch.enable: the replicas are the replicate dimension; set it to 1 and use --monarch.replicas"
        )
    if parallelism.data_parallel_shard_degree not in (-1, k // mp):
        raise ValueError(
            f"--monarch.procs_per_replica {k} does not match --parallelism.data_parallel_shard_degree "
            f"{parallelism.data_parallel_shard_degree}{' x ' + splits if splits else ''}: a replica's procs are its "
            "FSDP x CP x TP mesh; make them equal (or leave the shard degree at -1)"
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
    readers = "--monarch.procs_per_replica" + "".join(f" / --parallelism.{name}" for name in split)
    if total % per_step:
        raise ValueError(
            f"--training.global_batch_size {total} is not a multiple of --training.local_batch_size x "
            f"{readers} x --monarch.replicas = {per_step}: each accumulation micro-batch is one such global batch "
            "cut over the live replicas"
        )
    max_replicas, dp = monarch.max_replicas or monarch.replicas, data_parallel_procs(config)
    if per_step < max_replicas * dp:
        raise ValueError(
            f"a micro-batch of {per_step} samples (--training.local_batch_size {training.local_batch_size} x "
            f"{dp} data-parallel procs x {monarch.replicas} replicas) leaves some of up to {max_replicas * dp} "
            f"data-parallel procs (--monarch.max_replicas x {readers}) without a sample: raise "
            "--training.local_batch_size"
        )
