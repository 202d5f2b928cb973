"""A torchtitan job for the tests: the integration's CPU debug config, with a trainer that reports what it did.

Selected as `--module torchtitan_probe --config llama3_probe` (this folder on PYTHONPATH). Each proc appends one
JSON line per committed step to `<dump_folder>/probe/steps-<replica>-<local rank>.jsonl` (step, generation, live
replicas, loss, the stream positions it trained) and, when training ends, writes `result-<replica>-<local
rank>.json` with the step reached and a checksum of its shards of the weights and optimizer state (the procs
holding the same shard in different replicas must agree). `--probe.shrunk_steps N` makes survivors of a death
train N steps on their own and then wait at a step boundary until the replacement is announced, so a test
sees shrink, training on survivors, regrow and heal in one short run however slowly the replacement starts.
`--probe.step_sleep S` sleeps S seconds after each step, so a test can act between two checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field, fields, replace

import torch
from _regrow import wait_for_announced_grow

from monarch_plugin.integrations.torchtitan import MonarchTrainer
from monarch_plugin.integrations.torchtitan.config_registry import llama3_debugmodel_elastic


@dataclass(kw_only=True, slots=True)
class Probe:
    shrunk_steps: int = -1
    """Steps the survivors of a death train alone before waiting for the replacement (-1: never wait)."""
    step_sleep: float = 0.0
    """Seconds slept after each step, as a larger model's step would take."""


class ProbeTrainer(MonarchTrainer):
    @dataclass(kw_only=True, slots=True)
    class Config(MonarchTrainer.Config):
        probe: Probe = field(default_factory=Probe)
        """What the test wants the trainer to do besides training."""

    def train_step(self, data_iterator):
        self._wait_for_regrow()
        super().train_step(data_iterator)
        if self.last_commit is not None and self.last_commit.step == self.step:
            record = {**vars(self.last_commit), "pid": os.getpid()}
            with open(self._path("steps", "jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")
        time.sleep(self.config.probe.step_sleep)

    def _wait_for_regrow(self) -> None:
        tx, wanted = self._tx, self.config.monarch.replicas
        if self.config.probe.shrunk_steps < 0 or tx is None or tx.world >= wanted:
            return
        if self._shrunk_steps() >= self.config.probe.shrunk_steps:
            wait_for_announced_grow(tx)

    def _shrunk_steps(self) -> int:
        if not os.path.exists(self._path("steps", "jsonl")):
            return 0
        with open(self._path("steps", "jsonl")) as f:
            return sum(json.loads(line)["replicas"] < self.config.monarch.replicas for line in f)

    def train(self):
        super().train()
        digest = hashlib.sha256()
        for part in self.model_parts:
            for tensor in part.state_dict().values():
                digest.update(_local(tensor).detach().cpu().numpy().tobytes())
        for optimizer in self.optimizers.optimizers:
            for state in optimizer.state.values():
                for value in state.values():
                    digest.update(_local(value).detach().cpu().numpy().tobytes())
        with open(self._path("result", "json"), "w") as f:
            json.dump({"step": self.step, "checksum": digest.hexdigest(), "pid": os.getpid(),
                       "ntokens_seen": self.ntokens_seen}, f)

    def _path(self, kind: str, ext: str) -> str:
        ctx = self._tx.ctx
        folder = os.path.join(self.config.dump_folder, "probe")
        os.makedirs(folder, exist_ok=True)
        return os.path.join(folder, f"{kind}-{ctx.replica_id}-{ctx.local_rank}.{ext}")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def llama3_probe() -> ProbeTrainer.Config:
    """The integration's elastic debug config, its model cut from 6 transformer blocks to 2: what the tests check
    does not depend on depth, and each block's FSDP, TP and CP collectives are most of a step on 2 cores."""
    base = llama3_debugmodel_elastic()
    spec = base.model_spec
    model = replace(spec.model, layers=spec.model.layers[:2])
    return ProbeTrainer.Config(**{**{f.name: getattr(base, f.name) for f in fields(base) if f.init},
                                  "model_spec": replace(spec, model=model)})
