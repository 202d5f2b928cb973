"""An elastic torchtitan job of your own: llama3's debug model on 2 FSDP replicas, one of them SIGKILLed mid-run.

    python -m torchtitan.train --module recipes.torchtitan_llama3_elastic --config llama3_debug_sigkill

Run from the repo root (the replicas import this module from the same directory). That process is the
controller: it spawns 2 replicas of 2 procs (gloo on CPU, NCCL/RCCL on GPUs), each an FSDP group training
torchtitan's llama3 debug model. At step 8 every proc of replica 1 SIGKILLs itself; replica 0 drops that step,
redoes it alone on the same global batch and trains on; a replacement replica starts, heals from replica 0 at
a step boundary (each proc from the proc holding its shard) and joins; all finish `training.steps` with the
loss continuing where it was. The recovery is printed at the end; events go to runs/.../monarch_events.jsonl.

This file is the pattern for your own job: a torchtitan config function that returns `MonarchTrainer.Config`
with its `monarch` section set (here built on the integration's CPU debug config). Any field can still be
overridden from the command line: `--config llama3_debug_elastic` runs without the injected fault,
`--monarch.procs_per_replica 1 --training.local_batch_size 4` gives one proc per replica (same global batch).
"""

from __future__ import annotations

import dataclasses

from monarch_plugin.integrations.torchtitan import MonarchConfig, MonarchTrainer
from monarch_plugin.integrations.torchtitan.config_registry import llama3_debugmodel_cpu


def llama3_debug_elastic() -> MonarchTrainer.Config:
    """2 replicas x 2 FSDP procs of llama3's debug model, training on while at least one replica lives."""
    config = llama3_debugmodel_cpu()
    return dataclasses.replace(
        config,
        dump_folder="./runs/torchtitan_llama3_elastic",
        training=dataclasses.replace(config.training, steps=40),
        monarch=MonarchConfig(enable=True, replicas=2, min_replicas=1, procs_per_replica=2),
    )


def llama3_debug_sigkill() -> MonarchTrainer.Config:
    """The same job with replica 1 SIGKILLing itself at the start of step 8 (opt-in fault injection)."""
    config = llama3_debug_elastic()
    return dataclasses.replace(config, monarch=dataclasses.replace(config.monarch, fault="sigkill:replica=1:step=8"))
