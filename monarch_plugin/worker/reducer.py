"""Gradient reduction across the live replicas, as one transaction per step.

Gradients are packed into flat buckets, each weighted by this replica's share of the step's samples
(so the sum over replicas is the mean gradient of the global batch, whatever the replica count), and
summed with async all-reduces. A small float64 side tensor rides along in the same transaction: caller
metrics (summed across replicas) and the control word that tells every member, consistently, that a
grow is waiting. Either every reduction completes and the gradients are written back, or the step raises
`CollectiveInterrupted` and nothing is written back.
"""

from __future__ import annotations

import torch

from monarch_plugin.worker.collectives import wait_all
from monarch_plugin.worker.context import Flags

__all__ = ["GradientReducer"]

BUCKET_BYTES = 25 * 1024 * 1024  # torch DDP's default bucket_cap_mb


class GradientReducer:
    def __init__(self, params: list[torch.nn.Parameter], device: torch.device):
        self.params = [p for p in params if p.requires_grad]
        self.device = device
        self.buckets: list[list[torch.nn.Parameter]] = []
        current: list[torch.nn.Parameter] = []
        size = 0
        for p in self.params:
            nbytes = p.numel() * p.element_size()
            if current and (size + nbytes > BUCKET_BYTES or p.dtype != current[0].dtype):
                self.buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            self.buckets.append(current)

    def reduce(
        self,
        pg,
        weight: float,
        side: list[float],
        flags: Flags,
        gen: int,
        timeout_s: float,
    ) -> list[float]:
        """Sum weight*grad and `side` over the group; write grads back only if every reduction completed."""
        flats = []
        for bucket in self.buckets:
            parts = [
                (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(self.device)
                for p in bucket
            ]
            flat = torch.cat(parts)
            flat.mul_(weight)
            flats.append(flat)
        side_t = torch.tensor(side, dtype=torch.float64, device=self.device)
        works = [pg.allreduce([f]) for f in flats] + [pg.allreduce([side_t])]
        wait_all(works, flags, gen, timeout_s)
        for bucket, flat in zip(self.buckets, flats):
            offset = 0
            for p in bucket:
                n = p.numel()
                chunk = flat[offset : offset + n].view_as(p)
                if p.grad is None:
                    p.grad = chunk.to(p.device).clone()
                else:
                    p.grad.copy_(chunk)
                offset += n
        return side_t.cpu().tolist()

    def scale_local(self, weight: float) -> None:
        """Alone in the group: apply the same weighting the reduction would have applied."""
        if weight != 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(weight)
