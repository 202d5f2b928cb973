"""`MonarchStrategy`: Lightning's training step as the runtime's step transaction.

One class lives on both sides. In the user's process (the controller) it validates the configuration when the
Trainer is built and hands `fit` to `_MonarchLauncher`, which runs it in every replica. Inside a replica it is a
data-parallel strategy whose torch.distributed default group holds only that replica's own procs, so Lightning's
own collectives (`self.log(sync_dist=True)`, barriers, the SIGTERM broadcast) never cross replicas. Everything
that crosses replicas goes through the runtime's step transaction (`StepTransaction`):

* A global step is a window of `accumulate_grad_batches` micro-batches, each one global batch cut over the live
  replicas. The window's earlier micro-batches run under the reducer's `no_sync()` as Lightning drives them;
  `optimizer_step` runs the last one (Lightning's closure: training_step + backward), whose backward reduces the
  accumulated, weighted gradients over the live replicas, and steps the optimizer only if the reduction
  committed. A step that a death interrupts (or whose earlier micro-batches were cut for a generation that is
  gone) is redone whole inside the same call, by the new generation, on the same global micro-batches, so
  `trainer.global_step`, LR schedules and validation points are exactly those of a run without failures.
* The training dataloader draws from the runtime's `ElasticSampler` (one global cursor, moved only on commit).
* A newcomer joins before the fit loop starts and heals from a live peer: model, optimizer, LR schedulers,
  sampler cursor, RNG and the fit loop's progress as of the start of the step's window, which Lightning then
  resumes mid-epoch as from a checkpoint.
"""

from __future__ import annotations

import contextlib
import os
from collections import deque
from typing import Any, Callable, Optional

import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch.utils.data import DataLoader, RandomSampler
from typing_extensions import override

from monarch_plugin.backend import resolve_backend
from monarch_plugin.config import ElasticConfig, spell_fields
from monarch_plugin.errors import ConfigError
import monarch_plugin.integrations.lightning._lightning_hooks as _hooks
from monarch_plugin.integrations.lightning.checkpoint_io import AtomicCheckpointIO
from monarch_plugin.integrations.lightning.launcher import ARGUMENTS, argument, arguments_doc, check_training_loader
from monarch_plugin.sampler import ElasticSampler, share, weight
from monarch_plugin.worker import context as _context
from monarch_plugin.worker.transaction import StepTransaction, rng_state, set_rng_state

__all__ = ["MonarchStrategy"]


