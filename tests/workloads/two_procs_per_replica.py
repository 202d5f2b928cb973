"""Replicas of two procs each: a DDP-style gradient average *inside* the replica on the default group
(which must span only this replica's procs), and ElasticLoop across replicas.

The two procs are kept out of phase: local rank 1 spends most of each step's time between steps, local rank 0
inside the step. So an abort usually arrives while one proc is between steps and its sibling is mid-step: they
must still drop, rejoin and retry the same steps together, or their own all-reduces pair up across steps."""

import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from monarch_plugin import ElasticLoop, worker_context

out = sys.argv[1]
steps = int(sys.argv[2])
dist.init_process_group("gloo")  # env:// as monarch-run set it: this replica's procs only
ctx = worker_context()
assert dist.get_world_size() == ctx.procs_per_replica == 2, dist.get_world_size()
assert dist.get_rank() == ctx.local_rank

torch.manual_seed(0)
x = torch.randn(256, 8)
y = x.sum(-1, keepdim=True)
model = nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
loop = ElasticLoop(model, optimizer, dataset_size=256, global_batch_size=16, max_steps=steps)
seen = torch.zeros(steps * 16 // 256 + 1, 256)  # per epoch: how often each sample took part in a committed step
for step in loop:
    idx = torch.tensor(step.indices)
    nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
    for p in model.parameters():  # what DDP/FSDP do inside a replica
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    if ctx.local_rank == 0:
        time.sleep(0.02)
    mine = torch.zeros(256)
    mine[idx] = 1
    if step.commit(seen=mine):  # summed over this proc's counterparts in every replica
        seen[step.epoch] += step.metrics["seen"]
    with open(os.path.join(out, f"progress-{ctx.replica_id}"), "w") as f:
        f.write(str(loop.step))
    if ctx.local_rank == 1:
        time.sleep(0.2)
digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in model.state_dict().values())).hexdigest()
with open(os.path.join(out, f"result-{ctx.replica_id}-{ctx.local_rank}.json"), "w") as f:
    json.dump({"replica": ctx.replica_id, "local_rank": ctx.local_rank, "step": loop.step, "checksum": digest,
               "pid": os.getpid(), "seen": seen.tolist()}, f)
