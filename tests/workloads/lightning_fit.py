"""The Lightning training script the tests run as a subprocess: `python lightning_fit.py --out DIR ...`.

A tiny regressor plus a per-epoch sample counter `seen` that only the real gradient path can move: each
replica's loss adds the mean of `seen[epoch, idx]` over its share, the strategy weights that share by its
fraction of the global batch, and SGD with lr equal to the global batch then subtracts exactly 1 for every
time a sample took part in a committed step. `-seen` in the final weights is therefore the per-epoch count of
committed sightings of each sample. Momentum on the regressor and a step-wise LR schedule make the heal of
optimizer and scheduler state matter.

Writes DIR/result.json (controller's view: checksum, per-replica checksums, global_step, counts) and
DIR/weights.pt; each replica writes DIR/progress-<replica> after every step so a test knows when to kill it.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset

from monarch_plugin import worker_context
from monarch_plugin.integrations.lightning import MonarchStrategy
from monarch_plugin.integrations.lightning.strategy import weights_checksum


class Regression(Dataset):
    def __init__(self, n: int, dim: int):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g)
        w = torch.randn(dim, 1, generator=g)
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
    def __init__(self, samples: int, epochs: int, dim: int, global_batch: int, step_sleep: float, out: str):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, 16), nn.Tanh(), nn.Linear(16, 1))
        self.seen = nn.Parameter(torch.zeros(epochs, samples))
        self.global_batch = global_batch
        self.step_sleep = step_sleep
        self.out = out

    def training_step(self, batch, batch_idx):
        idx, x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.step_sleep:
            time.sleep(self.step_sleep)
        self.log("train_loss", loss)
        return loss + self.seen[self.current_epoch, idx].mean()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        ctx = worker_context()
        if ctx is not None:
            with open(os.path.join(self.out, f"progress-{ctx.replica_id}"), "w") as f:
                f.write(str(self.trainer.global_step))

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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="monarch", help="monarch (by instance), monarch-name, or single")
    p.add_argument("--devices", type=int, default=3)
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--samples", type=int, default=240)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--batch", type=int, default=8, help="per-replica batch size (global = batch x devices)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--fault", default=None)
    p.add_argument("--spares", type=int, default=0)
    p.add_argument("--events", default=None)
    p.add_argument("--unpicklable", action="store_true")
    p.add_argument("--resume", default=None, help="a checkpoint to resume from (fit's ckpt_path)")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    pl.seed_everything(0)
    global_batch = args.batch * args.devices
    cls = Unpicklable if args.unpicklable else Model
    model = cls(args.samples, args.epochs, args.dim, global_batch, args.step_sleep, args.out)
    if args.strategy == "single":
        strategy, devices, batch = "auto", 1, global_batch
    elif args.strategy == "monarch-name":
        strategy, devices, batch = "monarch", args.devices, args.batch
    else:
        strategy = MonarchStrategy(min_replicas=args.min_replicas, fault=args.fault, events_path=args.events,
                                   checkpoint_dir=os.path.join(args.out, "ckpt"), join_timeout_s=120,
                                   spares=args.spares)
        devices, batch = args.devices, args.batch
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_epochs=args.epochs,
        logger=CSVLogger(args.out, name="logs"), log_every_n_steps=1, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    loader = DataLoader(Regression(args.samples, args.dim), batch_size=batch, shuffle=False)
    trainer.fit(model, loader, ckpt_path=args.resume)

    replica_checksums = getattr(trainer.strategy, "replica_checksums", {})
    result = {
        "checksum": weights_checksum(model),
        "replica_checksums": {str(k): v for k, v in replica_checksums.items()},
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "counts": (-model.seen.detach()).tolist(),
        "callback_metrics": sorted(trainer.callback_metrics),
        "state": trainer.state.status.value,
    }
    torch.save(model.state_dict(), os.path.join(args.out, "weights.pt"))
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump(result, f)
    print(f"fit done: global_step {trainer.global_step} weights {result['checksum']} replicas {replica_checksums}",
          flush=True)


if __name__ == "__main__":
    main()
