"""`MonarchStrategy`: Lightning's training step as the runtime's step transaction.

Lightning's split: the strategy is the replica side, and the controller side is its launcher (`_MonarchLauncher`),
which the strategy creates when the Trainer is built in the user's process, and which checks the Trainer's
arguments against the settings (`MonarchStrategy(min_replicas=...)`, every `ElasticConfig` field by its name) and
runs `fit` in every replica. Inside a replica the strategy is a data-parallel strategy whose torch.distributed
default group holds only that replica's own procs, so Lightning's own collectives (`strategy.reduce`, barriers,
the SIGTERM broadcast) never cross replicas. Everything that crosses replicas goes through the runtime's
step transaction (`StepTransaction`):

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
from typing import Any, Callable, Optional

import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch.utils.data import DataLoader, RandomSampler
from typing_extensions import override

from monarch_plugin.backend import resolve_backend
from monarch_plugin.config import ElasticConfig
from monarch_plugin.storage.filemodes import make_dirs
import monarch_plugin.integrations.lightning._lightning_hooks as _hooks
from monarch_plugin.integrations.lightning.checkpoint_io import AtomicCheckpointIO
from monarch_plugin.integrations.lightning.launcher import arguments_doc, check_training_loader, signature
from monarch_plugin.integrations.lightning.launcher import take_settings
from monarch_plugin.data.sampler import ElasticSampler, ShareSampler, reloader
from monarch_plugin.worker import context as _context
from monarch_plugin.worker.transaction import StepTransaction, TrainingState
from monarch_plugin.worker.window import StepWindow, short_tail

__all__ = ["MonarchStrategy"]


class MonarchStrategy(ParallelStrategy):
    """Elastic data parallel: `Trainer(devices=N)` replicas, each one Monarch proc mesh; survives SIGKILLed workers."""

    strategy_name = "monarch"
    procs_per_replica = 1

    def __init__(self, elastic: Optional[ElasticConfig] = None, **kwargs: Any) -> None:
        self.settings = take_settings(type(self).__name__, elastic, kwargs)
        """The run's settings given here (`ElasticConfig` fields); the launcher adds Lightning's own (`devices`)."""
        # Trainer(plugins=[...]) still replaces it
        kwargs.setdefault("checkpoint_io", AtomicCheckpointIO(share=bool(self.settings.get("share_files", False))))
        # The controller's world is its one process (a replica sets its own in `setup_environment`): Lightning's
        # own search would find a SLURM batch script's variables and warn that `srun` is not used.
        kwargs.setdefault("cluster_environment", LightningEnvironment())
        super().__init__(**kwargs)
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
        self._batches: Optional[ShareSampler] = None
        self._loader: Optional[DataLoader] = None
        """The training DataLoader as the LightningModule gave it, which `_batches` re-cuts."""
        self._micro_batch_size = 0
        """Samples in one global micro-batch: the DataLoader's batch_size x every proc of the starting replicas."""
        self._window: Optional[StepWindow] = None
        """The step in flight's micro-batches, cut over the live replicas and this replica's data-parallel procs."""
        self._micro = 0
        """Index in its window of the micro-batch `training_step` runs next, which between micro-batches and while
        a step is being reduced is the number of the window's micro-batches Lightning counts as completed."""
        self._window_gen: Optional[int] = None
        """The generation the window's micro-batches were cut for; None before its first micro-batch."""
        self._window_progress: Optional[dict] = None
        """Lightning's batch progress as the window's first micro-batch started (`_progress_at_window_start`)."""
        self._step = 0
        self._validation_buffers: Optional[contextlib.AbstractContextManager] = None
        """Held while a validation runs inside a window: the last commit's buffers swapped in."""
        self._fit_loop_started = False

    @override
    def _configure_launcher(self) -> None:
        from monarch_plugin.integrations.lightning.launcher import _MonarchLauncher

        self._launcher = _MonarchLauncher(self)  # it checks the Trainer's arguments against the settings

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
        return self._ctx.rank if self._ctx is not None else 0

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
        intra = resolve_backend(ctx.config.backend)
        _hooks.init_replica_group(self.cluster_environment, intra)

    @override
    def setup(self, trainer) -> None:
        super().setup(trainer)
        ctx = self._ctx
        if ctx is not None and ctx.config.max_replicas * ctx.procs_per_replica > 1:
            # A file per proc, as ddp_spawn's ranks write them (`<stage>-<filename>-<rank>.txt`): Lightning numbers
            # them only when its world has several procs, and here its world is one replica's.
            rank = ctx.replica_id * ctx.procs_per_replica + ctx.local_rank
            trainer.profiler.setup(stage=trainer.state.fn, local_rank=rank, log_dir=trainer.log_dir)
        if trainer.state.fn != TrainerFn.FITTING or ctx is None:
            return
        module = self.lightning_module
        if len(self.optimizers) != 1:
            raise MisconfigurationException(
                f"MonarchStrategy supports exactly one optimizer, configure_optimizers returned "
                f"{len(self.optimizers)}: put all parameter groups into one optimizer"
            )
        self._tx = StepTransaction(self._ctx, _HealState(self), list(module.parameters()), buffers_of=[module],
                                   overlap=self._overlap, give_up=self._write_give_up_checkpoint,
                                   newest_checkpoint=self._newest_checkpoint, on_join=self._update_rank_zero)
        self._tx.sync(self._step)  # first generation: rank 0 seeds everyone; a newcomer heals from a live peer

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
        lane, k = self._data_parallel()
        self._micro_batch_size = dataloader.batch_size * config.replicas * k
        n = len(dataloader.dataset)
        procs = config.max_replicas * k
        if self._micro_batch_size < procs or short_tail(n, self._micro_batch_size, procs, dataloader.drop_last):
            raise MisconfigurationException(
                f"a global batch of {self._micro_batch_size} (batch_size {dataloader.batch_size} x "
                f"{config.replicas * k} data-parallel devices) over {n} samples leaves some of up to {procs} "
                "devices without a sample in a step: raise batch_size, or pass drop_last=True to the training "
                "DataLoader"
            )
        if self._sampler is None or self._sampler.num_samples != n:
            seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
            self._sampler = ElasticSampler(n, shuffle=isinstance(dataloader.sampler, RandomSampler), seed=seed,
                                           drop_last=dataloader.drop_last)
            if self._pending_sampler_state is not None:
                self._sampler.load_state_dict(self._pending_sampler_state)
                self._pending_sampler_state = None
        self._window = StepWindow(self._window_batches, lambda: (self._tx.rank, self._tx.world),
                                  lane=lane, lanes=k)
        self._batches, self._loader = ShareSampler(self._sampler, self._micro_batch_size, self._window.cut), dataloader
        return reloader(dataloader, self._batches, _ElasticDataLoader, self)

    @property
    def _accumulate(self) -> int:
        """Lightning's current `accumulate_grad_batches`: callbacks change it mid-fit
        (GradientAccumulationScheduler, StochasticWeightAveraging), and Lightning steps by the value of the day."""
        return self.lightning_module.trainer.accumulate_grad_batches

    def _window_batches(self) -> list[list[int]]:
        """The global micro-batches of the step at the cursor, grouped as Lightning's epoch loop groups batches.

        Lightning steps after the epoch's batch `b` when `(b + 1) % accumulate_grad_batches == 0` or when `b` is
        the epoch's last of `num_training_batches` (which `limit_train_batches` and `overfit_batches` cut short of
        the data), so a window never crosses the end of the epoch Lightning plans.
        """
        done = self._sampler.cursor // self._micro_batch_size  # the epoch's batches trained by committed steps
        left = self.lightning_module.trainer.num_training_batches - done
        return self._sampler.window(self._micro_batch_size, min(self._accumulate - done % self._accumulate, left))

    def _data_parallel(self) -> tuple[int, int]:
        """This proc's rank among its replica's procs that read samples of their own, and their number: every proc
        here (`MonarchFSDPStrategy` with tensor parallelism: one per TP group)."""
        return self._ctx.local_rank, self._ctx.procs_per_replica

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
        """With several data-parallel procs to a replica, each proc's loss is the mean over its own samples and the
        replica averages their gradients; weight each loss by its share so uneven splits still average right."""
        readers = self._data_parallel()[1] if self._tx is not None else 1
        if self._sampler is not None and readers > 1:
            micro = self._micro - 1  # training_step has moved on to the next micro-batch
            window = self._window
            closure_loss = closure_loss * (readers * len(window.share(micro)) / len(window.replica_share(micro)))
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
            args = (self._batch_for(args[0], self._micro), *args[1:])
            self._micro += 1
            for name, value in self._tx.metrics().items():  # the bar shows the replicas, target, last pause
                self.lightning_module.log(name, value, prog_bar=name != "elastic/recoveries", on_step=True,
                                          on_epoch=False, batch_size=1)
        return args

    def _batch_for(self, batch: Any, micro: int) -> Any:
        """`batch`, if it is this proc's share of micro-batch `micro` for the live group; else that share, loaded."""
        wanted = self._window.share(micro)
        if self._batches.in_hand(micro) == wanted:
            return batch
        loader = self._loader
        return self.batch_to_device(loader.collate_fn([loader.dataset[i] for i in wanted]))

    def _start_window(self) -> None:
        """A step boundary: enter a waiting generation (so a newcomer heals here) before any micro-batch runs."""
        self._tx.sync(self._step)
        if self._pending_logger_step is not None:
            # A healed newcomer: Lightning adds one to the logging step when it restores loop progress saved
            # after a batch, but a heal is taken before one.
            _hooks.set_logger_step(self.lightning_module.trainer, self._pending_logger_step)
            self._pending_logger_step = None
        self._tx.begin(self._step)
        self._window_progress = self.lightning_module.trainer.fit_loop.epoch_loop.batch_progress.state_dict()
        self._window_gen = self._tx.gen

    @override
    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        if self._tx is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._window_gen is None:
            self._start_window()  # a one-micro-batch window: the closure below is its only micro-batch
        last, loss = self._micro, None  # loss stays None only if a heal handed us this step before our closure ran

        def attempt(redo: bool) -> list[float]:
            nonlocal loss
            if redo or self._window_gen != self._tx.gen:  # its earlier micro-batches were cut for another group
                self._redo_window(optimizer, closure, last)
            self._tx.arm(self._window.weight())  # backward reduces as it goes
            loss = closure()
            self._micro = last  # Lightning completes that micro-batch only after the step: it stays in flight
            return []

        handed_over = self._tx.commit(self._step, lambda: self._step, attempt,
                                      lambda: optimizer.zero_grad(set_to_none=True)) is None
        if handed_over:  # a peer committed this step while ours was dropped: the heal handed us its result
            self._micro, self._window_gen = 0, None
            return loss
        micro_batches = len(self._window.batches())
        output = super().optimizer_step(optimizer, lambda: loss, model, **kwargs)
        self._sampler.advance(self._micro_batch_size, micro_batches)
        self._batches.forget()
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

    def _write_give_up_checkpoint(self, committed: int) -> Optional[str]:
        """The checkpoint of the last committed step, when the controller gives up or is lost: beside the
        `ModelCheckpoint`'s own files when the trainer has one, so that the newest file there, what a relaunch passes
        to `fit(ckpt_path=...)`, is this one (written last, so newest by time; its own name, so it never replaces a
        file the callback keeps track of); else in `checkpoint_dir`."""
        self._update_rank_zero()  # the replica's first proc writes (every one takes part: FSDP gathers)
        config = self._ctx.config
        folder = getattr(self.lightning_module.trainer.checkpoint_callback, "dirpath", None)
        if not folder:
            folder = config.checkpoint_dir
            make_dirs(folder, config.share_files)  # 0700 unless `share_files`
        path = os.path.join(folder, f"step{committed:08d}.ckpt")
        path = path if "://" in path else os.path.abspath(path)  # the IO makes a local callback's folder
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
        micro-batch too, or it would step after the wrong number of micro-batches. So does a give-up checkpoint
        written after training_step raised anywhere in the window, its forward or its backward.
        """
        progress = self.lightning_module.trainer.fit_loop.epoch_loop.batch_progress
        if self._window_gen is None:  # between windows (or after the last step) the live progress is right
            yield
            return
        saved = progress.state_dict()
        progress.load_state_dict(self._window_progress)
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
MonarchStrategy.__init__.__signature__ = signature()


class _HealState(TrainingState):
    """What a newcomer (or a replica that dropped a step its peers committed) receives from a live peer.

    A newcomer is healed before Lightning's fit loop starts, so it takes everything, the loop progress and the
    callbacks' state (early stopping, best checkpoints) included, and Lightning resumes mid-epoch exactly as from
    a mid-epoch checkpoint. A survivor healed mid-run is catching up, inside `optimizer_step` (`TrainingState`).
    """

    def __init__(self, strategy: MonarchStrategy):
        configs = lambda: strategy.lightning_module.trainer.lr_scheduler_configs  # noqa: E731
        super().__init__(strategy, "_step", lambda: strategy._tx.device, modules=lambda: [strategy.lightning_module],
                         optimizers=lambda: strategy.optimizers, schedulers=lambda: [c.scheduler for c in configs()])

    def catching_up(self) -> bool:
        return self.owner._fit_loop_started

    def extra_state(self) -> dict:
        s = self.owner
        trainer = s.lightning_module.trainer
        return {
            "sampler": s._sampler.state_dict() if s._sampler is not None else None,
            "fit_loop": s._fit_loop_state() if s._fit_loop_started else None,
            "logger_step": _hooks.logger_step(trainer),
            "callbacks": _hooks.callbacks_state(trainer),
        }

    def load_extra(self, state: dict, whole: bool) -> None:
        s = self.owner
        trainer = s.lightning_module.trainer
        if whole:
            if state["fit_loop"] is not None:
                trainer.fit_loop.load_state_dict(state["fit_loop"])
                s._pending_logger_step = state["logger_step"]
            _hooks.load_callbacks_state(trainer, state)
        if state["sampler"] is not None:
            if s._sampler is not None:
                s._sampler.load_state_dict(state["sampler"])
            else:
                s._pending_sampler_state = state["sampler"]


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