class MonarchStrategy(ParallelStrategy):
    """Elastic data parallel: `Trainer(devices=N)` replicas, each one Monarch proc mesh; survives SIGKILLed workers."""

    strategy_name = "monarch"
    procs_per_replica = 1

    def __init__(
        self,
        min_replicas: int = ElasticConfig.min_replicas,
        max_replicas: Optional[int] = None,
        backend: str = ElasticConfig.cross_backend,
        join_timeout_s: float = ElasticConfig.join_timeout_s,
        collective_timeout_s: float = ElasticConfig.collective_timeout_s,
        fault: Optional[str] = None,
        events_path: Optional[str] = None,
        checkpoint_dir: str = ElasticConfig.checkpoint_dir,
        max_restarts: int = ElasticConfig.max_restarts,
        spares: int = ElasticConfig.spares,
        forkserver: Optional[bool] = ElasticConfig.forkserver,
        hosts: Optional[list[str]] = None,
        hosts_file: Optional[str] = None,
        host_timeout_s: float = ElasticConfig.host_timeout_s,
        store_host: Optional[str] = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("checkpoint_io", AtomicCheckpointIO())  # Trainer(plugins=[...]) still replaces it
        super().__init__(**kwargs)
        self.min_replicas = min_replicas
        self.max_replicas = max_replicas
        self.backend = backend
        self.join_timeout_s = join_timeout_s
        self.collective_timeout_s = collective_timeout_s
        self.fault = fault
        self.events_path = events_path
        self.checkpoint_dir = checkpoint_dir
        self.max_restarts = max_restarts
        self.spares = spares
        self.forkserver = forkserver
        self.hosts = list(hosts or [])
        self.hosts_file = hosts_file
        self.host_timeout_s = host_timeout_s
        self.store_host = store_host
        self.num_nodes = 1
        """Lightning's `Trainer(num_nodes=...)`: the hosts the run starts on, `devices` replica procs on each."""
        self.replica_checksums: dict[int, str] = {}
        """After `fit`, in the controller: each finishing replica's weight checksum (all equal by construction)."""
        self._ctx: Optional[_context.WorkerContext] = None
        """Set inside a replica (any stage); None in the controller."""
        self._tx: Optional[StepTransaction] = None
        """Inside a replica that fits: its part in the run's steps."""
        self._sampler: Optional[ElasticSampler] = None
        self._pending_sampler_state: Optional[dict] = None
        self._pending_logger_step: Optional[int] = None
        self._batches: Optional[_ElasticBatchSampler] = None
        self._micro_batch_size = 0
        """Samples in one global micro-batch: the DataLoader's batch_size x every proc of the starting replicas."""
        self._micro = 0
        """Index in its window of the micro-batch `training_step` runs next, which between micro-batches and while
        a step is being reduced is the number of the window's micro-batches Lightning counts as completed."""
        self._window_gen: Optional[int] = None
        """The generation the window's micro-batches were cut for; None before its first micro-batch."""
        self._step = 0
        self._validation_buffers: Optional[contextlib.AbstractContextManager] = None
        """Held while a validation runs inside a window: the last commit's buffers swapped in."""
        self._fit_loop_started = False

    # -- controller side ---------------------------------------------------------------------------------

    @property
    def replicas(self) -> int:
        """Replicas spawned at start: Lightning's ``devices``, ``procs_per_replica`` devices to a replica."""
        return len(self.parallel_devices or []) * self.num_nodes // self.procs_per_replica

    def elastic_config(self, root_dir: Optional[str] = None, stage: str = "fit") -> ElasticConfig:
        """The runtime configuration these knobs mean; raises naming the Lightning argument to change.

        Unless `events_path` (or `$MONARCH_PLUGIN_EVENTS`) says otherwise, the events go to the Trainer's
        `default_root_dir` (`root_dir`), next to its logs and checkpoints: `monarch_events.jsonl` for `fit`,
        `monarch_events-<stage>.jsonl` for the other stages, so a `test` after `fit` keeps fit's record.
        `validate`, `test` and `predict` respawn nobody (any finishing replica holds the stage's result).
        """
        if self.replicas < self.min_replicas:
            raise MisconfigurationException(
                f"Trainer(devices={self.replicas}) starts {self.replicas} replica(s), fewer than "
                f"MonarchStrategy(min_replicas={self.min_replicas}): raise `devices` or lower `min_replicas`"
            )
        events = self.events_path
        if events is None and root_dir is not None:
            events = os.environ.get("MONARCH_PLUGIN_EVENTS") or os.path.join(root_dir, "monarch_events.jsonl")
        fitting = stage == "fit"
        if events and not fitting:
            base, ext = os.path.splitext(events)
            events = f"{base}-{stage}{ext}"
        settings = {field: getattr(self, name) for name, field in ARGUMENTS.items()}
        if not fitting:
            settings.update(min_replicas=1, fault=None, max_restarts=0, spares=0)
        settings.update(replicas=self.replicas, procs_per_replica=self.procs_per_replica, events_path=events)
        if self.hosts or self.hosts_file:  # `devices` is per host, as under Lightning's own multi-node strategies
            settings["replicas_per_host"] = len(self.parallel_devices or []) // self.procs_per_replica
        try:
            return ElasticConfig(**settings)
        except ConfigError as e:
            raise MisconfigurationException(f"MonarchStrategy: {spell_fields(str(e), argument)}") from e

    @override
    def _configure_launcher(self) -> None:
        if not isinstance(self.accelerator, (CPUAccelerator, CUDAAccelerator)):
            raise MisconfigurationException(
                f"MonarchStrategy runs replicas on CPUs or on CUDA/ROCm GPUs, got accelerator "
                f"{type(self.accelerator).__name__}: pass Trainer(accelerator='cpu' or 'gpu', devices=N)"
            )
        if self.num_nodes != 1 and not (self.hosts or self.hosts_file):
            raise MisconfigurationException(
                f"Trainer(num_nodes={self.num_nodes}) trains on {self.num_nodes} machines, each running a Monarch host "
                "agent (`monarch-plugin host --address tcp://IP:PORT`): pass their addresses as "
                "MonarchStrategy(hosts=[...]) or hosts_file=..., or drop num_nodes to train on this machine"
            )
        if self.hosts and not self.hosts_file and len(self.hosts) != self.num_nodes:
            raise MisconfigurationException(
                f"MonarchStrategy(hosts=...) lists {len(self.hosts)} host(s) but Trainer(num_nodes={self.num_nodes}): "
                "make them agree (num_nodes is the number of hosts the run starts on)"
            )
        _hooks.check_version()
        self.elastic_config()
        from monarch_plugin.integrations.lightning.launcher import _MonarchLauncher

        self._launcher = _MonarchLauncher(self)

    def set_world_ranks(self) -> None:
        """Lightning's world is one replica's procs: the controller and a one-proc replica are rank 0 of 1."""
        if self.cluster_environment is None:
            return
        self.cluster_environment.set_global_rank(int(os.environ.get("RANK", 0)) if self._ctx else 0)
        self.cluster_environment.set_world_size(int(os.environ.get("WORLD_SIZE", 1)) if self._ctx else 1)
        self._update_rank_zero()

    # -- the replica's own (intra-replica) world -------------------------------------------------------------

    @property
    @override
    def root_device(self) -> torch.device:
        """This proc's device. On GPUs the controller narrows each replica's visible GPUs to its own, so the
        local rank indexes them, as under torchrun."""
        if isinstance(self.accelerator, CUDAAccelerator):
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cpu")

    @property
    @override
    def is_global_zero(self) -> bool:
        """Rank 0 of the current generation: the one replica that logs and writes checkpoints."""
        return self.global_rank == 0 and self._elastic_rank() == 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}

    def _elastic_rank(self) -> int:
        if self._ctx is None:
            return 0
        if self._tx is not None and self._tx.gen >= 0:
            return self._tx.rank
        ctx = self._ctx
        return 0 if (ctx.initial and ctx.replica_id == 0) else 1 + ctx.replica_id

    def _update_rank_zero(self) -> None:
        rank_zero_only.rank = utils_rank_zero_only.rank = 0 if self.is_global_zero else max(self._elastic_rank(), 1)

    @override
    def setup_environment(self) -> None:
        ctx = _context.current()
        if ctx is None:
            raise RuntimeError(
                "MonarchStrategy trains inside Monarch replicas started by Trainer.fit in the controller; "
                "call trainer.fit(...) from your script instead of invoking the strategy directly"
            )
        self._ctx = ctx
        self.cluster_environment = LightningEnvironment()  # this replica's MASTER_PORT, not the controller's
        k = ctx.procs_per_replica
        on_gpu = self.root_device.type == "cuda"
        self.parallel_devices = [torch.device("cuda", i) for i in range(k)] if on_gpu else [self.root_device] * k
        self.set_world_ranks()
        super().setup_environment()
        # Within the replica: NCCL on GPUs (RCCL on ROCm builds), gloo on CPUs, unless `backend` says otherwise.
        intra = resolve_backend(self.backend)
        _hooks.init_replica_group(self.cluster_environment, intra)

    @override
    def setup(self, trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING or self._ctx is None:
            return
        module = self.lightning_module
        if len(self.optimizers) != 1:
            raise MisconfigurationException(
                f"MonarchStrategy supports exactly one optimizer, configure_optimizers returned "
                f"{len(self.optimizers)}: put all parameter groups into one optimizer"
            )
        self._tx = StepTransaction(self._ctx, _HealState(self), list(module.parameters()), buffers_of=[module],
                                   overlap=self._overlap, give_up=self._write_give_up_checkpoint,
                                   newest_checkpoint=self._newest_checkpoint)
        self._sync_generation()  # first generation: rank 0 seeds everyone; a newcomer heals from a live peer

    _overlap = True
    """Reduce buckets while backward runs (DDP's overlap); FSDP assigns its gradients after backward instead."""

    @override
    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    @override
    def reduce(self, tensor, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean"):
        """Within this replica only: metrics logged with sync_dist=True are not reduced across replicas."""
        if isinstance(tensor, torch.Tensor):
            return _hooks.reduce_in_replica(tensor, group, reduce_op)
        return tensor

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        """Within this replica only: replicas come and go, so a cross-replica barrier could wait on the dead."""
        if _hooks.distributed_is_initialized():
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _hooks.distributed_is_initialized():
            return obj
        holder = [obj]
        torch.distributed.broadcast_object_list(holder, src)
        return holder[0]

    # -- data -----------------------------------------------------------------------------------------------

    @override
    def process_dataloader(self, dataloader: object) -> object:
        if self._tx is None or not self.lightning_module.trainer.training:
            return dataloader
        check_training_loader(dataloader)
        config = self._ctx.config
        k = config.procs_per_replica
        self._micro_batch_size = dataloader.batch_size * config.replicas * k
        n = len(dataloader.dataset)
        tail = n % self._micro_batch_size
        procs = config.max_replicas * k
        short_tail = tail and not dataloader.drop_last and tail < procs
        if self._micro_batch_size < procs or short_tail:
            raise MisconfigurationException(
                f"a global batch of {self._micro_batch_size} (batch_size {dataloader.batch_size} x "
                f"{config.replicas * k} devices) over {n} samples leaves some of up to {procs} devices without a "
                "sample in a step: raise batch_size, or pass drop_last=True to the training DataLoader"
            )
        if self._sampler is None or self._sampler.num_samples != n:
            seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
            self._sampler = ElasticSampler(n, shuffle=isinstance(dataloader.sampler, RandomSampler), seed=seed,
                                           drop_last=dataloader.drop_last)
            if self._pending_sampler_state is not None:
                self._sampler.load_state_dict(self._pending_sampler_state)
                self._pending_sampler_state = None
        self._batches = _ElasticBatchSampler(self, dataloader.dataset, dataloader.collate_fn)
        return _ElasticDataLoader(
            self, dataloader.dataset, batch_sampler=self._batches, num_workers=dataloader.num_workers,
            collate_fn=dataloader.collate_fn, pin_memory=dataloader.pin_memory, timeout=dataloader.timeout,
            worker_init_fn=dataloader.worker_init_fn, multiprocessing_context=dataloader.multiprocessing_context,
            generator=dataloader.generator, persistent_workers=dataloader.persistent_workers,
            prefetch_factor=dataloader.prefetch_factor if dataloader.num_workers else None,
        )

    @property
    def _accumulate(self) -> int:
        """Lightning's current `accumulate_grad_batches`: callbacks change it mid-fit
        (GradientAccumulationScheduler, StochasticWeightAveraging), and Lightning steps by the value of the day."""
        return self.lightning_module.trainer.accumulate_grad_batches

    def _window(self) -> list[list[int]]:
        """The global micro-batches of the step at the cursor, grouped as Lightning's epoch loop groups batches.

        Lightning steps after the epoch's batch `b` when `(b + 1) % accumulate_grad_batches == 0` or when `b` is
        the epoch's last of `num_training_batches` (which `limit_train_batches` and `overfit_batches` cut short of
        the data), so a window never crosses the end of the epoch Lightning plans.
        """
        done = self._sampler.cursor // self._micro_batch_size  # the epoch's batches trained by committed steps
        left = self.lightning_module.trainer.num_training_batches - done
        return self._sampler.window(self._micro_batch_size, min(self._accumulate - done % self._accumulate, left))

    def _cut(self, batch: list[int]) -> list[int]:
        """This proc's samples of a global micro-batch: its replica's share, split over the replica's procs."""
        return share(share(batch, self._tx.rank, self._tx.world), self._ctx.local_rank, self._ctx.procs_per_replica)

    def _share(self, micro: int) -> list[int]:
        return self._cut(self._window()[micro])

    # -- the step transaction ------------------------------------------------------------------------------

    @override
    def on_train_start(self) -> None:
        self._fit_loop_started = True
        super().on_train_start()

    @override
    def on_validation_start(self) -> None:
        """A validation inside an accumulation window (`val_check_interval`) runs on the buffers of the last
        commit, as every replica holds them, not on this replica's own micro-batches' statistics since."""
        super().on_validation_start()
        if self._tx is not None and self._window_gen is not None:
            self._validation_buffers = self._tx.reducer.first_attempt_buffers()
            self._validation_buffers.__enter__()

    @override
    def on_validation_end(self) -> None:
        if self._validation_buffers is not None:
            self._validation_buffers.__exit__(None, None, None)
            self._validation_buffers = None
        super().on_validation_end()

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        """With several procs to a replica, each proc's loss is the mean over its own samples and the replica
        averages its procs' gradients; weight each loss by its share so uneven splits still average right."""
        if self._tx is not None and self._sampler is not None and self._ctx.procs_per_replica > 1:
            micro = self._micro - 1  # training_step has moved on to the next micro-batch
            replica_share = share(self._window()[micro], self._tx.rank, self._tx.world)
            closure_loss = closure_loss * (
                self._ctx.procs_per_replica * len(self._share(micro)) / len(replica_share)
            )
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def block_backward_sync(self):
        """Lightning's accumulation micro-batches: their backward accumulates locally, as under DDP's no_sync."""
        return self._tx.reducer.no_sync() if self._tx is not None else contextlib.nullcontext()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return super().training_step(*self._elastic_batch(args), **kwargs)

    def _elastic_batch(self, args: tuple) -> tuple:
        """The step's arguments with this proc's share of the live group's micro-batch swapped in."""
        if self._tx is not None and self._sampler is not None and args:
            if self._window_gen is None:
                self._start_window()
            args = (self._batches.batch_for(args[0], self._micro), *args[1:])
            self._micro += 1
            for name, value in self._tx.metrics().items():  # the bar shows the replicas, target, last pause
                self.lightning_module.log(name, value, prog_bar=name != "elastic/recoveries", on_step=True,
                                          on_epoch=False, batch_size=1)
        return args

    def _start_window(self) -> None:
        """A step boundary: enter a waiting generation (so a newcomer heals here) before any micro-batch runs."""
        self._sync_generation()
        if self._pending_logger_step is not None:
            # A healed newcomer: Lightning adds one to the logging step when it restores loop progress saved
            # after a batch, but a heal is taken before one.
            _hooks.set_logger_step(self.lightning_module.trainer, self._pending_logger_step)
            self._pending_logger_step = None
        self._tx.begin(self._step)
        self._window_gen = self._tx.gen

    @override
    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        if self._tx is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._window_gen is None:
            self._start_window()  # a one-micro-batch window: the closure below is its only micro-batch
        start, last = self._step, self._micro
        loss = None  # stays None only if a heal handed us this step before our closure ran
        while True:
            self._sync_generation()
            if self._step > start:
                # A peer committed this step while our reduction failed; the heal handed us its result.
                optimizer.zero_grad(set_to_none=True)
                self._micro, self._window_gen = 0, None
                return loss
            if self._window_gen != self._tx.gen:
                self._redo_window(optimizer, closure, last)
            self._tx.arm(weight(self._window(), self._tx.rank, self._tx.world))  # backward starts reducing as gradients arrive
            loss = closure()
            self._micro = last  # Lightning completes that micro-batch only after the step: it stays in flight
            if self._tx.reduce(self._step, [], lambda: optimizer.zero_grad(set_to_none=True)) is not None:
                break
            self._window_gen = -1  # its gradients are gone: redo the whole window
        micro_batches = len(self._window())
        output = super().optimizer_step(optimizer, lambda: loss, model, **kwargs)
        self._sampler.advance(self._micro_batch_size, micro_batches)
        self._tx.committed(self._step)
        self._step += 1
        self._micro, self._window_gen = 0, None
        return output

    def _redo_window(self, optimizer, closure: Callable[[], Any], last: int) -> None:
        """Rerun the window's micro-batches before `last` on this generation's shares, accumulating locally.

        Lightning's closure of the last micro-batch serves for all of them: `training_step` swaps in the share
        of micro-batch `self._micro`, and that closure never zeroes gradients (only a window's first does).
        """
        optimizer.zero_grad(set_to_none=True)
        self._tx.begin(self._step)
        self._window_gen = self._tx.gen
        with self._tx.reducer.no_sync():
            for micro in range(last):
                self._micro = micro
                closure()

    def _sync_generation(self) -> None:
        """Enter the newest generation if one is waiting (a death, or a grow agreed inside the last step)."""
        if self._tx.sync(self._step):
            self._update_rank_zero()

    def _write_give_up_checkpoint(self, committed: int) -> Optional[str]:
        self._update_rank_zero()
        if self._elastic_rank() != 0:
            return None  # every proc of the writing replica takes part (FSDP gathers); its first one writes
        config = self._ctx.config
        os.makedirs(config.checkpoint_dir, exist_ok=True)
        path = os.path.abspath(os.path.join(config.checkpoint_dir, f"step{committed:08d}.ckpt"))
        with self._progress_at_window_start():
            self.lightning_module.trainer.save_checkpoint(path)
        return path if self.is_global_zero else None

    def _newest_checkpoint(self) -> Optional[str]:
        """The newest `.ckpt` on disk, what `fit(ckpt_path=...)` resumes: the give-up checkpoints and every
        `ModelCheckpoint`'s."""
        trainer = self.lightning_module.trainer
        dirs = {self._ctx.config.checkpoint_dir, *(getattr(cb, "dirpath", None) for cb in trainer.checkpoint_callbacks)}
        found = [os.path.join(d, name) for d in dirs if d and os.path.isdir(d) for name in os.listdir(d)
                 if name.endswith(".ckpt")]
        return os.path.abspath(max(found, key=os.path.getmtime)) if found else None

    @contextlib.contextmanager
    def _progress_at_window_start(self):
        """Lightning's batch progress as of the current step's first micro-batch, for the state others resume.

        A generation can change while a window is half run; whoever resumes from this state (a newcomer, or a
        `fit(ckpt_path=...)`) starts from the step's cursor, so its loop must start at the window's first
        micro-batch too, or it would step after the wrong number of micro-batches.
        """
        progress = self.lightning_module.trainer.fit_loop.epoch_loop.batch_progress
        if not self._micro:  # at a window start (or after the last step) the live progress is already right
            yield
            return
        saved = progress.state_dict()
        for tracker in (progress.total, progress.current):
            for name in ("ready", "started", "processed", "completed"):
                setattr(tracker, name, getattr(tracker, name) - self._micro)
        progress.is_last_batch = False
        try:
            yield
        finally:
            progress.load_state_dict(saved)

    def finish(self) -> None:
        """After `fit`: leave together once every live replica has trained its last step (a death here is healed
        first). After the other stages, which never joined a generation: just leave."""
        if self._tx is not None and self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            self._tx.finish(lambda: self._step)

    def _fit_loop_state(self) -> dict:
        with self._progress_at_window_start():
            return self.lightning_module.trainer.fit_loop.state_dict()

    def full_state_dict(self) -> dict:
        """The trained weights as plain tensors, what `fit` hands back to the controller's module."""
        return self.lightning_module.state_dict()


MonarchStrategy.__doc__ += arguments_doc()


class _HealState:
    """What a newcomer (or a replica that dropped a step its peers committed) receives from a live peer.

    A newcomer is healed before Lightning's fit loop starts, so it takes everything, the loop progress and the
    callbacks' state (early stopping, best checkpoints) included, and Lightning resumes mid-epoch exactly as from
    a mid-epoch checkpoint. A survivor healed mid-run is one step
    behind, inside `optimizer_step`: it takes the weights, the optimizer's state and the cursor, but keeps its own
    learning rates, LR schedulers and loop progress, because its loop is about to finish that same step and
    advance them exactly as the donor's loop already did.
    """

    def __init__(self, strategy: MonarchStrategy):
        self.strategy = strategy

    @property
    def device_mesh(self):
        """Where received shards live (FSDP); None for an unsharded model."""
        return getattr(self.strategy, "device_mesh", None)

    def state_dict(self) -> dict:
        s = self.strategy
        trainer = s.lightning_module.trainer
        return {
            "step": s._step,
            "model": s.lightning_module.state_dict(),
            "optimizers": [o.state_dict() for o in s.optimizers],
            "lr_schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
            "sampler": s._sampler.state_dict() if s._sampler is not None else None,
            "fit_loop": s._fit_loop_state() if s._fit_loop_started else None,
            "logger_step": _hooks.logger_step(trainer),
            "callbacks": _hooks.callbacks_state(trainer),
            "rng": rng_state(s._tx.device),
        }

    def load_state_dict(self, state: dict) -> None:
        s = self.strategy
        trainer = s.lightning_module.trainer
        s.lightning_module.load_state_dict(state["model"])
        newcomer = not s._fit_loop_started
        for optimizer, saved in zip(s.optimizers, state["optimizers"]):
            own = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
            optimizer.load_state_dict(saved)
            if not newcomer:
                for group, hyper in zip(optimizer.param_groups, own):
                    group.update(hyper)
        if newcomer:
            for config, saved in zip(trainer.lr_scheduler_configs, state["lr_schedulers"]):
                config.scheduler.load_state_dict(saved)
            if state["fit_loop"] is not None:
                trainer.fit_loop.load_state_dict(state["fit_loop"])
                s._pending_logger_step = state["logger_step"]
            _hooks.load_callbacks_state(trainer, state)
            set_rng_state(state["rng"], s._tx.device)
        if state["sampler"] is not None:
            if s._sampler is not None:
                s._sampler.load_state_dict(state["sampler"])
            else:
                s._pending_sampler_state = state["sampler"]
        s._step = state["step"]


class _ElasticBatchSampler:
    """The training DataLoader's batch sampler: this replica's share of each global micro-batch, from the cursor on.

    Lightning fetches a batch ahead and DataLoader workers prefetch more, so a batch in hand may have been cut
    for a generation that no longer exists. Each issued share is remembered by (epoch, window start, micro-batch);
    at training_step time the strategy swaps in a freshly loaded share when the one in hand is not that
    micro-batch's share for the live group (and when it reruns a window, whose earlier shares are long gone).
    """

    def __init__(self, strategy: MonarchStrategy, dataset: Any, collate_fn: Callable):
        self.strategy = strategy
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.sampler = strategy._sampler
        self.issued: deque[tuple[tuple[int, int], list[int]]] = deque()

    def __len__(self) -> int:
        return self.sampler.batches_per_epoch(self.strategy._micro_batch_size)

    def __iter__(self):
        sampler, strategy = self.sampler, self.strategy
        epoch = sampler.epoch
        for pos, batch in sampler.micro_batches(strategy._micro_batch_size):
            micro = (pos // strategy._micro_batch_size) % strategy._accumulate
            window_start = pos - micro * strategy._micro_batch_size
            share = strategy._cut(batch)
            self.issued.append(((epoch, window_start, micro), share))
            yield share

    def batch_for(self, batch: Any, micro: int) -> Any:
        s = self.strategy
        key = (self.sampler.epoch, self.sampler.cursor, micro)
        while self.issued and self.issued[0][0] < key:
            self.issued.popleft()
        wanted = s._share(micro)
        if self.issued and self.issued[0][0] == key and self.issued[0][1] == wanted:
            return batch
        return s.batch_to_device(self.collate_fn([self.dataset[i] for i in wanted]))


class _ElasticDataLoader(DataLoader):
    """Stateful for Lightning: its cursor and committed step ride in every checkpoint's loop state, so
    `fit(ckpt_path=...)` (for example from the checkpoint written when a run gives up) resumes the exact data
    order."""

    def __init__(self, strategy: MonarchStrategy, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.strategy = strategy

    def state_dict(self) -> dict:
        return {"sampler": self.strategy._sampler.state_dict(), "step": self.strategy._step}

    def load_state_dict(self, state: dict) -> None:
        self.strategy._sampler.load_state_dict(state["sampler"])
        self.strategy._step = state["step"]
