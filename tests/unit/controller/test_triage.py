"""`triage`: whether what a replica's training code raised is that replica's failure or the code's own bug."""

from __future__ import annotations

import pytest

from monarch_plugin.controller import triage
from monarch_plugin.wire.protocol import Raised

pytestmark = pytest.mark.timeout(60)


def _raised(replica: int = 0, kind: str = "torch.OutOfMemoryError", step: int = 5, **fields) -> Raised:
    return Raised(replica=replica, lane=0, error=f"{kind.rsplit('.')[-1]}: boom", kind=kind,
                  traceback=f"Traceback of replica {replica}\n", step=step, **fields)


def test_the_code_fails_wherever_it_runs_when_it_cannot_load_sets_up_or_after_training():
    assert triage.at_once(_raised(stage="load", step=-1), initial=False)
    assert triage.at_once(_raised(step=-1), initial=True)  # set-up, which every replica runs alike
    assert not triage.at_once(_raised(step=-1), initial=False)  # a replacement's set-up may meet a bad machine
    assert triage.at_once(_raised(finished=True), initial=False)
    assert not triage.at_once(_raised(), initial=True)  # mid-training: that replica's failure
    assert not triage.at_once(_raised(step=-1, runtime="join"), initial=True)  # the runtime's own failure


def test_the_same_exception_at_the_same_step_in_another_replica_is_its_twin():
    first, other_step, same_replica = _raised(0), _raised(1, step=6), _raised(2)
    raises = [(0, first), (1, other_step), (2, same_replica)]
    assert triage.twin(raises, 3, _raised(3)) == (0, first)
    assert triage.twin(raises[1:], 2, _raised(2)) is None  # its own earlier report is no twin
    assert triage.twin(raises, 3, _raised(3, kind="RuntimeError")) is None
    assert triage.twin(raises, 3, _raised(3, step=-1)) is None  # before a first step: nothing to match on
    assert triage.twin(raises, 3, _raised(3, runtime="heal")) is None
    assert triage.twin([(0, _raised(0, runtime="heal"))], 3, _raised(3)) is None


def test_the_messages_say_when_it_raised_and_what_the_death_was():
    assert triage.how(_raised()) == "raised OutOfMemoryError at step 5"
    assert triage.how(_raised(step=-1, runtime="heal")) == "its monarch-plugin heal failed before its first step"
    load = triage.code_error(3, _raised(stage="load", step=-1))
    assert load.startswith("replica 3 could not load the target (OutOfMemoryError: boom)")
    assert load.endswith("--- replica traceback ---\nTraceback of replica 0\n")
    assert "after training ended" in triage.code_error(3, _raised(finished=True))
    assert "while setting up" in triage.code_error(3, _raised(step=-1))
    assert triage.tracebacks([(0, _raised(0)), (4, _raised(4))]) == (
        "\n--- replica 0 traceback ---\nTraceback of replica 0\n--- replica 4 traceback ---\nTraceback of replica 4")
