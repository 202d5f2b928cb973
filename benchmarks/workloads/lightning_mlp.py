"""The goodput benchmark's workload through Lightning: mlp.py's MLP as a LightningModule, two ways.

    python lightning_mlp.py --strategy monarch --steps N --out DIR        # the process is the controller
    torchrun --max-restarts R ... lightning_mlp.py --strategy ddp --ckpt-every K --steps N --out DIR

`monarch`: `Trainer(strategy=MonarchStrategy(...))` on 4 devices, elastic down to 2, events in DIR/events.jsonl.
`ddp`: Lightning's own DDP under torchrun (Lightning reads torchrun's environment), `ModelCheckpoint` every K
steps, and each (re)start resumes from the newest one (`fit(ckpt_path="last")`): what a Lightning user without the
plugin does. Each worker appends "<step> <unix time>" per trained step (0-based, as mlp.py) to
DIR/steps-<id>.txt, <id> the replica (monarch) or "<rank>-<restart>" (ddp), which also writes DIR/pid-<id>.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from mlp import SIZES, build  # a script beside it: its folder is on the path

DEVICES, MIN_REPLICAS, BATCH = 4, 2, 8  # a global batch of 32, as mlp.py's


class StepLog(pl.Callback):
    def __init__(self, out: str, strategy: str):
        self.out, self.strategy = out, strategy

    def _ident(self, trainer) -> str:
        if self.strategy == "monarch":
            from monarch_plugin import worker_context

            return str(worker_context().replica_id)
        return f"{trainer.global_rank}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"

    def on_train_start(self, trainer, module):
        if self.strategy == "ddp":
            Path(self.out, f"pid-{self._ident(trainer)}").write_text(str(os.getpid()))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        with open(os.path.join(self.out, f"steps-{self._ident(trainer)}.txt"), "a") as f:
            f.write(f"{trainer.global_step - 1} {time.time()}\n")


class MLP(pl.LightningModule):
    """Takes the built net, so the pickled module (sent to Monarch replicas) needs no `mlp` import."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def setup(self, stage):
        torch.set_num_threads(1)  # one core per device, on both sides

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-4)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", choices=("monarch", "ddp"), required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--ckpt-every", type=int, default=0, help="ddp: ModelCheckpoint every K steps (0: none)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    pl.seed_everything(0)
    width = SIZES["10m"][0]
    x = torch.randn(BATCH * DEVICES * (args.steps + 1), width)
    loader = DataLoader(TensorDataset(x, x.flip(-1)), batch_size=BATCH)
    callbacks: list[pl.Callback] = [StepLog(args.out, args.strategy)]
    if args.strategy == "monarch":
        from monarch_plugin.integrations.lightning import MonarchStrategy

        strategy = MonarchStrategy(min_replicas=MIN_REPLICAS, max_restarts=1000,
                                   events_path=os.path.join(args.out, "events.jsonl"))
    else:
        strategy = "ddp"
        # torchrun's workers share its agent's store across restarts, and on torch 2.13 a restarted gloo group
        # reads the dead round's addresses from it (connectFullMesh: connection refused, every restart): each
        # round's rank 0 hosts a store of its own instead, on a port of that round's.
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
        os.environ["MASTER_PORT"] = str(int(os.environ["MASTER_PORT"]) + 1 + restart % 1000)
        if args.ckpt_every:
            callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=os.path.join(args.out, "ckpt"), save_last=True,
                                                          every_n_train_steps=args.ckpt_every, save_top_k=0))
    trainer = pl.Trainer(accelerator="cpu", devices=DEVICES, strategy=strategy, max_steps=args.steps, max_epochs=1,
                         logger=False, enable_checkpointing=bool(args.ckpt_every), enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks)
    last = os.path.join(args.out, "ckpt", "last.ckpt")
    trainer.fit(MLP(build("10m")), loader, ckpt_path=last if args.strategy == "ddp" and os.path.exists(last) else None)


if __name__ == "__main__":
    main()
