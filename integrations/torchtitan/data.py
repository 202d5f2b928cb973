"""torchtitan's data loader, sharded by the replicas live at each step instead of by a static group size.

torchtitan shards its text streams by data-parallel rank up front (`split_dataset_by_node(rank, world)`):
when a replica dies its shard of the data is simply not trained on, and a regrown group no longer lines
up with the shards. Here every proc reads the same unsharded stream of packed samples (the job's own
dataloader config, built for one rank with a batch of one sample), and one global cursor moves through it:
each step takes the next global batch from the stream and cuts it over the replicas live *for that step*,
then over the replica's data-parallel procs (the procs of one TP group read the same samples). The cursor moves only when the step commits; a dropped step is redone
on the same global batch, cut for the new group; and the stream's state at the last committed step is part
of what a newcomer heals from, so whatever the group does no sample is skipped or trained twice.

The cost is that every proc reads and tokenizes the whole global batch rather than its share.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.dataloader import BaseDataLoader, DataloaderExhaustedError
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.config import Configurable

from monarch_plugin.sampler import shard_bounds

__all__ = ["ElasticDataLoader"]

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]


class ElasticDataLoader(BaseDataLoader):
    """Yields this proc's share of each micro-batch of the step in flight, for the live group.

    The trainer drives it: `regroup(rank, world)` at the start of every attempt at a step (it also rewinds to
    the step's first micro-batch), iteration for the micro-batches, `commit()` when the step committed.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        source: BaseDataLoader.Config
        """The job's own dataloader config; built unsharded, one sample per batch, and read by every proc."""

        micro_batch_size: int
        """Samples in one global micro-batch: local batch size x data-parallel procs per replica x replicas at
        start."""

        micro_batches: int = 1
        """Micro-batches per optimizer step (gradient accumulation)."""

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer, seq_len: int,
                 local_batch_size: int, **kwargs: Any):
        self.config = config
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.source = config.source.build(dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=seq_len,
                                          local_batch_size=1, snapshot_every_n_steps=1)
        self.consumed = 0
        """Global samples trained by committed steps: the cursor's position in the stream."""
        self._stream: Iterator[Batch] | None = None
        self._window: list[list[Batch]] | None = None
        self._boundary: dict | None = None  # the source's state before the window was read
        self._next = 0
        self._group = (0, 1)

    # -- the step protocol ---------------------------------------------------------------------------------

    def regroup(self, rank: int, world: int) -> None:
        """(Re)start the step in flight for replica `rank` of `world` live ones, from its first micro-batch."""
        self._group = (rank, world)
        self._next = 0

    def __iter__(self) -> Iterator[Batch]:
        while True:
            window = self._read_window()
            if self._next >= len(window):
                raise RuntimeError(
                    f"the step asked for micro-batch {self._next + 1} of {len(window)}: call commit() or "
                    "regroup() between steps"
                )
            samples = self.share(self._next)
            self._next += 1
            yield _collate([window[self._next - 1][i] for i in samples])

    def share(self, micro: int) -> list[int]:
        """Indices (within the global micro-batch) of this proc's samples: its replica's share, then its data-parallel
        rank's (torchtitan's `dp_rank`, shared by the procs of a TP group)."""
        rank, world = self._group
        start, end = shard_bounds(self.config.micro_batch_size, rank, world)
        lo, hi = shard_bounds(end - start, self.dp_rank, self.dp_world_size)
        return list(range(start + lo, start + hi))

    def positions(self) -> list[int]:
        """Stream positions of the samples this proc trains in the step in flight (for audits and tests)."""
        size = self.config.micro_batch_size
        return [self.consumed + m * size + i for m in range(self.config.micro_batches) for i in self.share(m)]

    def valid_tokens(self) -> int:
        """Label tokens that count towards the loss in the whole step, over every replica: each proc holds the
        global batch, so the loss is normalised by the global count without a collective."""
        window = self._read_window()
        return int(sum((labels != IGNORE_INDEX).sum() for micro in window for _, labels in micro))

    def commit(self) -> None:
        """The step in flight was trained by every live replica: move the cursor past its global batch."""
        self.consumed += self.config.micro_batch_size * self.config.micro_batches
        self._window = self._boundary = None
        self._next = 0

    def _read_window(self) -> list[list[Batch]]:
        if self._window is None:
            if self._stream is None:
                self._stream = iter(self.source)
            self._boundary = self.source.state_dict()
            size = self.config.micro_batch_size
            try:
                self._window = [[next(self._stream) for _ in range(size)] for _ in range(self.config.micro_batches)]
            except StopIteration as e:
                raise DataloaderExhaustedError() from e
        return self._window

    # -- state: as of the last committed step ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        source = self._boundary if self._window is not None else self.source.state_dict()
        return {"source": source, "consumed": self.consumed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        self.source.load_state_dict(state_dict["source"])
        self.consumed = state_dict["consumed"]
        self._stream = self._window = self._boundary = None
        self._next = 0


def _collate(samples: list[Batch]) -> Batch:
    inputs = {key: torch.cat([s[0][key] for s in samples]) for key in samples[0][0]}
    return inputs, torch.cat([s[1] for s in samples])
