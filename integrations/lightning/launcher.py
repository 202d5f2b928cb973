"""`_MonarchLauncher`: `trainer.fit` (or `validate`, `test`, `predict`) in the user's process becomes the run's
single controller.

Modelled on Lightning's ddp_spawn launcher (`_MultiProcessingLauncher`): the trainer and the stage's arguments
are pickled to every replica, each replica runs the stage (`Trainer._fit_impl`, `_test_impl`, ...), and what
Lightning's main process needs afterwards (trained weights, `trainer.state`, `callback_metrics`, the loop
progress behind `trainer.global_step`, the stage's return value) comes back and is restored here. Unlike
ddp_spawn, replicas are Monarch proc meshes under `ElasticController`, so one dying costs the others a step, not
the run. No launcher command is needed: `python train.py` works; under `monarch-run train.py` each replica runs
the script and every stage runs in place.

`validate`, `test` and `predict` are not sharded: every replica evaluates every sample (Lightning's own loop,
one replica's procs as its world), so their metrics and predictions are a single device's, in dataset order,
and any one replica that finishes gives the result. A replica dying mid-stage costs nothing while another one
finishes; none is respawned (a replacement would only start the stage over).
"""

from __future__ import annotations

import io
import textwrap
from dataclasses import dataclass
from typing import Any, Callable, Optional

import cloudpickle
import torch
from lightning.fabric.utilities import move_data_to_device
from lightning.pytorch import LightningDataModule
from lightning.pytorch.trainer.states import TrainerFn, TrainerState
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader, IterableDataset
from typing_extensions import override

from monarch_plugin.checksum import state_checksum
from monarch_plugin.config import field_docs, spell_fields
from monarch_plugin.controller import ElasticController
from monarch_plugin.errors import ConfigError, ElasticRunAborted
from monarch_plugin.integrations.lightning._lightning_hooks import Launcher
from monarch_plugin.report import run_summary
from monarch_plugin.target import Target
from monarch_plugin.worker import context as _context


ARGUMENTS = {
    "min_replicas": "min_replicas", "max_replicas": "max_replicas", "backend": "cross_backend",
    "join_timeout_s": "join_timeout_s", "collective_timeout_s": "collective_timeout_s", "fault": "fault",
    "events_path": "events_path", "checkpoint_dir": "checkpoint_dir", "max_restarts": "max_restarts",
    "spares": "spares", "forkserver": "forkserver", "hosts": "hosts", "hosts_file": "hosts_file",
    "host_timeout_s": "host_timeout_s", "store_host": "store_host",
}
"""The Lightning strategies' keyword arguments, each the `ElasticConfig` field it sets: the same name, but for
`backend`, which is both the replica's own backend and the cross-replica one. `replicas` and `procs_per_replica`
come from Lightning's own `devices` and `num_nodes` (and `MonarchFSDPStrategy(procs_per_replica=...)`); on several
hosts `replicas_per_host` is `devices` over `procs_per_replica`."""

_FIELD_ARGUMENT = {field: name for name, field in ARGUMENTS.items()}

_LIGHTNING_DOCS = {
    "max_replicas": ("Most replicas trained on at once; with `hosts`, a machine that joins mid-run grows the run up "
                     "to it. None means the replicas `devices` starts."),
    "cross_backend": 'torch.distributed backend within and across replicas: "auto" (nccl on CUDA and ROCm builds, '
                     'where it is RCCL; gloo on CPU), "gloo" or "nccl".',
    "hosts": "Monarch host agents to run the replicas on, one per machine, as `tcp://IP:PORT` (start one with "
             "`monarch-plugin host --address tcp://IP:PORT`); `Trainer(num_nodes=...)` of them, each given `devices` "
             "replica procs. None: every replica on this machine. The script and its environment must be at the same "
             "paths on every host, as with torchrun.",
    "events_path": "JSON-lines file for structured events (spawn, death, quorum, dropped step, heal, give-up). "
                   "None: `$MONARCH_PLUGIN_EVENTS` or `monarch_events.jsonl` in the Trainer's `default_root_dir` "
                   "(`monarch_events-<stage>.jsonl` for validate, test and predict).",
}
"""Where a strategy argument means more than its field: Lightning's `devices` and `default_root_dir` fill it in."""


def argument(field: str) -> str:
    """A runtime setting as the Lightning strategies spell it: their keyword argument."""
    return f"`{_FIELD_ARGUMENT.get(field, field)}`"


