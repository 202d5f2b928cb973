"""`faults`: the fault specs, their points and lists."""

from __future__ import annotations

import pytest
import torch

from monarch_plugin import ConfigError, FaultSpec
from monarch_plugin.faults import parse_faults

pytestmark = pytest.mark.timeout(60)


def test_fault_spec_parsing():
    spec = FaultSpec.parse("sigkill:replica=1:step=20")
    assert (spec.mode, spec.replica, spec.step, spec.at) == ("sigkill", 1, 20, "step")
    assert spec.applies(1, 20) and not spec.applies(0, 20) and not spec.applies(1, 19)
    assert not spec.applies(1, 20, at="construct")
    assert FaultSpec.parse("raise:step=3").applies(7, 3)


def test_fault_points_and_lists():
    faults = parse_faults("sigkill:replica=1:step=5, stop:replica=3:at=construct,hang:replica=0:at=heal_donor:step=2")
    assert [(f.mode, f.replica, f.at, f.step) for f in faults] == [
        ("sigkill", 1, "step", 5), ("stop", 3, "construct", None), ("hang", 0, "heal_donor", 2)]
    construct, donor = faults[1], faults[2]
    assert construct.applies(3, 0, at="construct") and construct.applies(3, 99, at="construct")
    assert not construct.applies(3, 0, at="arrived") and not construct.applies(4, 0, at="construct")
    assert not donor.applies(0, 1, at="heal_donor") and donor.applies(0, 2, at="heal_donor")  # after step 2
    # Named replicas are hit even as replacements; unnamed faults only hit the replicas spawned at the start.
    assert construct.targets(3, initial=False) and not construct.targets(2, initial=True)
    unnamed = FaultSpec.parse("raise:step=3")
    assert unnamed.targets(0, initial=True) and not unnamed.targets(5, initial=False)
    one_proc = FaultSpec.parse("hang:replica=1:lane=1:step=5")
    assert one_proc.targets(1, initial=True, lane=1) and not one_proc.targets(1, initial=True, lane=0)
    assert parse_faults(None) == () and parse_faults("") == ()
    with pytest.raises(ConfigError, match="unknown fault point at='somewhere'.*choose one of step, forward"):
        parse_faults("sigkill:replica=1:step=5,sigkill:at=somewhere")


def test_faults_mid_forward_and_backward_fire_at_their_exact_step_and_an_oom_is_torchs():
    forward, oom = parse_faults("raise:replica=1:step=4:at=forward,oom:replica=2:step=6:at=backward")
    assert forward.applies(1, 4, at="forward") and not forward.applies(1, 5, at="forward")
    assert not forward.applies(1, 4) and not forward.applies(1, 4, at="backward")
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory.*injected at the backward of step 6"):
        oom.fire()
    with pytest.raises(ConfigError, match="needs a step"):
        parse_faults("raise:replica=1:at=backward")
