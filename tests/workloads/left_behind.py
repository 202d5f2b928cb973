"""What runs leave in the user's process: `python left_behind.py OUT`.

One process runs the runtime's Python API twice (`ElasticController(...).run()`), then a Lightning Trainer's
`fit`, `validate`, `test`, `predict` and `fit` again, and after each compares the process with what it was before
the first: its threads, environment, signal handlers and open file descriptors. Writes OUT/result.json: per run,
what differs (empty when nothing was left), and the run's result, so a test sees that the run really trained.
Each stage profiles with Lightning's `SimpleProfiler` into OUT/profiler, which ddp_spawn fills with a file per rank,
and has a callback whose state (which the first generation's heal carries) holds a path.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import sys
import threading

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.profilers import SimpleProfiler
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from monarch_plugin import ElasticConfig, ElasticController, Target, worker_context
from monarch_plugin.integrations.lightning import MonarchStrategy


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch, i):
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, i):
        x, y = batch
        self.log("loss", nn.functional.mse_loss(self.layer(x), y))

    test_step = validation_step

    def predict_step(self, batch, i):
        return self.layer(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def replica_id() -> int:
    return worker_context().replica_id


def process_state() -> dict:
    """What a run must leave as it found it."""
    handlers = {}
    for sig in signal.valid_signals():
        if isinstance(sig, signal.Signals) and sig not in (signal.SIGKILL, signal.SIGSTOP):
            handlers[sig.name] = repr(signal.getsignal(sig))
    return {"threads": sorted(t.name for t in threading.enumerate()), "environment": dict(os.environ),
            "fds": {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                    if os.path.exists(f"/proc/self/fd/{fd}")},
            "signal handlers": handlers}


class Remembers(Callback):
    """State holding a path, as Lightning's `SpikeDetection` keeps its `exclude_batches_path`."""

    def __init__(self, where: str):
        self.where = pathlib.Path(where)

    def state_dict(self) -> dict:
        return {"where": self.where}

    def load_state_dict(self, state: dict) -> None:
        self.where = state["where"]


def differences(before: dict, after: dict) -> dict:
    """Per kind, each entry that was added, removed or changed: {name: [before, after]}."""
    found = {}
    for kind in before:
        if isinstance(before[kind], dict):
            changed = {k: [before[kind].get(k), after[kind].get(k)] for k in {*before[kind], *after[kind]}
                       if before[kind].get(k) != after[kind].get(k)}
        else:
            changed = {k: [k in before[kind], k in after[kind]] for k in {*before[kind], *after[kind]}
                       if (k in before[kind]) != (k in after[kind])}
        if changed:
            found[kind] = changed
    return found


def main() -> None:
    out = sys.argv[1]
    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    runs = []
    before = process_state()
    for i in range(2):
        config = ElasticConfig(replicas=2, events_path=os.path.join(out, f"api-{i}.jsonl"))
        result = ElasticController(config, Target.function(replica_id)).run()
        runs.append({"run": f"api {i}", "result": sorted(v[0] for v in result.values.values()),
                     "left": differences(before, process_state())})
    for stage in ("fit", "validate", "test", "predict", "fit"):
        profiler = SimpleProfiler(os.path.join(out, "profiler"), "profiler")
        trainer = pl.Trainer(strategy=MonarchStrategy(), devices=2, accelerator="cpu", max_epochs=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             default_root_dir=out, profiler=profiler,
                             callbacks=[Remembers(out)])
        returned = getattr(trainer, stage)(Regressor(), DataLoader(data, batch_size=4))
        runs.append({"run": stage, "result": trainer.global_step if stage == "fit" else len(returned),
                     "left": differences(before, process_state())})
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(runs, f)


if __name__ == "__main__":
    main()