def arguments_doc() -> str:
    """The "Args:" section of the strategies' docstrings, from `ElasticConfig`'s field docstrings."""
    docs = field_docs()
    lines = ["", "", "    Args:"]
    for name, field in ARGUMENTS.items():
        text = _LIGHTNING_DOCS.get(field) or spell_fields(docs[field].replace("``", "`"), argument)
        lines += textwrap.wrap(f"{name}: {text}", 116, initial_indent=" " * 8, subsequent_indent=" " * 12,
                               break_on_hyphens=False)
    return "\n".join(lines) + "\n"


def check_training_loader(loader: object) -> None:
    """Refuse, naming the fix, a training loader the strategy cannot cut into shares of a global batch: checked in
    the launching process when `fit` is handed the loader, so nothing is spawned for it; in each replica otherwise
    (a `train_dataloader()` hook or a datamodule builds it there)."""
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        raise MisconfigurationException(
            "MonarchStrategy shards each global batch over the live replicas by sample index: give fit a "
            "torch DataLoader over a map-style Dataset (with __len__ and __getitem__); an IterableDataset has no "
            "index to cut by (HF Trainer's callback supports streams, docs/hf.md)"
        )
    if loader.batch_size is None:
        raise MisconfigurationException(
            "MonarchStrategy builds the batches itself from one global cursor: give the training DataLoader "
            "a batch_size (per replica, as with DDP) instead of a batch_sampler"
        )


class _MonarchLauncher(Launcher):
    def __init__(self, strategy) -> None:
        self._strategy = strategy

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return False

    @override
    def launch(self, function: Callable, *args: Any, trainer=None, **kwargs: Any) -> Any:
        fitting = trainer.state.fn == TrainerFn.FITTING
        model = args[0] if args else kwargs.get("model")
        if fitting:
            loader = args[1] if len(args) > 1 else kwargs.get("train_dataloaders")
            if loader is not None and not isinstance(loader, LightningDataModule):
                check_training_loader(loader)
        if fitting and not model.automatic_optimization:
            raise MisconfigurationException(
                "MonarchStrategy redoes a step that a death interrupted (all of its accumulated micro-batches), "
                "which needs Lightning's automatic optimization: remove `self.automatic_optimization = False` "
                "from your LightningModule"
            )
        ctx = _context.current()
        if ctx is not None:
            # Under `monarch-run` this process already is one replica and the controller is monarch-run's:
            # train here, with monarch-run's replica flags in charge of the topology.
            if self._strategy.replicas != ctx.config.replicas:
                rank_zero_info(
                    f"monarch: Trainer(devices={self._strategy.replicas * self._strategy.procs_per_replica}) "
                    f"asks for {self._strategy.replicas} replica(s); monarch-run started {ctx.config.replicas}, "
                    "which is what trains"
                )
            results = function(*args, **kwargs)
            trainer.strategy.finish()
            return results
        try:
            cloudpickle.dumps(model)
        except Exception as e:  # noqa: BLE001 - any pickling failure has the same fix
            raise MisconfigurationException(
                f"{type(model).__name__} cannot be pickled to send it to the Monarch replicas "
                f"({type(e).__name__}: {e}): keep open files, locks, sockets and the like out of __init__ and "
                "create them in setup() or on first use"
            ) from e
        for logger in trainer.loggers:
            logger.version  # fixed here, so every replica (and a later rank 0) logs into the same version
        config = self._strategy.elastic_config(root_dir=trainer.default_root_dir, stage=trainer.state.fn.value)
        try:
            target = Target.function(_StageInReplica(trainer, function.__name__, args, kwargs))
        except ConfigError as e:
            raise MisconfigurationException(str(e)) from e
        try:
            controller = ElasticController(config, target)
        except ConfigError as e:  # e.g. more replicas x procs than visible GPUs
            raise MisconfigurationException(f"MonarchStrategy: {spell_fields(str(e), argument)}") from e
        try:
            result = controller.run()
        except ElasticRunAborted as e:  # the message names the strategy's own arguments
            raise ElasticRunAborted(spell_fields(str(e), argument), e.checkpoint) from e
        except ConfigError as e:  # found once the hosts answered: too little room, none usable
            raise MisconfigurationException(f"MonarchStrategy: {spell_fields(str(e), argument)}") from e
        for line in run_summary(result):
            rank_zero_info(f"monarch: {line}")
        outputs: list[_StageOutput] = sorted((v[0] for v in result.values.values() if v and v[0]),
                                             key=lambda o: o.rank)
        if not fitting:  # any replica's result is the stage's: each one evaluated every sample
            self._recover_stage_results(outputs[0], trainer)
            return outputs[0].results
        self._strategy.replica_checksums = {o.replica: o.checksum for o in outputs}
        if len(set(self._strategy.replica_checksums.values())) != 1:
            raise RuntimeError(
                f"replicas finished with different weights {self._strategy.replica_checksums}: a bug in "
                f"monarch-plugin; please report it with the events file {result.events_path}"
            )
        self._recover_results_in_main_process(outputs[0], trainer)
        return outputs[0].results

    def _recover_results_in_main_process(self, output: _FitOutput, trainer) -> None:
        trainer.lightning_module.load_state_dict(output.weights)
        trainer.fit_loop.load_state_dict(output.fit_loop)
        trainer.fit_loop.restarting = False
        self._recover_stage_results(output, trainer)
        if trainer.checkpoint_callback is not None and hasattr(trainer.checkpoint_callback, "best_model_path"):
            trainer.checkpoint_callback.best_model_path = output.best_model_path or ""

    @staticmethod
    def _recover_stage_results(output: _StageOutput, trainer) -> None:
        """What every stage hands back, as ddp_spawn does: the trainer's state and its callback metrics."""
        trainer.state = output.trainer_state
        trainer.callback_metrics.update(torch.load(io.BytesIO(output.callback_metrics), weights_only=True))

    @override
    def kill(self, signum) -> None:
        """The controller owns the replicas' lifetime; interrupting `fit` stops it, and it stops them."""


