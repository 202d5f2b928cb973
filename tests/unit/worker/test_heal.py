"""`worker.heal`: the heal's bound, its donors (holders of the run's state only), its shares and its shard check."""

from __future__ import annotations

import pytest

from monarch_plugin.worker.heal import (
    ASSUMED_BYTES_PER_S,
    HEAL_FLOOR_S,
    heal_bound_s,
    plan_heal,
    shares,
)

pytestmark = pytest.mark.timeout(60)


def test_heal_bound_follows_the_state_size_and_the_measured_rate():
    assert heal_bound_s(1_000_000, None) == HEAL_FLOOR_S  # small state: the floor
    assert heal_bound_s(10**9, 1e9) == HEAL_FLOOR_S  # 1 GB at a measured 1 GB/s: 4 s, so the floor
    assert heal_bound_s(100 * 10**9, 1e9) == pytest.approx(400.0)  # a big state is not cut off at 60 s
    assert heal_bound_s(10**9, None) == pytest.approx(4 * 10**9 / ASSUMED_BYTES_PER_S)  # no rate measured yet


def test_heal_plan_picks_donors_at_the_newest_step():
    held = [True] * 4
    assert plan_heal([5, 5], [False, False], held[:2]) is None
    plan = plan_heal([5, 5, -1], [False, False, True], [True, True, False])
    assert (plan.donors, plan.recipients, plan.step) == ((0,), (2,), 5)
    assert plan_heal([5, 5, -1], [False, False, True], [True, True, False], max_donors=2).donors == (0, 1)
    plan = plan_heal([4, 5, 5, 5], [False, False, False, True], [True, True, True, False], max_donors=2)
    assert (plan.donors, plan.recipients) == ((1, 2), (0, 3))  # never one that is behind: a survivor dropped a step
    plan = plan_heal([0, 0, 0], [True, True, True], held[:3], max_donors=2)  # first generation: rank 0 alone seeds
    assert (plan.donors, plan.recipients) == ((0,), (1, 2))


def test_only_a_holder_of_the_runs_state_ever_serves_a_heal():
    # A newcomer that joined alone once (its donor died mid-heal) is not fresh, and may even be ahead: still no donor.
    plan = plan_heal([3, 9], [False, False], [True, False], max_donors=2)
    assert (plan.donors, plan.recipients, plan.step) == ((0,), (1,), 3)
    # A late initial replica (fresh, at step 0) that is not a holder, beside the holders: a recipient.
    plan = plan_heal([0, 7, 7], [True, False, False], [False, True, True], max_donors=1)
    assert (plan.donors, plan.recipients) == ((1,), (0,))
    # The first generation seeds from its lowest-rank holder, not from rank 0.
    plan = plan_heal([0, 0, 0], [True, True, True], [False, True, True])
    assert (plan.donors, plan.recipients) == ((1,), (0, 2))
    with pytest.raises(RuntimeError, match="no member of this generation holds the run's trained state"):
        plan_heal([0, 12], [True, False], [False, False])


def test_shares_split_the_tensors_by_bytes_without_cutting_one():
    assert shares([10, 10, 10, 10], 1) == [range(0, 4)]
    assert shares([10, 10, 10, 10], 2) == [range(0, 2), range(2, 4)]
    assert shares([40, 1, 1, 1, 37], 2) == [range(0, 1), range(1, 5)]  # the nearer boundary: 40 / 40
    assert shares([100, 1], 3) == [range(0, 0), range(0, 1), range(1, 2)]  # one tensor outweighs the rest: empty
    sizes = [4096 * 1024 * 4, 4096 * 4, 1024 * 4096 * 4, 1024 * 4, 8] * 3  # an MLP's weights and Adam's moments
    split = shares(sizes, 2)
    assert [i for run in split for i in run] == list(range(len(sizes)))  # every tensor once, in order
    halves = [sum(sizes[i] for i in run) for run in split]
    assert abs(halves[0] - halves[1]) <= max(sizes)


