"""torchtitan's data loader, sharded by the replicas live at each step instead of by a static group size.

torchtitan shards its text streams by data-parallel rank up front (`split_dataset_by_node(rank, world)`):
when a replica dies its shard of the data is simply not trained on, and a regrown group no longer lines
up with the shards. Here every proc reads the same unsharded stream of packed samples (the job's own
dataloader config, built for one rank with a batch of one sample) through the runtime's `StreamWindow`: each
step takes the next global batch from the stream and cuts it over the replicas live *for that step*, then over
the replica's data-parallel procs (the procs of one CP x TP group read the same samples). The cursor moves only
when the step commits; a dropped step is redone on the same global batch, cut for the new group; and the stream's
position at the last committed step, with a fingerprint of the next step's samples that the receiver checks, is
part of what a newcomer heals from, so whatever the group does no sample is skipped or trained twice.

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

from monarch_plugin.data.stream import StreamWindow
from monarch_plugin.worker.window import StepWindow

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
        source = config.source.build(dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=seq_len,
                                     local_batch_size=1, snapshot_every_n_steps=1)
        self.stream = StreamWindow(source, config.micro_batch_size * config.micro_batches)
        """The stream every proc reads whole; its cursor counts the global samples committed steps trained."""
        self._next = 0
        self._group = (0, 1)
        self.window = StepWindow(lambda: self.stream.positions(config.micro_batch_size), lambda: self._group,
                                 lane=dp_rank, lanes=dp_world_size)
        """The step in flight's micro-batches as stream positions, cut for this proc: its replica's share, then its
        data-parallel rank's (torchtitan's `dp_rank`, shared by the procs of a CP x TP group)."""

    # -- the step protocol ---------------------------------------------------------------------------------

    def regroup(self, rank: int, world: int) -> None:
        """(Re)start the step in flight for replica `rank` of `world` live ones, from its first micro-batch."""
        self._group = (rank, world)
        self._next = 0

    def __iter__(self) -> Iterator[Batch]:
        while True:
            if self._next >= self.config.micro_batches:
                raise RuntimeError(
                    f"the step asked for micro-batch {self._next + 1} of {self.config.micro_batches}: call commit() "
                    "or regroup() between steps"
                )
            self._samples()  # read here: a stream with no whole step left ends the data
            samples = self.stream.samples(self.window.share(self._next))
            self._next += 1
            yield _collate(samples)

    def positions(self) -> list[int]:
        """Stream positions of the samples this proc trains in the step in flight (for audits and tests)."""
        return [p for m in range(self.config.micro_batches) for p in self.window.share(m)]

    def valid_tokens(self) -> int:
        """Label tokens that count towards the loss in the whole step, over every replica: each proc holds the
        global batch, so the loss is normalised by the global count without a collective."""
        return int(sum((labels != IGNORE_INDEX).sum() for _, labels in self._samples()))

    def commit(self) -> None:
        """The step in flight was trained by every live replica: move the cursor past its global batch."""
        self.stream.commit()
        self._next = 0

    def _samples(self) -> list[Batch]:
        """The step in flight's global batch, every replica's samples."""
        window = self.stream.window()
        if window is None:
            raise DataloaderExhaustedError()
        return window

    # -- state: as of the last committed step ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return self.stream.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        self.stream.load_state_dict(state_dict)
        self._next = 0


def _collate(samples: list[Batch]) -> Batch:
    inputs = {key: torch.cat([s[0][key] for s in samples]) for key in samples[0][0]}
    return inputs, torch.cat([s[1] for s in samples])
