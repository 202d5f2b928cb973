"""The plain ElasticLoop with Adam and an LR schedule, logging every committed step: for resume and hang tests.

The generation's rank 0 (its local rank 0) appends one JSON line per committed step to DIR/steps.jsonl: the step, its epoch, the
global batch it trained (every replica's share, summed in the step's own transaction), the global-batch mean loss
and the live replica count. Run it under `monarch-run --checkpoint-steps N [--resume auto]`; DIR/result-<id>.json
holds each replica's final step and weights checksum. `--straggler R --straggle S` makes replica R slow but alive.
`--fsdp` shards the model over the replica's procs (`--procs-per-replica`) with FSDP2 on their default group.
A test pins when things happen with files: `--hold R:FILE` keeps replica R from getting ready until FILE exists,
`--pause STEP:FILE` holds every replica at step STEP while FILE exists.
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
from monarch_plugin.storage.checksum import state_checksum

p = argparse.ArgumentParser()
p.add_argument("--samples", type=int, default=240)
p.add_argument("--batch", type=int, default=24)
p.add_argument("--epochs", type=int, default=4)
p.add_argument("--step-sleep", type=float, default=0.1)
p.add_argument("--straggler", type=int, default=None, help="this replica is slow but alive: it sleeps --straggle "
               "seconds more in each step before --straggle-until")
p.add_argument("--straggle", type=float, default=0.0)
p.add_argument("--straggle-until", type=int, default=0)
p.add_argument("--batchnorm", action="store_true", help="a BatchNorm1d in the model, whose statistics a forward moves")
p.add_argument("--dropout", action="store_true", help="a Dropout in the model, which draws from the RNG in a forward")
p.add_argument("--fsdp", action="store_true", help="fully_shard the model over this replica's procs")
p.add_argument("--hold", default=None, metavar="R:FILE", help="replica R builds its loop (gets ready to join) only "
               "once FILE exists: a replacement as slow to get ready as the test needs")
p.add_argument("--pause", default=None, metavar="STEP:FILE", help="every replica waits at the start of step STEP "
               "while FILE exists: a run kept from ending before what the test waits for has happened")
p.add_argument("--out", required=True)
args = p.parse_args()
ctx = worker_context()
if args.hold:
    held, release = args.hold.split(":", 1)
    while ctx.replica_id == int(held) and not os.path.exists(release):
        time.sleep(0.05)

x, y, model = toy_problem(args.samples, args.batchnorm)
if args.dropout:
    model.insert(len(model) - 1, nn.Dropout(0.1))
if args.fsdp:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")  # env:// as monarch-run set it: this replica's procs only
    fully_shard(model)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.8)
loop = ElasticLoop(model, optimizer, scheduler=scheduler, dataset_size=args.samples, global_batch_size=args.batch,
                   max_epochs=args.epochs, seed=0)
pause_step, pause = args.pause.split(":", 1) if args.pause else ("-1", "")
for step in loop:
    while step.number == int(pause_step) and os.path.exists(pause):
        time.sleep(0.05)
    idx = torch.tensor(step.indices, dtype=torch.long)
    loss = nn.functional.mse_loss(model(x[idx]), y[idx])  # this share's mean: the runtime weighs the shares
    loss.backward()
    time.sleep(args.step_sleep)
    if ctx.replica_id == args.straggler and step.number < args.straggle_until:
        time.sleep(args.straggle)
    counts = torch.zeros(args.samples)
    counts[idx] = 1.0
    loss_sum = loss.detach() * len(idx)
    if args.fsdp:  # the replica's procs' together: the step's metrics sum lane k over the replicas
        dist.all_reduce(counts)
        dist.all_reduce(loss_sum)
    if step.commit(loss_sum=loss_sum, seen=counts) and step.rank == 0 and ctx.local_rank == 0:
        batch = step.metrics["seen"].nonzero().flatten().tolist()
        record = {"step": step.number, "epoch": step.epoch, "batch": batch, "replicas": step.num_replicas,
                  "loss": step.metrics["loss_sum"] / len(batch)}
        with open(os.path.join(args.out, "steps.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
checksum = (state_checksum({k: v.full_tensor() for k, v in model.state_dict().items()}) if args.fsdp
            else weights_checksum(model))
if ctx.local_rank == 0:
    with open(os.path.join(args.out, f"result-{ctx.replica_id}.json"), "w") as f:
        json.dump({"replica": ctx.replica_id, "step": loop.step, "checksum": checksum}, f)
