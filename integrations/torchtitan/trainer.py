"""`MonarchTrainer`: torchtitan's Trainer with a `monarch` config section, elastic across replicas.

The same class serves both sides. In the launching process, `Config.build()` returns the controller
(`launch.ElasticLauncher`) instead of a Trainer when `--monarch.enable` is set; it spawns the replicas, each
of which runs the same command and builds a real `MonarchTrainer` whose torch.distributed world is its own
replica's procs (its FSDP x CP x TP mesh, as torchtitan builds it). Across replicas only the runtime's session talks:

* **The step is a transaction.** `train_step` computes the step's micro-batches (FSDP, CP and TP communicate inside
  the replica as usual), then sums each proc's gradient shard with the same shard of the other live replicas
  and votes inside the replica; only if every reduction completed do clipping, the optimizer, the LR
  schedule, the data cursor and the step counter move. A death drops the step: the survivors join the new
  generation and redo it, on the same global batch cut over fewer replicas, inside the same `train_step`.
* **The heal is taken at a step boundary.** A replica joins a new generation only between steps (before the
  step's first forward, or after a dropped step's backward has finished), from the training thread, so a
  donor serves weights and optimizer state that no FSDP forward, backward or optimizer step is touching.
  Each proc heals from the proc holding the same shard in the donor replica, after checking that its mesh
  dimensions and placements are the donor's.
* **The loss is normalised globally.** Every proc holds the step's whole global batch (`ElasticDataLoader`),
  so it divides its loss by the global valid-token count: FSDP's in-replica sum plus the cross-replica sum
  give the global-batch mean at any number of live replicas, uneven splits included.

Everything else is torchtitan's own `train()` loop: checkpoints (written by one replica), validation,
profiling and metrics (each replica in its own folders), and garbage collection.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torchtitan.components.dataloader import DataloaderExhaustedError
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from monarch_plugin.integrations.torchtitan import compat
from monarch_plugin.integrations.torchtitan.config import (
    MonarchConfig,
    global_batch_size,
    micro_batch_size,
    validate,
)
from monarch_plugin.integrations.torchtitan.data import ElasticDataLoader
from monarch_plugin.storage.checkpoint import newest
from monarch_plugin.worker import context as _context
from monarch_plugin.worker.dtensors import local_part
from monarch_plugin.worker.transaction import StepTransaction, TrainingState


__all__ = ["CommittedStep", "MonarchTrainer"]

_STEP_FOLDER = re.compile(r"step-(?P<step>\d+)")
"""How torchtitan's checkpointer names the checkpoint of step N in its folder."""


@dataclass(frozen=True)
class CommittedStep:
    """What the last committed step was, as this proc saw it (for callers, logs and tests)."""

    step: int
    generation: int
    replicas: int
    """Live replicas that trained the step (the global batch was cut over this many)."""
    loss: float | None
    """The global-batch mean loss; None on steps torchtitan does not log (`--metrics.log_freq`)."""
    samples: list[int]
    """Stream positions of the samples this proc trained in the step."""


class MonarchTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        monarch: MonarchConfig = field(default_factory=MonarchConfig)
        """Elastic training across replicas (each an FSDP x CP x TP mesh) under PyTorch Monarch; off unless
        `--monarch.enable`."""

        def __post_init__(self) -> None:
            if self.monarch.enable:  # first, so an unsupported combination is reported against --monarch.enable
                validate(self)
            Trainer.Config.__post_init__(self)  # explicit: zero-argument super() fails in slots dataclasses

        def build(self, **kwargs: Any):
            """In the launching process of an elastic job: the controller, whose `train()` runs the replicas."""
            if self.monarch.enable and _context.current() is None:
                from monarch_plugin.integrations.torchtitan.launch import ElasticLauncher

                return ElasticLauncher(self)
            return Trainer.Config.build(self, **kwargs)

    def __init__(self, config: Config):
        compat.apply()
        ctx = _context.current()
        if ctx is not None and not config.monarch.enable:
            raise RuntimeError(
                "this torchtitan job runs inside a monarch-plugin replica but --monarch.enable is off: launch it "
                "with `python -m torchtitan.train ... --monarch.enable` (the controller is that process)"
            )
        self._tx: StepTransaction | None = None
        self._committed = 0
        self._in_step = False
        self.last_commit: CommittedStep | None = None
        """The last step this proc committed (elastic runs only)."""
        if compat.on_cpu():
            config.model_spec = dataclasses.replace(
                config.model_spec, parallelize_fn=_summing_fsdp(config.model_spec.parallelize_fn)
            )
        if config.monarch.enable:
            _check_launch(config, ctx)
            _per_replica_outputs(config, ctx.replica_id)
            micro = micro_batch_size(config)
            config.dataloader = ElasticDataLoader.Config(
                source=config.dataloader, micro_batch_size=micro, micro_batches=global_batch_size(config) // micro,
            )
        super().__init__(config)
        if config.monarch.enable:
            self._tx = StepTransaction(ctx, _HealState(self), self._params(), buffers_of=self.model_parts,
                                       overlap=False, give_up=self._write_give_up_checkpoint,
                                       newest_checkpoint=self._newest_checkpoint)
            # torchtitan counted accumulation over this replica alone; a micro-batch spans every replica here.
            self.gradient_accumulation_steps = self.dataloader.config.micro_batches
            self.checkpointer = _OneWriter(self.checkpointer, self._tx)
            logger.info(
                f"monarch: replica {ctx.replica_id}, proc {ctx.local_rank} of {ctx.procs_per_replica}: global batch "
                f"{global_batch_size(config)} samples per step ({self.gradient_accumulation_steps} micro-batch(es) "
                f"of {micro}), cut over the live replicas"
            )

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for part in self.model_parts for p in part.parameters()]

    # -- the loop: torchtitan's train(), with a step boundary where generations change -------------------------

    def should_continue_training(self) -> bool:
        """At every step boundary: enter a waiting generation (heal if behind); at the end, leave together."""
        if self._tx is None:
            return super().should_continue_training()
        self._tx.sync(self._committed)
        if self.step < self.config.training.steps:
            return True
        self._tx.finish(lambda: self._committed)
        return False

    def train_step(self, data_iterator):
        if self._tx is None:
            return super().train_step(data_iterator)
        self._in_step = True
        zero_grad = lambda: self.optimizers.zero_grad(set_to_none=self.config.training.disable_cuda_graphs)  # noqa
        try:
            reduced = self._tx.commit(self.step, lambda: self._committed, lambda redo: self._attempt(data_iterator),
                                      zero_grad)
        except DataloaderExhaustedError:
            self._tx.finish(lambda: self._committed)  # every replica reads the same stream: all ran out together
            raise
        finally:
            self._in_step = False
        if reduced is not None:  # else a peer committed this step while ours was dropped; the heal handed it over
            self._step_optimizer(reduced)

    def _attempt(self, data_iterator) -> list[float]:
        """One try at step `self.step` on the current generation: its forward and backward; the loss to sum."""
        tx = self._tx
        self.dataloader.regroup(tx.rank, tx.world)
        self.optimizers.zero_grad(set_to_none=self.config.training.disable_cuda_graphs)
        should_log = self.metrics_processor.should_log(self.step)
        global_valid_tokens = torch.tensor(self.dataloader.valid_tokens(), dtype=torch.int64, device=self.device)
        local_valid_tokens = torch.tensor(0, dtype=torch.int64)
        tokens_before = self.ntokens_seen
        tx.begin(self.step)
        tx.arm(1.0)  # every proc normalises its loss by the global token count: the sum is the mean
        loss_sum = torch.zeros((), device=self.device)
        for _ in range(self.gradient_accumulation_steps):
            input_dict, labels = next(data_iterator)
            local_valid_tokens += (labels != IGNORE_INDEX).sum()
            input_dict = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in input_dict.items()}
            loss = self.forward_backward_step(input_dict=input_dict, labels=labels.to(self.device),
                                              global_valid_tokens=global_valid_tokens)
            loss_sum += local_part(loss.detach())  # under TP's loss parallel a DTensor, as torchtitan reads it
        self.ntokens_seen = tokens_before  # counted globally at commit, so a redone step is not counted twice
        self._attempted = (should_log, loss_sum, global_valid_tokens, local_valid_tokens)
        return [float(loss_sum)] if should_log else []

    def _step_optimizer(self, reduced: list[float]) -> None:
        """The step committed (every live replica summed its gradients): clip, step, move the cursor, log."""
        tx, parallel_dims = self._tx, self.parallel_dims
        should_log, loss_sum, global_valid_tokens, local_valid_tokens = self._attempted
        lr_metrics = self.lr_schedulers.get_metrics()
        grad_norm = dist_utils.clip_grad_norm_(self._params(), self.config.training.max_norm, foreach=True,
                                               pp_mesh=None, ep_enabled=False)
        self.checkpointer.maybe_wait_for_staging()
        self.optimizers.step()
        self.lr_schedulers.step()
        samples = self.dataloader.positions()
        step_samples = self.dataloader.config.micro_batch_size * self.gradient_accumulation_steps
        self.ntokens_seen += step_samples * self.config.training.seq_len
        self.dataloader.commit()
        self._committed = self.step
        tx.committed(self.step)
        loss = None
        if should_log:
            loss_mesh = parallel_dims.get_optional_mesh("loss") if parallel_dims.dp_cp_enabled else None
            total = torch.tensor(reduced[0], device=self.device)
            local_avg = loss_sum * global_valid_tokens / local_valid_tokens.clamp(min=1).to(self.device)
            loss = dist_utils.dist_sum(total, loss_mesh)
            self.metrics_processor.log(
                self.step, loss, dist_utils.dist_max(local_avg, loss_mesh), float(grad_norm.item()),
                extra_metrics={"n_tokens_seen": self.ntokens_seen, **tx.metrics(), **lr_metrics},
            )
        self.last_commit = CommittedStep(step=self.step, generation=tx.gen, replicas=tx.world, loss=loss,
                                         samples=samples)

    def _write_give_up_checkpoint(self, committed: int) -> str | None:
        """The run stops (too few replicas, a signal) or its controller is lost: the generation's first replica
        writes torchtitan's checkpoint of the last committed step, which `--checkpoint.enable` loads on the next
        start. Always the whole training state, as an interval's: torchtitan takes the highest complete `step-N` and
        loads all of it, so a model-only one (`last_save_model_only`, on by default, is for a run's end) would stop
        the relaunch instead of resuming it."""
        if not self.checkpointer.enable:
            return None
        inner = self.checkpointer.inner
        model_only, in_hf = inner.last_save_model_only, inner.last_save_in_hf
        inner.last_save_model_only = inner.last_save_in_hf = False
        try:
            saved = inner.save(committed, last_step=True)  # at once, whatever the interval, and synchronously
        finally:
            inner.last_save_model_only, inner.last_save_in_hf = model_only, in_hf
        if not saved or torch.distributed.get_rank() != 0:
            return None
        return os.path.abspath(os.path.join(self.config.dump_folder, self.config.checkpoint.folder,
                                            f"step-{committed}"))

    def _newest_checkpoint(self) -> str | None:
        """The newest complete `step-N` in the checkpoint folder (one with DCP's `.metadata`), which
        `--checkpoint.enable` loads on the next start."""
        return newest(os.path.join(self.config.dump_folder, self.config.checkpoint.folder), name=_STEP_FOLDER)

    # -- torchtitan's train_state (checkpoints) --------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The last committed step: the give-up checkpoint is written from inside a step that was dropped."""
        if self._tx is None:
            return super().state_dict()
        return {"step": self._committed, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._committed = self.step


class _HealState(TrainingState):
    """What a newcomer, or a replica that dropped a step its peers committed, receives from a live replica.

    Served and loaded only at a step boundary (see the module docstring), before this replica's loop steps its
    schedulers, so even a replica one step behind takes everything; each proc exchanges its own shards.
    """

    def __init__(self, trainer: MonarchTrainer):
        super().__init__(trainer, "_committed", lambda: trainer.device, modules=lambda: trainer.model_parts,
                         optimizers=lambda: trainer.optimizers.optimizers, schedulers=lambda: [trainer.lr_schedulers])

    def extra_state(self) -> dict:
        t = self.owner
        return {"ntokens_seen": t.ntokens_seen, "data": t.dataloader.state_dict()}

    def load_extra(self, state: dict, whole: bool) -> None:
        t = self.owner
        t.dataloader.load_state_dict(state["data"])
        t.ntokens_seen = state["ntokens_seen"]
        if not t._in_step:  # between steps, torchtitan's own step counter is the committed steps too
            t.step = state["step"]


class _OneWriter:
    """torchtitan's checkpointer, saving from the current generation's first replica only (all its procs take
    part, as DCP needs): every replica holds the same state, and they share one checkpoint folder."""

    def __init__(self, inner, tx: StepTransaction):
        self.inner = inner
        self.tx = tx

    def save(self, curr_step: int, last_step: bool = False) -> bool:
        return self.tx.rank == 0 and self.inner.save(curr_step, last_step)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _summing_fsdp(parallelize_fn):
    """torchtitan's parallelize function, then FSDP told to reduce with SUM (see `compat.force_sum_reduction`)."""

    def parallelize(model, **kwargs):
        model = parallelize_fn(model, **kwargs)
        compat.force_sum_reduction(model)
        return model

    return parallelize


def _per_replica_outputs(config: MonarchTrainer.Config, replica_id: int) -> None:
    """torchtitan names its TensorBoard/W&B folder (written by rank 0), profiler traces (`rank<r>_trace.json.gz`)
    and memory snapshots by the torch.distributed rank, which is replica-local here: every replica would write
    the same files, the traces overwriting each other and a TensorBoard run getting one event file per replica.
    Each replica writes under a `replica_<id>` subfolder of each folder instead (ids are never reused, so a
    replacement gets a folder of its own); checkpoints stay shared (`_OneWriter`)."""
    leaf = f"replica_{replica_id}"
    config.metrics.save_tb_folder = os.path.join(config.metrics.save_tb_folder, leaf)
    config.profiler.save_traces_folder = os.path.join(config.profiler.save_traces_folder, leaf)
    config.profiler.save_memory_snapshot_folder = os.path.join(config.profiler.save_memory_snapshot_folder, leaf)


def replica_structured_logs(*, structured_logger, rank: int, source: str, output_dir: str) -> None:
    """torchtitan's structured trace log in a replica (its `TITAN_STRUCT_LOGGER_HANDLERS` hook, named for the
    replicas by `config.elastic_config`): torchtitan's own JSONL handler, writing under `replica_<id>/` of the
    dump folder, since its file names carry the replica-local rank, the same in every replica."""
    from torchtitan.observability.structured_logger.jsonl_handler import register_jsonl_handler

    folder = os.path.join(output_dir, f"replica_{_context.current().replica_id}")
    register_jsonl_handler(structured_logger=structured_logger, rank=rank, source=source, output_dir=folder)


def _check_launch(config: MonarchTrainer.Config, ctx) -> None:
    if ctx is None:
        raise RuntimeError(
            "MonarchTrainer with --monarch.enable trains inside replicas the controller spawns: build it with "
            "config.build() (as `python -m torchtitan.train` does), not MonarchTrainer(config)"
        )
    for name in ("replicas", "procs_per_replica"):
        if getattr(ctx.config, name) != getattr(config.monarch, name):
            raise RuntimeError(
                f"this replica was started with {name}={getattr(ctx.config, name)} but the job says "
                f"--monarch.{name} {getattr(config.monarch, name)}: launch the job with `python -m "
                "torchtitan.train ... --monarch.enable` so the controller takes its settings from the job"
            )
