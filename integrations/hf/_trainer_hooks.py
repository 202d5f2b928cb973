"""Everything the HF front end does to a `Trainer` beyond the callback API, kept in one place.

A `TrainerCallback` sees the training loop's events but not the `Trainer`, and the loop's position in an epoch
lives in local variables of `Trainer._inner_training_loop`. Three kinds of access go beyond the callback API:

* **Finding the Trainer.** `on_init_end` is dispatched from `Trainer.__init__`; the Trainer is the `self` of
  that frame. A callback added later with `trainer.add_callback` never sees `on_init_end`, and no event reaches
  it before `train()` has built its loader and computed its schedule from it (too late to shard the data), and
  run the other callbacks' `on_train_begin` (too late to say which replica reports). So `Trainer.add_callback`
  itself is wrapped, once, on the class (`attach_on_add_callback`): it adds the callback as before, then hands
  the Trainer to it. Only additions of the callback's own type are affected.
* **Public methods replaced on this one instance**, each within its documented contract:
  `get_train_dataloader` (returns the loader built around the runtime's sampler, or a stream's), `log` (HF's
  training log line also carries `elastic/replicas`), `save_model` ("will only save from the main process": the
  main process is rank 0 of the current generation) and `train` (records which checkpoint it resumes from, where
  a stream's position was saved).
* **Public attributes set beyond the callback API**: the callback handler's list, so the join runs before every
  other callback's `on_train_begin` (`put_first`); accelerate's DDP wrapper switched off (`switch_off_ddp`: it
  spans one replica's single proc, and its end-of-backward write-back would overwrite the cross-replica
  reduction); HF's `ProgressCallback.training_bar`, opened on a replica that becomes the main one mid-run
  (`open_progress_bar`).
* **Private, version-checked** (`CHECKED_ON`): `Trainer._run_epoch`, wrapped so that a replacement healed
  mid-run, or a streaming run resumed from a checkpoint (HF would skip `global_step x gradient_accumulation_steps`
  micro-batches of a fresh stream), enters the epoch loop where its peers are, through the loop's own
  resume-from-checkpoint path (skip the epochs and micro-batches already trained); `_globalstep_last_logged` /
  `_initial_global_step`, moved to the healed step so its logged loss and train metrics cover what it trained;
  and `_save_checkpoint`, for the checkpoint the survivors write when the run gives up (the one HF writes for
  `save_steps`, resumable with `resume_from_checkpoint`).

`install` checks the private signatures first and names the transformers version they were checked on.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from typing import Any

import transformers
from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer
from transformers.trainer_callback import ProgressCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

__all__ = ["CHECKED_ON", "attach_on_add_callback", "checkpoint_folder", "find_trainer", "install",
           "move_loop_counters", "open_progress_bar", "put_first", "save_checkpoint", "switch_off_ddp"]

CHECKED_ON = "5.24.0"

_RUN_EPOCH_ARGS = {"epoch", "epochs_trained", "steps_trained_in_current_epoch", "resume_from_checkpoint"}
_COUNTERS = ("_globalstep_last_logged", "_initial_global_step")

# `_run_epoch` skips batches only when it is resuming; it reads this path only for `rng_state.pth`, which is
# absent here (the heal already set the RNG), so the loop logs that it found none and goes on.
_HEALED = "<healed from a live replica>"


def find_trainer() -> Trainer | None:
    """The Trainer whose `__init__` is dispatching the calling callback event, or None."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, Trainer):
                return candidate
            frame = frame.f_back
        return None
    finally:
        del frame


def attach_on_add_callback(kind: type, attach: Callable[[Any, Trainer], None]) -> None:
    """From now on, `trainer.add_callback(c)` of a `kind` (instance or class) also calls `attach(added, trainer)`."""
    if getattr(Trainer.add_callback, "_attaches", None) is not None:
        return
    original = Trainer.add_callback

    @functools.wraps(original)
    def add_callback(self, callback):
        original(self, callback)
        added = self.callback_handler.callbacks[-1]  # CallbackHandler appends (an instance, for a class)
        if isinstance(added, kind):
            attach(added, self)

    add_callback._attaches = kind
    Trainer.add_callback = add_callback


def _unsupported(missing: str) -> RuntimeError:
    return RuntimeError(
        f"MonarchElasticCallback was checked on transformers {CHECKED_ON}; this Trainer (transformers "
        f"{transformers.__version__}) has no {missing}: install transformers=={CHECKED_ON}"
    )


