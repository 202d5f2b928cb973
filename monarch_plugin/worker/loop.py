"""`ElasticLoop`: the small API a plain PyTorch training loop uses to become elastic.

    loop = ElasticLoop(model, optimizer, dataset_size=len(data), global_batch_size=32, max_steps=100)
    for step in loop:
        x, y = data[step.indices]          # this replica's share of the step's global batch
        loss_fn(model(x), y).backward()
        step.commit()                      # reduce over live replicas; optimizer.step() only if all did

Under `monarch-run` every replica runs this same loop; a step that a death interrupts is dropped and redone
by the new group, a newcomer is healed before its first step, and the loop ends on the same step on every
replica. Under plain `python` it is an ordinary single-process loop.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Iterator

import torch

from monarch_plugin.config import ElasticConfig
from monarch_plugin.sampler import ElasticSampler, share, weight
from monarch_plugin.worker import context as _context
from monarch_plugin.checkpoint import CheckpointWriter, file_name, lane_file, newest, save
from monarch_plugin.worker.session import StopReplica
from monarch_plugin.worker.transaction import StepTransaction, rng_state, set_rng_state

__all__ = ["ElasticLoop", "Step"]


@dataclass
class Step:
    """One attempt at one global step. If it is dropped, the loop yields the same step number again."""

    number: int
    epoch: int
    indices: list[int]
    rank: int
    num_replicas: int
    generation: int
    _loop: "ElasticLoop" = field(repr=False)
    committed: bool | None = None
    metrics: dict[str, float | torch.Tensor] = field(default_factory=dict)
    weight: float = field(default=1.0, repr=False)

    def no_sync(self):
        """Context for every backward but the last of a step (gradient accumulation), as DDP's no_sync."""
        tx = self._loop.tx
        return tx.reducer.no_sync() if tx is not None else contextlib.nullcontext()

    def commit(self, **metrics: float | torch.Tensor) -> bool:
        """Reduce gradients over the live replicas and, only if every one succeeded, step the optimizer.

        Keyword metrics (numbers or tensors) are summed across the replicas inside the same transaction,
        so they count exactly the committed step (available as `step.metrics`). Returns False when the step was dropped; the loop then retries it.
        """
        if self.committed is not None:
            raise RuntimeError(f"step {self.number} was already committed: call step.commit() once per step")
        self.committed = self._loop._commit(self, metrics)
        return self.committed


