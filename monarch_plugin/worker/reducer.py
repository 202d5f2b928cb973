"""Gradient reduction across the live replicas, as one transaction per step.

Gradients are packed into flat buckets (in reverse registration order, roughly the order backward
produces them, as torch DDP does), each weighted by this replica's share of the step's samples so the sum
over replicas is the mean gradient of the global batch whatever the replica count. With overlap on, a
bucket's async all-reduce starts from a post-accumulate-grad hook as soon as its last gradient exists,
so communication runs under the rest of backward. The last bucket carries one extra element, the
control word that tells every member, consistently, that a grow is waiting; caller metrics (summed across
replicas) and the module's buffers follow in a small float64 reduction only when there are any. Either every
reduction completes and the gradients (and buffers) are written back, or the step raises `CollectiveInterrupted`
and nothing is written back.

Buffers (BatchNorm's running statistics, counters) are averaged at commit, weighted like the gradients: the
running mean every replica ends the step with is then exactly the one a single process would keep over the
whole global batch (the running variance misses the spread between the replicas' batch means), whoever is rank
0 and however many replicas are live. DDP instead broadcasts rank 0's buffers at the start of every forward, so
its running statistics follow rank 0's share of the data alone and its other ranks drift until the next one.
Forward passes of an attempt that is dropped must not move the statistics: `begin_attempt` keeps the buffers as
of the step's first attempt and puts them back when the step is attempted again.

Sharded parameters (FSDP's DTensors) are reduced by their local shard: each proc of a replica exchanges
its shard with the procs holding the same shard in the other replicas.
"""

from __future__ import annotations

import contextlib

import torch

from monarch_plugin.wire.protocol import Phase
from monarch_plugin.wire.handshake import CollectiveInterrupted
from monarch_plugin.worker.collectives import wait_all
from monarch_plugin.worker.context import Flags
from monarch_plugin.worker.dtensors import local_part

__all__ = ["GradientReducer"]

BUCKET_BYTES = 25 * 1024 * 1024  # torch DDP's default bucket_cap_mb