def _check_version(trainer: Trainer) -> None:
    run_epoch = getattr(trainer, "_run_epoch", None)
    params = set(inspect.signature(run_epoch).parameters) if run_epoch is not None else set()
    if not _RUN_EPOCH_ARGS <= params:
        raise _unsupported(f"Trainer._run_epoch({', '.join(sorted(_RUN_EPOCH_ARGS))})")
    if not callable(getattr(trainer, "_save_checkpoint", None)):
        raise _unsupported("Trainer._save_checkpoint")


def install(trainer: Trainer, owner: Any) -> None:
    """Route this Trainer's training data, epoch entry, logs and model saving through `owner`, the callback.

    `owner._build_loader(original_loader)` returns the elastic training loader; `owner._entry_position()` returns
    (epoch, micro-batch) where a replacement healed mid-run (or a resumed stream) must enter the epoch loop, else
    None (asked once, when the loop starts); `owner._training_done()` says the healed state already reached `max_steps`;
    `owner._annotate_log(logs)` adds the replica count to a training log; `owner.is_main_replica` says this
    replica is the one that writes; `owner._resume_from` is set to the checkpoint `train()` resumes from.
    """
    _check_version(trainer)
    original_train = trainer.train
    original_loader = trainer.get_train_dataloader
    original_run_epoch = trainer._run_epoch
    original_log = trainer.log
    original_save = trainer.save_model
    entry: list = []  # [(epoch, micro-batch) or None], read at the first epoch, after on_train_begin healed

    def train(resume_from_checkpoint=None, *args, **kwargs):
        # HF's own reading of the argument: True is the newest checkpoint in output_dir, False is none.
        path = resume_from_checkpoint
        if path is True:
            path = get_last_checkpoint(trainer.args.output_dir)
        owner._resume_from = path or None
        return original_train(resume_from_checkpoint, *args, **kwargs)

    def get_train_dataloader():
        return owner._build_loader(original_loader())

    def run_epoch(**kwargs):
        if owner._training_done():
            trainer.control.should_training_stop = True
            return None
        if not entry:
            entry.append(owner._entry_position())
        if entry[0] is not None:
            epoch, micro = entry[0]
            if kwargs["epoch"] < epoch:
                return None  # an epoch the peers finished before this replica joined
            entry[0] = None
            if micro > 0:
                kwargs.update(epochs_trained=epoch, steps_trained_in_current_epoch=micro,
                              resume_from_checkpoint=kwargs["resume_from_checkpoint"] or _HEALED)
        return original_run_epoch(**kwargs)

    def log(logs: dict, start_time: float | None = None) -> None:
        owner._annotate_log(logs)
        original_log(logs, start_time)

    def save_model(output_dir: str | None = None, _internal_call: bool = False) -> None:
        if owner.is_main_replica:
            original_save(output_dir, _internal_call=_internal_call)

    trainer.train = train
    trainer.get_train_dataloader = get_train_dataloader
    trainer._run_epoch = run_epoch
    trainer.log = log
    trainer.save_model = save_model


def move_loop_counters(trainer: Trainer, step: int) -> None:
    """A replacement healed at `step`: the loop set its logging and metrics baselines to 0 before the heal."""
    for name in _COUNTERS:
        if not hasattr(trainer, name):  # both are set by the loop before `on_train_begin`
            raise _unsupported(f"Trainer.{name}")
        setattr(trainer, name, step)


def checkpoint_folder(trainer: Trainer) -> str:
    """Where `_save_checkpoint` writes the checkpoint of the current `global_step` (no hyperparameter search)."""
    folder = f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
    return os.path.abspath(os.path.join(trainer.args.output_dir, folder))


def save_checkpoint(trainer: Trainer) -> str:
    """Write the Trainer's own `checkpoint-<global_step>` (model, optimizer, scheduler, RNG, state); its path."""
    trainer._save_checkpoint(trainer.model_wrapped, trial=None)
    return checkpoint_folder(trainer)


def put_first(trainer: Trainer, callback: Any) -> None:
    """Make `callback` the first the handler calls. A new list: the handler may be iterating over the current one
    (`add_callback` from inside an event)."""
    handler = trainer.callback_handler
    handler.callbacks = [callback, *handler.callbacks]


def switch_off_ddp(trainer: Trainer) -> None:
    """accelerate wraps the model in DDP over this replica's own world of one proc: nothing to reduce, and its
    end-of-backward write-back would overwrite the cross-replica reduction."""
    if isinstance(trainer.model_wrapped, DistributedDataParallel):
        trainer.model_wrapped.require_backward_grad_sync = False
        trainer.model_wrapped.require_forward_param_sync = False


def open_progress_bar(trainer: Trainer) -> None:
    """HF's progress bar exists only where `on_train_begin` saw the main process; open it on the new main one."""
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, ProgressCallback) and callback.training_bar is None:
            callback.on_train_begin(trainer.args, trainer.state, trainer.control)
