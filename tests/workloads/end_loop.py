"""The plain ElasticLoop for tests of the end of training: a replica that is slow to reach the end, or that runs code
after its loop (an evaluation, an upload, a slow exit) while the others have returned.

`--late R --late-s S`: replica R sleeps S seconds after committing the last step, still inside its loop, so the
others wait for it at the end-of-training barrier. `--linger R --linger-s S`: replica R sleeps S seconds after its
loop ended. Each replica writes DIR/at-end-<id> once its last step is committed, DIR/after-<id> once its loop has
ended, and DIR/result-<id>.json (step, weights checksum, per-epoch sample counts) before it returns.
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
p.add_argument("--batch", type=int, default=24)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--step-sleep", type=float, default=0.02)
p.add_argument("--late", type=int, default=None)
p.add_argument("--late-s", type=float, default=0.0)
p.add_argument("--linger", type=int, default=None)
p.add_argument("--linger-s", type=float, default=0.0)
p.add_argument("--out", required=True)
args = p.parse_args()

x, y, model = toy_problem(args.samples)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
loop = ElasticLoop(model, optimizer, dataset_size=args.samples, global_batch_size=args.batch,
                   max_epochs=args.epochs, seed=0)
ctx = worker_context()
seen = torch.zeros(args.epochs, args.samples)


def mark(name: str) -> None:
    with open(os.path.join(args.out, f"{name}-{ctx.replica_id}"), "w") as f:
        f.write(str(os.getpid()))


for step in loop:
    idx = torch.tensor(step.indices, dtype=torch.long)
    nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
    time.sleep(args.step_sleep)
    counts = torch.zeros(args.samples)
    counts[idx] = 1.0
    if step.commit(seen=counts):
        seen[step.epoch] += step.metrics["seen"].float()
        if loop.done():
            mark("at-end")
            if ctx.replica_id == args.late:
                time.sleep(args.late_s)
mark("after")
if ctx.replica_id == args.linger:
    time.sleep(args.linger_s)
with open(os.path.join(args.out, f"result-{ctx.replica_id}.json"), "w") as f:
    json.dump({"replica": ctx.replica_id, "step": loop.step, "checksum": weights_checksum(model),
               "seen": seen.tolist()}, f)
