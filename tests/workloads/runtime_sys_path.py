"""A user's script whose training function lives in a module found through a sys.path entry it adds at
runtime: `python runtime_sys_path.py DIR MODE --events PATH`, run from DIR.

It writes DIR/mods/<module>.py, does `sys.path.insert(0, "mods")` (relative, as scripts often do), imports
`train` from that module and runs it on two replicas with the real controller. MODE "present": the module
stays; the replicas can only import it through the sys.path and working directory the controller carries
to them. MODE "gone": the module is deleted before the replicas start, so unpickling `train` in a replica
raises ModuleNotFoundError. Writes DIR/out/result.json: the replicas' return values, or the controller's
error (then exits 1).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import sys

from monarch_plugin import ElasticConfig, ElasticController, ReplicaCodeError, Target

MODULE = '''
import os

import torch
from torch import nn

from monarch_plugin import ElasticLoop, weights_checksum, worker_context


def train(steps):
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = x.sum(-1, keepdim=True)
    model = nn.Linear(4, 1)
    loop = ElasticLoop(model, torch.optim.SGD(model.parameters(), lr=0.05), dataset_size=64,
                       global_batch_size=8, max_steps=steps)
    for step in loop:
        idx = torch.tensor(step.indices)
        nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        step.commit()
    return {"replica": worker_context().replica_id, "step": loop.step, "checksum": weights_checksum(model),
            "cwd": os.getcwd(), "module_file": __file__}
'''

NAMES = {"present": "runtime_models", "gone": "vanished_models"}

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("mode", choices=sorted(NAMES))
    p.add_argument("--events", required=True)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()

    name = NAMES[args.mode]
    os.makedirs(os.path.join(args.dir, "mods"))
    with open(os.path.join(args.dir, "mods", f"{name}.py"), "w") as f:
        f.write(MODULE)
    sys.path.insert(0, "mods")
    train = importlib.import_module(name).train
    if args.mode == "gone":
        shutil.rmtree(os.path.join(args.dir, "mods"))

    out = os.path.join(args.dir, "out", "result.json")
    config = ElasticConfig(replicas=2, join_timeout_s=60, events_path=args.events)
    try:
        result = ElasticController(config, Target.function(train, args.steps)).run()
    except ReplicaCodeError as e:
        with open(out, "w") as f:
            json.dump({"error": type(e).__name__, "message": str(e)}, f)
        sys.exit(1)
    with open(out, "w") as f:
        json.dump({"values": [v[0] for v in result.values.values()]}, f)