class ElasticLoop:
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        dataset_size: int,
        global_batch_size: int,
        max_steps: int | None = None,
        max_epochs: int | None = None,
        scheduler=None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        extra_state=None,
        overlap: bool = True,
    ):
        if max_steps is None and max_epochs is None:
            raise ValueError("give ElasticLoop max_steps or max_epochs so every replica knows when to stop")
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.extra_state = extra_state
        self.global_batch_size = global_batch_size
        self.max_steps = max_steps
        self.max_epochs = max_epochs
        self.sampler = ElasticSampler(dataset_size, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.step = 0
        self.ctx = _context.current()
        self.config = self.ctx.config if self.ctx else ElasticConfig(replicas=1)
        lanes = self.ctx.procs_per_replica if self.ctx else 1
        if self.ctx and global_batch_size < self.config.max_replicas * lanes:
            # constant_local cuts it into max_replicas local batches first: the same bound.
            raise ValueError(
                f"global_batch_size {global_batch_size} is smaller than max_replicas {self.config.max_replicas} x "
                f"procs_per_replica {lanes}: some procs would get no samples and their gradients would be zero; "
                f"raise global_batch_size to {self.config.max_replicas * lanes} or more, or run fewer replicas "
                "(max_replicas) or procs per replica"
            )
        if self.config.scale_lr_with_replicas and scheduler is not None:
            raise ValueError(
                "scale_lr_with_replicas rescales the learning rate at each resize and would fight the LR "
                "scheduler: scale inside your scheduler's lambda with loop.num_replicas instead"
            )
        self.tx = (
            StepTransaction(self.ctx, self, list(model.parameters()), buffers_of=[model], overlap=overlap,
                            give_up=self._write_checkpoint, restore=self._restore)
            if self.ctx else None
        )
        self._base_lrs = [g["lr"] for g in optimizer.param_groups]
        config = self.config
        self._checkpoints = (
            CheckpointWriter(config.checkpoint_dir, config.checkpoint_steps, config.checkpoint_interval_s,
                             self.ctx.local_rank, self.ctx.procs_per_replica, self.ctx.events.emit,
                             keep=config.checkpoint_keep)
            if self.ctx and (config.checkpoint_steps or config.checkpoint_interval_s) else None
        )
        if self.ctx and self.ctx.initial and config.resume:  # a replacement heals from its peers instead
            self.resume(config.resume)

    # -- what the loop is at ---------------------------------------------------------------------------

    @property
    def num_replicas(self) -> int:
        return self.tx.world if self.tx else 1

    @property
    def rank(self) -> int:
        return self.tx.rank if self.tx else 0

    def done(self) -> bool:
        if self.max_steps is not None and self.step >= self.max_steps:
            return True
        return self.max_epochs is not None and self.sampler.epoch >= self.max_epochs

    def _step_batch_size(self) -> int:
        if self.config.batch_policy == "constant_local":
            local = self.global_batch_size // self.config.max_replicas
            return local * self.num_replicas
        return self.global_batch_size

    # -- the iteration ---------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Step]:
        try:
            yield from self._steps()
        except StopReplica:
            if self.ctx:
                self.ctx.events.emit("stopped", replica=self.ctx.replica_id, step=self.step)
            raise
        finally:
            if self._checkpoints is not None:
                self._checkpoints.wait()  # the last one written is on disk before the loop ends
            if self.tx:
                self.tx.close()

    def _steps(self) -> Iterator[Step]:
        tx = self.tx
        while True:
            if tx and tx.sync(self.step):
                self._apply_lr_policy()
            if self.done():
                if tx:
                    tx.finish(lambda: self.step)
                break
            if tx:
                tx.begin(self.step)
            batch = self.sampler.window(self._step_batch_size())[0]
            lanes = self.ctx.procs_per_replica if self.ctx else 1
            lane = self.ctx.local_rank if self.ctx else 0
            step = Step(
                number=self.step, epoch=self.sampler.epoch,
                indices=share(batch, self.rank * lanes + lane, self.num_replicas * lanes),
                rank=self.rank, num_replicas=self.num_replicas,
                generation=tx.gen if tx else 0, _loop=self,
            )
            step.weight = self._weight(batch, lanes)
            if tx:
                tx.arm(step.weight)
            yield step
            if step.committed is None:
                raise RuntimeError("call step.commit() at the end of every step of an ElasticLoop")

    def _commit(self, step: Step, metrics: dict) -> bool:
        tensors = {k: torch.as_tensor(v).detach().to(torch.float64).cpu() for k, v in metrics.items()}
        values = [x for t in tensors.values() for x in t.reshape(-1).tolist()]
        batch = self._step_batch_size()
        weight = step.weight
        if self.tx:
            values = self.tx.reduce(step.number, values, lambda: self.optimizer.zero_grad(set_to_none=True))
            if values is None:
                return False
        elif weight != 1.0:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(weight)
        offset = 0
        for name, t in tensors.items():
            reduced = torch.tensor(values[offset : offset + t.numel()], dtype=torch.float64).reshape(t.shape)
            step.metrics[name] = reduced.item() if t.dim() == 0 else reduced
            offset += t.numel()
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.sampler.advance(batch)
        self.step += 1
        if self.tx:
            self.tx.committed(step.number)
        if self._checkpoints is not None and self.rank == 0 and self._checkpoints.due(self.step):
            self._checkpoints.write(self.step, self.state_dict())
        return True

    def _weight(self, batch: list[int], lanes: int) -> float:
        """This replica's factor in the sum over replicas, so that the sum is the global-batch mean. The batch is
        cut over every replica's lanes; the replica's weight is its lanes' together (inside a replica, FSDP/DDP
        already average over procs)."""
        if self.config.batch_policy != "constant_global":
            return 1.0 / self.num_replicas
        world = self.num_replicas * lanes
        return sum(weight([batch], self.rank * lanes + lane, world) for lane in range(lanes))

    def _apply_lr_policy(self) -> None:
        if not self.config.scale_lr_with_replicas:
            return
        factor = self.num_replicas / self.config.max_replicas
        for group, base in zip(self.optimizer.param_groups, self._base_lrs):
            group["lr"] = base * factor

    # -- the state a newcomer heals from -----------------------------------------------------------------

    def state_dict(self) -> dict:
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "sampler": self.sampler.state_dict(),
            "step": self.step,
            "rng": rng_state(self._device),
        }
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self.extra_state is not None:
            state["extra"] = self.extra_state.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.sampler.load_state_dict(state["sampler"])
        self.step = state["step"]
        set_rng_state(state["rng"], self._device)
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.extra_state is not None and "extra" in state:
            self.extra_state.load_state_dict(state["extra"])

    @property
    def _device(self) -> torch.device:
        """Where this proc trains: its GPU under nccl, the CPU otherwise."""
        return self.tx.device if self.tx else torch.device("cpu")

    def _write_checkpoint(self, committed: int) -> str | None:
        """The controller gave up: the generation's first replica saves every proc's state (`resume` loads it)."""
        if self._checkpoints is not None:
            self._checkpoints.wait()
        directory = self.config.checkpoint_dir
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, file_name(committed, self.ctx.local_rank, self.ctx.procs_per_replica))
        save(self.state_dict(), path)
        return os.path.abspath(path)

    def _restore(self, path: str) -> int:
        """A RESTORE generation (no replica left holding the run's state): load the run's checkpoint mid-run."""
        self.resume(path)
        return self.step

    def resume(self, path: str) -> bool:
        """Load a durable checkpoint (before iterating): one of its files, or "auto" for the newest complete one
        in `checkpoint_dir`. Under `monarch-run --resume` the initial replicas call it themselves. False if
        "auto" found none."""
        lanes, lane = (self.ctx.procs_per_replica, self.ctx.local_rank) if self.ctx else (1, 0)
        if path == "auto":
            path = newest(self.config.checkpoint_dir, lanes)
            if path is None:
                return False
        path = lane_file(path, lane)
        try:
            self.load_state_dict(torch.load(path, weights_only=False))
        except (RuntimeError, KeyError, ValueError) as e:  # missing or unexpected keys, other shapes
            raise ValueError(f"the checkpoint {path} is not of this model and optimizer ({type(e).__name__}: "
                             f"{' '.join(str(e).split())[:240]}): resume from this model's `checkpoint_dir`, or drop "
                             "`resume`") from e
        if self.tx:
            self.tx.session.fresh = False
        return True
