"""Everything the Lightning front end uses beyond Lightning's public API, kept in one place.

A custom Strategy and Launcher are public extension points, but a few things they need are private in Lightning
2.6 (`CHECKED_ON`), each used within the contract Lightning's own strategies use it in:

* **The replica's process group.** `_init_dist_connection` (how every Lightning strategy creates its default
  group), `_sync_ddp_if_available` (how DDP reduces `self.log(sync_dist=True)` metrics) and
  `_distributed_is_initialized`: here they act on one replica's own procs.
* **The launcher base class** `_Launcher`, which every Lightning launcher subclasses.
* **Heal state beyond a checkpoint.** The callbacks' state (`trainer.call._call_callbacks_state_dict` /
  `_call_callbacks_load_state_dict`, what `save_checkpoint` and `fit(ckpt_path=...)` use) and the logging step
  (`fit_loop.epoch_loop._batches_that_stepped`, which a checkpoint restores through the loop's state, but a heal
  taken before a batch must set by hand).
* **The optimizer under `LightningOptimizer`** (`_optimizer`), for FSDP's optimizer state dict.

`check_version` runs in the user's process when the Trainer picks the strategy, before anything is spawned, and
names the Lightning version these were checked on.
"""

from __future__ import annotations

import inspect
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities import distributed as _distributed
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies.launchers.launcher import _Launcher as Launcher
from lightning.pytorch.trainer import call as _call

__all__ = ["CHECKED_ON", "Launcher", "callbacks_state", "check_version", "distributed_is_initialized",
           "init_replica_group", "load_callbacks_state", "logger_step", "reduce_in_replica", "set_logger_step",
           "unwrap_optimizer"]

CHECKED_ON = "2.6.6"

_PRIVATE = (
    (_distributed, "_init_dist_connection", {"cluster_environment", "torch_distributed_backend"}),
    (_distributed, "_sync_ddp_if_available", {"result", "group", "reduce_op"}),
    (_distributed, "_distributed_is_initialized", set()),
    (_call, "_call_callbacks_state_dict", {"trainer"}),
    (_call, "_call_callbacks_load_state_dict", {"trainer", "checkpoint"}),
)


def check_version() -> None:
    """Raise, naming the version to install, if this Lightning lacks a private function used here."""
    for module, name, params in _PRIVATE:
        function = getattr(module, name, None)
        if function is None or not params <= set(inspect.signature(function).parameters):
            raise RuntimeError(
                f"MonarchStrategy was checked on Lightning {CHECKED_ON}; this Lightning ({pl.__version__}) has no "
                f"{module.__name__}.{name}({', '.join(sorted(params))}): install lightning=={CHECKED_ON}"
            )


def init_replica_group(cluster_environment: Any, backend: str) -> None:
    """The default process group, over this replica's procs only (the environment holds the replica's ranks)."""
    _distributed._init_dist_connection(cluster_environment, backend)


def reduce_in_replica(tensor: Any, group: Any, reduce_op: Any) -> Any:
    return _distributed._sync_ddp_if_available(tensor, group, reduce_op=reduce_op)


def distributed_is_initialized() -> bool:
    return _distributed._distributed_is_initialized()


def callbacks_state(trainer: Any) -> dict:
    """Every callback's `state_dict`, keyed as in a checkpoint's "callbacks"."""
    return _call._call_callbacks_state_dict(trainer)


def load_callbacks_state(trainer: Any, state: dict) -> None:
    """Load `state["callbacks"]` (as `callbacks_state` wrote it) into the trainer's callbacks."""
    _call._call_callbacks_load_state_dict(trainer, state)


def logger_step(trainer: Any) -> int:
    """The step loggers are given: the fit loop's count of batches that stepped the optimizer."""
    loop = trainer.fit_loop.epoch_loop
    if not hasattr(loop, "_batches_that_stepped"):
        raise RuntimeError(
            f"MonarchStrategy was checked on Lightning {CHECKED_ON}; this Lightning ({pl.__version__}) has no "
            f"_TrainingEpochLoop._batches_that_stepped: install lightning=={CHECKED_ON}"
        )
    return loop._batches_that_stepped


def set_logger_step(trainer: Any, step: int) -> None:
    logger_step(trainer)  # checks it exists
    trainer.fit_loop.epoch_loop._batches_that_stepped = step


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer Lightning wraps in a `LightningOptimizer` (as `strategy.optimizers` holds it)."""
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
