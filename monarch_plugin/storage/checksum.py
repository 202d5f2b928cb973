"""A short digest of model weights: how runs, tests and recipes show that every replica ends bitwise identical."""

from __future__ import annotations

import hashlib

import torch

__all__ = ["state_checksum", "weights_checksum"]


def state_checksum(state: dict) -> str:
    """Digest of a state dict of plain tensors, by name, so the order of entries does not matter."""
    h = hashlib.sha256()
    for name, t in sorted(state.items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def weights_checksum(module: torch.nn.Module) -> str:
    return state_checksum(module.state_dict())