class _RunsCode:
    def __reduce__(self):
        return (print, ("a donor's skeleton ran code in its receiver",))


def test_a_skeleton_is_read_as_data_and_one_naming_other_code_is_refused_not_run(capsys):
    """The receiver reads the donor's skeleton with torch's `weights_only` unpickler: slots, placements, an RNG state
    come back; anything else it names is refused (whoever sent it), and nothing of it runs."""
    import io
    import pathlib
    import random

    import torch
    from torch.distributed.tensor import Replicate, Shard

    from monarch_plugin.errors import ProtocolError
    from monarch_plugin.worker.heal import _ShardSlot, _TensorSlot, _load_skeleton
    from monarch_plugin.worker.transaction import rng_state

    def wire(obj) -> bytes:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        return buffer.getvalue()

    skeleton = {"w": _TensorSlot(0, (2, 3), torch.float32, True), "rng": rng_state(torch.device("cpu")),
                "s": _ShardSlot(1, (2,), torch.bfloat16, False, (Shard(0), Replicate()), (4,), (1,), ("fsdp", "tp")),
                "optimizer": [{"lr": 0.1, "betas": (0.9, 0.999), "name": None}], "python": random.getstate(),
                "callbacks": {"SpikeDetection": {"exclude_batches_path": pathlib.Path("/runs/a")}}}
    back = _load_skeleton(wire({**skeleton, "rng": {**skeleton["rng"], "torch": _TensorSlot(2, (8,), torch.uint8,
                                                                                            True)}}))
    assert back["s"] == skeleton["s"] and back["w"] == skeleton["w"] and back["python"] == skeleton["python"]
    assert back["callbacks"] == skeleton["callbacks"]  # a Lightning callback's state holding a path
    with pytest.raises(ProtocolError, match="a heal does not carry"):
        _load_skeleton(wire({"w": skeleton["w"], "x": _RunsCode()}))
    assert "ran code" not in capsys.readouterr().out


@pytest.fixture
def one_proc_group():
    """A real one-proc gloo group over an in-memory store (nothing listens), for building DTensors."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_donor_whose_shards_are_not_this_replicas_is_refused_before_any_tensor_moves(one_proc_group):
    """TP x FSDP: the receiver checks mesh dimensions, placements and shapes of every shard it holds against the
    donor's skeleton, and rebuilds each shard on its own mesh of the donor's dimension names."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from monarch_plugin.errors import ProtocolError
    from monarch_plugin.worker.heal import _join, _split, check_layout

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("fsdp", "tp"))
    own = {"model": [{"w": DTensor.from_local(torch.ones(4, 2), mesh, (Shard(0), Shard(1))), "b": torch.zeros(2)}]}
    tensors: list = []
    skeleton = _split({**own, "optimizers": [{"exp_avg": own["model"][0]["w"]}]}, tensors)
    meshes = check_layout(skeleton, own)
    assert meshes == {("fsdp", "tp"): mesh}
    back = _join(skeleton, tensors, meshes)
    assert back["optimizers"][0]["exp_avg"].placements == (Shard(0), Shard(1))

    replicated = {"model": [{"w": DTensor.from_local(torch.ones(4, 2), mesh, (Shard(0), Replicate())),
                             "b": torch.zeros(2)}]}
    with pytest.raises(ProtocolError, match=r"the donor's shard of model.0.w is .*Replicate.* this replica's is "
                                            r".*Shard\(dim=1\).*the same parallelism"):
        check_layout(_split(replicated, []), own)
    other = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
    flat = {"model": [{"w": DTensor.from_local(torch.ones(4, 2), other, (Shard(0),)), "b": torch.zeros(2)}]}
    with pytest.raises(ProtocolError, match=r"model.0.w"):
        check_layout(_split(flat, []), own)
    unsharded = {"model": [{"w": torch.ones(4, 2), "b": torch.zeros(2)}]}
    with pytest.raises(ProtocolError, match=r"model.0.w is not sharded"):
        check_layout(_split(unsharded, []), own)
