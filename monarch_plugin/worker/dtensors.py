"""Sharded tensors (FSDP's DTensor), recognised without importing them.

Importing `torch.distributed.tensor` costs a second of CPU at every process start (a third of a plain-loop
replica's imports). A process that never imported it holds no DTensor, since whatever built one imported it, so
the check reads `sys.modules` instead of importing.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["is_dtensor", "local_part"]


def is_dtensor(t: object) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This proc's part of a tensor: its shard for a DTensor, the tensor itself otherwise."""
    return t.to_local() if is_dtensor(t) else t
