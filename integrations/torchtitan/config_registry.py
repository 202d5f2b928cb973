"""Config functions for `--module monarch_plugin.integrations.torchtitan --config <fn>`: llama3's debug model on CPU.

torchtitan's `llama3_debugmodel`, made to train on a CPU in seconds: the tokenizer and corpus this repo ships
(`recipes/data/torchtitan`, no hub access needed), short sequences, float32, no activation checkpointing,
and the `partial_dtensor` SPMD backend (torch 2.13's FSDP cannot shard the `spmd_types` backend's
parameters over several procs). Both return `MonarchTrainer.Config`, so `--monarch.*` applies to either.
Outside a checkout of this repo, point `--hf_assets_path` and `--dataloader.dataset_path` at your own assets.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from torchtitan.config import ParallelismConfig
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.llama3.config_registry import llama3_debugmodel

from monarch_plugin.integrations.torchtitan.config import MonarchConfig
from monarch_plugin.integrations.torchtitan.trainer import MonarchTrainer

__all__ = ["ASSETS", "llama3_debugmodel_cpu", "llama3_debugmodel_elastic"]

ASSETS = Path(__file__).resolve().parents[2] / "recipes" / "data" / "torchtitan"
"""The tiny tokenizer (`tokenizer/`) and corpus (`corpus/`) shipped in this repo; see its build_assets.py."""


def llama3_debugmodel_cpu() -> MonarchTrainer.Config:
    """llama3 debugmodel on CPU, elasticity off: plain torchtitan (run it under torchrun), or add `--monarch.enable`."""
    base = llama3_debugmodel()
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    training = dataclasses.replace(base.training, local_batch_size=2, seq_len=128, steps=20,
                                   mixed_precision_param="float32")
    return MonarchTrainer.Config(**{
        **fields,
        "hf_assets_path": str(ASSETS / "tokenizer"),
        "dump_folder": "./runs/llama3_debugmodel_cpu",
        "dataloader": HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=str(ASSETS / "corpus")),
        "training": training,
        "parallelism": ParallelismConfig(spmd_backend="partial_dtensor"),
        "activation_checkpoint": None,
    })


def llama3_debugmodel_elastic() -> MonarchTrainer.Config:
    """The same, elastic: 2 replicas of 2 FSDP procs each, training on as long as one replica lives."""
    config = llama3_debugmodel_cpu()
    return dataclasses.replace(
        config, dump_folder="./runs/llama3_debugmodel_elastic",
        monarch=MonarchConfig(enable=True, replicas=2, min_replicas=1, procs_per_replica=2),
    )
