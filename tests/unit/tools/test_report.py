"""`report`: what the recovery report says of a run's events."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.timeout(60)


def test_recovery_report_says_why_a_replacement_never_trained():
    from monarch_plugin.tools.report import format_recovery, recoveries

    events = [
        {"ts": 1.0, "event": "quorum", "gen": 0, "members": [0, 1]},
        {"ts": 2.0, "event": "death", "replica": 1, "detected_by": "pidfd", "gen": 0},
        {"ts": 2.0, "event": "quorum", "gen": 1, "members": [0]},
        {"ts": 2.1, "event": "first_commit", "replica": 0, "gen": 1, "step": 5},
        {"ts": 5.0, "event": "spawn", "replica": 2, "seconds": 2.5, "pids": [9]},
        {"ts": 5.5, "event": "quorum", "gen": 2, "members": [0, 2]},
    ]
    assert "the run ended before it trained" in format_recovery(recoveries(events)[0])
    died = events + [{"ts": 6.0, "event": "death", "replica": 2, "detected_by": "pidfd", "gen": 2}]
    text = format_recovery(recoveries(died)[0])
    assert "died before it trained" in text and "None" not in text


def test_recovery_report_of_a_restore_says_what_is_trained_again_never_no_step_lost():
    """The last holder (replica 0) dies serving replica 2's heal: the next generation restores step 10's checkpoint
    though the run had committed 14 steps."""
    from monarch_plugin.tools.report import format_recovery, format_summary, recoveries

    events = [
        {"ts": 1.0, "event": "quorum", "gen": 0, "members": [0, 1], "action": "train"},
        {"ts": 2.0, "event": "death", "replica": 1, "detected_by": "pidfd", "gen": 0},
        {"ts": 2.0, "event": "quorum", "gen": 1, "members": [0], "action": "train"},
        {"ts": 2.1, "event": "first_commit", "replica": 0, "gen": 1, "step": 8},
        {"ts": 2.6, "event": "spawn", "replica": 2, "seconds": 0.5, "pids": [9]},
        {"ts": 2.7, "event": "quorum", "gen": 2, "members": [0, 2], "action": "train"},
        {"ts": 2.8, "event": "death", "replica": 0, "detected_by": "pidfd", "gen": 2},
        {"ts": 2.8, "event": "quorum", "gen": 3, "members": [2], "action": "restore", "checkpoint": "/c/s10.pt"},
        {"ts": 2.8, "event": "restore", "gen": 3, "members": [2], "path": "/c/s10.pt", "step": 10},
        {"ts": 2.9, "event": "restored", "replica": 2, "gen": 3, "step": 10, "newest_seen": 14},
        {"ts": 3.0, "event": "first_commit", "replica": 2, "gen": 3, "step": 10},
    ]
    second = recoveries(events)[1]
    assert (second.restored_step, second.redone_steps, second.restored_by) == (10, 4, [2])
    text = format_recovery(second)
    assert "no step lost" not in text
    assert "replicas [2] restored the checkpoint of step 10, and train again the 4 step(s)" in text
    assert any("restored step 10, 4 redone" in line for line in format_summary(events))


def test_recovery_report_of_an_out_of_memory_says_the_survivors_waited_and_times_it_to_their_next_commit():
    from monarch_plugin.tools.report import format_recovery, recoveries

    events = [
        {"ts": 1.0, "event": "quorum", "gen": 0, "members": [0, 1, 2], "action": "train"},
        {"ts": 2.0, "event": "fault_injected", "replica": 1, "step": 6},
        {"ts": 2.01, "event": "death", "replica": 1, "detected_by": "raised OutOfMemoryError at step 6", "gen": 0},
        {"ts": 2.01, "event": "quorum", "gen": 1, "members": [0, 2], "action": "wait"},
        {"ts": 2.3, "event": "spawn", "replica": 3, "seconds": 0.3, "pids": [9]},
        {"ts": 2.4, "event": "quorum", "gen": 2, "members": [0, 2, 3], "action": "train"},
        {"ts": 2.5, "event": "first_commit", "replica": 0, "gen": 2, "step": 6},
        {"ts": 2.5, "event": "first_commit", "replica": 3, "gen": 2, "step": 6},
    ]
    [rec] = recoveries(events)
    assert rec.waited and rec.survivors == [0, 2] and rec.phases()["kill_to_next_commit"] == pytest.approx(0.5)
    text = format_recovery(rec)
    assert text.startswith("replica 1 raised OutOfMemoryError at step 6 (noticed 10 ms after it was raised)")
    assert "survivors [0, 2] waited for the replacement, training nothing" in text and "500 ms after" in text


# A torchtitan run's events (`--monarch.fault sigkill:replica=0:step=3`, 2 replicas x 2 procs, `--training.steps 6`),
# trimmed to the fields the report reads: the writer (replica 0) dies, the survivor reaches step 6 alone and the run
# ends 5 s after replica 2 was spawned for it, before replica 2 could join a generation.
_WRITER_DEATH = """
{"ts": 552.631, "event": "spawn", "replica": 0, "initial": true, "seconds": 16.083}
{"ts": 554.008, "event": "spawn", "replica": 1, "initial": true, "seconds": 17.457}
{"ts": 588.56, "event": "quorum", "gen": 0, "members": [0, 1]}
{"ts": 588.759, "event": "heal", "gen": 0, "recipients": [1], "step": 0, "bytes": 14703208, "seconds": 0.1784}
{"ts": 588.76, "event": "heal", "gen": 0, "recipients": [1], "step": 0, "bytes": 14703214, "seconds": 0.1811}
{"ts": 590.6, "event": "first_commit", "replica": 1, "gen": 0, "step": 1}
{"ts": 590.607, "event": "first_commit", "replica": 0, "gen": 0, "step": 1}
{"ts": 590.732, "event": "first_commit", "replica": 1, "gen": 0, "step": 1}
{"ts": 591.083, "event": "first_commit", "replica": 0, "gen": 0, "step": 1}
{"ts": 593.165, "event": "fault_injected", "replica": 0, "step": 3}
{"ts": 593.166, "event": "fault_injected", "replica": 0, "step": 3}
{"ts": 593.354, "event": "death", "replica": 0, "detected_by": "pidfd (pid 19648 exited)", "gen": 0}
{"ts": 593.363, "event": "quorum", "gen": 1, "members": [1]}
{"ts": 594.639, "event": "dropped_step", "replica": 1, "step": 3, "gen": 0}
{"ts": 594.644, "event": "dropped_step", "replica": 1, "step": 3, "gen": 0}
{"ts": 597.069, "event": "first_commit", "replica": 1, "gen": 1, "step": 3}
{"ts": 597.072, "event": "first_commit", "replica": 1, "gen": 1, "step": 3}
{"ts": 603.266, "event": "spawn", "replica": 2, "initial": false, "seconds": 9.903}
{"ts": 608.36, "event": "finished", "replica": 1, "gen": 1}
{"ts": 608.36, "event": "run_end", "gen": 1, "members": [1]}
"""


# The same job with the survivor waiting for the regrow (`--probe.shrunk_steps 2`): replica 2 joins generation 2,
# is healed shard by shard from replica 1 (both shards at once: the heal is their sum), and both procs of each
# replica commit step 6 in it.
_WRITER_DEATH_REGROWN = """
{"ts": 31.552, "event": "spawn", "replica": 0, "initial": true, "seconds": 17.142}
{"ts": 31.797, "event": "spawn", "replica": 1, "initial": true, "seconds": 17.384}
{"ts": 51.839, "event": "quorum", "gen": 0, "members": [0, 1]}
{"ts": 54.585, "event": "first_commit", "replica": 0, "gen": 0, "step": 1}
{"ts": 54.589, "event": "first_commit", "replica": 1, "gen": 0, "step": 1}
{"ts": 56.182, "event": "fault_injected", "replica": 0, "step": 3}
{"ts": 56.405, "event": "death", "replica": 0, "detected_by": "pidfd (pid 15447 exited)", "gen": 0}
{"ts": 56.407, "event": "quorum", "gen": 1, "members": [1]}
{"ts": 57.471, "event": "dropped_step", "replica": 1, "step": 3, "gen": 0}
{"ts": 59.087, "event": "first_commit", "replica": 1, "gen": 1, "step": 3}
{"ts": 59.095, "event": "first_commit", "replica": 1, "gen": 1, "step": 3}
{"ts": 64.668, "event": "spawn", "replica": 2, "initial": false, "seconds": 8.261}
{"ts": 74.215, "event": "quorum", "gen": 2, "members": [1, 2]}
{"ts": 75.135, "event": "heal", "gen": 2, "recipients": [2], "step": 5, "bytes": 39365200, "seconds": 0.2847}
{"ts": 75.189, "event": "heal", "gen": 2, "recipients": [2], "step": 5, "bytes": 39365202, "seconds": 0.3408}
{"ts": 76.402, "event": "first_commit", "replica": 1, "gen": 2, "step": 6}
{"ts": 76.408, "event": "first_commit", "replica": 1, "gen": 2, "step": 6}
{"ts": 76.88, "event": "first_commit", "replica": 2, "gen": 2, "step": 6}
{"ts": 77.045, "event": "first_commit", "replica": 2, "gen": 2, "step": 6}
"""


def test_recovery_report_of_a_writer_death_names_the_replacement_whether_or_not_it_joined():
    from monarch_plugin.tools.report import format_recovery, recoveries

    [rec] = recoveries([json.loads(line) for line in _WRITER_DEATH.splitlines() if line])
    assert (rec.survivors, rec.dropped_steps, rec.replacement, rec.replacement_joined) == ([1], [3], 2, False)
    assert format_recovery(rec).splitlines() == [
        "replica 0 died (noticed by pidfd (pid 19648 exited), 189 ms after the kill)",
        "  survivors [1] kept training: next committed step 3904 ms after the kill (dropped step [3])",
        "  replacement replica 2: spawned in 9903 ms, the run ended before it joined",
    ]
    [rec] = recoveries([json.loads(line) for line in _WRITER_DEATH_REGROWN.splitlines() if line])
    assert (rec.replacement, rec.replacement_joined, rec.participating_step) == (2, True, 6)
    assert format_recovery(rec).splitlines()[-1] == (
        "  replacement replica 2: spawned in 8261 ms, healed from a live peer in 341 ms (78.7 MB), training at step 6 "
        "20473 ms after spawn began")


def test_a_drained_replica_gets_its_own_line_not_a_recovery():
    from monarch_plugin.tools.report import drains, recoveries

    events = [{"event": "notice", "ts": 1.0, "replica": 1, "signal": "SIGTERM", "pid": 7},
              {"event": "drain", "ts": 1.3, "replicas": [1], "gen": 1, "members": [0, 2], "signal": "SIGTERM"},
              {"event": "drained", "ts": 1.5, "replica": 1, "gen": 1, "seconds": 0.5}]
    assert drains(events) == ["replica 1 drained on SIGTERM: left at a step boundary 0.50 s after it, nothing dropped"]
    assert recoveries(events) == []
