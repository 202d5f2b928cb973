"""`procs.devices`: each replica slot's own GPUs."""

from __future__ import annotations

import pytest

from monarch_plugin import ConfigError
from monarch_plugin.procs.devices import plan_gpus

pytestmark = pytest.mark.timeout(60)


def test_each_replica_slot_sees_its_own_gpus():
    assert plan_gpus("cpu", 0, {}, slots=4, procs_per_replica=2) is None
    plan = plan_gpus("cuda", 8, {}, slots=3, procs_per_replica=2)
    assert [plan.env_for_slot(s) for s in range(3)] == [
        {"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}, {"CUDA_VISIBLE_DEVICES": "4,5"}]
    # The controller's own narrowing is respected, on ROCm through the variable it was narrowed by.
    plan = plan_gpus("rocm", 3, {"HIP_VISIBLE_DEVICES": "5,6,7"}, slots=3, procs_per_replica=1)
    assert plan.env_for_slot(2) == {"HIP_VISIBLE_DEVICES": "7"}
    plan = plan_gpus("rocm", 2, {"CUDA_VISIBLE_DEVICES": "2,3"}, slots=2, procs_per_replica=1)
    assert plan.env_for_slot(1) == {"CUDA_VISIBLE_DEVICES": "3"}
    assert plan_gpus("rocm", 2, {}, slots=2, procs_per_replica=1).env_for_slot(0) == {"HIP_VISIBLE_DEVICES": "0"}
    with pytest.raises(ConfigError, match=r"need 6 GPUs, but 4 are visible.*lower --replicas or --spares"):
        plan_gpus("cuda", 4, {}, slots=3, procs_per_replica=2)
