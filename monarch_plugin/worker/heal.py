"""Live heal: a replica that is behind (a newcomer, or a survivor that dropped a step its peers committed)
pulls the whole training state from a healthy donor over the network, not from disk.

The donor serves its state from the training thread itself, at a step boundary, so it never reads tensors
that an optimizer step or an FSDP forward is mutating (torchtitan's torchft path crashed the donor that way).
The state is split into a skeleton and its tensors; the skeleton goes first so receivers can
allocate (read back with torch's `weights_only` unpickler, `_SKELETON_TYPES`: a donor's skeleton is data, never
code), then one broadcast per tensor (measured fastest here: one flat buffer was 5-10x slower).
Several healthy replicas at the newest step (up to `heal_donors`) serve one heal together: each sends a disjoint
share of the tensors (`shares`: contiguous runs of about equal bytes, which donors and receivers compute alike from
the tensors' sizes) over a group of its own, so the receivers take in that many streams at once. One stream is
bound by the kernel's copies and the receiver's page faults, not the network (docs/benchmarks.md).
A sharded tensor (a DTensor: FSDP's, TP's, or both on one 2-D mesh) travels as its local shard, from the donor proc
holding the same shard (proc k of one replica holds what proc k of any other holds, the replicas being built alike).
Before any byte moves, the receiver checks the donor's shards against its own (`sharded()`): the same mesh
dimensions, placements and shapes for every sharded tensor it holds, or the heal fails naming the first that
differs. It rebuilds each shard on its own mesh of the same dimension names.
"""

from __future__ import annotations

import bisect
import io
import pathlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from monarch_plugin.errors import ProtocolError
from monarch_plugin.worker.collectives import wait_all
from monarch_plugin.worker.context import Flags
from monarch_plugin.worker.dtensors import is_dtensor

__all__ = ["StateProvider", "HealPlan", "Moved", "plan_heal", "shares", "heal_bound_s", "transfer_state"]


class StateProvider(Protocol):
    """What a front end hands the runtime so it can serve and receive live state."""

    step: int
    """The committed steps its state holds."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def sharded(self) -> dict:
        """The sharded part of this replica's state as it holds it now, under the keys `state_dict` uses (the
        model's); without copying. A received state must match it shard for shard, and its meshes rebuild the
        shards received."""


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
    mesh_dims: tuple | None
    """The donor mesh's dimension names (torchtitan's `("fsdp", "tp")`): the receiver's mesh of the same names
    rebuilds it."""


_SKELETON_TYPES = (_TensorSlot, _ShardSlot, pathlib.PurePosixPath, pathlib.PosixPath)
"""What a skeleton may name besides containers, numbers, strings, dtypes and DTensor placements: the slots, and the
paths front ends' state holds (Lightning's `SpikeDetection` keeps its `exclude_batches_path` in its state). Building
any of them runs none of the donor's code."""


@dataclass(frozen=True)
class HealPlan:
    donors: tuple[int, ...]
    """The ranks serving the heal, one share of the state each (`shares`); the first also sends the skeleton."""
    recipients: tuple[int, ...]
    step: int


def plan_heal(steps: list[int], fresh: list[bool], holders: list[bool], max_donors: int = 1) -> HealPlan | None:
    """Pick the donors and receivers from every member's committed step, whether it is fresh (it has never joined a
    generation, so its state was never exchanged) and whether it holds the run's trained state (`Plan.holders`).

    Only a holder ever serves. Donors: the lowest ranks among the holders that are not fresh at their highest
    committed step, at most `max_donors` (healthy replicas at one committed step hold the same state: DDP's
    invariant, which the runtime's checks of identical replicas test). Receivers: everyone else. In the first
    generation every holder is fresh (each built its own model, or loaded the same checkpoint), so the lowest-rank
    holder alone seeds the others, as DDP's initial broadcast does. With no holder at all, healing from any member
    would train on from weights that were never the run's: the controller never publishes such a generation (it
    restores a checkpoint or stops), so meeting one is a bug, raised.
    """
    trusted = [r for r, held in enumerate(holders) if held]
    if not trusted:
        raise ProtocolError("heal", f"no member of this generation holds the run's trained state (steps {steps}): "
                            "a generation like that is never published to train; a bug in monarch-plugin")
    synced = [r for r in trusted if not fresh[r]]
    if not synced:
        donors: tuple[int, ...] = (trusted[0],)
        top = steps[trusted[0]]
    else:
        top = max(steps[r] for r in synced)
        donors = tuple(r for r in synced if steps[r] == top)[:max_donors]
    up_to_date = {r for r in synced if steps[r] == top} | set(donors)
    recipients = tuple(r for r in range(len(steps)) if r not in up_to_date)
    return HealPlan(donors, recipients, top) if recipients else None


