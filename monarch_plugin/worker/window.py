"""The step in flight as one proc trains it: its window, this replica's share, this proc's part and the weight.

A step trains one window: its global micro-batches (one, or `gradient_accumulation_steps` of them), each a list of
sample indices (an `ElasticSampler`'s window at the cursor) or of a stream's positions (`StreamWindow.positions`).
Which micro-batches make the window is the front end's to say, since its framework groups them (Lightning ends a
window where its epoch plan ends, HF where the data does); how they are cut is the runtime's, for `ElasticLoop` and
every front end: contiguous shares, sizes differing by at most one, over the replicas live for that step, then over
the replica's data-parallel procs (`ElasticLoop` cuts over all their procs at once). Each replica scales its
gradients by its weight, its fraction of the window's samples, so that their sum over the live replicas is the mean
over the global batch even when the shares differ in size.

The live group is read at each use: a generation can change between two micro-batches of one window, and the
step is then redone on the new group's shares of the same samples.
"""

from __future__ import annotations

from typing import Callable

from monarch_plugin.data.sampler import shard_bounds, share, weight

__all__ = ["StepWindow", "short_tail"]


class StepWindow:
    """The window of the step in flight (`batches()`), cut for this proc of the group live now (`group()`: this
    replica's rank and the live replicas), `lane` of the replica's `lanes` data-parallel procs.

    `flat` is `ElasticLoop`'s cut: each micro-batch over every proc of the live replicas at once, where the front ends
    cut it over the replicas first and each replica's share over its procs.
    """

    def __init__(self, batches: Callable[[], list[list[int]]], group: Callable[[], tuple[int, int]], *,
                 lane: int = 0, lanes: int = 1, flat: bool = False):
        self.batches, self.group = batches, group
        self.lane, self.lanes, self.flat = lane, lanes, flat

    def cut(self, batch: list[int]) -> list[int]:
        """This proc's samples of the global micro-batch `batch`."""
        rank, world = self.group()
        if self.flat:
            return share(batch, rank * self.lanes + self.lane, world * self.lanes)
        return share(share(batch, rank, world), self.lane, self.lanes)

    def share(self, micro: int) -> list[int]:
        """This proc's samples of the window's micro-batch `micro`."""
        return self.cut(self.batches()[micro])

    def replica_share(self, micro: int) -> list[int]:
        """This replica's samples of the window's micro-batch `micro`, which its procs' shares make up."""
        batch, (rank, world) = self.batches()[micro], self.group()
        if self.flat:
            procs, first = world * self.lanes, rank * self.lanes
            return batch[shard_bounds(len(batch), first, procs)[0]:shard_bounds(len(batch), first + self.lanes - 1,
                                                                                  procs)[1]]
        return share(batch, rank, world)

    def weight(self) -> float:
        """This replica's fraction of the window's samples (its procs' together; inside a replica, FSDP and DDP
        average over the procs already)."""
        window, (rank, world) = self.batches(), self.group()
        if self.flat:
            procs = world * self.lanes
            return sum(weight(window, rank * self.lanes + lane, procs) for lane in range(self.lanes))
        return weight(window, rank, world)


def short_tail(samples: int, size: int, procs: int, drop_last: bool) -> int:
    """The samples of an epoch's last global micro-batch of `size` over `samples` when they are too few to give each
    of up to `procs` procs one (a loader that keeps its last, short batch); 0 when every proc gets a sample. A front
    end refuses such a batch size before training, in its framework's words."""
    tail = samples % size
    return tail if tail and not drop_last and tail < procs else 0
