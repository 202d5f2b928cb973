"""The controller's policies, as the pure functions it calls: who trains next, respawns, when to stop."""

from __future__ import annotations

import pytest

from monarch_plugin.controller import policies
from monarch_plugin.config import ElasticConfig
from monarch_plugin.wire.protocol import Raised

pytestmark = pytest.mark.timeout(60)


def test_after_a_death_survivors_then_ready_replicas_train_up_to_the_target_size():
    assert policies.next_members([0, 2], [4, 5], wanted=3) == [0, 2, 4]  # one spare in; the other stays a spare
    assert policies.next_members([0], [], wanted=3) == [0]
    assert policies.admit([0, 2], [4, 5], wanted=3) == [4]
    assert policies.admit([0, 1, 2], [4], wanted=3) == []  # full: a ready replacement waits as a hot spare


def test_a_machine_joining_mid_run_grows_the_run_up_to_max_replicas():
    config = ElasticConfig(replicas=2, max_replicas=5)
    assert policies.grown(2, slots=2, config=config) == 4
    assert policies.grown(4, slots=2, config=config) == 5
    assert policies.grown(2, slots=1, config=ElasticConfig(replicas=2)) == 2  # max_replicas defaults to replicas


def test_too_few_survivors_stop_the_run_naming_the_setting():
    config = ElasticConfig(replicas=3, min_replicas=2)
    assert policies.below_min(2, config) is None
    assert "below `min_replicas` 2" in policies.below_min(1, config)


def test_a_ready_replacement_counts_towards_min_replicas_with_the_survivor_it_heals_from():
    config = ElasticConfig(replicas=3, min_replicas=2)
    members = policies.next_members([2], [3], wanted=3)  # replica 1 died, 3 is ready, then 0 died too
    assert members == [2, 3] and policies.below_min(len(members), config) is None


def test_a_run_with_no_holder_of_its_state_left_restores_its_checkpoint_or_stops():
    assert policies.state_lost("/ckpt/step00000040") is None
    stop = policies.state_lost(None)
    assert stop.startswith("the last replica holding the run's trained state died") and "`checkpoint_steps`" in stop


def test_replacements_that_die_before_joining_back_off_then_stop_the_run():
    config = ElasticConfig(restart_backoff_s=1.0, crash_loop_limit=3)
    assert [policies.respawn_delay(n, config) for n in range(4)] == [0.0, 1.0, 2.0, 4.0]
    assert policies.respawn_delay(20, config) == policies.MAX_BACKOFF_S
    assert policies.respawn_delay(3, ElasticConfig(restart_backoff_s=0)) == 0.0
    assert policies.crash_loop(2, config) is None and "crash loop" in policies.crash_loop(3, config)
    assert policies.crash_loop(100, ElasticConfig(crash_loop_limit=0)) is None  # 0: never


def test_a_replica_is_respawned_only_while_one_is_missing_and_restarts_are_left():
    config = ElasticConfig(replicas=2, spares=1, max_restarts=2)
    assert policies.respawn_wanted(live=2, scheduled=0, wanted=2, config=config)  # the spare is missing
    assert not policies.respawn_wanted(live=2, scheduled=1, wanted=2, config=config)
    assert policies.respawn_wanted(live=3, scheduled=0, wanted=3, config=config)  # grown by a machine
    assert policies.respawn_refused(restarts=1, scheduled=0, config=config) is None
    assert policies.respawn_refused(restarts=1, scheduled=1, config=config) == "`max_restarts` 2 used"


def test_replicas_spread_over_the_hosts_with_room_and_a_full_run_has_nowhere_to_go():
    assert policies.place({0: (2, set()), 1: (2, set())}) == (0, 0)
    assert policies.place({0: (2, {0}), 1: (2, set())}) == (1, 0)  # spread before doubling up
    assert policies.place({0: (2, {1}), 1: (2, {0})}) == (0, 0)  # a freed slot is reused
    assert policies.place({1: (2, {0, 1}), 2: (1, set())}) == (2, 0)  # host 0 lost: not offered
    assert policies.place({0: (1, {0}), 1: (1, {0})}) is None


def test_after_an_out_of_memory_the_run_never_trains_on_fewer_replicas_under_a_constant_global_batch():
    assert policies.oom_floor(3, ElasticConfig(replicas=3)) == 3
    assert policies.oom_floor(3, ElasticConfig(replicas=3, batch_policy="constant_local")) == 0  # shares keep size
    config = ElasticConfig(replicas=3, join_timeout_s=60)
    assert policies.short_of_floor(members=2, coming=1, floor=3, waited_s=1, config=config) is None
    stop = policies.short_of_floor(members=2, coming=0, floor=3, waited_s=1, config=config)
    assert "trains on no fewer than 3" in stop and "no replacement is coming" in stop
    assert "`spares`" in stop and "constant_local" in stop
    stop = policies.short_of_floor(members=2, coming=1, floor=3, waited_s=61, config=config)  # never unbounded
    assert "waited `join_timeout_s` 60 for the replacements" in stop


def test_the_same_exception_at_the_same_step_in_two_replicas_is_the_codes_own():
    raised = Raised(replica=2, lane=0, error="ValueError: bad", kind="builtins.ValueError", traceback="", step=7)
    why = policies.same_error(0, 2, raised)
    assert "at step 7 in replica 0 and again in replica 2" in why and "ValueError: bad" in why
    oom = Raised(replica=2, lane=0, error="OutOfMemoryError: CUDA out of memory", kind="torch.OutOfMemoryError",
                 traceback="", step=7, oom=True)
    assert "both ran out of memory at step 7" in policies.same_error(0, 2, oom)


def test_a_drain_goes_on_above_min_replicas_and_stops_with_a_checkpoint_below_it_or_when_everyone_is_told():
    config = ElasticConfig(replicas=3, min_replicas=2)
    assert policies.drain_stop(2, [1], "SIGTERM", config) is None
    assert "below `min_replicas` 2" in policies.drain_stop(1, [1, 2], "SIGTERM", config)
    assert "to every replica" in policies.drain_stop(0, [0, 1, 2], "SIGUSR1", config)
