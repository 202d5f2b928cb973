"""Live heal: a replica that is behind (a newcomer, or a survivor that dropped a step its peers committed)
pulls the whole training state from a healthy donor over the network, not from disk.

The donor serves its state from the training thread itself, at a step boundary, so it never reads tensors
that an optimizer step or an FSDP forward is mutating (torchtitan's torchft path crashed the donor that way).
The state is split into a pickled skeleton and its tensors; the skeleton goes first so receivers can
allocate, then one broadcast per tensor (measured fastest here: one flat buffer was 5-10x slower).
A sharded tensor (FSDP's DTensor) travels as its local shard, from the donor proc holding the same shard;
the receiver rebuilds it on its own device mesh, which the provider names (`device_mesh`).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from monarch_plugin.worker.collectives import wait_all
from monarch_plugin.worker.context import Flags

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed tensors holds no sharded state
    DTensor = ()

__all__ = ["StateProvider", "HealPlan", "plan_heal", "transfer_state"]


class StateProvider(Protocol):
    """What a front end hands the runtime so it can serve and receive live state."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass(frozen=True)
class _TensorSlot:
    index: int
    shape: tuple
    dtype: torch.dtype
    on_cpu: bool
    """Held on the CPU by the donor (an RNG state, a step counter): it goes back there after crossing NCCL."""


@dataclass(frozen=True)
class _ShardSlot(_TensorSlot):
    """A DTensor's local shard (`shape` is the shard's), and what rebuilds the DTensor around it."""

    placements: tuple
    global_shape: tuple
    stride: tuple


@dataclass(frozen=True)
class HealPlan:
    donor: int
    recipients: tuple[int, ...]
    step: int


def plan_heal(steps: list[int], fresh: list[bool]) -> HealPlan | None:
    """Pick the donor and receivers from every member's committed step and whether it holds state at all.

    Donor: the lowest rank holding state at the highest committed step. Receivers: everyone fresh or
    behind. On the very first generation nobody holds state, so rank 0 seeds the others (as DDP's
    initial broadcast does).
    """
    holders = [r for r, f in enumerate(fresh) if not f]
    if not holders:
        if len(steps) == 1:
            return None
        return HealPlan(donor=0, recipients=tuple(range(1, len(steps))), step=steps[0])
    top = max(steps[r] for r in holders)
    donor = min(r for r in holders if steps[r] == top)
    recipients = tuple(r for r in range(len(steps)) if fresh[r] or steps[r] != top)
    return HealPlan(donor, recipients, top) if recipients else None


def _split(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, DTensor):
        local = obj.to_local()
        tensors.append(local)
        return _ShardSlot(len(tensors) - 1, tuple(local.shape), local.dtype, local.device.type == "cpu",
                          tuple(obj.placements), tuple(obj.shape), tuple(obj.stride()))
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _TensorSlot(len(tensors) - 1, tuple(obj.shape), obj.dtype, obj.device.type == "cpu")
    if isinstance(obj, dict):
        return type(obj)((k, _split(v, tensors)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_split(v, tensors) for v in obj)
    return obj


def _join(obj: Any, tensors: list[torch.Tensor], mesh: Any) -> Any:
    if isinstance(obj, _ShardSlot):
        if mesh is None:
            raise RuntimeError("the donor sent sharded state, but this replica's provider names no device_mesh")
        local = tensors[obj.index]
        return DTensor.from_local(local.cpu() if obj.on_cpu else local, mesh, obj.placements, run_check=False,
                                  shape=torch.Size(obj.global_shape), stride=obj.stride)
    if isinstance(obj, _TensorSlot):
        return tensors[obj.index].cpu() if obj.on_cpu else tensors[obj.index]
    if isinstance(obj, dict):
        return type(obj)((k, _join(v, tensors, mesh)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_join(v, tensors, mesh) for v in obj)
    return obj


def transfer_state(
    pg,
    rank: int,
    provider: StateProvider | None,
    device: torch.device,
    flags: Flags,
    gen: int,
    timeout_s: float,
) -> tuple[dict | None, int]:
    """Broadcast rank 0's state to every other rank of `pg`; returns (state on receivers, bytes moved).

    `pg` holds only the donor (rank 0) and the receivers, so healthy peers are not made to wait on it.
    """
    tensors: list[torch.Tensor] = []

    def bcast(t: torch.Tensor) -> torch.Tensor:
        wire = t.to(device)
        wait_all([pg.broadcast(wire, 0)], flags, gen, timeout_s)
        return wire.cpu()

    if rank == 0:
        skeleton = pickle.dumps(_split(provider.state_dict(), tensors))
        size = bcast(torch.tensor([len(skeleton)], dtype=torch.int64))
        bcast(torch.frombuffer(bytearray(skeleton), dtype=torch.uint8))
    else:
        size = bcast(torch.zeros(1, dtype=torch.int64))
        skeleton_obj = pickle.loads(bcast(torch.empty(int(size.item()), dtype=torch.uint8)).numpy().tobytes())

    if rank == 0:
        payload = [t.detach().to(device).contiguous() for t in tensors]
    else:
        slots: list[_TensorSlot] = []
        _collect_slots(skeleton_obj, slots)
        slots.sort(key=lambda s: s.index)
        payload = [torch.empty(s.shape, dtype=s.dtype, device=device) for s in slots]
    works = [pg.broadcast(t, 0) for t in payload if t.numel()]  # uneven shards can be empty
    wait_all(works, flags, gen, timeout_s)
    moved = sum(t.numel() * t.element_size() for t in payload) + int(size.item())
    if rank == 0:
        return None, moved
    return _join(skeleton_obj, payload, getattr(provider, "device_mesh", None)), moved


def _collect_slots(obj: Any, out: list[_TensorSlot]) -> None:
    if isinstance(obj, _TensorSlot):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect_slots(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _collect_slots(v, out)