def shares(sizes: list[int], count: int) -> list[range]:
    """Split tensors `0 .. len(sizes)-1` (`sizes` in bytes) into `count` contiguous runs of about equal bytes, one
    per donor. A pure function of the sizes, so every donor and receiver computes the same split without
    exchanging it; a tensor is never cut, so a share may be empty (one tensor larger than the rest together)."""
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    total, bounds = prefix[-1], [0]
    for j in range(1, count):
        target = total * j / count
        b = bisect.bisect_left(prefix, target)
        if b > 0 and target - prefix[b - 1] <= prefix[b] - target:
            b -= 1  # the nearer boundary
        bounds.append(max(b, bounds[-1]))
    bounds.append(len(sizes))
    return [range(lo, hi) for lo, hi in zip(bounds, bounds[1:])]


def _split(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if is_dtensor(obj):
        local = obj.to_local()
        tensors.append(local)
        return _ShardSlot(len(tensors) - 1, tuple(local.shape), local.dtype, local.device.type == "cpu",
                          tuple(obj.placements), tuple(obj.shape), tuple(obj.stride()), obj.device_mesh.mesh_dim_names)
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _TensorSlot(len(tensors) - 1, tuple(obj.shape), obj.dtype, obj.device.type == "cpu")
    if isinstance(obj, dict):
        return type(obj)((k, _split(v, tensors)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_split(v, tensors) for v in obj)
    return obj


def _join(obj: Any, tensors: list[torch.Tensor], meshes: dict) -> Any:
    """The received state: each slot's tensor, each shard rebuilt on this replica's mesh of the donor's dimension
    names (`meshes`, found by `check_layout`)."""
    if isinstance(obj, _ShardSlot):
        from torch.distributed.tensor import DTensor  # loaded already: this replica's own state is sharded

        local = tensors[obj.index]
        return DTensor.from_local(local.cpu() if obj.on_cpu else local, meshes[obj.mesh_dims], obj.placements,
                                  run_check=False, shape=torch.Size(obj.global_shape), stride=obj.stride)
    if isinstance(obj, _TensorSlot):
        return tensors[obj.index].cpu() if obj.on_cpu else tensors[obj.index]
    if isinstance(obj, dict):
        return type(obj)((k, _join(v, tensors, meshes)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_join(v, tensors, meshes) for v in obj)
    return obj


def _shards(obj: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """(path, shard) of every sharded tensor in a state (a DTensor) or a skeleton (a `_ShardSlot`)."""
    if isinstance(obj, _ShardSlot) or is_dtensor(obj):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _shards(v, (*path, k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _shards(v, (*path, i))


def _layout(shard: Any) -> tuple:
    """A shard's mesh dimension names, placements, global shape and shard shape."""
    if isinstance(shard, _ShardSlot):
        return shard.mesh_dims, shard.placements, shard.global_shape, shard.shape
    return shard.device_mesh.mesh_dim_names, tuple(shard.placements), tuple(shard.shape), tuple(shard.to_local().shape)


def check_layout(skeleton: dict, own: dict) -> dict:
    """Refuse a donor's state whose shards are not this replica's (`own`: its `sharded()` state), before any tensor
    moves: every sharded tensor this replica holds must arrive with the same mesh dimensions, placements and shapes,
    and every shard the donor sends must have a mesh of its dimension names here. Returns those meshes by name."""
    mine = dict(_shards(own))
    meshes = {t.device_mesh.mesh_dim_names: t.device_mesh for t in mine.values()}
    theirs = dict(_shards({k: skeleton.get(k) for k in own}))
    for path, shard in mine.items():
        sent = _layout(theirs[path]) if path in theirs else "not sharded"
        if sent != _layout(shard):
            raise ProtocolError("heal", f"the donor's shard of {'.'.join(map(str, path))} is {sent} (mesh "
                                f"dimensions, placements, global and shard shape), this replica's is "
                                f"{_layout(shard)}: every replica must be built with the same parallelism over the "
                                "same number of procs")
    for path, slot in _shards(skeleton):
        if slot.mesh_dims not in meshes:
            raise ProtocolError("heal", f"the donor sent {'.'.join(map(str, path))} sharded over a mesh "
                                f"{slot.mesh_dims}, which this replica does not have: every replica must be built "
                                "with the same parallelism")
    return meshes


HEAL_FLOOR_S = 10.0
"""No heal step counts as stuck sooner: process scheduling on a loaded host, pickling the skeleton."""

ASSUMED_BYTES_PER_S = 25e6
"""Rate assumed before this worker has measured one: a quarter of 1 GbE, so a first heal is not cut short."""


def heal_bound_s(nbytes: int, bytes_per_s: float | None) -> float:
    """How long moving `nbytes` may take before the heal is abandoned: four times what the measured rate
    (`bytes_per_s`, from this worker's last heal; ASSUMED_BYTES_PER_S before any) predicts, and never
    under HEAL_FLOOR_S. A heal is bounded by what it moves, not by the collective timeout: a stuck
    100 MB heal is given up in 10 s, and a 100 GB one is not cut off at 60 s."""
    rate = bytes_per_s if bytes_per_s and bytes_per_s > 0 else ASSUMED_BYTES_PER_S
    return max(HEAL_FLOOR_S, 4.0 * nbytes / rate)


@dataclass(frozen=True)
class Moved:
    """What one heal moved, for the events and the next heal's bound."""

    bytes: int
    seconds: float
    bound_s: float


def transfer_state(
    groups: list,
    share: int | None,
    count: int,
    provider: StateProvider | None,
    device: torch.device,
    flags: Flags,
    gen: int,
    bytes_per_s: float | None = None,
    fault_point: Callable[[str], None] | None = None,
) -> tuple[dict | None, Moved]:
    """Move the donors' state to the receivers; returns (state on receivers, what this proc moved).

    Each group holds one donor (its rank 0) and the receivers, so healthy peers are not made to wait on it. A donor
    (`share`: its index among the `count` donors) passes its one group and sends its share (`shares`); a receiver
    (`share` None) passes one group per donor, in the plan's order, and takes in every share at once. The first
    donor sends a header first (skeleton size and the bound it computed from the payload size and its measured
    rate, `heal_bound_s`), then the skeleton; every wait after it uses that bound, and raises CollectiveTimedOut
    past it. `fault_point("heal_donor" | "heal_recipient")` fires between header and tensors.
    """
    tensors: list[torch.Tensor] = []
    first = groups[0]

    def bcast(t: torch.Tensor, bound_s: float) -> torch.Tensor:
        wire = t.to(device)
        wait_all([first.broadcast(wire, 0)], flags, gen, bound_s)
        return wire.cpu()

    skeleton_bytes = 0
    if share is not None:
        skeleton_obj = _split(provider.state_dict(), tensors)
        sizes = [t.numel() * t.element_size() for t in tensors]
        bound_s = heal_bound_s(sum(sizes), bytes_per_s)
        if share == 0:
            buffer = io.BytesIO()
            torch.save(skeleton_obj, buffer)
            skeleton = buffer.getvalue()
            skeleton_bytes = len(skeleton)
            bcast(torch.tensor([skeleton_bytes, int(bound_s * 1000)], dtype=torch.int64), HEAL_FLOOR_S)
            bcast(torch.frombuffer(bytearray(skeleton), dtype=torch.uint8), bound_s)
    else:
        header = bcast(torch.zeros(2, dtype=torch.int64), HEAL_FLOOR_S)
        skeleton_bytes, bound_s = int(header[0]), int(header[1]) / 1000
        skeleton_obj = _load_skeleton(bcast(torch.empty(skeleton_bytes, dtype=torch.uint8), bound_s).numpy().tobytes())
        meshes = check_layout(skeleton_obj, provider.sharded())
    if fault_point is not None:
        fault_point("heal_donor" if share is not None else "heal_recipient")

    t0 = time.monotonic()
    if share is not None:
        payload = [tensors[i].detach().to(device).contiguous() for i in shares(sizes, count)[share]]
        works = [first.broadcast(t, 0) for t in payload if t.numel()]  # uneven shards can be empty
    else:
        slots: list[_TensorSlot] = []
        _collect_slots(skeleton_obj, slots)
        slots.sort(key=lambda s: s.index)
        payload = [torch.empty(s.shape, dtype=s.dtype, device=device) for s in slots]
        runs = shares([t.numel() * t.element_size() for t in payload], len(groups))
        works = [groups[j].broadcast(payload[i], 0) for j, run in enumerate(runs) for i in run if payload[i].numel()]
    wait_all(works, flags, gen, bound_s)
    moved = Moved(sum(t.numel() * t.element_size() for t in payload) + skeleton_bytes, time.monotonic() - t0, bound_s)
    if share is not None:
        return None, moved
    return _join(skeleton_obj, payload, meshes), moved


def _load_skeleton(raw: bytes) -> Any:
    """The donor's skeleton, read with torch's `weights_only` unpickler: containers, numbers, strings, dtypes,
    DTensor placements and the types named in `_SKELETON_TYPES` only. Whatever else a skeleton names is refused, not
    run: a process that took the donor's place (or a front end's state holding an object) fails the heal with the
    type named."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import Partial, _StridedShard  # FSDP over TP's shards: strided

    try:
        with torch.serialization.safe_globals([*_SKELETON_TYPES, Shard, Replicate, Partial, _StridedShard]):
            return torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch's UnpicklingError names the type it refused
        raise ProtocolError("heal", f"the donor's state holds a type a heal does not carry ({_first_line(e)}): keep "
                            "the state's non-tensor values to numbers, strings, paths, lists and dicts") from None


def _first_line(e: BaseException) -> str:
    return next((line.strip() for line in str(e).splitlines() if "GLOBAL" in line or "Unsupported" in line),
                str(e).splitlines()[0] if str(e) else type(e).__name__)


def _collect_slots(obj: Any, out: list[_TensorSlot]) -> None:
    if isinstance(obj, _TensorSlot):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect_slots(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _collect_slots(v, out)
