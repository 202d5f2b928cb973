"""Step time of one LightningModule under `strategy="ddp"` and `strategy="monarch"`, side by side.

    python -m benchmarks.overhead.lightning_step --devices 2 --steps 100 --repeats 3 --out benchmarks/results

What the elastic strategy costs a failure-free Lightning run: the same module (benchmarks/workloads/mlp.py's MLP),
data, batch and optimizer, on the same CPU devices, once with Lightning's own DDP and once with
`MonarchStrategy`. One invocation runs both sides one after the other (each as its own `python -m` process, as a
user would start it: DDP's launcher re-executes that command for its other ranks, the Monarch strategy makes
it the controller), alternating `--repeats` times, so the ratio shares one machine state. Rank 0 of each run
appends "<global step> <unix time>" per step to its steps.txt; a run's step time is the median interval
after a warm-up, a side's the median over its runs. Writes <out>/lightning_overhead.json and prints a markdown
table (pasted into docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from benchmarks.harness import REPO, add_out, alternate, alternate_table, write_json


def run_side(side: str, devices: int, steps: int, size: str, batch: int, work: Path) -> None:
    """One training run; what each rank executes (DDP's launcher runs this same command again per rank)."""
    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import monarch_plugin.integrations.lightning  # noqa: F401 - registers strategy="monarch"
    from benchmarks.workloads.mlp import SIZES, build

    width = SIZES[size][0]

    class StepClock(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.is_global_zero:
                with open(work / "steps.txt", "a") as f:
                    f.write(f"{trainer.global_step} {time.time()}\n")

    class MLP(pl.LightningModule):
        """Takes the built net, so the pickled module (sent to Monarch replicas) needs no `mlp` import."""

        def __init__(self, net: nn.Module):
            super().__init__()
            self.net = net

        def setup(self, stage):
            torch.set_num_threads(1)  # in every rank's own process, on both sides: one core per device

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    pl.seed_everything(0)
    x = torch.randn(batch * devices * (steps + 1), width)
    loader = DataLoader(TensorDataset(x, x.flip(-1)), batch_size=batch)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=side, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[StepClock()])
    trainer.fit(MLP(build(size)), loader)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--size", choices=("10m", "100m"), default="10m")
    p.add_argument("--batch", type=int, default=16, help="per device, as Lightning's DataLoader batch_size")
    p.add_argument("--repeats", type=int, default=3, help="runs of each side, alternating")
    p.add_argument("--side", choices=("ddp", "monarch"), help="run one side only (the driver uses this)")
    p.add_argument("--work", default="/tmp/monarch_plugin_lightning_bench")
    add_out(p)
    args = p.parse_args()
    work = Path(args.work)
    if args.side:
        run_side(args.side, args.devices, args.steps, args.size, args.batch, work)
        return
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    side_args = ["--devices", str(args.devices), "--steps", str(args.steps), "--size", args.size, "--batch",
                 str(args.batch)]
    commands = {side: [sys.executable, "-m", __spec__.name, "--side", side, *side_args, "--work", "."]
                for side in ("ddp", "monarch")}
    # Each run's folder is its working directory: the checkout goes on its path, for `-m` and DDP's re-executions.
    runs = alternate(commands, args.repeats, args.steps, work, {"PYTHONPATH": str(REPO)})
    results = {"devices": args.devices, "steps": args.steps, "size": args.size, "batch_per_device": args.batch,
               "repeats": args.repeats, **runs}
    header = f"{args.size} MLP, {args.devices} CPU devices, batch {args.batch}/device, {args.steps} steps"
    table = alternate_table(results, {"ddp": '`strategy="ddp"`', "monarch": '`strategy="monarch"`'}, header)
    write_json(args.out, "lightning_overhead", results)
    print(table)


if __name__ == "__main__":
    main()
