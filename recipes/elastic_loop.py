"""A plain PyTorch training loop made elastic with `ElasticLoop`; the demo that README runs.

    monarch-run --replicas 3 --min-replicas 2 --fault sigkill:replica=1:step=15 recipes/elastic_loop.py

One replica SIGKILLs itself at step 15; the other two drop that step, shrink to two, keep training; a
replacement is spawned, healed from a live peer, and joins. Every replica prints the same final
checksum. Also runs without monarch-run: `python recipes/elastic_loop.py`.

The same script trains semi-synchronously (DiLoCo: each replica takes 8 steps on its own, then they sync), where the
kill costs only the dead replica's steps since the last sync:

    monarch-run --replicas 3 --sync-every 8 --fault sigkill:replica=1:step=15 recipes/elastic_loop.py

With --out DIR each replica writes what the tests check: its final step, a checksum of its weights and
how many times each sample of each epoch took part in a committed step.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch import nn

from monarch_plugin import ElasticLoop, weights_checksum, worker_context


def make_data(n: int, dim: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, 1, generator=g)
    return x, x @ w + 0.1 * torch.randn(n, 1, generator=g)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch", type=int, default=32, help="global batch size")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--step-sleep", type=float, default=0.05, help="extra seconds per step, standing in for a bigger model")
    p.add_argument("--batchnorm", action="store_true", help="a BatchNorm1d in the model (its statistics are averaged at commit)")
    p.add_argument("--out", default=None, help="directory for per-replica results (tests)")
    args = p.parse_args()

    torch.manual_seed(0)
    x, y = make_data(args.samples, args.dim)
    norm = [nn.BatchNorm1d(args.hidden)] if args.batchnorm else []
    model = nn.Sequential(nn.Linear(args.dim, args.hidden), *norm, nn.Tanh(), nn.Linear(args.hidden, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.9)
    loop = ElasticLoop(model, optimizer, scheduler=scheduler, dataset_size=args.samples,
                       global_batch_size=args.batch, max_epochs=args.epochs, seed=0)

    ctx = worker_context()
    replica = ctx.replica_id if ctx else 0
    seen = torch.zeros(args.epochs, args.samples)
    counted = None

    def count_sync() -> None:
        """Semi-synchronous: a sync commits what the replicas learned since the one before, between two steps."""
        nonlocal counted
        sync = loop.last_sync
        if sync is None or sync is counted:
            return
        counted = sync
        seen[sync.epoch] += sync.metrics["seen"].float()
        if loop.rank == 0:
            mean = sync.metrics["loss_sum"] / sync.metrics["samples"]
            print(f"[replica {replica}] sync {sync.number:3d} at step {sync.step:3d} epoch {sync.epoch} loss "
                  f"{mean:.4f} replicas {loop.num_replicas}", flush=True)

    for step in loop:
        count_sync()
        idx = torch.tensor(step.indices, dtype=torch.long)
        loss = nn.functional.mse_loss(model(x[idx]), y[idx])
        loss.backward()
        if args.step_sleep:
            time.sleep(args.step_sleep)
        counts = torch.zeros(args.samples)
        counts[idx] = 1.0
        n = torch.tensor(float(len(idx)))
        if not step.commit(loss_sum=loss.detach() * n, samples=n, seen=counts):
            print(f"[replica {replica}] step {step.number} dropped (generation {step.generation}); retrying",
                  flush=True)
            continue
        if loop.sync_every == 1:  # synchronous: the step's metrics are every replica's (semi: this one's own)
            seen[step.epoch] += step.metrics["seen"].float()
        if loop.sync_every == 1 and step.rank == 0 and step.number % 5 == 0:
            mean = step.metrics["loss_sum"] / step.metrics["samples"]
            print(f"[replica {replica}] step {step.number:3d} epoch {step.epoch} loss {mean:.4f} "
                  f"replicas {step.num_replicas}", flush=True)
        if args.out:
            with open(os.path.join(args.out, f"progress-{replica}"), "w") as f:
                f.write(str(loop.step))

    count_sync()
    digest = weights_checksum(model)
    print(f"[replica {replica}] done at step {loop.step}: weights {digest}", flush=True)
    if args.out:
        result = {"replica": replica, "step": loop.step, "checksum": digest, "pid": os.getpid(),
                  "seen": seen.tolist(), "initial": bool(ctx.initial) if ctx else True}
        with open(os.path.join(args.out, f"result-{replica}.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
