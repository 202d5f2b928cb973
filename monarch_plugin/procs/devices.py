"""Which GPUs each replica's procs see, so replicas sharing a host never share a device.

Replicas come and go, so GPUs are handed out by slot, not by replica id: a replacement takes the slot (and so
the GPUs) its dead predecessor freed. A replica in slot `s` with `k` procs sees the host's GPUs
`s*k .. s*k+k-1` through the visibility variable the GPU stack reads (`CUDA_VISIBLE_DEVICES` on CUDA,
`HIP_VISIBLE_DEVICES` on ROCm), so inside it `LOCAL_RANK` indexes its own GPUs, as under torchrun. On a
CPU-only host nothing is set. Kept pure (the caller passes the environment and device count) to be tested alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from monarch_plugin.errors import ConfigError

__all__ = ["GpuPlan", "plan_gpus"]


@dataclass(frozen=True)
class GpuPlan:
    variable: str
    """The environment variable that restricts a process's GPUs on this stack."""
    ids: tuple[str, ...]
    """The GPUs this controller may hand out, as that variable names them."""
    procs_per_replica: int

    def env_for_slot(self, slot: int) -> dict[str, str]:
        k = self.procs_per_replica
        return {self.variable: ",".join(self.ids[slot * k : (slot + 1) * k])}


def plan_gpus(kind: str, device_count: int, environ: Mapping[str, str], slots: int,
              procs_per_replica: int) -> GpuPlan | None:
    """The GPU plan for `slots` replicas alive at once, or None on a CPU host.

    `kind` is `backend.accelerator_kind()`; `device_count` what torch sees; `environ` the controller's
    environment, whose visibility variable (if set) narrows the GPUs it may hand out.
    """
    if kind == "cpu":
        return None
    variable = "CUDA_VISIBLE_DEVICES"
    if kind == "rocm" and ("HIP_VISIBLE_DEVICES" in environ or variable not in environ):
        variable = "HIP_VISIBLE_DEVICES"  # ROCm reads both; narrow the one the controller was narrowed by
    listed = environ.get(variable)
    ids = tuple(i.strip() for i in listed.split(",") if i.strip()) if listed else tuple(map(str, range(device_count)))
    needed = slots * procs_per_replica
    if needed > len(ids):
        raise ConfigError(
            f"{slots} replica(s) alive at once (replicas + spares) x {procs_per_replica} proc(s) need {needed} "
            f"GPUs, but {len(ids)} are visible ({variable}={','.join(ids) or 'none'}): lower --replicas or "
            "--spares, or use fewer --procs-per-replica"
        )
    return GpuPlan(variable, ids, procs_per_replica)
