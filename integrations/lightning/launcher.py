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

import copy
import difflib
import inspect
import io
import os
import textwrap
from dataclasses import dataclass
from typing import Any, Callable, Optional

import cloudpickle
import torch
from lightning.fabric.utilities import move_data_to_device
from lightning.pytorch import LightningDataModule
from lightning.pytorch.callbacks import BatchSizeFinder
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerState
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader, IterableDataset
from typing_extensions import override

from monarch_plugin.storage.checksum import state_checksum
from monarch_plugin.config import (LOOP_ONLY, ElasticConfig, field_default, front_end_fields, front_end_settings,
                                   given, in_slurm_allocation)
from monarch_plugin.controller import ElasticController
from monarch_plugin.errors import ConfigError
from monarch_plugin.integrations.lightning._lightning_hooks import Launcher, check_version
from monarch_plugin.tools.report import run_summary
from monarch_plugin.target import Target
from monarch_plugin.worker import context as _context


FROM_TRAINER = {
    "replicas": "`Trainer(devices=..., num_nodes=...)`: `devices` x `num_nodes` procs, `procs_per_replica` each",
    "procs_per_replica": "1 for `MonarchStrategy`; `MonarchFSDPStrategy(procs_per_replica=...)`",
    "replicas_per_host": "with `hosts`, `Trainer(devices=...)` over `procs_per_replica`: `devices` is per host",
}
"""The settings Lightning's own arguments give. The strategies take every other field of `front_end_fields` as a
keyword argument of the same name and default (or all at once, as `elastic=ElasticConfig(...)`);
`LOOP_ONLY` are not Lightning's (its checkpoints are `ModelCheckpoint`'s and `fit(ckpt_path=...)`'s)."""

_NOTES = {
    "max_replicas": ("Most replicas trained on at once; with `hosts`, a machine that joins mid-run grows the run up "
                     "to it. None means the replicas `devices` starts."),
    "backend": 'torch.distributed backend within and across replicas: "auto" (nccl on CUDA and ROCm builds, '
               'where it is RCCL; gloo on CPU), "gloo" or "nccl".',
    "events_path": "JSON-lines file for structured events (spawn, death, quorum, dropped step, heal, give-up). "
                   "None: `$MONARCH_PLUGIN_EVENTS` or `monarch_events.jsonl` in `trainer.log_dir` (the first "
                   "logger's version directory; `default_root_dir` with `logger=False`), "
                   "`monarch_events-<stage>.jsonl` for validate, test and predict.",
    "hosts": "Monarch host agents to run the replicas on, one per machine, as `tcp://IP:PORT` (start one with "
             "`monarch-plugin host --address tcp://IP:PORT`); `Trainer(num_nodes=...)` of them, each given `devices` "
             "replica procs. Empty: every replica on this machine. The script and its environment must be at the same "
             "paths on every host, as with torchrun.",
}
"""Where a strategy argument means more than its field: Lightning's `devices` and `default_root_dir` fill it in."""

_SETTINGS = {f.name for f in front_end_fields(tuple(FROM_TRAINER))}


def take_settings(strategy: str, elastic: Optional[ElasticConfig], kwargs: dict) -> dict:
    """The run's settings among a strategy's arguments (taken out of `kwargs`): `elastic`'s chosen ones (`given`),
    then the keyword arguments. Refuses, naming the fix, one that Lightning's own arguments set or that is not
    an argument at all, before the Trainer is built."""
    if elastic is not None and not isinstance(elastic, ElasticConfig):
        raise MisconfigurationException(f"{strategy}(elastic=...) takes an ElasticConfig, got {type(elastic).__name__}")
    settings = given(elastic) if elastic is not None else {}
    lightnings = set(inspect.signature(ParallelStrategy.__init__).parameters)
    for name in [*(n for n in settings if n in LOOP_ONLY), *kwargs]:
        if name in _SETTINGS:
            settings[name] = kwargs.pop(name)
        elif name in FROM_TRAINER:
            raise MisconfigurationException(f"{strategy}({name}=...) is set by {FROM_TRAINER[name]}: drop it")
        elif name in LOOP_ONLY:
            raise MisconfigurationException(
                f"{strategy}({name}=...) is ElasticLoop's own: under Lightning the global batch stays constant, "
                "checkpoints are a ModelCheckpoint callback's and trainer.fit(ckpt_path=...)'s (one replica writes), "
                "and the gradients are reduced at every step (semi-synchronous training is ElasticLoop's only, "
                "for now)")
        elif name not in lightnings:
            close = difflib.get_close_matches(name, [*_SETTINGS, *lightnings], n=1)
            hint = f"did you mean `{close[0]}`? " if close else ""
            raise MisconfigurationException(f"{strategy} has no argument `{name}`: {hint}it takes the ElasticConfig "
                                            f"settings ({', '.join(sorted(_SETTINGS))}) and Lightning's own")
    return settings