@dataclass(kw_only=True)
class _StageOutput:
    """What a replica's first proc sends back after `validate`, `test` or `predict` (ddp_spawn's `_WorkerOutput`)."""

    rank: int
    """The replica's rank in the last generation; the lowest rank's output is the stage's."""
    trainer_state: TrainerState
    callback_metrics: bytes
    """`trainer.callback_metrics` on the CPU, `torch.save`d (tensors only, so the controller loads it safely)."""
    results: Any
    """What the Trainer's stage method returned."""


@dataclass(kw_only=True)
class _FitOutput(_StageOutput):
    """After `fit`: also what the controller's module and loop take over, and the checksum every replica agrees on."""

    replica: int
    checksum: str
    """The weights' checksum: the launcher checks that every replica finished with the same weights."""
    weights: Optional[dict]
    """The trained state dict, from the generation's rank 0 only (the others send their checksum)."""
    fit_loop: dict
    best_model_path: Optional[str]


class _StageInReplica:
    """What each replica runs: the stage (fit: and leave together), and send back what the controller restores."""

    def __init__(self, trainer, method: str, args: tuple, kwargs: dict):
        self.trainer, self.method, self.args, self.kwargs = trainer, method, args, kwargs

    def __repr__(self) -> str:
        model = self.args[0] if self.args else self.kwargs.get("model")
        return f"Trainer.{self.method.lstrip('_')}({type(model).__name__})"

    def __call__(self) -> Optional[_StageOutput]:
        trainer = self.trainer
        results = getattr(trainer, self.method)(*self.args, **self.kwargs)
        strategy = trainer.strategy
        strategy.finish()
        buffer = io.BytesIO()
        torch.save(move_data_to_device(dict(trainer.callback_metrics), "cpu"), buffer)
        if trainer.state.fn != TrainerFn.FITTING:
            if strategy.global_rank != 0:
                return None
            return _StageOutput(rank=strategy._elastic_rank(), trainer_state=trainer.state,
                                callback_metrics=buffer.getvalue(), results=move_data_to_device(results, "cpu"))
        rank = strategy._tx.rank
        weights = move_data_to_device(strategy.full_state_dict(), "cpu")  # on every proc: FSDP gathers
        if strategy.global_rank != 0:
            return None  # the replica's first proc speaks for it
        return _FitOutput(
            rank=rank, trainer_state=trainer.state, callback_metrics=buffer.getvalue(), results=results,
            replica=_context.current().replica_id, checksum=state_checksum(weights),
            weights=weights if rank == 0 else None,
            fit_loop=trainer.fit_loop.state_dict(),
            best_model_path=getattr(trainer.checkpoint_callback, "best_model_path", None),
        )
