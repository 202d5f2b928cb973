"""Gradient reduction across the live replicas, as one transaction per step.

Gradients are packed into flat buckets (in reverse registration order, roughly the order backward
produces them, as torch DDP does), each weighted by this replica's share of the step's samples so the sum
over replicas is the mean gradient of the global batch whatever the replica count. With overlap on, a
bucket's async all-reduce starts from a post-accumulate-grad hook as soon as its last gradient exists,
so communication runs under the rest of backward. A small float64 side tensor joins the same
transaction at commit: caller metrics (summed across replicas) and the control word that tells every
member, consistently, that a grow is waiting. Either every reduction completes and the gradients are
written back, or the step raises `CollectiveInterrupted` and nothing is written back.
"""

from __future__ import annotations

import contextlib

import torch

from monarch_plugin.worker.collectives import wait_all
from monarch_plugin.worker.context import Flags

__all__ = ["GradientReducer"]

BUCKET_BYTES = 25 * 1024 * 1024  # torch DDP's default bucket_cap_mb


class GradientReducer:
    def __init__(self, params: list[torch.nn.Parameter], device: torch.device, overlap: bool = True):
        self.params = [p for p in params if p.requires_grad]
        self.device = device
        self.buckets: list[list[torch.nn.Parameter]] = []
        current: list[torch.nn.Parameter] = []
        size = 0
        for p in reversed(self.params):
            nbytes = p.numel() * p.element_size()
            if current and (size + nbytes > BUCKET_BYTES or p.dtype != current[0].dtype):
                self.buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            self.buckets.append(current)
        self._bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self._pg = None
        self._weight = 1.0
        self._pending: list[int] = [0] * len(self.buckets)
        self._flats: dict[int, torch.Tensor] = {}
        self._works: dict[int, object] = {}
        self._seen: set[int] = set()
        self._misuse = False
        self._synced = True
        if overlap:
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._on_grad)

    # -- overlap ---------------------------------------------------------------------------------------

    def arm(self, pg, weight: float) -> None:
        """Start a step: later backward passes launch their buckets' reductions on `pg` as they finish."""
        self._pg, self._weight = pg, weight
        self._pending = [len(b) for b in self.buckets]
        self._flats, self._works, self._seen = {}, {}, set()
        self._misuse = False

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally only (gradient accumulation)."""
        self._synced = False
        try:
            yield
        finally:
            self._synced = True

    def _on_grad(self, p: torch.Tensor) -> None:
        if self._pg is None or not self._synced:
            return
        if id(p) in self._seen:
            self._misuse = True
            return
        self._seen.add(id(p))
        i = self._bucket_of[id(p)]
        self._pending[i] -= 1
        if self._pending[i] == 0:
            self._launch(i)

    def _launch(self, i: int) -> None:
        parts = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(self.device)
            for p in self.buckets[i]
        ]
        flat = torch.cat(parts)
        flat.mul_(self._weight)
        self._flats[i] = flat
        self._works[i] = self._pg.allreduce([flat])

    # -- commit ----------------------------------------------------------------------------------------

    def reduce(self, side: list[float], flags: Flags, gen: int, timeout_s: float) -> list[float]:
        """Finish the step's reductions (launching buckets backward did not) and write the grads back."""
        if self._misuse:
            self._pg = None
            raise RuntimeError(
                "backward() ran more than once in this step, so some gradients were reduced before they "
                "were complete: wrap every backward but the last in `with step.no_sync():` (gradient "
                "accumulation), or build the ElasticLoop with overlap=False"
            )
        for i in range(len(self.buckets)):
            if i not in self._works:
                self._launch(i)
        side_t = torch.tensor(side, dtype=torch.float64, device=self.device)
        works = [self._works[i] for i in range(len(self.buckets))] + [self._pg.allreduce([side_t])]
        self._pg = None  # whatever happens next, no more launches for this step
        wait_all(works, flags, gen, timeout_s)
        for i, bucket in enumerate(self.buckets):
            flat, offset = self._flats[i], 0
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
        self._pg = None
        if weight != 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(weight)