def signature() -> inspect.Signature:
    """`MonarchStrategy(...)`'s signature as `help()` and editors show it: `elastic`, then one keyword argument
    per setting, with the field's type and default."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
              inspect.Parameter("elastic", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                                annotation=Optional[ElasticConfig])]
    params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=field_default(f), annotation=kind)
               for f, kind, _ in front_end_settings(tuple(FROM_TRAINER), _NOTES)]
    return inspect.Signature([*params, inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])


def arguments_doc() -> str:
    """The "Args:" section of the strategies' docstrings, from `ElasticConfig`'s field docstrings."""
    lines = ["", "", "    Args:", "        elastic: every setting below at once, as an `ElasticConfig` (its `replicas` "
             "and", "            `procs_per_replica` must agree with the Trainer's); keyword arguments override it."]
    for f, _, text in front_end_settings(tuple(FROM_TRAINER), _NOTES):
        lines += textwrap.wrap(f"{f.name}: {text}", 116, initial_indent=" " * 8, subsequent_indent=" " * 12,
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


def check_callbacks(callbacks: list) -> None:
    """Refuse, naming the fix, before anything is spawned: a `BatchSizeFinder` (also what `Tuner.scale_batch_size`
    adds), refused as Lightning refuses it under its distributed strategies, since its trials would run inside
    each replica and the size found would never reach this process; and a callback that cannot load its own
    `state_dict()`, since a replacement replica loads every callback's state from a live peer (as resuming from a
    checkpoint does) and would fail every heal. Lightning 2.6's `SpikeDetection` is one: its `load_state_dict`
    reads an attribute it never sets. The reload is tried on a copy."""
    for callback in callbacks:
        if isinstance(callback, BatchSizeFinder):
            raise MisconfigurationException(
                "Batch size finder is not supported with distributed strategies, MonarchStrategy included: its "
                "trials would run inside each replica. Find the batch size with one device, then set it"
            )
        try:
            state, twin = callback.state_dict(), copy.deepcopy(callback)
        except Exception:  # noqa: BLE001 - not copyable here (a lock, a handle): the heal itself will say
            continue
        if not state:
            continue
        try:
            twin.load_state_dict(copy.deepcopy(state))
        except Exception as e:  # noqa: BLE001 - any failure has the same fix
            raise MisconfigurationException(
                f"{type(callback).__name__}.load_state_dict fails on its own state_dict() ({type(e).__name__}: {e}); "
                "MonarchStrategy loads every callback's state into a replacement replica, as resuming from a "
                f"checkpoint does: remove the {type(callback).__name__} callback or fix its load_state_dict"
            ) from e


class _MonarchLauncher(Launcher):
    """The controller side of the strategies: checks the Trainer's arguments when it is built, and runs a stage's
    replicas under `ElasticController` when it is called."""

    def __init__(self, strategy) -> None:
        self._strategy = strategy
        if not isinstance(strategy.accelerator, (CPUAccelerator, CUDAAccelerator)):
            raise MisconfigurationException(
                f"MonarchStrategy runs replicas on CPUs or on CUDA/ROCm GPUs, got accelerator "
                f"{type(strategy.accelerator).__name__}: pass Trainer(accelerator='cpu' or 'gpu', devices=N)"
            )
        hosts, nodes = strategy.settings.get("hosts", []), strategy.num_nodes
        on_allocation = strategy.settings.get("slurm")
        if on_allocation is None:  # as `ElasticConfig` finds it: the batch script of a multi-node allocation
            on_allocation = not (hosts or strategy.settings.get("hosts_file")) and in_slurm_allocation(os.environ)
        if nodes != 1 and not (hosts or strategy.settings.get("hosts_file") or on_allocation):
            raise MisconfigurationException(
                f"Trainer(num_nodes={nodes}) trains on {nodes} machines, each running a Monarch host "
                "agent (`monarch-plugin host --address tcp://IP:PORT`): pass their addresses as "
                "MonarchStrategy(hosts=[...]) or hosts_file=..., run the script in a SLURM batch script of "
                f"{nodes} nodes, or drop num_nodes to train on this machine"
            )
        if hosts and not strategy.settings.get("hosts_file") and len(hosts) != nodes:
            raise MisconfigurationException(
                f"MonarchStrategy(hosts=...) lists {len(hosts)} host(s) but Trainer(num_nodes={nodes}): "
                "make them agree (num_nodes is the number of hosts the run starts on)"
            )
        check_version()
        self.config()

    @property
    def replicas(self) -> int:
        """Replicas spawned at start: Lightning's ``devices``, ``procs_per_replica`` devices to a replica."""
        s = self._strategy
        return len(s.parallel_devices or []) * s.num_nodes // s.procs_per_replica

    def config(self, log_dir: Optional[str] = None, stage: str = "fit") -> ElasticConfig:
        """The run's `ElasticConfig`: the strategy's settings and what Lightning's own arguments say; raises
        naming the argument to change.

        Unless `events_path` (or `$MONARCH_PLUGIN_EVENTS`) says otherwise, the events go to `log_dir`, the
        Trainer's `log_dir`: the first logger's version directory, next to that run's metrics, hyperparameters and
        checkpoints, so each logged version keeps its own record (with `logger=False`, Lightning's `log_dir` is
        `default_root_dir`). The tools that read that directory (TensorBoard, the CSV logger's versioning,
        `ModelCheckpoint`) pick their own files by name. `monarch_events.jsonl` for `fit`,
        `monarch_events-<stage>.jsonl` for the other stages, so a `test` after `fit` keeps fit's record.
        `validate`, `test` and `predict` respawn nobody (any finishing replica holds the stage's result).
        """
        s, settings = self._strategy, dict(self._strategy.settings)
        devices = len(s.parallel_devices or [])
        if devices % s.procs_per_replica:
            raise MisconfigurationException(
                f"Trainer(devices={devices}) cannot be cut into replicas of {type(s).__name__}(procs_per_replica="
                f"{s.procs_per_replica}): make devices a multiple of procs_per_replica"
            )
        derived = {"replicas": self.replicas, "procs_per_replica": s.procs_per_replica}
        if settings.get("hosts") or settings.get("hosts_file"):  # `devices` is per host, as under Lightning's own
            derived["replicas_per_host"] = devices // s.procs_per_replica
        for name, value in derived.items():
            if settings.get(name, value) != value:
                raise MisconfigurationException(
                    f"{type(s).__name__}(elastic=ElasticConfig({name}={settings[name]})) disagrees with the "
                    f"Trainer, which gives {value} ({FROM_TRAINER[name]}): make them agree, or leave it out")
        if self.replicas < settings.get("min_replicas", 1):
            raise MisconfigurationException(
                f"Trainer(devices={self.replicas}) starts {self.replicas} replica(s), fewer than "
                f"{type(s).__name__}(min_replicas={settings['min_replicas']}): raise `devices` or lower `min_replicas`"
            )
        events = settings.get("events_path")
        if events is None and log_dir is not None:
            events = os.environ.get("MONARCH_PLUGIN_EVENTS") or os.path.join(log_dir, "monarch_events.jsonl")
        if stage != "fit":
            settings.update(min_replicas=1, fault=None, max_restarts=0, spares=0)
            if events:
                base, ext = os.path.splitext(events)
                events = f"{base}-{stage}{ext}"
        try:
            return ElasticConfig(**{**settings, **derived, "events_path": events})
        except ConfigError as e:
            raise MisconfigurationException(f"{type(s).__name__}: {e}") from e

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
            check_callbacks(trainer.callbacks)
        if fitting and getattr(self._strategy, "tensor_parallel_size", 1) > 1 and not is_overridden(
                "configure_model", model):
            raise MisconfigurationException(
                f"{type(self._strategy).__name__}(tensor_parallel_size={self._strategy.tensor_parallel_size}) needs "
                f"{type(model).__name__}.configure_model to parallelize the model, as Lightning's "
                "ModelParallelStrategy does: apply your TP plan over self.device_mesh['tensor_parallel'] and FSDP "
                "over self.device_mesh['data_parallel'] there"
            )
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
            if self.replicas != ctx.config.replicas:
                rank_zero_info(
                    f"monarch: Trainer(devices={self.replicas * self._strategy.procs_per_replica}) "
                    f"asks for {self.replicas} replica(s); monarch-run started {ctx.config.replicas}, "
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
        config = self.config(log_dir=trainer.log_dir or trainer.default_root_dir, stage=trainer.state.fn.value)
        try:  # its messages name the settings as the strategies' arguments do
            target = Target.function(_StageInReplica(trainer, function.__name__, args, kwargs))
            result = ElasticController(config, target).run()
        except ConfigError as e:  # e.g. more replicas x procs than visible GPUs, or too little room on the hosts
            raise MisconfigurationException(f"MonarchStrategy: {e}") from e
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
