"""The Lightning training script the tests run as a subprocess: `python lightning_fit.py --out DIR ...`.

A tiny regressor plus a per-epoch sample counter `seen` that only the real gradient path can move: each
replica's loss adds the mean of `seen[epoch, idx]` over its share, the strategy weights that share by its
fraction of the global batch, and SGD with lr equal to the global batch then subtracts exactly 1 for every
time a sample took part in a committed step. `-seen` in the final weights is therefore the per-epoch count of
committed sightings of each sample. Momentum on the regressor and a step-wise LR schedule make the heal of
optimizer and scheduler state matter. With `--accumulate A` the seen counter's learning rate is the samples of
a whole step (A global micro-batches), so it still counts exactly 1 per committed sighting; `--clip` clips by
value at a threshold above the counter's per-sample gradient, so only the regressor's gradients are clipped.
With `--val-samples`, every finished validation appends "<global_step> <val_loss>" to DIR/val-<replica>
(DIR/val-single without Monarch), so a test can see where each replica validated and on what weights.

Writes DIR/result.json (controller's view: checksum, per-replica checksums, global_step, counts) and
DIR/weights.pt (under `monarch-run`, where every replica runs this script: DIR/result-<replica>.json and
DIR/weights-<replica>.pt); each replica writes DIR/progress-<replica> (its global_step) after every batch
so a test knows when to kill it; `--slow-replica R` makes replica R the straggler its peers wait for inside the reduction.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler, ModelCheckpoint, StochasticWeightAveraging
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset

from _regrow import wait_for_announced_grow

from monarch_plugin import worker_context
from monarch_plugin.integrations.lightning import MonarchFSDPStrategy, MonarchStrategy
from monarch_plugin import weights_checksum


class Regression(Dataset):
    """Noisy linear data; `split` draws other samples of the same linear map (0: training, 1: validation)."""

    def __init__(self, n: int, dim: int, split: int = 0):
        w = torch.randn(dim, 1, generator=torch.Generator().manual_seed(0))
        g = torch.Generator().manual_seed(1 + split)
        self.x = torch.randn(n, dim, generator=g)
        self.y = self.x @ w + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return i, self.x[i], self.y[i]


def decay(step: int) -> float:
    return 0.8 ** (step // 4)


def constant(step: int) -> float:
    return 1.0


class Model(pl.LightningModule):
    def __init__(self, samples: int, epochs: int, dim: int, global_batch: int, step_sleep: float, out: str,
                 slow_replica: int = -1, replicas: int = 1, hold_from: int = -1, batchnorm: bool = False):
        super().__init__()
        self.slow_replica = slow_replica
        self.replicas = replicas
        self.hold_from = hold_from
        norm = [nn.BatchNorm1d(16)] if batchnorm else []
        self.net = nn.Sequential(nn.Linear(dim, 16), *norm, nn.Tanh(), nn.Linear(16, 1))
        self.seen = nn.Parameter(torch.zeros(epochs, samples))
        self.global_batch = global_batch
        self.step_sleep = step_sleep
        self.out = out
        self.eval_sleep = 0.0
        self.sample_sleep = 0.0
        self.skip_tp_plan = False

    def training_step(self, batch, batch_idx):
        self._hold_for_regrow()
        idx, x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.step_sleep:
            ctx = worker_context()
            slow = ctx is not None and ctx.replica_id == self.slow_replica
            time.sleep(self.step_sleep * (5 if slow else 1))
        if self.sample_sleep:  # compute that grows with this replica's share, as a bigger model's does
            time.sleep(self.sample_sleep * len(idx))
        self.log("train_loss", loss)
        return loss + self.seen[self.current_epoch, idx].mean()

    def configure_model(self):
        """Under `MonarchFSDPStrategy(tensor_parallel_size=...)`, as under Lightning's ModelParallelStrategy: the
        first layer split by columns and the last by rows over the TP group, then FSDP over the data-parallel procs."""
        mesh = self.device_mesh
        if mesh is None or "tensor_parallel" not in (mesh.mesh_dim_names or ()) or self.skip_tp_plan:
            return
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        parallelize_module(self.net, mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(self, mesh=mesh["data_parallel"])

    def _hold_for_regrow(self) -> None:
        """--hold-for-regrow-from K: from global step K on, a shrunk group waits at each batch until a grow is
        announced, so a test sees the replacement join however slowly it starts (as the torchtitan probe)."""
        tx = getattr(self.trainer.strategy, "_tx", None)
        if self.hold_from < 0 or tx is None or self.trainer.global_step < self.hold_from:
            return
        if tx.world < self.replicas:
            wait_for_announced_grow(tx)

    def on_fit_start(self):
        if worker_context() is None and self.trainer.world_size > 1:  # ddp_spawn's ranks, for the harness to reap
            with open(os.path.join(self.out, f"ddp-pid-{self.global_rank}"), "w") as f:
                f.write(str(os.getpid()))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        ctx = worker_context()
        if ctx is not None:
            with open(os.path.join(self.out, f"progress-{ctx.replica_id}"), "w") as f:
                f.write(str(self.trainer.global_step))

    def on_train_end(self):
        if self.trainer.is_global_zero:  # ddp_spawn hands the weights back to its main process, not the step
            with open(os.path.join(self.out, "trained-steps"), "w") as f:
                f.write(str(self.trainer.global_step))
        ctx = worker_context()
        if ctx is not None:  # the step Lightning's loggers use, which a replica that becomes rank 0 logs at
            with open(os.path.join(self.out, f"logger-step-{ctx.replica_id}"), "w") as f:
                f.write(str(self.trainer.fit_loop.epoch_loop._batches_that_stepped))

    def on_validation_epoch_start(self):
        self.val_sum, self.val_count = 0.0, 0

    def validation_step(self, batch, batch_idx):
        _, x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y, reduction="sum")
        self.val_sum += float(loss)
        self.val_count += len(x)
        self.log("val_loss", loss / len(x))

    def on_validation_epoch_end(self):
        ctx = worker_context()
        if self.trainer.sanity_checking or (ctx is not None and ctx.local_rank):
            return
        name = f"val-{ctx.replica_id}" if ctx is not None else "val-single"
        with open(os.path.join(self.out, name), "a") as f:
            f.write(f"{self.trainer.global_step} {self.val_sum / self.val_count!r}\n")

    def test_step(self, batch, batch_idx):
        _, x, y = batch
        ctx = worker_context()
        if ctx is not None:  # so a test knows when to kill a replica mid-stage
            with open(os.path.join(self.out, f"test-progress-{ctx.replica_id}"), "w") as f:
                f.write(str(batch_idx))
        time.sleep(self.eval_sleep)
        self.log("test_loss", nn.functional.mse_loss(self.net(x), y))

    def predict_step(self, batch, batch_idx):
        _, x, _ = batch
        return self.net(x)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD([
            {"params": self.net.parameters(), "lr": 0.05, "momentum": 0.9},
            {"params": [self.seen], "lr": float(self.global_batch), "momentum": 0.0},
        ])
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [decay, constant])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Unpicklable(Model):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lock = threading.Lock()


def _batches(text: str) -> int | float:
    """Lightning's batch limits: an int counts batches, a float is a fraction of the epoch."""
    return float(text) if "." in text else int(text)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="monarch",
                   help="monarch (by instance), monarch-name, single, or ddp_spawn (the reference)")
    p.add_argument("--devices", type=int, default=3)
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--samples", type=int, default=240)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--batch", type=int, default=8, help="per-replica batch size (global = batch x devices)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=-1)
    p.add_argument("--accumulate", type=int, default=1, help="Trainer(accumulate_grad_batches=...)")
    p.add_argument("--accumulate-schedule", default=None,
                   help="GradientAccumulationScheduler, e.g. '0:2,1:3' (epoch:factor)")
    p.add_argument("--limit-train-batches", type=_batches, default=None, help="Trainer(limit_train_batches=...)")
    p.add_argument("--overfit-batches", type=_batches, default=0, help="Trainer(overfit_batches=...)")
    p.add_argument("--shuffle", action="store_true", help="shuffle the training DataLoader")
    p.add_argument("--workers", type=int, default=0, help="the training DataLoader's num_workers (persistent)")
    p.add_argument("--batchnorm", action="store_true", help="a BatchNorm1d after the first layer")
    p.add_argument("--swa", action="store_true",
                   help="StochasticWeightAveraging from epoch 1 (with --batchnorm it adds an epoch that refits BN)")
    p.add_argument("--clip", type=float, default=None, help="Trainer(gradient_clip_val=...), by value")
    p.add_argument("--val-samples", type=int, default=0, help="validate on this many samples (0: no validation)")
    p.add_argument("--val-interval", type=int, default=None, help="Trainer(val_check_interval=...) in batches")
    p.add_argument("--val-every-n-epoch", type=int, default=1, help="Trainer(check_val_every_n_epoch=...)")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--slow-replica", type=int, default=-1, help="this replica sleeps 5x --step-sleep per batch")
    p.add_argument("--sample-sleep", type=float, default=0.0,
                   help="seconds per sample of this replica's share, so a shrunk group steps slower")
    p.add_argument("--hold-for-regrow-from", type=int, default=-1,
                   help="from this global step on, a shrunk group waits for its replacement to be announced")
    p.add_argument("--then", default="", help="stages after fit, e.g. 'validate,test,predict', on the val samples")
    p.add_argument("--eval-sleep", type=float, default=0.0, help="seconds each test batch takes")
    p.add_argument("--fault", default=None)
    p.add_argument("--collective-timeout", type=float, default=60.0, help="MonarchStrategy(collective_timeout_s=...)")
    p.add_argument("--spares", type=int, default=0)
    p.add_argument("--events", default=None)
    p.add_argument("--unpicklable", action="store_true")
    p.add_argument("--resume", default=None, help="a checkpoint to resume from (fit's ckpt_path)")
    p.add_argument("--fsdp", type=int, default=0, help="MonarchFSDPStrategy with this many procs per replica")
    p.add_argument("--tp", type=int, default=1, help="MonarchFSDPStrategy(tensor_parallel_size=...)")
    p.add_argument("--skip-tp-plan", action="store_true", help="configure_model leaves the model as it is")
    p.add_argument("--checkpoint-every", type=int, default=0, help="ModelCheckpoint every N steps into DIR/ckpts")
    p.add_argument("--hosts-file", default=None, help="MonarchStrategy(hosts_file=...): replicas on host agents")
    p.add_argument("--num-nodes", type=int, default=1, help="Trainer(num_nodes=...): the hosts, --devices on each")
    p.add_argument("--store-host", default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    pl.seed_everything(0)
    global_batch = args.batch * args.devices * args.num_nodes // args.tp  # the procs of a TP group share samples
    cls = Unpicklable if args.unpicklable else Model
    model = cls(args.samples, args.epochs + args.swa, args.dim, global_batch * args.accumulate, args.step_sleep, args.out,
                args.slow_replica, args.devices * args.num_nodes // max(args.fsdp, 1), args.hold_for_regrow_from,
                args.batchnorm)
    model.sample_sleep = args.sample_sleep
    model.skip_tp_plan = args.skip_tp_plan
    if args.strategy == "single":
        strategy, devices, batch = "auto", 1, global_batch
    elif args.strategy in ("monarch-name", "ddp_spawn"):
        strategy, devices, batch = args.strategy.replace("-name", ""), args.devices, args.batch
    else:
        knobs = dict(min_replicas=args.min_replicas, fault=args.fault, events_path=args.events,
                     collective_timeout_s=args.collective_timeout,
                     checkpoint_dir=os.path.join(args.out, "ckpt"), join_timeout_s=120, spares=args.spares)
        if args.hosts_file:
            knobs.update(hosts_file=args.hosts_file, store_host=args.store_host, host_timeout_s=4)
        if args.fsdp:
            strategy = MonarchFSDPStrategy(procs_per_replica=args.fsdp, tensor_parallel_size=args.tp, **knobs)
        else:
            strategy = MonarchStrategy(**knobs)
        devices, batch = args.devices, args.batch
    callbacks = []
    if args.swa:
        callbacks.append(StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1))
    if args.accumulate_schedule:
        schedule = dict(map(int, kv.split(":")) for kv in args.accumulate_schedule.split(","))
        callbacks.append(GradientAccumulationScheduler(scheduling=schedule))
    if args.checkpoint_every:
        callbacks.append(ModelCheckpoint(dirpath=os.path.join(args.out, "ckpts"), filename="{step}",
                                         every_n_train_steps=args.checkpoint_every, save_top_k=-1))
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, num_nodes=args.num_nodes, strategy=strategy, max_epochs=args.epochs,
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate, gradient_clip_val=args.clip,
        limit_train_batches=args.limit_train_batches, overfit_batches=args.overfit_batches, gradient_clip_algorithm="value",
        val_check_interval=args.val_interval, check_val_every_n_epoch=args.val_every_n_epoch,
        logger=CSVLogger(args.out, name="logs"), log_every_n_steps=1, callbacks=callbacks,
        enable_checkpointing=args.checkpoint_every > 0,
        enable_progress_bar=False, enable_model_summary=False,
    )
    loader = DataLoader(Regression(args.samples, args.dim), batch_size=batch, shuffle=args.shuffle,
                        num_workers=args.workers, persistent_workers=args.workers > 0)
    val_loader = None
    if args.val_samples:
        val_loader = DataLoader(Regression(args.val_samples, args.dim, split=1), batch_size=16)
    trainer.fit(model, loader, val_loader, ckpt_path=args.resume)

    stages = {}
    model.eval_sleep = args.eval_sleep
    for stage in filter(None, args.then.split(",")):
        if stage == "predict":
            stages[stage] = torch.cat(trainer.predict(model, val_loader)).reshape(-1).tolist()
        else:
            stages[stage] = getattr(trainer, stage)(model, val_loader)
        stages[f"{stage}_fn"] = trainer.state.fn.value
    replica_checksums = getattr(trainer.strategy, "replica_checksums", {})
    result = {
        "checksum": weights_checksum(model),
        "replica_checksums": {str(k): v for k, v in replica_checksums.items()},
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "counts": (-model.seen.detach()).tolist(),
        "callback_metrics": sorted(trainer.callback_metrics),
        "state": trainer.state.status.value,
        "stages": stages,
    }
    ctx = worker_context()  # under monarch-run every replica runs this script and writes its own result
    suffix = f"-{ctx.replica_id}" if ctx else ""
    torch.save(model.state_dict(), os.path.join(args.out, f"weights{suffix}.pt"))
    with open(os.path.join(args.out, f"result{suffix}.json"), "w") as f:
        json.dump({**result, "replica": ctx.replica_id if ctx else None}, f)
    print(f"fit done: global_step {trainer.global_step} weights {result['checksum']} replicas {replica_checksums}",
          flush=True)


if __name__ == "__main__":
    main()
