"""`ElasticLoop`: the small API a plain PyTorch training loop uses to become elastic.

    loop = ElasticLoop(model, optimizer, dataset_size=len(data), global_batch_size=32, max_steps=100)
    for step in loop:
        x, y = data[step.indices]          # this replica's share of the step's global batch
        loss_fn(model(x), y).backward()
        step.commit()                      # reduce over live replicas; optimizer.step() only if all did

Under `monarch-run` every replica runs this same loop; a step that a death interrupts is dropped and redone
by the new group, a newcomer is healed before its first step, and the loop ends on the same step on every
replica. Under plain `python` it is an ordinary single-process loop.

With `monarch-run --sync-every H` the replicas train semi-synchronously (DiLoCo, or LocalSGD with `--semi-sync
local_sgd`; `monarch_plugin.worker.semi_sync`): `step.commit()` steps this replica's optimizer alone, and every H
steps the loop syncs the replicas between two steps. The same loop body serves both; `loop.last_sync` is the newest
sync (its metrics summed over the replicas), and `loop.syncs` counts them.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import pickle
import re
import threading
from dataclasses import dataclass, field
from typing import Iterator

import torch

from monarch_plugin.storage.checkpoint import complete, damage, newest, step_path
from monarch_plugin.config import ElasticConfig
from monarch_plugin.data.sampler import ElasticSampler
from monarch_plugin.worker import context as _context
from monarch_plugin.worker.checkpoint_writer import CheckpointWriter
from monarch_plugin.worker.semi_sync import SemiSync
from monarch_plugin.worker.session import StopReplica
from monarch_plugin.worker.transaction import StepTransaction, rng_state, set_rng_state
from monarch_plugin.worker.window import StepWindow

__all__ = ["ElasticLoop", "Step", "Sync"]

logger = logging.getLogger("monarch_plugin")


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
    extra: bool = False
    """Semi-synchronous: samples of a replica lost since the last sync, trained by this one before the sync (with the
    number of the round's last step); its commit steps the optimizer, not the learning-rate scheduler."""

    def no_sync(self):
        """Context for every backward but the last of a step (gradient accumulation), as DDP's no_sync."""
        tx = self._loop.tx
        return tx.reducer.no_sync() if tx is not None else contextlib.nullcontext()

    def commit(self, **metrics: float | torch.Tensor) -> bool:
        """Reduce gradients over the live replicas and, only if every one succeeded, step the optimizer.

        Keyword metrics (numbers or tensors) are summed across the replicas inside the same transaction,
        so they count exactly the committed step (available as `step.metrics`). Returns False when the step was
        dropped; the loop then retries it.

        Semi-synchronous (`sync_every` above 1), a step is this replica's own: its optimizer steps, the metrics stay
        its own (`step.metrics`), and it always commits. They are summed over the replicas at the round's sync, over
        the samples the synced model learned (`loop.last_sync.metrics`).
        """
        if self.committed is not None:
            raise RuntimeError(f"step {self.number} was already committed: call step.commit() once per step")
        self.committed = self._loop._commit(self, metrics)
        return self.committed


@dataclass
class Sync:
    """A committed sync of a semi-synchronous loop, as the loop's next step (or its end) finds it."""

    number: int
    """The run's syncs, this one included."""
    step: int
    """The committed steps after it."""
    epoch: int
    """The epoch its round's samples came from (a round ends at an epoch's end at the latest)."""
    metrics: dict[str, float | torch.Tensor]
    """What the round's steps passed to `commit`, summed over the samples the synced model learned: every replica's
    steps but those of a replica lost before the sync, whose samples another replica trained and counted instead."""


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
        outer_optimizer: torch.optim.Optimizer | None = None,
    ):
        """`outer_optimizer`: semi-synchronous DiLoCo's (`sync_every` above 1), over `model.parameters()`; Nesterov
        SGD (lr 0.7, momentum 0.9) if not given. Under plain `python` the loop is one process and never syncs."""
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
        semi = self.ctx is not None and _semi_synchronous(self.config, outer_optimizer)
        self._semi = SemiSync(model, self.config.semi_sync, self.config.sync_every, outer_optimizer) if semi else None
        self.last_sync: Sync | None = None
        """The newest sync this replica took part in (semi-synchronous)."""
        self.tx = (
            StepTransaction(self.ctx, self, list(model.parameters()), buffers_of=[model], overlap=overlap,
                            give_up=self._write_checkpoint, restore=self._restore)
            if self.ctx else None
        )
        self._base_lrs = [g["lr"] for g in optimizer.param_groups]
        config = self.config
        self._lanes, self._lane = (self.ctx.procs_per_replica, self.ctx.local_rank) if self.ctx else (1, 0)
        self._window = StepWindow(lambda: self.sampler.window(self._step_batch_size()),
                                  lambda: (self.rank, self.num_replicas), lane=self._lane, lanes=self._lanes, flat=True)
        """The step's one global batch, cut over every proc of the live replicas."""
        self._trainer = threading.current_thread()
        self._group = None  # `_checkpoint_group`
        self._checkpoints = (
            CheckpointWriter(config.checkpoint_dir, config.checkpoint_steps, config.checkpoint_interval_s,
                             self._lane == 0, self.ctx.events.emit, keep=config.checkpoint_keep,
                             share=config.share_files, bound_s=config.join_timeout_s)
            if self.ctx and (config.checkpoint_steps or config.checkpoint_interval_s) else None
        )
        if self.ctx and self.ctx.initial and config.resume:  # a replacement heals from its peers instead
            self.resume(config.resume)

    # -- what the loop is at ---------------------------------------------------------------------------

    @property
    def num_replicas(self) -> int:
        return self.tx.world if self.tx else 1

    @property
    def syncs(self) -> int:
        """The run's syncs committed (semi-synchronous; 0 otherwise)."""
        return self._semi.syncs if self._semi is not None else 0

    @property
    def sync_every(self) -> int:
        """Steps between syncs: 1 when the loop reduces gradients at every step (synchronous)."""
        return self._semi.every if self._semi is not None else 1

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
            if self._group is not None:
                import torch.distributed as dist

                dist.destroy_process_group(self._group)
            if self.tx:
                self.tx.close()

    def _steps(self) -> Iterator[Step]:
        tx = self.tx
        while True:
            if tx and tx.sync(self.step, agreed_only=self._semi is not None):
                self._apply_lr_policy()
            if self.done():
                if tx:
                    tx.finish(lambda: self.step)
                break
            if self._semi is not None:
                yield from self._round()
                continue
            if tx:
                tx.begin(self.step)
            step = Step(
                number=self.step, epoch=self.sampler.epoch, indices=self._window.share(0),
                rank=self.rank, num_replicas=self.num_replicas,
                generation=tx.gen if tx else 0, _loop=self,
            )
            step.weight = (self._window.weight() if self.config.batch_policy == "constant_global"
                           else 1.0 / self.num_replicas)
            if tx:
                tx.arm(step.weight)
            yield from self._yield(step)

    def _round(self) -> Iterator[Step]:
        """Semi-synchronous: the round's local steps, then its sync, redone in each new generation until it commits
        (with the samples of the replicas lost meanwhile trained first). A replica healed into a round whose sync is in
        progress goes straight to it."""
        semi, tx, start = self._semi, self.tx, self.step
        rid = self.ctx.replica_id

        def local(number: int, indices: list[int], extra: bool = False) -> Step:
            return Step(number=number, epoch=self.sampler.epoch, indices=indices, rank=self.rank,
                        num_replicas=self.num_replicas, generation=tx.gen, _loop=self, extra=extra)

        if semi.round is None:
            steps = semi.every if self.max_steps is None else min(semi.every, self.max_steps - self.step)
            batches = self.sampler.window(self._step_batch_size(), steps)  # never past the epoch's end
            semi.start(batches, tx.session.members, self._schedule())
            tx.begin(start)
            for i, indices in enumerate(semi.round.trained[rid]):
                if i:
                    tx.local_step(start + i)
                yield from self._yield(local(start + i, indices))
        while True:
            tx.sync(start)
            if self.step != start or semi.round is None:
                return  # healed past the sync (a peer committed it while this replica dropped it), or restored
            last = start + semi.round.steps - 1
            extra = semi.round.regroup(tx.session.members)[rid]
            while semi.owed or extra:
                tx.local_step(last)
                yield from self._yield(local(last, (semi.owed or extra).pop(0), extra=True))
            if self._sync(start):
                return

    def _yield(self, step: Step) -> Iterator[Step]:
        yield step
        if step.committed is None:
            raise RuntimeError("call step.commit() at the end of every step of an ElasticLoop")

    def _sync(self, start: int) -> bool:
        """The round's sync, one transaction: the pseudo-gradients summed over the generation, each weighted by its
        replica's share of the round's samples, with the round's metrics; then the outer step. False if dropped."""
        semi, tx = self._semi, self.tx
        rid = self.ctx.replica_id
        ledger = semi.round
        metrics = semi.round_metrics()
        semi.pseudo_gradients()
        self.ctx.fault_point("sync", start)
        tx.arm(ledger.weight(rid))
        zero_grad = lambda: self.optimizer.zero_grad(set_to_none=True)  # noqa: E731
        reduced = tx.reduce(start + ledger.steps - 1, _flat(metrics), zero_grad)
        if reduced is None:
            return False
        semi.outer_step()
        self.last_sync = Sync(number=semi.syncs, step=self.step + ledger.steps, epoch=self.sampler.epoch,
                              metrics=_shaped(metrics, reduced))
        self.sampler.advance(ledger.size, ledger.steps)
        self.step += ledger.steps
        tx.committed(self.step - 1)
        if self._checkpoints is not None and self.rank == 0 and self._checkpoints.due(self.step, ledger.steps):
            self._periodic_checkpoint()
        return True

    def _commit(self, step: Step, metrics: dict) -> bool:
        tensors = {k: torch.as_tensor(v).detach().to(torch.float64).cpu() for k, v in metrics.items()}
        if self._semi is not None:  # this replica's own step: the round's sync sums its metrics
            self._semi.add_metrics(tensors)
            step.metrics = _shaped(tensors, _flat(tensors))
            self.optimizer.step()
            if self.scheduler is not None and not step.extra:
                self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            return True
        values = _flat(tensors)
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
        step.metrics = _shaped(tensors, values)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.sampler.advance(batch)
        self.step += 1
        if self.tx:
            self.tx.committed(step.number)
        if self._checkpoints is not None and self.rank == 0 and self._checkpoints.due(self.step):
            self._periodic_checkpoint()
        return True

    def _periodic_checkpoint(self) -> None:
        """Write this step's checkpoint in the background, or skip it if the previous write is still going: waiting
        would stall the step on the disk. The replica's procs skip or write together (their write is one DCP save)."""
        busy = self._checkpoints.busy()
        if self.tx is not None:
            busy = self.tx.session.any_of(busy)
        if busy:
            if self._lane == 0:
                self.ctx.events.emit("checkpoint_skipped", step=self.step, message=(
                    f"the checkpoint of step {self.step} is skipped: the previous one is still being written (a slow "
                    "disk? raise `checkpoint_steps`)"))
            return
        self._checkpoints.write(self.step, self.checkpoint_state(), self._checkpoint_group())

    def _apply_lr_policy(self) -> None:
        if not self.config.scale_lr_with_replicas:
            return
        factor = self.num_replicas / self.config.max_replicas
        for group, base in zip(self.optimizer.param_groups, self._base_lrs):
            group["lr"] = base * factor

    # -- the state a newcomer heals from -----------------------------------------------------------------

    def state_dict(self) -> dict:
        model = self.model.state_dict()
        if self._semi is not None:  # the run's state is the synced one, whatever this replica trained since
            model.update(self._semi.synced_state())
        state = {
            "model": model,
            "optimizer": self.optimizer.state_dict(),
            "sampler": self.sampler.state_dict(),
            "step": self.step,
            "rng": rng_state(self._device),
        }
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self.extra_state is not None:
            state["extra"] = self.extra_state.state_dict()
        if self._semi is not None:
            state["semi"] = self._semi.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        if self._semi is not None:
            self._semi.load_state_dict(state["semi"], self.ctx.replica_id)
        self.optimizer.load_state_dict(state["optimizer"])
        self.sampler.load_state_dict(state["sampler"])
        self.step = state["step"]
        set_rng_state(state["rng"], self._device)
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.extra_state is not None and "extra" in state:
            self.extra_state.load_state_dict(state["extra"])

    def sharded(self) -> dict:
        """The model's state as held now (sharded over the replica's procs by FSDP2's `fully_shard`, or whole): a heal
        checks a donor's shards against it and rebuilds them on its meshes."""
        return {"model": self.model.state_dict()}

    @property
    def _device(self) -> torch.device:
        """Where this proc trains: its GPU under nccl, the CPU otherwise."""
        return self.tx.device if self.tx else torch.device("cpu")

    # -- durable checkpoints -------------------------------------------------------------------------------

    def checkpoint_state(self, lane: int | None = None, outer: bool = True) -> dict:
        """The state a durable checkpoint holds, as DCP writes it: the model's and optimizer's tensors by name
        (sharded as this proc holds them), the loop's counters once, and this proc's random generators as
        `lane{k}`. With `lane`, what loading lane `lane`'s generators into this proc reads. Semi-synchronous, the
        model is as the last sync left it (call it between syncs, or under `SemiSync.synced_parameters`), the
        optimizer is this replica's own, and the outer optimizer's state and the syncs count are there too, unless
        `outer` is False (the skeleton of a checkpoint a synchronous run wrote)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict  # DCP's: not at a replica's start

        model, optimizer = get_state_dict(self.model, self.optimizer)
        loop = {"sampler": self.sampler.state_dict(), "step": self.step}
        semi = self._semi is not None and outer
        if semi:
            loop["syncs"] = self._semi.syncs
        if self.scheduler is not None:
            loop["scheduler"] = self.scheduler.state_dict()
        if self.extra_state is not None:
            loop["extra"] = self.extra_state.state_dict()
        rng = rng_state(self._device)
        state = {"model": model, "optimizer": optimizer, "loop": loop,
                 f"lane{self._lane if lane is None else lane}": rng}
        if semi:
            # DCP fills an optimizer's empty state (before the first sync) only when no gradient is set: set aside
            # what a mid-round write finds there, so that the checkpoint has what a fresh process's skeleton asks for.
            grads = {name: p.grad for name, p in self._semi.params.items()}
            for p in self._semi.params.values():
                p.grad = None
            try:
                state["outer"] = get_state_dict(self.model, self._semi.outer)[1]
            finally:
                for name, p in self._semi.params.items():
                    p.grad = grads[name]
        return state

    def _checkpoint_group(self):
        """The group this replica's procs write and read checkpoints on: a gloo group of their own over their default
        group (the replica's procs, as monarch-run sets it), so that DCP's collectives, which run on the writing
        thread, never interleave with FSDP's. None for a one-proc replica. Formed by the training thread at the
        first checkpoint its procs write or read together."""
        if self.ctx is None or self._lanes == 1 or self._group is not None:
            return self._group
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() != self._lanes:
            raise ValueError(f"a replica of {self._lanes} procs writes and reads its checkpoints together over its "
                             "procs' default group: call torch.distributed.init_process_group() in the training "
                             "script (monarch-run sets its environment: this replica's procs) before ElasticLoop")
        self._group = dist.new_group(backend="gloo", group_desc="monarch_plugin_checkpoint")
        return self._group

    def _write_checkpoint(self, committed: int) -> str | None:
        """The controller gave up: every proc of the generation's first replica writes its part of the checkpoint of
        the step its state holds (`resume` loads it); its path on local rank 0. After the training code raised, the
        raiser alone is left to write: a proc of a multi-proc replica holds only its part, so it writes none."""
        if self._lanes > 1 and threading.current_thread() is not self._trainer:
            return None
        self._wait_for_periodic("write the stop's checkpoint")
        from monarch_plugin.worker import dcp_io

        path = step_path(self.config.checkpoint_dir, committed)  # the steps the state holds (`StepTransaction.held`)
        with self._at_last_sync():
            dcp_io.save(self.checkpoint_state(), path, self._checkpoint_group(), self.config.share_files)
        return path if self._lane == 0 else None

    def _schedule(self) -> dict:
        """What the schedule is at a round's start, by value: the scheduler's state, `extra_state`'s and the optimizer's
        hyperparameters (the learning rates the scheduler sets)."""
        groups = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        return copy.deepcopy({"scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                              "extra": self.extra_state.state_dict() if self.extra_state is not None else None,
                              "groups": groups})

    @contextlib.contextmanager
    def _at_last_sync(self):
        """Semi-synchronous, mid-round: for the duration, the parameters, the schedule and the learning rates are those
        of the last sync (what a checkpoint holds with its committed steps); this replica's own after."""
        semi = self._semi
        if semi is None or semi.round is None:
            yield
            return
        own = self._schedule()
        self._load_schedule(semi.schedule)
        try:
            with semi.synced_parameters():
                yield
        finally:
            self._load_schedule(own)

    def _load_schedule(self, schedule: dict) -> None:
        if self.scheduler is not None:
            self.scheduler.load_state_dict(copy.deepcopy(schedule["scheduler"]))
        if self.extra_state is not None:
            self.extra_state.load_state_dict(copy.deepcopy(schedule["extra"]))
        for group, hyper in zip(self.optimizer.param_groups, schedule["groups"]):
            group.update(copy.deepcopy(hyper))

    def _restore(self, path: str) -> int:
        """A RESTORE generation (no replica left holding the run's state): load the run's checkpoint mid-run."""
        self._wait_for_periodic("restore a checkpoint")
        self.resume(path)
        return self.step

    def _wait_for_periodic(self, what: str) -> None:
        """Until the periodic write in progress is done: its group is the one a stop's write or a restore's load runs
        on, and two DCP operations on one group would mix their collectives. One that hangs past its bound fails this
        proc instead (the controller then has another holder write, or replaces this replica)."""
        if self._checkpoints is None:
            return
        self._checkpoints.wait()
        if self._checkpoints.busy():
            raise RuntimeError(f"monarch-plugin cannot {what}: this proc's periodic checkpoint write has not finished "
                               f"in `join_timeout_s` {self.config.join_timeout_s:g} s (a filesystem that stopped "
                               "answering?), and a second write or a load on its group would mix with it")

    def resume(self, path: str) -> bool:
        """Load a durable checkpoint (before iterating): its `step<N>` directory, or "auto" for the newest complete
        one in `checkpoint_dir` whose files are as they were written (a damaged one is passed over, with a warning).
        Under `monarch-run --resume` the initial replicas call it themselves, the controller having checked it. False
        if "auto" found none.

        It may have been written by replicas of another number of procs: DCP reshards the model and optimizer onto
        this proc's part. Each proc takes the random generators of the proc of its local rank that wrote it; when
        there are more procs now, local rank k takes those of k modulo the procs that wrote (two procs then draw
        the same numbers, as the replicas do), and when there are fewer, the extra procs' generators are left."""
        if path == "auto":
            path = newest(self.config.checkpoint_dir, skipped=lambda p, why: logger.warning(
                "the checkpoint %s is damaged: %s; it is passed over for an older one", p, why))
            if path is None:
                return False
        if not complete(path):
            raise ValueError(f"{path} is not a complete checkpoint (no DCP metadata in it): give a step<N> directory "
                             "that a run finished writing, or 'auto' for the newest complete one")
        why = damage(path) if self.ctx is None else None  # under a controller: checked there, once for all
        if why:
            raise ValueError(f"the checkpoint {path} is damaged: {why}; resume another one, or 'auto' for the newest "
                             "intact one")
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from monarch_plugin.worker import dcp_io  # DCP: imported when a checkpoint is read, not at a replica's start

        try:
            metadata = dcp_io.read_metadata(path)
        except (pickle.UnpicklingError, EOFError, OSError) as e:
            raise ValueError(f"the checkpoint {path} is damaged: its .metadata cannot be read ({dcp_io.describe(e)}); "
                             "resume another one, or 'auto' for the newest intact one") from e
        saved = {key.split(".")[0] for key in metadata.state_dict_metadata if key.startswith("lane")}
        lane = self._lane % len(saved) if saved else self._lane
        # A synchronous run's checkpoint holds no outer optimizer: a semi-synchronous one resumed from it starts one.
        outer = any(key.startswith("outer.") for key in metadata.state_dict_metadata)
        try:
            state = dcp_io.load(self.checkpoint_state(lane, outer), path, self._checkpoint_group())
        except (Exception, dcp_io.CheckpointException) as e:  # DCP's wraps a missing key, another shape
            code = re.search(r"GLOBAL (\S+)", str(e))
            if code:
                raise ValueError(f"the checkpoint {path} holds an object that loading would run code for "
                                 f"({code[1]}): it is not loaded; give `extra_state` a state_dict of tensors, "
                                 "numbers and strings, or drop `resume`") from e
            raise ValueError(f"the checkpoint {path} is not of this model and optimizer ("
                             f"{dcp_io.describe(e)[:240]}): resume from this model's `checkpoint_dir`, or drop "
                             "`resume`") from e
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        if self._semi is not None:
            if "outer" in state:
                set_state_dict(self.model, self._semi.outer, model_state_dict={}, optim_state_dict=state["outer"])
            self._semi.round = None  # a round in flight is the checkpoint's no more: the next starts from its step
            self._semi.syncs = state["loop"].get("syncs", 0)
            self._semi.resync()
        loop = state["loop"]
        self.sampler.load_state_dict(loop["sampler"])
        self.step = loop["step"]
        if self.scheduler is not None and "scheduler" in loop:
            self.scheduler.load_state_dict(loop["scheduler"])
        if self.extra_state is not None and "extra" in loop:
            self.extra_state.load_state_dict(loop["extra"])
        set_rng_state(state[f"lane{lane}"], self._device)
        if self.tx:
            self.tx.session.fresh = False
        return True


def _flat(metrics: dict[str, torch.Tensor]) -> list[float]:
    """Metrics as a transaction sums them: their numbers in one list."""
    return [x for t in metrics.values() for x in t.reshape(-1).tolist()]


def _shaped(metrics: dict[str, torch.Tensor], values: list[float]) -> dict[str, float | torch.Tensor]:
    """`values` (`_flat(metrics)`, summed) in the metrics' names and shapes: a number for each scalar."""
    shaped, offset = {}, 0
    for name, t in metrics.items():
        value = torch.tensor(values[offset : offset + t.numel()], dtype=torch.float64).reshape(t.shape)
        shaped[name] = value.item() if t.dim() == 0 else value
        offset += t.numel()
    return shaped


def _semi_synchronous(config: ElasticConfig, outer_optimizer) -> bool:
    """Whether the run trains semi-synchronously (`sync_every` above 1); refuses an outer optimizer it would not use."""
    if config.sync_every == 1:
        if outer_optimizer is not None:
            raise ValueError("outer_optimizer is DiLoCo's, for semi-synchronous training: run with monarch-run "
                             "--sync-every H (H above 1), or drop it")
        return False
    if outer_optimizer is not None and config.semi_sync == "local_sgd":
        raise ValueError("LocalSGD averages the parameters and takes no outer_optimizer: drop it, or run with "
                         "--semi-sync diloco")
    return True
