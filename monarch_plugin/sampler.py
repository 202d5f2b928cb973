"""An epoch-aware sampler with one global cursor, so a resize neither skips nor repeats samples.

A static `DistributedSampler` shards the epoch by rank up front: when the group shrinks, the dead rank's
shard is lost, and when it regrows the shards no longer line up (transformers #40245, torchtitan #811).
Here the epoch is one permutation and a cursor; each step takes the next global batch from the cursor and
splits it over whoever is live *for that step*. The cursor only moves when a step commits, and it is part
of the state a newcomer heals from.
"""

from __future__ import annotations

import torch

__all__ = ["ElasticSampler", "shard_bounds"]


def shard_bounds(n: int, rank: int, world: int) -> tuple[int, int]:
    """[start, end) of rank's contiguous share of n items; shares differ in size by at most one."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class ElasticSampler:
    """Global batches of sample indices over epochs, cut into per-replica shards on demand."""

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

    def steps_per_epoch(self, global_batch_size: int) -> int:
        full, rest = divmod(self.num_samples, global_batch_size)
        return full if (self.drop_last or rest == 0) else full + 1

    def global_batch(self, global_batch_size: int) -> list[int]:
        """The indices the next step consumes, across all replicas."""
        order = self._epoch_order()
        return order[self.cursor : self.cursor + global_batch_size].tolist()

    def shard(self, global_batch_size: int, rank: int, world: int) -> list[int]:
        """This replica's part of the next step's global batch."""
        batch = self.global_batch(global_batch_size)
        start, end = shard_bounds(len(batch), rank, world)
        return batch[start:end]

    def advance(self, global_batch_size: int) -> None:
        """Mark the next global batch consumed (called only when its step commits)."""
        self.cursor += len(self.global_batch(global_batch_size))
        remaining = self.num_samples - self.cursor
        if remaining <= 0 or (self.drop_last and remaining < global_batch_size):
            self.epoch += 1
            self.cursor = 0
            self._order = None

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
