"""`hangs`: who a probe's answers show hung, and why, as the pure functions the controller calls."""

from __future__ import annotations

import pytest

from monarch_plugin.controller import hangs

pytestmark = pytest.mark.timeout(60)


def _status(phase: str, seconds: float, step: int = 7, forming: int = 0) -> dict:
    """One proc's answer, as its control actor gives it: in `phase` (a `Phase`'s value) for `seconds`, at `step`,
    forming generation `forming`."""
    return {"phase": phase, "since": 100.0, "now": 100.0 + seconds, "step": step, "forming": forming}


def test_the_member_stuck_outside_the_reduction_past_the_bound_is_hung_not_its_waiting_peers():
    answers = {0: [_status("reduce", 40.0)], 1: [_status("compute", 40.0, step=8)], 2: [_status("compute", 1.0)]}
    verdict = hangs.judge_stall(answers, {0, 1, 2}, bound=30.0, unfit={2: "heal past its bound"})
    assert list(verdict.hung) == [1]  # the waiting peer and the member busy for 1 s are not; nor the unfit one
    assert verdict.how == "hang"
    assert "at step 8 for 40.0 s, past collective_timeout_s 30" in verdict.hung[1]
    assert set(verdict.probed) == {0, 1, 2}  # what every member was doing, suspected or not
    assert verdict.probed[0] == f"reduce for 40.0 s at step 7"


def test_a_member_that_does_not_answer_is_hung_as_frozen():
    verdict = hangs.judge_stall({0: [_status("compute", 1.0)], 1: None}, {0, 1}, bound=30.0, unfit={})
    assert verdict.hung == {1: f"no answer from its control actor in {hangs.PROBE_TIMEOUT_S:.0f} s (frozen)"}
    assert verdict.probed[1] == verdict.hung[1]


def test_with_nobody_to_blame_the_members_reported_unfit_go_and_with_none_nobody_does():
    answers = {0: [_status("compute", 1.0)], 1: [_status("compute", 2.0)]}
    unfit = hangs.judge_stall(answers, {0, 1}, bound=30.0, unfit={1: "its procs disagree", 5: "gone already"})
    assert (unfit.hung, unfit.how) == ({1: "its procs disagree"}, "reported unfit")  # 5 is no member any more
    assert hangs.judge_stall(answers, {0, 1}, bound=30.0, unfit={}).hung == {}  # the same members form again


def test_a_member_that_died_while_the_probe_was_out_is_not_judged():
    verdict = hangs.judge_stall({0: None, 1: [_status("compute", 1.0)]}, {1}, bound=30.0, unfit={})
    assert verdict.hung == {} and set(verdict.probed) == {1}


def test_a_member_still_forming_an_older_generation_is_wedged():
    answers = {
        0: [_status("join", 9.0, forming=4)],  # in the current generation's formation
        1: [_status("join", 9.0, forming=3), _status("join", 9.0, forming=2)],  # its oldest named
        2: None,  # a wedge is found in an answer: silence is a stall's to judge
        3: [_status("join", 9.0, forming=2)],  # no member any more
    }
    assert hangs.judge_wedged(answers, {0, 1, 2}, gen=4) == {1: "still forming generation 2 in generation 4"}


def test_a_generation_is_probed_for_wedged_members_once_past_the_formation_bound_while_it_trains():
    bound = 10.0
    due = bound + 2 * hangs.STALL_GRACE_S
    assert hangs.wedge_due(3, checked=2, waiting=False, since_announced=due, bound=bound)
    assert not hangs.wedge_due(3, checked=2, waiting=False, since_announced=due - 0.1, bound=bound)
    assert not hangs.wedge_due(3, checked=3, waiting=False, since_announced=due, bound=bound)  # once
    assert not hangs.wedge_due(3, checked=2, waiting=True, since_announced=due, bound=bound)  # nobody forms
    assert not hangs.wedge_due(-1, checked=-2, waiting=False, since_announced=due, bound=bound)  # none yet


def test_a_replica_not_ready_within_join_timeout_s_of_its_spawn_is_stuck_before_training():
    stuck = hangs.never_ready({0: 100.0, 1: 150.0}, now=161.0, bound=60.0)
    assert list(stuck) == [0]
    assert stuck[0].startswith("not ready 60 s after its spawn began (`join_timeout_s`)")
