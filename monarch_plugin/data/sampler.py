"""An epoch-aware sampler with one global cursor, so a resize neither skips nor repeats samples.

A static `DistributedSampler` shards the epoch by rank up front: when the group shrinks, the dead rank's
shard is lost, and when it regrows the shards no longer line up (transformers #40245, torchtitan #811).
Here the epoch is one permutation and a cursor; each step takes the next global batch from the cursor and
splits it over whoever is live *for that step*. The cursor only moves when a step commits, and it is part
of the state a newcomer heals from.
"""

from __future__ import annotations

import torch

__all__ = ["ElasticSampler", "ShareSampler", "forget_before", "reloader", "share", "shard_bounds", "weight"]


def shard_bounds(n: int, rank: int, world: int) -> tuple[int, int]:
    """[start, end) of rank's contiguous share of n items; shares differ in size by at most one."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def share(batch: list, rank: int, world: int) -> list:
    """`rank`'s share of `batch` among `world`: a replica's part of a global micro-batch (`world` the live
    replicas), or a proc's part of its replica's share (`world` the replica's procs)."""
    start, end = shard_bounds(len(batch), rank, world)
    return batch[start:end]


def weight(window: list[list], rank: int, world: int) -> float:
    """`rank`'s fraction of the samples of a step's window (its global micro-batches). Each replica scales its
    gradients by its weight, so their sum over the live replicas is the mean over the step's global batch even
    when the shares differ in size."""
    total = sum(len(batch) for batch in window)
    return sum(len(share(batch, rank, world)) for batch in window) / total


class ElasticSampler:
    """An epoch's samples as one permutation and a cursor; each step's window is read from the cursor."""

    def __init__(self, num_samples: int, shuffle: bool = True, seed: int = 0, drop_last: bool = False):
        if num_samples < 1:
            raise ValueError(f"the dataset is empty (num_samples={num_samples}): give it at least one sample")
        self.num_samples = num_samples
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.cursor = 0
        self._order: torch.Tensor | None = None

    def _epoch_order(self) -> torch.Tensor:
        if self._order is None:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + self.epoch)
                self._order = torch.randperm(self.num_samples, generator=g)
            else:
                self._order = torch.arange(self.num_samples)
        return self._order

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its first sample, unless the cursor is already in it.

        A framework may end an epoch before the data does (Lightning's `limit_train_batches`); its next epoch
        starts the next permutation from the top, as `DistributedSampler.set_epoch` would, rather than
        carrying on where the cut-short epoch stopped. Restating the current epoch (a newcomer resumed mid-epoch,
        or the cursor already rolled over at the epoch's last commit) keeps the cursor.
        """
        if epoch != self.epoch:
            self.epoch, self.cursor, self._order = epoch, 0, None

    def batches_per_epoch(self, batch_size: int) -> int:
        """How many global (micro-)batches of `batch_size` an epoch holds, as a DataLoader would cut it."""
        full, rest = divmod(self.num_samples, batch_size)
        return full if (self.drop_last or rest == 0) else full + 1

    def micro_batches(self, size: int, start: int | None = None, limit: int | None = None):
        """(position, indices) of the epoch's global micro-batches of `size`, from position `start` (default: the
        cursor) on, as a DataLoader with this batch size and `drop_last` would cut them; at most `limit`."""
        order, n = self._epoch_order(), self.num_samples
        pos, count = self.cursor if start is None else start, 0
        while pos < n and not (self.drop_last and n - pos < size) and (limit is None or count < limit):
            yield pos, order[pos : pos + size].tolist()
            pos += size
            count += 1

    def window(self, size: int, count: int = 1) -> list[list[int]]:
        """The next step's window: its `count` global micro-batches of `size` from the cursor (fewer at the end
        of the epoch), across all replicas. Cut it with `share`, weigh it with `weight`."""
        return [batch for _, batch in self.micro_batches(size, limit=count)]

    def advance(self, size: int, count: int = 1) -> None:
        """Mark the next step's window of `count` micro-batches of `size` consumed (only when the step commits)."""
        for _ in range(count):
            self.cursor += len(self.window(size)[0])
            remaining = self.num_samples - self.cursor
            if remaining <= 0 or (self.drop_last and remaining < size):
                self.epoch += 1
                self.cursor = 0
                self._order = None
                return

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        if state["num_samples"] != self.num_samples:
            raise ValueError(
                f"sampler state is for {state['num_samples']} samples but this dataset has "
                f"{self.num_samples}: every replica must load the same dataset"
            )
        self.epoch, self.cursor, self.seed = state["epoch"], state["cursor"], state["seed"]
        self._order = None


class ShareSampler:
    """A training DataLoader's batch sampler: this proc's share (`cut`) of each global micro-batch of `size`.

    Each share issued is remembered by (epoch, position), because a framework fetches a batch ahead and DataLoader
    workers prefetch more: a batch in hand may have been cut for a generation that no longer exists. At step time
    the front end compares the share it holds (`issued`, `in_hand`) with the one the live group gives that
    micro-batch, and loads a fresh one where they differ. From the cursor on (Lightning), or from the epoch's start
    (`from_start`: HF's resume path skips the micro-batches already trained).
    """

    def __init__(self, sampler: ElasticSampler, size: int, cut, *, from_start: bool = False):
        self.sampler, self.size, self.cut, self.from_start = sampler, size, cut, from_start
        self.issued: dict[tuple[int, int], list[int]] = {}

    def __len__(self) -> int:
        return self.sampler.batches_per_epoch(self.size)

    def __iter__(self):
        epoch = self.sampler.epoch
        for pos, batch in self.sampler.micro_batches(self.size, start=0 if self.from_start else None):
            mine = self.cut(batch)  # the generation of the moment: it may change between batches
            self.issued[(epoch, pos)] = mine
            yield mine

    def key(self, micro: int) -> tuple[int, int]:
        """(epoch, position) of micro-batch `micro` of the step at the cursor."""
        return self.sampler.epoch, self.sampler.cursor + micro * self.size

    def in_hand(self, micro: int) -> list[int] | None:
        """The share a framework that takes the batches in order holds at micro-batch `micro` of the step at the
        cursor: the oldest issued from there on, once those before it are dropped. None when that is not
        `micro`'s own: none was issued for it, or it was passed (a window being redone holds its last batch)."""
        key = self.key(micro)
        forget_before(self.issued, key)
        oldest = next(iter(self.issued.items()), None)
        return oldest[1] if oldest is not None and oldest[0] == key else None

    def forget(self) -> None:
        """Drop the shares of committed steps (those before the cursor)."""
        forget_before(self.issued, self.key(0))


def forget_before(issued: dict[tuple[int, int], list[int]], key: tuple[int, int]) -> None:
    """Drop, in place, the shares recorded for micro-batches before (epoch, position) `key`."""
    for old in [k for k in issued if k < key]:
        del issued[old]


def reloader(loader, batch_sampler, loader_class=None, *args):
    """`loader` again (its dataset, collator, workers and the rest) with `batch_sampler` in place of its own; a
    `loader_class` (a `DataLoader` subclass, given `args` first) in place of DataLoader."""
    from torch.utils.data import DataLoader

    workers = loader.num_workers
    return (loader_class or DataLoader)(
        *args, loader.dataset, batch_sampler=batch_sampler, num_workers=workers, collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory, timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context, generator=loader.generator,
        prefetch_factor=loader.prefetch_factor if workers else None,
        persistent_workers=loader.persistent_workers if workers else False,
    )
