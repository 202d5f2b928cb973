"""A stream that every replica reads whole, one step's samples at a time, its position moved only when a step commits.

A stream (a torch `IterableDataset`, torchtitan's text loaders) has no indices for the sampler to shard. Sharded by
rank up front instead (accelerate's and torchtitan's way under torchrun), a dead rank's part of the stream would be
lost and a regrown group would no longer line up. So every replica reads the same unsharded stream, and one cursor
(the samples of the current pass that committed steps trained) moves only at commit. Each step reads the next
`step_samples` samples, which the front end cuts over the replicas live for that step, so a resize neither skips nor
repeats a sample; a dropped step is redone on the same samples, which are held until it commits.

A newcomer is positioned at the cursor: with the stream's own `state_dict`/`load_state_dict` where it has them
(`datasets.IterableDataset` and torchtitan's loaders do), else by reading the pass from its start and skipping the
samples already trained. Either way the donor also sends a fingerprint of the next step's samples and the newcomer
checks it: a state that does not restore the position exactly (datasets documents that a shuffle buffer's content
is not in its state) is replaced by the skip, and a stream that yields different samples in different processes
(shuffled with no seed) stops the run with an error instead of training each replica on a different stream.

Where a pass ends short of a whole step is the front end's to say (`next_pass`): by default the stream ends there.
The cost is that every replica reads (and holds until commit) the whole step rather than its share.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

__all__ = ["StreamWindow", "fingerprint"]


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


class StreamWindow:
    """The stream's position (pass, cursor) and the samples of the step in flight.

    `window()` reads the next step's `step_samples` samples on first use (sample `p` of the pass is
    `samples([p])[0]`); `commit()` moves the cursor past them. `state_dict()` is the position as of the last commit,
    with the stream's own state there (None for a stream without one, replayed instead) and a fingerprint of the
    next step's samples.
    """

    def __init__(self, source: Iterable, step_samples: int):
        self.source = source
        self.step_samples = step_samples
        self.epoch = 0
        """Passes over the stream finished."""
        self.cursor = 0
        """Samples of this pass trained by committed steps."""
        self._stateful = callable(getattr(source, "state_dict", None)) and callable(
            getattr(source, "load_state_dict", None))
        self._initial = source.state_dict() if self._stateful else None
        self._loaded = False  # a state was loaded: a fresh pass puts the initial one back first
        self._it: Iterator | None = None
        self._at: Any = None  # the stream's own state at the cursor; None: replay the pass up to it
        self._window: list | None = None

    def next_pass(self, left: list) -> bool:
        """The pass ended with `left`, fewer samples than a step, after `cursor` trained ones: True starts the next
        pass, False ends the stream (`window()` is None from then on). The front end's policy; here, the end."""
        return False

    # -- reading --------------------------------------------------------------------------------------------

    def window(self) -> list | None:
        """The samples of the step in flight, read on first use; None once the stream has no whole step left."""
        if self._window is None:
            if self._it is None:
                self._start(None)
            window = list(itertools.islice(self._it, self.step_samples))
            if len(window) < self.step_samples:
                if not self.next_pass(window):
                    return None
                self.epoch, self.cursor, self._it, self._at = self.epoch + 1, 0, None, None
                return self.window()
            self._window = window
        return self._window

    def samples(self, positions: list[int]) -> list:
        """The step in flight's samples at `positions` of the pass."""
        window = self.window()
        return [window[p - self.cursor] for p in positions]

    def positions(self, size: int) -> list[list[int]]:
        """The step in flight's samples as positions of the pass, in global micro-batches of `size` (a
        `StepWindow`'s window: `samples` reads each share)."""
        return [list(range(p, p + size)) for p in range(self.cursor, self.cursor + self.step_samples, size)]

    def commit(self) -> None:
        """The step in flight committed on every live replica: move the cursor past its samples."""
        self.cursor += self.step_samples
        self._window = None
        self._at = self.source.state_dict() if self._stateful else None

    def _start(self, state: Any) -> None:
        """A fresh iteration of pass `epoch`, from `state` (the stream's own) or its start, skipping to the cursor
        when there is no state."""
        if callable(getattr(self.source, "set_epoch", None)):
            self.source.set_epoch(self.epoch)
        if state is not None:
            self.source.load_state_dict(state)
            self._loaded = True
        elif self._loaded:
            self.source.load_state_dict(self._initial)
        self._it = iter(self.source)
        if state is None and self.cursor:
            skipped = sum(1 for _ in itertools.islice(self._it, self.cursor))
            if skipped < self.cursor:
                raise RuntimeError(f"the stream ended after {skipped} samples of pass {self.epoch}; its peers "
                                   f"trained {self.cursor}")
        if state is None and self._stateful:
            state = self.source.state_dict()
        self._at = state
        self._window = None

    # -- state: as of the last commit -----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        # Read ahead: the fingerprint of the next step's samples, in order, lets a newcomer check where it stands (one
        # sample would not do: two differently shuffled streams often start with the same one). The same keys and
        # types whatever the position (a stateful stream's state, "" past its end), as DCP's checkpoints need.
        window = self.window()
        return {"epoch": self.epoch, "cursor": self.cursor, "stream": self._at,
                "next": fingerprint(window) if window else ""}

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
            f"the stream does not yield the same samples in every replica (pass {self.epoch}, sample {self.cursor} "
            "differs from the donor's): every replica must read the same stream in the same order; seed its "
            "shuffling (e.g. `dataset.shuffle(seed=..., buffer_size=...)`)"
        )

    def _agrees(self, expected: str) -> bool:
        window = self.window()
        return (fingerprint(window) if window else "") == expected
