"""The plain ElasticLoop trained semi-synchronously (`monarch-run --sync-every H [--semi-sync local_sgd]`), recording each
sync: for the DiLoCo / LocalSGD tests.

The toy problem with Adam as the inner optimizer, the shares of `ElasticSampler(samples, seed=0)`'s batches. After
each sync every replica appends one JSON line to DIR/syncs-<id>.jsonl: the sync's number, the committed steps, the
replicas, a checksum of its parameters and the samples the sync's metrics say the synced model learned; with
`--params`, the parameters themselves go to DIR/params-<id>-<sync>.pt. DIR/result-<id>.json holds its final step,
sync count and checksum, as `logged_loop.py`'s does. `--pause STEP:FILE` holds every replica at the start of step
STEP while FILE exists (a test's moment to act between two syncs); `--inner sgd` trains with plain SGD, whose
replicas hold no optimizer state of their own; `--scheduler` decays its learning rate every 3 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from _toy import toy_problem
from torch import nn

from monarch_plugin import ElasticLoop, weights_checksum, worker_context

p = argparse.ArgumentParser()
p.add_argument("--samples", type=int, default=96)
p.add_argument("--batch", type=int, default=16)
p.add_argument("--epochs", type=int, default=None)
p.add_argument("--steps", type=int, default=None)
p.add_argument("--step-sleep", type=float, default=0.0)
p.add_argument("--params", action="store_true", help="save the parameters after each sync")
p.add_argument("--pause", default=None, metavar="STEP:FILE")
p.add_argument("--inner", choices=("adam", "sgd"), default="adam")
p.add_argument("--scheduler", action="store_true")
p.add_argument("--out", required=True)
args = p.parse_args()
ctx = worker_context()
rid = ctx.replica_id

x, y, model = toy_problem(args.samples)
optimizer = (torch.optim.Adam(model.parameters(), lr=1e-2) if args.inner == "adam" else
             torch.optim.SGD(model.parameters(), lr=5e-2))
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.8) if args.scheduler else None
loop = ElasticLoop(model, optimizer, scheduler=scheduler, dataset_size=args.samples, global_batch_size=args.batch,
                   max_epochs=args.epochs, max_steps=args.steps, seed=0)
pause_step, pause = args.pause.split(":", 1) if args.pause else ("-1", "")
syncs = -1


def record() -> None:
    """The sync committed since the last look (at most one between two steps)."""
    global syncs
    sync = loop.last_sync
    if sync is None or sync.number == syncs:
        return
    syncs = sync.number
    learned = sync.metrics["seen"].nonzero().flatten().tolist()
    line = {"sync": syncs, "step": sync.step, "epoch": sync.epoch, "world": loop.num_replicas,
            "checksum": weights_checksum(model), "learned": learned, "counts": sorted(set(sync.metrics["seen"].tolist()))}
    with open(os.path.join(args.out, f"syncs-{rid}.jsonl"), "a") as f:
        f.write(json.dumps(line) + "\n")
    if args.params:
        torch.save({n: q.detach().clone() for n, q in model.named_parameters()},
                   os.path.join(args.out, f"params-{rid}-{syncs}.pt"))


for step in loop:
    record()
    while step.number == int(pause_step) and not step.extra and os.path.exists(pause):
        time.sleep(0.05)
    idx = torch.tensor(step.indices, dtype=torch.long)
    loss = nn.functional.mse_loss(model(x[idx]), y[idx])
    loss.backward()
    time.sleep(args.step_sleep)
    seen = torch.zeros(args.samples)
    seen[idx] = 1.0
    step.commit(loss_sum=loss.detach() * len(idx), seen=seen)
    with open(os.path.join(args.out, f"progress-{rid}"), "w") as f:
        f.write(str(step.number))
record()

with open(os.path.join(args.out, f"result-{rid}.json"), "w") as f:
    json.dump({"replica": rid, "step": loop.step, "syncs": loop.syncs, "checksum": weights_checksum(model),
               "pid": os.getpid(), "initial": bool(ctx.initial)}, f)
