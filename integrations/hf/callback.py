"""`MonarchElasticCallback`: HF `Trainer.train()` as the elastic runtime's step transaction.

Under `monarch-run` every replica runs the user's unchanged script. Each replica's torch.distributed world is
its own procs (one here), so accelerate's DDP wrapper spans nothing and is switched off; everything that crosses
replicas goes through the runtime's `ReplicaSession`:

* **Data.** The training loader is rebuilt around the runtime's `ElasticSampler`: one permutation per epoch (the
  one accelerate's seedable sampler would draw under torchrun), one global cursor that moves only when a step
  commits. A global micro-batch is `per_device_train_batch_size x replicas` samples, cut into contiguous shares
  over the replicas live for that step; a step is `gradient_accumulation_steps` of them, as HF groups them. A
  streaming train_dataset (an `IterableDataset`) is read whole by every replica and cut the same way, with a
  cursor over the stream (`_stream`).
* **The step.** `on_step_begin` arms the runtime's reducer with this replica's share of the step's samples; the
  window's earlier micro-batches accumulate locally (the reducer's `no_sync`), and the last backward reduces the
  weighted gradients over the live replicas, so HF's clipping acts on the global-batch gradient, as with DDP.
  `on_pre_optimizer_step` is the commit point: if the reduction completed everywhere, HF's own
  `optimizer.step()`, scheduler step and `global_step += 1` follow. If a death interrupted it, the step is
  dropped and redone inside that same call, by the new group, on its shares of the same global micro-batches
  (through the Trainer's public `get_batch_samples` and `training_step`), and clipped again; so the optimizer,
  the LR schedule and `state.global_step` advance exactly once per committed step.
* **Generations** change only at step boundaries this callback controls: a grow agreed inside a committed step,
  or a death noticed after one, is entered in `on_step_end`; a replacement joins in `on_train_begin` and heals
  there from a live peer (weights, optimizer, scheduler, cursor, `TrainerState`, stateful callbacks, RNG); the
  epoch loop then resumes where its peers are (`_trainer_hooks`).
* **One writer.** Rank 0 of the current generation is the main process: only it saves checkpoints and reports
  to loggers (`state.is_world_process_zero`); `elastic/replicas` goes through `Trainer.log`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState, TrainerState
from transformers.utils import logging

from monarch_plugin.config import LOOP_ONLY, cli_flag, field_default
from monarch_plugin.integrations.hf import _trainer_hooks
from monarch_plugin.integrations.hf._stream import ElasticStream
from monarch_plugin.data.sampler import ElasticSampler, ShareSampler, forget_before, reloader
from monarch_plugin.worker import context as _context
from monarch_plugin.worker.transaction import StepTransaction, TrainingState
from monarch_plugin.worker.window import StepWindow, short_tail

__all__ = ["MonarchElasticCallback"]

logger = logging.get_logger(__name__)

_INACTIVE = (
    "MonarchElasticCallback is inactive: this process was not started by `monarch-run`, so Trainer.train() runs "
    "as usual. Launch with `monarch-run --replicas N --min-replicas M script.py` to train on elastic replicas."
)

# Written next to each checkpoint of a streaming run: where the stream is at the checkpoint's step.
_STREAM_STATE = "monarch_stream.pt"

# Per-replica fields of TrainerState that a heal must not overwrite.
_OWN_STATE_FIELDS = {"is_local_process_zero", "is_world_process_zero", "stateful_callbacks"}


class MonarchElasticCallback(TrainerCallback):
    """Makes `Trainer.train()` survive SIGKILLed workers when the script is launched by `monarch-run`.

    Pass it to the Trainer: `Trainer(..., callbacks=[MonarchElasticCallback()])`, or add it with
    `trainer.add_callback(MonarchElasticCallback())` before `train()`. Under `monarch-run --replicas N
    --min-replicas M script.py` each replica runs `train()`; a dead replica costs the others the step in flight,
    a replacement heals from a live peer and joins, and every replica returns from `train()` with identical
    weights at the exact `global_step`. Under plain `python script.py` it says once that it is inactive and does
    nothing. The elastic run's settings (replicas, faults, timeouts, events file) are `monarch-run`'s flags.
    """

    def __init__(self) -> None:
        _trainer_hooks.attach_on_add_callback(MonarchElasticCallback, MonarchElasticCallback._attach)
        self._ctx: _context.WorkerContext | None = None
        self._trainer = None
        self._tx: StepTransaction | None = None
        self._sampler: ElasticSampler | None = None
        self._stream: ElasticStream | None = None
        """Instead of the sampler, for a streaming (iterable) train_dataset."""
        self._resume_from: str | None = None
        self._dataset: Any = None
        self._collate: Any = None
        self._micro_batch_size = 0
        """Samples in one global micro-batch: per_device_train_batch_size x the starting replicas."""
        self._accumulate = 1
        self._step = 0
        """Committed steps; `state.global_step` catches up right after each commit."""
        self._micro_batches = 0
        """Micro-batches in the step in flight (fewer than `gradient_accumulation_steps` at an epoch's end)."""
        self._window = StepWindow(self._window_batches, lambda: (self._tx.rank, self._tx.world))
        """The step in flight's micro-batches, cut over the live replicas."""
        self._armed = False
        self._no_sync: contextlib.AbstractContextManager | None = None
        self._substeps = 0
        self._issued: dict[tuple[int, int], list[int]] = {}
        """(epoch, position) of each global micro-batch handed to the loader -> the share it was cut as."""
        self._joined = False
        """In the run's generations (the first one entered): a replica promoted to main from then on shows the bar."""
        self._in_step = False
        self._committed_world = 0
        self._logged_world = 0
        self._position: tuple[int, int] | None = None

    # -- what the run is at ---------------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        """True in a replica started by `monarch-run`; False under plain `python`."""
        return self._ctx is not None

    @property
    def num_replicas(self) -> int:
        """Live replicas in the current generation (1 when inactive)."""
        return self._tx.world if self._tx is not None and self._tx.gen >= 0 else 1

    @property
    def is_main_replica(self) -> bool:
        """Rank 0 of the current generation: the one replica that writes checkpoints and reports to loggers.

        Before the first generation forms it is the first initial replica; it moves when that replica dies.
        Always True when inactive."""
        return self._ctx is None or self._ctx.rank == 0

    # -- set-up, in Trainer.__init__ or Trainer.add_callback ---------------------------------------------------

    def on_init_end(self, args, state, control, **kwargs):
        if _context.current() is None:
            logger.warning_once(_INACTIVE)
            return
        trainer = _trainer_hooks.find_trainer()
        if trainer is None:
            raise RuntimeError("MonarchElasticCallback could not find the Trainer that is being built: pass it as "
                               "Trainer(..., callbacks=[MonarchElasticCallback()])")
        self._attach(trainer)

    def _attach(self, trainer) -> None:
        """Take over `trainer`'s training data, epoch entry, logs and saving: from `Trainer.__init__`
        (`on_init_end`), or from `trainer.add_callback` on a Trainer that has not started `train()`."""
        ctx = _context.current()
        if ctx is None:
            logger.warning_once(_INACTIVE)
            return
        if self._trainer is not None:
            raise RuntimeError("a MonarchElasticCallback serves one Trainer: create a new one for each Trainer")
        if trainer.is_in_train:
            raise RuntimeError("MonarchElasticCallback was added while Trainer.train() runs, after the training data "
                               "was built: add it before calling train()")
        _check_arguments(trainer, ctx)
        self._ctx, self._trainer = ctx, trainer
        _trainer_hooks.install(trainer, self)
        # Join before any other callback's on_train_begin, so they all see the healed state and who is main.
        _trainer_hooks.put_first(trainer, _JoinFirst(self))

    def on_train_begin(self, args, state, control, **kwargs):
        if self._trainer is not None:
            return
        if _context.current() is not None:
            raise RuntimeError("MonarchElasticCallback was added to the Trainer's callback list behind "
                               "Trainer.add_callback's back, so it could not shape the training data: pass it as "
                               "Trainer(..., callbacks=[MonarchElasticCallback()]) or trainer.add_callback(...) "
                               "before train()")
        logger.warning_once(_INACTIVE)

    def _build_loader(self, loader: DataLoader) -> DataLoader:
        """The Trainer's training loader, re-cut by the global cursor; keeps its dataset, collator and workers."""
        trainer, config = self._trainer, self._ctx.config
        args = trainer.args
        dataset = loader.dataset
        self._micro_batch_size = args.per_device_train_batch_size * config.replicas
        self._accumulate = args.gradient_accumulation_steps
        if isinstance(dataset, IterableDataset):
            return self._build_stream_loader(loader)
        if not hasattr(dataset, "__len__"):
            raise ValueError(
                "MonarchElasticCallback shards each global batch over the live replicas by sample index: give the "
                "Trainer a map-style train_dataset (with __len__ and __getitem__) or a torch IterableDataset"
            )
        n = len(dataset)
        tail = short_tail(n, self._micro_batch_size, config.max_replicas, args.dataloader_drop_last)
        if tail:
            raise ValueError(
                f"per_device_train_batch_size={args.per_device_train_batch_size} x {config.replicas} replica(s) is a "
                f"global batch of {self._micro_batch_size}; over {n} samples each epoch ends with a batch of {tail}, "
                f"which cannot be split over up to {config.max_replicas} replicas: choose a batch size that divides "
                "the dataset more evenly, or set TrainingArguments(dataloader_drop_last=True)"
            )
        seed = args.data_seed if args.data_seed is not None else args.seed
        self._sampler = ElasticSampler(n, shuffle=args.train_sampling_strategy == "random", seed=seed,
                                       drop_last=args.dataloader_drop_last)
        self._dataset, self._collate = dataset, loader.collate_fn
        # From the epoch's first micro-batch, as any batch sampler: HF's resume path skips those already trained.
        batches = ShareSampler(self._sampler, self._micro_batch_size, self._window.cut, from_start=True)
        self._issued = batches.issued
        return reloader(loader, batches)

    def _build_stream_loader(self, loader: DataLoader) -> DataLoader:
        """The training loader for a stream: this replica's share of each global micro-batch every replica reads."""
        args = self._trainer.args
        if args.max_steps <= 0:
            raise ValueError(
                "a streaming (iterable) train_dataset has no length, so the number of steps is not known: set "
                "TrainingArguments(max_steps=...), as HF requires for a dataset without __len__"
            )
        if loader.num_workers:
            raise ValueError(
                f"dataloader_num_workers={loader.num_workers} with a streaming train_dataset is not supported by "
                "MonarchElasticCallback: every replica reads the whole stream in its training process, in one "
                "order, to cut each global batch over the live replicas. Set dataloader_num_workers=0"
            )
        self._stream = ElasticStream(loader.dataset, self._micro_batch_size, self._accumulate)
        self._collate = loader.collate_fn
        return DataLoader(_StreamShares(self), batch_size=None, collate_fn=_CollateShare(loader.collate_fn),
                          pin_memory=loader.pin_memory)

    # -- joining -------------------------------------------------------------------------------------------------

    def _join_first(self, state) -> None:
        """`on_train_begin`, ahead of every other callback: first generation, or heal as a replacement."""
        if self._tx is not None:
            raise RuntimeError("MonarchElasticCallback trains one Trainer.train() per replica")
        if self._data is None:
            raise RuntimeError("the training DataLoader was not built by Trainer.get_train_dataloader: "
                               "MonarchElasticCallback needs it to shard data over the replicas")
        trainer = self._trainer
        _trainer_hooks.switch_off_ddp(trainer)
        self._step = state.global_step  # > 0 when resuming from a checkpoint
        if self._stream is not None:
            if self._step:
                self._stream.load_state_dict(self._stream_checkpoint())
        else:
            self._sampler.load_state_dict(self._cursor_at(self._step))
        self._tx = StepTransaction(self._ctx, _HealState(self), list(trainer.model.parameters()),
                                   buffers_of=[trainer.model], give_up=self._give_up,
                                   newest_checkpoint=self._newest_checkpoint, on_join=self._take_main_role)
        resumed_at = self._step
        self._tx.sync(self._step)
        self._joined = True
        # A replacement healed from a peer mid-run; or a stream resumed, whose position HF cannot work out from
        # global_step (it takes a stream for one epoch of max_steps).
        if self._step != resumed_at or (self._stream is not None and self._step):
            self._position = (self._data.epoch, self._data.cursor // self._micro_batch_size)
            _trainer_hooks.move_loop_counters(trainer, self._step)

    @property
    def _data(self) -> ElasticSampler | ElasticStream | None:
        """What holds the data cursor (epoch, cursor): the sampler, or the stream."""
        return self._stream if self._stream is not None else self._sampler

    def _stream_checkpoint(self) -> dict:
        """The stream's position saved with the checkpoint `train(resume_from_checkpoint=...)` resumes from."""
        path = os.path.join(self._resume_from or "", _STREAM_STATE)
        if not os.path.isfile(path):
            raise ValueError(
                f"resuming a streaming train_dataset at step {self._step} needs the stream's position, which "
                f"MonarchElasticCallback writes into every checkpoint as {_STREAM_STATE}; {path} does not exist: "
                "resume from a checkpoint this callback wrote under monarch-run"
            )
        return torch.load(path, weights_only=True)

    def _save_stream_position(self, folder: str) -> None:
        if self._stream is not None:
            torch.save(self._stream.state_dict(), os.path.join(folder, _STREAM_STATE))

    def _cursor_at(self, step: int) -> dict:
        """The sampler state after `step` committed steps: HF's own resume position, as a global cursor."""
        per_epoch = self._sampler.batches_per_epoch(self._micro_batch_size)
        steps_per_epoch = max(-(-per_epoch // self._accumulate), 1)
        epoch, done = divmod(step, steps_per_epoch)
        cursor = min(done * self._accumulate * self._micro_batch_size, self._sampler.num_samples)
        return {"epoch": epoch, "cursor": cursor, "seed": self._sampler.seed, "num_samples": self._sampler.num_samples}

    def _entry_position(self) -> tuple[int, int] | None:
        return self._position

    def _training_done(self) -> bool:
        state = self._trainer.state
        return state.max_steps > 0 and state.global_step >= state.max_steps

    def _take_main_role(self, open_bar: bool = True) -> None:
        """HF's process-zero flags follow the generation's rank 0, which moves when the main replica dies; a
        replica that becomes main mid-run opens the progress bar (`open_bar`)."""
        trainer = self._trainer
        state = trainer.state
        promoted = self.is_main_replica and not state.is_world_process_zero
        state.is_world_process_zero = state.is_local_process_zero = self.is_main_replica
        if open_bar and self._joined and promoted:
            _trainer_hooks.open_progress_bar(trainer)

    def _give_up(self, committed: int) -> str | None:
        """The controller gave up: the main replica writes HF's checkpoint of the last committed step."""
        self._take_main_role(open_bar=False)  # HF saves from process zero; no bar to show for it
        path = _trainer_hooks.save_checkpoint(self._trainer)
        self._save_stream_position(path)
        return path

    def _newest_checkpoint(self) -> str | None:
        """The newest `checkpoint-N` in `output_dir`: what `trainer.train(resume_from_checkpoint=True)` resumes."""
        from transformers.trainer_utils import get_last_checkpoint

        output_dir = self._trainer.args.output_dir
        found = get_last_checkpoint(output_dir) if output_dir and os.path.isdir(output_dir) else None
        return os.path.abspath(found) if found else None

    # -- the step transaction -------------------------------------------------------------------------------------

    def on_step_begin(self, args, state, control, **kwargs):
        if not self.active:
            return
        self._tx.begin(self._step)
        if self._stream is not None:
            self._micro_batches = self._accumulate  # a stream's passes are cut into whole steps
        else:
            size = self._micro_batch_size
            remaining = self._sampler.batches_per_epoch(size) - self._sampler.cursor // size
            self._micro_batches = min(self._accumulate, remaining)
        self._substeps = 0
        # DataLoader workers cut shares ahead of time; a share cut for an older generation is recomputed at commit.
        self._armed = all(self._issued.get(self._key(j)) == self._window.share(j) for j in range(self._micro_batches))
        if self._armed:
            self._arm()

    def _arm(self) -> None:
        self._tx.arm(self._window.weight())
        if self._micro_batches > 1:
            self._no_sync = self._tx.reducer.no_sync()
            self._no_sync.__enter__()

    def _leave_no_sync(self) -> None:
        if self._no_sync is not None:
            self._no_sync.__exit__(None, None, None)
            self._no_sync = None

    def on_substep_end(self, args, state, control, **kwargs):
        if not self.active:
            return
        self._substeps += 1
        if self._substeps == self._micro_batches - 1:
            self._leave_no_sync()  # the next micro-batch is the window's last: its backward reduces

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if not self.active:
            return
        self._leave_no_sync()
        self._in_step = True
        try:
            self._commit(args)
        finally:
            self._in_step = False

    def _commit(self, args) -> None:
        """Reduce, or drop and redo the step on the new generation, until it commits (or a heal hands it over)."""
        trainer, tx, start = self._trainer, self._tx, self._step
        redone = False

        def attempt(redo: bool) -> list[float]:
            nonlocal redone
            self._redo_window()  # its micro-batches were cut for another group, or their gradients are gone
            redone = True
            return []

        if tx.commit(start, lambda: self._step, attempt, lambda: trainer.model.zero_grad(set_to_none=True),
                     computed=self._armed) is None:
            # A peer committed this step while ours was dropped; the heal handed us its result. With no gradients,
            # HF's optimizer.step() that follows is a no-op; its scheduler step and global_step increment bring this
            # replica's own loop to where the donor's already is.
            self._committed_world = tx.world
            return
        if redone and args.max_grad_norm is not None and args.max_grad_norm > 0:
            trainer.accelerator.clip_grad_norm_(trainer.model_wrapped.parameters(), args.max_grad_norm)
        if self._stream is not None:
            self._stream.commit()
        else:
            self._sampler.advance(self._micro_batch_size, self._micro_batches)
        forget_before(self._issued, (self._data.epoch, self._data.cursor))
        self._step += 1
        self._committed_world = tx.world
        tx.committed(start)

    def _redo_window(self) -> None:
        """Recompute the step's micro-batches on this generation's shares; the last backward reduces."""
        trainer = self._trainer
        trainer.model.zero_grad(set_to_none=True)
        self._tx.begin(self._step)
        batches = [self._collate(self._samples(self._window.share(j))) for j in range(self._micro_batches)]
        batches, num_items = trainer.get_batch_samples(iter(batches), len(batches), trainer.args.device)
        self._arm()
        for batch in batches[:-1]:
            trainer.training_step(trainer.model_wrapped, batch, num_items)
        self._leave_no_sync()
        trainer.training_step(trainer.model_wrapped, batches[-1], num_items)

    # -- data of the step in flight ---------------------------------------------------------------------------

    def _key(self, j: int) -> tuple[int, int]:
        return self._data.epoch, self._data.cursor + j * self._micro_batch_size

    def _window_batches(self) -> list[list[int]]:
        """The global micro-batches of the step in flight: dataset indices, or a stream's positions in its pass."""
        if self._stream is not None:  # whole steps: the stream's loader cuts ahead, before `on_step_begin`
            return self._stream.positions(self._micro_batch_size)
        return self._sampler.window(self._micro_batch_size, self._micro_batches)

    def _samples(self, ids: list[int]) -> list:
        return self._stream.samples(ids) if self._stream is not None else [self._dataset[i] for i in ids]

    # -- between steps ----------------------------------------------------------------------------------------

    def on_step_end(self, args, state, control, **kwargs):
        if not self.active:
            return
        if not control.should_log and self._committed_world != self._logged_world:
            self._trainer.log({})  # a resize between HF's logging steps gets a log line of its own
        self._tx.sync(self._step)
        control.should_save = control.should_save and self.is_main_replica

    def _annotate_log(self, logs: dict) -> None:
        """Training log lines (HF's, with the loss, and the resize lines above) carry the runtime's `elastic/*`
        metrics, with the replica count of the step they log."""
        if self.active and self._committed_world and (not logs or "loss" in logs):
            logs.update({**self._tx.metrics(), "elastic/replicas": float(self._committed_world)})
            self._logged_world = self._committed_world

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.active:
            control.should_save = control.should_save and self.is_main_replica

    def on_save(self, args, state, control, **kwargs):
        """The main replica saved HF's checkpoint; a stream's position goes with it (HF's has none)."""
        if self.active:
            self._save_stream_position(_trainer_hooks.checkpoint_folder(self._trainer))

    def on_train_end(self, args, state, control, **kwargs):
        """Leave together once every live replica has committed the last step (a death here is healed first)."""
        if not self.active or self._tx is None:
            return
        self._tx.finish(lambda: self._step)


class _JoinFirst(TrainerCallback):
    """Runs `MonarchElasticCallback`'s join at the head of `on_train_begin`; see `on_init_end`."""

    def __init__(self, owner: MonarchElasticCallback):
        self.owner = owner

    def on_train_begin(self, args, state, control, **kwargs):
        self.owner._join_first(state)


_SKIPPED = object()
"""What the stream loader yields for a micro-batch its pass already trained; HF's resume path discards it."""


class _StreamShares(IterableDataset):
    """The stream loader's dataset: this replica's share (a list of samples) of each global micro-batch of a pass.

    Like the map-style loader's `ShareSampler`, it starts each pass from its first micro-batch, so HF's resume path
    (which discards the micro-batches already trained) positions it; those are `_SKIPPED` placeholders, not read.
    It ends when the pass has no whole step left, and every share is recorded as it was cut.
    """

    def __init__(self, owner: MonarchElasticCallback):
        self.owner = owner

    def __iter__(self):
        owner, stream = self.owner, self.owner._stream
        epoch = stream.epoch
        yield from [_SKIPPED] * (stream.cursor // stream.micro_batch_size)
        step, j = None, 0  # (epoch, cursor) of the step whose micro-batch j is next
        while stream.window() is not None and stream.epoch == epoch:
            if (stream.epoch, stream.cursor) != step:
                step, j = (stream.epoch, stream.cursor), 0
            if j == stream.micro_batches:
                raise RuntimeError("the Trainer asked for a micro-batch beyond gradient_accumulation_steps before "
                                   "the step committed")
            share = owner._window.share(j)
            owner._issued[owner._key(j)] = share
            j += 1
            yield stream.samples(share)


class _CollateShare:
    """The Trainer's collator for a share of samples; the resume path's placeholders pass through."""

    def __init__(self, collate):
        self.collate = collate

    def __call__(self, share):
        return share if share is _SKIPPED else self.collate(share)


class _HealState(TrainingState):
    """What a replacement (or a replica that dropped a step its peers committed) receives from a live peer.

    A replacement heals in `on_train_begin`, before its epoch loop starts, and takes everything: weights,
    optimizer and scheduler, the data cursor, `TrainerState` (global step, epoch, log history, best metric),
    the stateful callbacks (early stopping) and the RNG. A survivor healed inside `on_pre_optimizer_step` is
    catching up (`TrainingState`): it keeps its own scheduler and `TrainerState` too.
    """

    def __init__(self, owner: MonarchElasticCallback):
        trainer = owner._trainer  # its optimizer and scheduler are read when served: HF builds them in `train()`
        super().__init__(owner, "_step", lambda: owner._tx.device, modules=lambda: [trainer.model],
                         optimizers=lambda: [trainer.optimizer],
                         schedulers=lambda: [s for s in [trainer.lr_scheduler] if s is not None])

    def catching_up(self) -> bool:
        return self.owner._in_step

    def extra_state(self) -> dict:
        trainer = self.owner._trainer
        return {
            "data": self.owner._data.state_dict(),  # a stream reads ahead here: the RNG is taken after it
            "trainer_state": {f.name: getattr(trainer.state, f.name) for f in dataclasses.fields(TrainerState)
                              if f.name not in _OWN_STATE_FIELDS},
            "callbacks": [(type(c).__name__, c.state()) for c in trainer.callback_handler.callbacks
                          if isinstance(c, ExportableState)],
        }

    def load_extra(self, state: dict, whole: bool) -> None:
        trainer = self.owner._trainer
        self.owner._data.load_state_dict(state["data"])
        if not whole:
            return
        for name, value in state["trainer_state"].items():
            setattr(trainer.state, name, value)
        mine = [c for c in trainer.callback_handler.callbacks if isinstance(c, ExportableState)]
        for (name, saved), callback in zip(state["callbacks"], mine):
            if type(callback).__name__ == name:
                for attribute, value in saved.get("attributes", {}).items():
                    setattr(callback, attribute, value)


def _check_arguments(trainer, ctx) -> None:
    """Reject, naming the fix, what the elastic step cannot honour; runs in Trainer.__init__, before training."""
    args, config = trainer.args, ctx.config
    if args.deepspeed or getattr(trainer, "is_deepspeed_enabled", False):
        raise ValueError(
            "DeepSpeed is not supported by MonarchElasticCallback: ZeRO partitions the optimizer across a fixed set "
            "of ranks, while elastic replicas come and go. Remove `deepspeed=` from TrainingArguments; each replica "
            "then holds the whole model and optimizer, as with DDP"
        )
    if args.fsdp or getattr(trainer, "is_fsdp_enabled", False):
        raise ValueError("FSDP is not supported by MonarchElasticCallback: remove `fsdp=` from TrainingArguments")
    if ctx.procs_per_replica > 1:
        raise ValueError(
            f"MonarchElasticCallback runs one process per replica, got --procs-per-replica "
            f"{ctx.procs_per_replica}: drop the flag"
        )
    chosen = [cli_flag(f.name) for f in dataclasses.fields(config)
              if f.name in LOOP_ONLY and getattr(config, f.name) != field_default(f)]
    if chosen:
        raise ValueError(
            f"{', '.join(chosen)}: ElasticLoop's own settings. MonarchElasticCallback keeps the global batch "
            "constant (HF's steps per epoch are fixed when train() starts), and checkpoints are the Trainer's own, "
            "TrainingArguments(save_steps=...) and trainer.train(resume_from_checkpoint=...) (one replica writes "
            "them); it reduces the gradients at every step (semi-synchronous training is ElasticLoop's only, for "
            "now): drop the flags"
        )
    if args.train_sampling_strategy not in ("random", "sequential"):
        raise ValueError(
            f"train_sampling_strategy={args.train_sampling_strategy!r} is not supported by MonarchElasticCallback, "
            "whose sampler cuts each global batch from one permutation: use 'random' or 'sequential'"
        )
    if args.save_strategy == "best":
        raise ValueError(
            "save_strategy='best' is not supported by MonarchElasticCallback (only one replica may write, and HF "
            "decides 'best' saves after every callback ran): use save_strategy='steps' or 'epoch' with "
            "load_best_model_at_end=True"
        )
    for name, why in (("auto_find_batch_size", "it changes the global batch mid-run"),
                      ("ignore_data_skip", "a replacement enters the epoch by skipping what its peers trained"),
                      ("torch_compile", "with it the replicas' gradients were measured not to be reduced across "
                                        "replicas: each trained on its own share and the replicas diverged, "
                                        "benchmarks/frontends/hf_features.py")):
        if getattr(args, name):
            raise ValueError(f"{name}=True is not supported by MonarchElasticCallback ({why}): remove it")
    if args.n_gpu > 1:
        raise ValueError(f"one device per replica: this replica sees {args.n_gpu} GPUs (DataParallel)")
    if args.per_device_train_batch_size * config.replicas < config.max_replicas:
        raise ValueError(
            f"per_device_train_batch_size={args.per_device_train_batch_size} x {config.replicas} replica(s) is a "
            f"global batch of {args.per_device_train_batch_size * config.replicas} samples, which cannot be split "
            f"over up to {config.max_replicas} replicas: raise per_device_train_batch_size"
        )
