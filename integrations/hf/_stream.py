"""A streaming `train_dataset` (a torch `IterableDataset`), read whole by every replica and cut by the live group.

A stream has no indices for the runtime's sampler to shard. Under torchrun, accelerate has rank 0 read it and
hand each rank a slice of every global batch; sharded by rank instead, a dead rank's part of the stream would be
lost and a regrown group would no longer line up. Here, as in the torchtitan front end, every replica reads the
same unsharded stream, and one cursor (the samples of the current pass over the stream that committed steps
trained) moves only when a step commits. Each step reads the next `global batch x gradient_accumulation_steps`
samples and the callback cuts every global micro-batch over the replicas live for that step, so a resize neither
skips nor repeats a sample; a dropped step is redone on the same samples, which are held until it commits.

A newcomer is positioned at the cursor: with the stream's own `state_dict`/`load_state_dict` where it has them
(`datasets.IterableDataset` does), else by reading the pass from its start and skipping the samples already
trained. Either way the donor also sends a fingerprint of the next step's samples and the newcomer checks it: a
state that does not restore the position exactly (datasets documents that a shuffle buffer's content is not in
its state) is replaced by the skip, and a stream that yields different samples in different processes (shuffled
with no seed) stops the run with an error instead of training each replica on a different stream.

Where a pass cannot be cut exactly: HF's loop cannot see where a stream ends, so it cannot end a pass with a
shorter step. A pass therefore trains whole steps only; the last `len(stream) mod (global batch x
gradient_accumulation_steps)` samples of every pass are not trained (a warning says how many), and the next pass
starts, as HF's next epoch does, with the stream's `set_epoch(pass)` where it has one.

The cost is that every replica reads (and holds until commit) the whole global step rather than its share.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from transformers.utils import logging

__all__ = ["ElasticStream", "fingerprint"]

logger = logging.get_logger(__name__)


def fingerprint(sample: Any) -> str:
    """A digest of one sample that is equal in two processes exactly when the samples are equal."""
    digest = hashlib.sha256()

    def feed(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            digest.update(f"tensor{t.dtype}{tuple(t.shape)}".encode())
            digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(obj, np.ndarray):
            digest.update(f"array{obj.dtype}{obj.shape}".encode())
            digest.update(np.ascontiguousarray(obj).tobytes())
        elif isinstance(obj, dict):
            digest.update(b"{")
            for key in sorted(obj, key=repr):
                digest.update(repr(key).encode())
                feed(obj[key])
            digest.update(b"}")
        elif isinstance(obj, (list, tuple)):
            digest.update(b"[")
            for item in obj:
                feed(item)
            digest.update(b"]")
        else:
            digest.update(repr(obj).encode())

    feed(sample)
    return digest.hexdigest()


class ElasticStream:
    """The stream's position (pass, cursor) and the samples of the step in flight.

    `window()` reads the next step's samples (global micro-batch `j` is `samples(positions(j))`); `commit()`
    moves the cursor past them. Positions count samples from the start of the pass. `state_dict()` is the
    position as of the last commit, with the stream's own state there and a fingerprint of the next step's
    samples.
    """

    def __init__(self, dataset, micro_batch_size: int, micro_batches: int):
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.micro_batches = micro_batches
        self.step_samples = micro_batch_size * micro_batches
        self.epoch = 0
        """Passes over the stream finished: HF's epoch."""
        self.cursor = 0
        """Samples of this pass trained by committed steps."""
        self._stateful = callable(getattr(dataset, "state_dict", None)) and callable(
            getattr(dataset, "load_state_dict", None))
        self._initial = dataset.state_dict() if self._stateful else None
        self._loaded = False  # a state was loaded: a fresh pass puts the initial one back first
        self._it: Iterator | None = None
        self._at: Any = None  # the stream's own state at the cursor; None: replay the pass up to it
        self._window: list | None = None

    # -- reading --------------------------------------------------------------------------------------------

    def window(self) -> list | None:
        """The samples of the step in flight, read on first use; None once the stream has no whole step left.

        Reaching the end of a pass starts the next one; a pass that cannot fill a single step from its start
        ends training (HF sees an empty epoch and stops), and is an error in the first pass.
        """
        if self._window is None:
            if self._it is None:
                self._start(None)
            window = list(itertools.islice(self._it, self.step_samples))
            if len(window) < self.step_samples:
                if self.cursor == 0:
                    if self.epoch == 0:
                        raise ValueError(
                            f"the streaming train_dataset yielded {len(window)} sample(s), fewer than one optimizer "
                            f"step takes ({self.micro_batch_size} x {self.micro_batches} = per_device_train_batch_size "
                            "x --replicas x gradient_accumulation_steps): give it more samples or lower those"
                        )
                    return None
                if window:
                    logger.warning_once(
                        f"each pass over the streaming train_dataset ends with {len(window)} sample(s) that do not "
                        f"fill an optimizer step of {self.step_samples}; they are not trained. Make the stream's "
                        f"length a multiple of {self.step_samples} to train every sample"
                    )
                self.epoch, self.cursor, self._it, self._at = self.epoch + 1, 0, None, None
                return self.window()
            self._window = window
        return self._window

    def positions(self, j: int) -> list[int]:
        """Positions of global micro-batch `j` of the step in flight."""
        start = self.cursor + j * self.micro_batch_size
        return list(range(start, start + self.micro_batch_size))

    def samples(self, positions: list[int]) -> list:
        window = self.window()
        return [window[p - self.cursor] for p in positions]

    def commit(self) -> None:
        """The step in flight committed on every live replica: move the cursor past its samples."""
        self.cursor += self.step_samples
        self._window = None
        self._at = self.dataset.state_dict() if self._stateful else None

    def _start(self, state: Any) -> None:
        """A fresh iteration of pass `epoch`, from `state` (the stream's own) or its start, skipping to the cursor
        when there is no state."""
        if callable(getattr(self.dataset, "set_epoch", None)):
            self.dataset.set_epoch(self.epoch)
        if state is not None:
            self.dataset.load_state_dict(state)
            self._loaded = True
        elif self._loaded:
            self.dataset.load_state_dict(self._initial)
        self._it = iter(self.dataset)
        if state is None and self.cursor:
            skipped = sum(1 for _ in itertools.islice(self._it, self.cursor))
            if skipped < self.cursor:
                raise RuntimeError(f"the streaming train_dataset ended after {skipped} samples of pass "
                                   f"{self.epoch}; its peers trained {self.cursor}")
            state = self.dataset.state_dict() if self._stateful else None
        self._at = state
        self._window = None

    # -- state: as of the last commit ---------------------------------------------------------------------------

    def state_dict(self) -> dict:
        # Read ahead: the fingerprint of the next step's samples, in order, lets a newcomer check where it stands (one
        # sample would not do: two differently shuffled streams often start with the same one).
        window = self.window()
        return {"epoch": self.epoch, "cursor": self.cursor, "stream": self._at,
                "next": fingerprint(window) if window else None}

    def load_state_dict(self, state: dict) -> None:
        """Take a peer's position; a replica holding the step the peer committed just commits it."""
        after_window = (self.epoch, self.cursor + self.step_samples)
        if self._window is not None and (state["epoch"], state["cursor"]) == after_window:
            self.commit()
        if (state["epoch"], state["cursor"]) != (self.epoch, self.cursor):
            self.epoch, self.cursor = state["epoch"], state["cursor"]
            self._start(state["stream"])
        if self._agrees(state["next"]):
            return
        if self._at is not None:  # the stream's state does not restore its position exactly: replay the pass
            self._start(None)
            if self._agrees(state["next"]):
                return
        raise RuntimeError(
            f"the streaming train_dataset does not yield the same samples in every replica (pass {self.epoch}, "
            f"sample {self.cursor} differs from the donor's): every replica must read the same stream in the "
            "same order; seed its shuffling (e.g. `dataset.shuffle(seed=..., buffer_size=...)`)"
        )

    def _agrees(self, expected: str | None) -> bool:
        window = self.window()
        return (fingerprint(window) if window else None) == expected
