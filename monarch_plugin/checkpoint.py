"""Durable checkpoints of an `ElasticLoop` run: what survives the loss of the controller itself.

Deaths of replicas cost only the step in flight, but the controller is one process: if it (or its machine) is
lost, the replicas end with it, and a relaunch has only what was written to disk. So one replica (the
generation's rank 0) writes a checkpoint of a committed step every `checkpoint_steps` steps and/or every
`checkpoint_interval_s` seconds, off the critical path: it copies its state in memory at the step boundary and a
thread writes the copy while training goes on. A relaunch with `resume="auto"` starts from the newest complete
one, on any number of replicas: the global batch and the sample order do not depend on how many there are.

A checkpoint of committed step N is one file per proc of a replica (its shard, under FSDP):
`step{N:08d}-local{k}-of{K}.pt` in `checkpoint_dir`. Each file is written under a temporary name, flushed to
disk, then renamed into place, so a crash mid-write leaves a temporary file, which no reader takes, and never a
file that loads wrong; a checkpoint is complete once all K of its files are in place. The checkpoint the run
writes when it gives up (too few replicas) is the same kind of file, written the same way.
"""

from __future__ import annotations

import os
import re
import threading
import time
from typing import Any, Callable

import torch

from monarch_plugin.errors import ConfigError

__all__ = ["CheckpointWriter", "lane_file", "newest", "file_name", "newest_written", "save", "step_of"]

_NAME = re.compile(r"step(?P<step>\d{8})-local(?P<lane>\d+)-of(?P<lanes>\d+)\.pt")


def file_name(step: int, lane: int, lanes: int) -> str:
    """The file of proc `lane` (of `lanes` in a replica) in the checkpoint of committed step `step`."""
    return f"step{step:08d}-local{lane}-of{lanes}.pt"


def save(state: dict, path: str) -> None:
    """Write `state` to `path` atomically: all of it, or (after a crash) nothing under that name."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a power loss
    finally:
        os.close(fd)


def _complete(paths: list[str]) -> list[tuple[int, int, str]]:
    """(step, lanes, directory) of each checkpoint all of whose files are among `paths`."""
    have: dict[tuple[int, int, str], set[int]] = {}
    for path in paths:
        match = _NAME.fullmatch(os.path.basename(path))
        if match:
            key = (int(match["step"]), int(match["lanes"]), os.path.dirname(path))
            have.setdefault(key, set()).add(int(match["lane"]))
    return [key for key, found in have.items() if found == set(range(key[1]))]


def newest(directory: str, lanes: int) -> str | None:
    """Lane 0's file of the newest complete checkpoint in `directory` for replicas of `lanes` procs; None if there
    is none. ConfigError if the directory holds checkpoints only of replicas of another size (FSDP shards do not
    reshard on load)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return None
    complete = _complete([os.path.join(os.path.abspath(directory), name) for name in names])
    mine = [step for step, k, _ in complete if k == lanes]
    if mine:
        return os.path.join(os.path.abspath(directory), file_name(max(mine), 0, lanes))
    others = sorted({k for _, k, _ in complete})
    if others:
        raise ConfigError(f"`checkpoint_dir` {directory} holds checkpoints of replicas of {others} proc(s), and this "
                          f"run's have {lanes}: resume with `procs_per_replica` {others[-1]}, or set another "
                          "`checkpoint_dir`", "resume")
    return None


def newest_written(paths: list[str], lanes: int) -> str | None:
    """Lane 0's file of the newest checkpoint (for replicas of `lanes` procs) of which every file is among `paths`
    (what a run recorded writing) and still on disk; None if there is none."""
    complete = [(step, d) for step, k, d in _complete([p for p in paths if os.path.exists(p)]) if k == lanes]
    if not complete:
        return None
    step, directory = max(complete)
    return os.path.join(directory, file_name(step, 0, lanes))


def step_of(path: str) -> int:
    """The committed steps held by the checkpoint that `path` is a file of, read from its name."""
    return int(_NAME.fullmatch(os.path.basename(path))["step"])


def lane_file(path: str, lane: int) -> str:
    """The file of proc `lane` in the checkpoint whose lane-0 file is `path`; ConfigError if it is not one."""
    match = _NAME.fullmatch(os.path.basename(path))
    if match is None:
        raise ConfigError(f"`resume`: {path} is not a checkpoint file of this runtime (step<N>-local<k>-of<K>.pt): "
                          "give one of those, or 'auto' for the newest in `checkpoint_dir`", "resume")
    return os.path.join(os.path.dirname(path), file_name(int(match["step"]), lane, int(match["lanes"])))


class CheckpointWriter:
    """Writes a replica's periodic checkpoints from a thread: `due(step)` says whether step `step` is one to keep;
    `write` copies the state now and saves it in the background (a copy made while the previous write is still
    going waits for it, so at most two states are ever in memory). A write that fails (a full disk) is reported
    as a `checkpoint_failed` event and training goes on: the next one may succeed."""

    def __init__(self, directory: str, every_steps: int, every_s: float, lane: int, lanes: int,
                 emit: Callable[..., None], keep: int = 0):
        self._directory, self._every_steps, self._every_s, self._keep = directory, every_steps, every_s, keep
        self._lane, self._lanes, self._emit = lane, lanes, emit
        self._last_at = time.monotonic()
        self._thread: threading.Thread | None = None

    def due(self, step: int) -> bool:
        if self._every_steps and step % self._every_steps == 0:
            return True
        return bool(self._every_s) and time.monotonic() - self._last_at >= self._every_s

    def write(self, step: int, state: dict) -> None:
        copy = _detached_copy(state)
        self.wait()
        self._last_at = time.monotonic()
        self._thread = threading.Thread(target=self._save, args=(step, copy), daemon=True,
                                        name="monarch-plugin-checkpoint")
        self._thread.start()

    def wait(self) -> None:
        """Until the write in progress (if any) is on disk; before the loop ends, so the last one is kept."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _save(self, step: int, state: dict) -> None:
        t0 = time.monotonic()
        try:
            os.makedirs(self._directory, exist_ok=True)
            path = os.path.join(self._directory, file_name(step, self._lane, self._lanes))
            save(state, path)
        except Exception as e:  # noqa: BLE001 - a checkpoint lost is not a reason to stop training
            self._emit("checkpoint_failed", step=step, error=f"{type(e).__name__}: {e}")
            return
        self._emit("checkpoint", step=step, path=os.path.abspath(path), seconds=round(time.monotonic() - t0, 3),
                   periodic=True)
        if self._keep:
            self._prune(step)

    def _prune(self, newest_step: int) -> None:
        """Delete this proc's files of all but the newest `keep` checkpoints (each proc prunes its own shard)."""
        mine = sorted(int(m["step"]) for m in map(_NAME.fullmatch, os.listdir(self._directory))
                      if m and int(m["lane"]) == self._lane and int(m["lanes"]) == self._lanes
                      and int(m["step"]) <= newest_step)
        for step in mine[: -self._keep]:
            try:
                os.remove(os.path.join(self._directory, file_name(step, self._lane, self._lanes)))
            except FileNotFoundError:
                pass


def _detached_copy(obj: Any) -> Any:
    """The state as it is now, in memory the training step does not touch: tensors cloned to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, _detached_copy(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_detached_copy(v) for v in obj)
    return obj
