"""The plain ElasticLoop for tests that must see a regrow: recipes/elastic_loop.py's checks, plus a hold.

With --hold-for-regrow-from K a group shrunk below --replicas waits, from step K on, until its grow is announced,
so a test sees the replacement join (on a host that came back, or after a recovery that itself failed) however
slowly it starts, and need not train for long just to outlast it. Each replica writes its progress and, at the
end, its step, weights checksum, per-epoch sample counts and host address (as the recipe's --out does).

For tests of the end of training: with --linger S each replica (or only --linger-replica R) stays S seconds in its
own code after its loop (an evaluation, an upload, a slow exit) before it writes its result; with --late R --late-s S
replica R sleeps S seconds after committing the last step, still inside its loop, so the others wait for it at the
end-of-training barrier. Each replica writes its pid to OUT/at-end-<id> once its last step is committed, and to
OUT/after-<id> once its loop has ended.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from _regrow import wait_for_announced_grow
from _toy import toy_problem
from torch import nn

from monarch_plugin import ElasticLoop, weights_checksum, worker_context

p = argparse.ArgumentParser()
p.add_argument("--samples", type=int, default=256)
p.add_argument("--batch", type=int, default=24)
p.add_argument("--epochs", type=int, default=4)
p.add_argument("--step-sleep", type=float, default=0.05)
p.add_argument("--replicas", type=int, required=True)
p.add_argument("--hold-for-regrow-from", type=int, default=-1)
p.add_argument("--linger", type=float, default=0.0)
p.add_argument("--linger-replica", type=int, default=None)
p.add_argument("--late", type=int, default=None)
p.add_argument("--late-s", type=float, default=0.0)
p.add_argument("--out", required=True)
args = p.parse_args()

x, y, model = toy_problem(args.samples)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
loop = ElasticLoop(model, optimizer, dataset_size=args.samples, global_batch_size=args.batch,
                   max_epochs=args.epochs, seed=0)
ctx = worker_context()
seen = torch.zeros(args.epochs, args.samples)


def publish(name: str, text: str) -> None:
    """OUT/name, whole or not at all: the test reads it while this replica runs (and may be killed mid-write)."""
    path = os.path.join(args.out, name)
    with open(f"{path}.tmp", "w") as f:
        f.write(text)
    os.replace(f"{path}.tmp", path)


def mark(name: str) -> None:
    publish(f"{name}-{ctx.replica_id}", str(os.getpid()))


for step in loop:
    if 0 <= args.hold_for_regrow_from <= step.number and step.num_replicas < args.replicas:
        wait_for_announced_grow(loop.tx)
    idx = torch.tensor(step.indices, dtype=torch.long)
    nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
    time.sleep(args.step_sleep)
    counts = torch.zeros(args.samples)
    counts[idx] = 1.0
    if step.commit(seen=counts):
        seen[step.epoch] += step.metrics["seen"].float()
        publish(f"progress-{ctx.replica_id}", str(loop.step))
        if loop.done():
            mark("at-end")
            if ctx.replica_id == args.late:
                time.sleep(args.late_s)
mark("after")
if args.linger_replica in (None, ctx.replica_id):
    time.sleep(args.linger)
publish(f"result-{ctx.replica_id}.json", json.dumps({
    "replica": ctx.replica_id, "step": loop.step, "checksum": weights_checksum(model), "pid": os.getpid(),
    "seen": seen.tolist(), "initial": ctx.initial, "host": ctx.bind_address}))
