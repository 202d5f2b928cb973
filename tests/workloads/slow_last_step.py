"""Replica 0 lingers after committing the last step, holding the others in the finish barrier while a
replacement for a dead replica becomes ready: the replacement must be told to stop, not wait forever."""

import json
import os
import sys
import time

import torch
from torch import nn

from monarch_plugin import ElasticLoop, worker_context

out, steps, linger = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
ctx = worker_context()
torch.manual_seed(0)
x = torch.randn(512, 8)
y = x.sum(-1, keepdim=True)
model = nn.Linear(8, 1)
loop = ElasticLoop(model, torch.optim.SGD(model.parameters(), lr=0.05), dataset_size=512,
                   global_batch_size=16, max_steps=steps)
for step in loop:
    idx = torch.tensor(step.indices)
    nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
    time.sleep(0.05)
    step.commit()
    with open(os.path.join(out, f"progress-{ctx.replica_id}"), "w") as f:
        f.write(str(loop.step))
    if loop.step == steps and ctx.replica_id == 0:
        time.sleep(linger)
with open(os.path.join(out, f"result-{ctx.replica_id}.json"), "w") as f:
    json.dump({"replica": ctx.replica_id, "step": loop.step,
               "weights": [t.tolist() for t in model.state_dict().values()]}, f)