class GradientReducer:
    """Reduces a step's gradients over the live replicas, with DDP's semantics.

    With overlap (the default), as with DDP, when `backward()` returns the gradients are already the
    global-batch mean: buckets reduce while backward runs and an autograd final callback waits for the
    last of them. So clipping or any edit after backward acts on reduced gradients, as users of DDP
    expect. A failure during that wait never escapes from `backward()`: it is kept and raised at commit.
    Without overlap, everything is reduced at commit, after whatever the caller did to its local grads.
    """

    def __init__(self, params: list[torch.nn.Parameter], device: torch.device, overlap: bool = True,
                 buffers_of: list[torch.nn.Module] = ()):
        self.params = [p for p in params if p.requires_grad]
        self.device = device
        self.buffers_of = list(buffers_of)
        """Modules whose buffers are averaged at commit, looked up at every use: code that replaces a buffer
        tensor rather than writing into it (Lightning's StochasticWeightAveraging resets BatchNorm that way)
        must not leave the reducer averaging the old one."""
        self._attempted_step: int | None = None
        self._buffers_at_first_attempt: list[torch.Tensor] = []
        self.buckets: list[list[torch.nn.Parameter]] = []
        current: list[torch.nn.Parameter] = []
        size = 0
        for p in reversed(self.params):
            nbytes = local_part(p).numel() * p.element_size()
            if current and (size + nbytes > BUCKET_BYTES or p.dtype != current[0].dtype):
                self.buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            self.buckets.append(current)
        self._bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        # Reused every step: fresh 25 MB buffers would page-fault their way in on every step (all but one that an
        # interrupted attempt left a reduction in flight on: `_reset`). The last bucket reduced carries one extra
        # element, the control word, so a step needs no extra collective.
        self._buffers = [
            torch.empty(sum(local_part(p).numel() for p in b) + (i == len(self.buckets) - 1), dtype=b[0].dtype,
                        device=device)
            for i, b in enumerate(self.buckets)
        ]
        self._pg = None
        self._synced = True
        self._works: dict[int, object] = {}
        self._reset(None, 1.0, None, -1, 0.0)
        if overlap:
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._on_grad)

    def _reset(self, pg, weight: float, flags: Flags | None, gen: int, timeout_s: float) -> None:
        for i, work in self._works.items():
            if not work.is_completed():
                # Left behind by an interrupted attempt, on a group that cannot abort it (gloo): once the peers that
                # were still in that step reach it, it completes, and writes the sum into this bucket then. The bucket
                # goes with the work; the next attempt reduces in a new one.
                self._buffers[i] = torch.empty_like(self._buffers[i])
        self._pg, self._weight = pg, weight
        self._flags, self._gen, self._timeout_s = flags, gen, timeout_s
        self._pending = [len(b) for b in self.buckets]
        self._flats: dict[int, torch.Tensor] = {}
        self._works: dict[int, object] = {}
        self._seen: set[int] = set()
        self._misuse = False
        self._callback_queued = False
        self._reduced = False
        self._failure: CollectiveInterrupted | None = None

    def begin_attempt(self, step: int) -> None:
        """Call before the first forward of every attempt at `step`: the first keeps the buffers, a retry (the
        attempt before it was dropped, or cut for a generation that is gone) restores them."""
        buffers = self.buffers
        if step == self._attempted_step:
            _copy_into(buffers, self._buffers_at_first_attempt)
            return
        self._attempted_step = step
        self._buffers_at_first_attempt = [b.detach().clone() for b in buffers]

    @contextlib.contextmanager
    def first_attempt_buffers(self):
        """Inside an attempt at a step: the buffers as the last commit left them, for the duration.

        An evaluation in the middle of an accumulation window would otherwise run on statistics each replica has
        moved with its own micro-batches since, and replicas would disagree on metrics that decisions are taken
        from (early stopping, the best checkpoint)."""
        buffers = self.buffers
        own = [b.detach().clone() for b in buffers]
        _copy_into(buffers, self._buffers_at_first_attempt)
        try:
            yield
        finally:
            _copy_into(buffers, own)

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The buffers averaged at commit; complex and boolean ones (rotary tables, masks) are constants."""
        return [b for m in self.buffers_of for b in m.buffers() if not (b.is_complex() or b.dtype == torch.bool)]

    def arm(self, pg, weight: float, flags: Flags, gen: int, timeout_s: float) -> None:
        """Start a step: its backward reduces on `pg` as it goes."""
        self._reset(pg, weight, flags, gen, timeout_s)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally only (gradient accumulation)."""
        self._synced = False
        try:
            yield
        finally:
            self._synced = True

    # -- during backward -------------------------------------------------------------------------------

    def _on_grad(self, p: torch.Tensor) -> None:
        if self._pg is None or not self._synced:
            return
        if self._reduced or id(p) in self._seen:
            self._misuse = True
            return
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self._seen.add(id(p))
        i = self._bucket_of[id(p)]
        self._pending[i] -= 1
        if self._pending[i] == 0:
            self._launch(i)

    def backward_done(self) -> None:
        """Reduce now, for gradients that are assigned rather than accumulated (FSDP assigns its sharded
        gradients after its own reduce-scatter, so no autograd hook fires): call it when backward returned."""
        if self._pg is not None and self._synced and not self._reduced:
            self._finish_backward()

    def _finish_backward(self) -> None:
        if self._misuse or self._pg is None:
            return
        try:
            self._complete()
        except CollectiveInterrupted as e:
            self._failure = e

    def _launch(self, i: int) -> None:
        parts = [
            local_part(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(self.device)
            for p in self.buckets[i]
        ]
        flat = self._buffers[i]
        n = flat.numel() - (i == len(self.buckets) - 1)
        torch.cat(parts, out=flat[:n])
        flat[:n].mul_(self._weight)
        if n < flat.numel():
            flat[n] = 1.0 if self._flags.regroup_gen > self._gen else 0.0
        self._flats[i] = flat
        self._works[i] = self._pg.allreduce([flat])

    def _complete(self) -> None:
        """Launch what backward did not, wait for every bucket, write the reduced grads back."""
        for i in range(len(self.buckets)):
            if i not in self._works:
                self._launch(i)
        self._flags.set_phase(Phase.REDUCE)  # waiting on peers: the controller must not take this for a hang
        wait_all([self._works[i] for i in range(len(self.buckets))], self._flags, self._gen, self._timeout_s)
        for i, bucket in enumerate(self.buckets):
            flat, offset = self._flats[i], 0
            for p in bucket:
                local = local_part(p)
                n = local.numel()
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                with torch.no_grad():
                    local_part(p.grad).copy_(flat[offset : offset + n].view_as(local))
                offset += n
        self._reduced = True
        self._flags.set_phase(Phase.COMPUTE)

    # -- commit ----------------------------------------------------------------------------------------

    def reduce(self, metrics: list[float]) -> tuple[bool, list[float]]:
        """Finish the step's transaction: the gradients (if backward did not) and the caller's metrics.

        Returns whether any member saw a grow waiting (the control word) and the metrics summed.
        """
        pg, self._pg = self._pg, None  # whatever happens next, no more launches for this step
        if self._misuse:
            raise RuntimeError(
                "backward() ran more than once in this step, so gradients were reduced before they were "
                "complete: wrap every backward but the last in `with step.no_sync():` (gradient "
                "accumulation), or build the ElasticLoop with overlap=False"
            )
        if self._failure is not None:
            raise self._failure
        if not self._reduced:
            self._pg = pg
            try:
                self._complete()
            finally:
                self._pg = None
        grow = bool(self._buffers[-1][-1] > 0)
        buffers = self.buffers
        if not metrics and not buffers:
            return grow, []
        side = torch.cat([
            torch.tensor(metrics, dtype=torch.float64, device=self.device),
            *(local_part(b).reshape(-1).to(self.device, torch.float64) * self._weight for b in buffers),
        ])
        wait_all([pg.allreduce([side])], self._flags, self._gen, self._timeout_s)
        offset = len(metrics)
        with torch.no_grad():
            for b in buffers:
                local = local_part(b)
                mean = side[offset : offset + local.numel()].view_as(local)
                local.copy_(mean if local.is_floating_point() else mean.round())
                offset += local.numel()
        return grow, side[: len(metrics)].cpu().tolist()

    def scale_local(self, weight: float) -> None:
        """Alone in the group: apply the same weighting the reduction would have applied."""
        self._pg = None
        if weight != 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(weight)


def _copy_into(buffers: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for b, v in zip(buffers, values):
            b.copy_(v)
