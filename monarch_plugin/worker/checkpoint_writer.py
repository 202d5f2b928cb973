"""A replica's periodic checkpoints, written off the step's critical path: a copy at the step boundary, written by
a thread (`CheckpointWriter`), and the random generators in types a checkpoint loads without running code."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from monarch_plugin.storage.checkpoint import prune, step_path
from monarch_plugin.worker.dtensors import is_dtensor

__all__ = ["CheckpointWriter", "detached_copy"]


class CheckpointWriter:
    """Writes a replica's periodic checkpoints from a thread: `due(step)` says whether step `step` is one to keep;
    `busy()` whether the previous write is still going (the caller skips the new one then, never waiting: a slow
    disk must not stall training); `write` copies the state now (a GPU's into pinned host memory kept for the next)
    and saves it in the background on `group`. A write
    that fails (a full disk) is reported as a `checkpoint_failed` event and training goes on; the proc that
    coordinates the write (the group's rank 0) reports it and prunes once it is complete."""

    def __init__(self, directory: str, every_steps: int, every_s: float, coordinator: bool,
                 emit: Callable[..., None], *, bound_s: float, keep: int = 0, share: bool = False):
        """`share`: the checkpoints' directories readable by others too (`ElasticConfig.share_files`). `bound_s`: the
        longest `wait` waits for a write (`ElasticConfig.join_timeout_s`)."""
        self._directory, self._every_steps, self._every_s, self._keep = directory, every_steps, every_s, keep
        self._share, self._bound_s = share, bound_s
        self._step = -1  # the step of the write in progress
        self._coordinator, self._emit = coordinator, emit
        self._last_at = time.monotonic()
        self._thread: threading.Thread | None = None
        self._staging: dict = {}
        """Pinned host buffers a GPU state is copied into, kept from one write to the next (`detached_copy`): as
        much host memory as one copy of the state, held for the run."""

    def due(self, step: int, steps: int = 1) -> bool:
        """At `step` committed steps, the last `steps` of them committed together (a semi-synchronous sync's round)."""
        if self._every_steps and step // self._every_steps > (step - steps) // self._every_steps:
            return True
        return bool(self._every_s) and time.monotonic() - self._last_at >= self._every_s

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def write(self, step: int, state: dict, group: dist.ProcessGroup | None) -> None:
        self.wait()  # at once when called as meant, not `busy()`; the staging buffers are free again then
        if self.busy():  # a write that hangs: none is started over it
            return
        copy = detached_copy(state, self._staging)
        if self._staging:
            torch.cuda.synchronize()  # the pinned copies are in place before the thread reads them
        self._last_at = time.monotonic()
        self._step = step
        self._thread = threading.Thread(target=self._save, args=(step, copy, group), daemon=True,
                                        name="monarch-plugin-checkpoint")
        self._thread.start()

    def wait(self) -> None:
        """Until the write in progress (if any) is on disk; before the loop ends, so the last one is kept. A write still
        going after `bound_s` (a filesystem that stopped answering) is given up on, with a `checkpoint_failed` event: it
        is left to its thread, and nothing is written over it (`busy`)."""
        if self._thread is None:
            return
        self._thread.join(self._bound_s)
        if not self._thread.is_alive():
            self._thread = None
        elif self._coordinator:
            self._emit("checkpoint_failed", step=self._step, path=step_path(self._directory, self._step),
                       error=f"the write did not finish in {self._bound_s:g} s (`join_timeout_s`): given up on")

    def _save(self, step: int, state: dict, group: dist.ProcessGroup | None) -> None:
        t0 = time.monotonic()
        path = step_path(self._directory, step)
        from monarch_plugin.worker import dcp_io  # here, not at the replica's start (`dcp_io`)

        try:
            dcp_io.save(state, path, group, self._share)
        except (Exception, dcp_io.CheckpointException) as e:  # noqa: BLE001 - a lost checkpoint stops nothing
            if self._coordinator:
                self._emit("checkpoint_failed", step=step, path=path, error=dcp_io.describe(e)[:500])
            return
        if not self._coordinator:
            return
        self._emit("checkpoint", step=step, path=path, seconds=round(time.monotonic() - t0, 3), periodic=True)
        if self._keep:
            removed = prune(self._directory, self._keep)
            if removed:
                self._emit("checkpoint_pruned", paths=removed)


def detached_copy(obj: Any, staging: dict | None = None, _at: tuple = ()) -> Any:
    """The state as it is now, in memory the training step does not touch: tensors cloned to the CPU (a DTensor's
    local shard, kept in its DTensor so DCP still knows where the shard lies).

    `staging`: host buffers kept from one copy to the next, by place in the state. A GPU tensor is copied into a
    pinned one there (made at the first copy), which the GPU fills by DMA at the link's speed instead of the
    pageable copy's ~1 GB/s (docs/gpus.md); the caller waits for the device before reading the copy."""
    if is_dtensor(obj):
        local = detached_copy(obj.to_local(), staging, _at)
        return type(obj).from_local(local, obj.device_mesh, obj.placements, run_check=False, shape=obj.shape,
                                    stride=obj.stride())
    if isinstance(obj, torch.Tensor):
        if staging is None or obj.device.type == "cpu":
            return obj.detach().to("cpu", copy=True)
        buffer = staging.get(_at)
        if buffer is None or buffer.shape != obj.shape or buffer.dtype != obj.dtype:
            buffer = staging[_at] = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=True)
        return buffer.copy_(obj.detach(), non_blocking=True)
    if isinstance(obj, dict):
        return type(obj)((k, detached_copy(v, staging, (*_at, k))) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(detached_copy(v, staging, (*_at, i)) for i, v in enumerate(obj))
    return obj
