"""The wire protocol's pure parts, and the RNG capture every front end heals with."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch

from monarch_plugin.wire.protocol import (
    WAITING_ON_PEERS,
    Action,
    Drain,
    Key,
    Outcome,
    Phase,
    Plan,
    ReplicaState,
    mesh_names,
    replica_of_mesh,
    spawned_by_controller,
    unfit_line,
    unfit_members,
    watcher_names,
)
from monarch_plugin.worker.transaction import rng_state, set_rng_state

pytestmark = pytest.mark.timeout(60)


def test_a_plan_round_trips_through_the_store_text():
    plan = Plan(gen=3, members=[0, 2], action=Action.CHECKPOINT, reason="giving up: too few replicas", target=3)
    assert Plan.loads(plan.dumps()) == plan
    assert Plan.loads(plan.dumps().encode()).action is Action.CHECKPOINT  # the store hands back bytes
    restore = Plan(gen=4, members=[2, 3], action=Action.RESTORE, reason="no holder", checkpoint="/c/step1.pt")
    assert Plan.loads(restore.dumps()) == restore and restore.holders == []


def test_unfit_members_are_appended_by_their_finders_and_read_back_once_each():
    raw = unfit_line(3, "its heal did not finish within its bound") + unfit_line(1, "vote timed out")
    raw += unfit_line(3, "another reason")
    assert unfit_members(raw.encode()) == {3: "its heal did not finish within its bound", 1: "vote timed out"}


def test_keys_are_distinct_per_generation_replica_and_lane():
    keys = [Key.LATEST, Key.plan(1), Key.ready(1, 0), Key.ready(1, 1), Key.formed(1, 0, 0), Key.formed(1, 1, 0),
            Key.formed(1, 0, 1), Key.stalled(1), Key.stalled_by(1, 0, 0), Key.stalled_by(1, 0, 1),
            Key.stalled_by(1, 1, 0), Key.unfit(1), Key.holds(1, 0), Key.holds(1, 1),
            Key.arrived("pg/1/0", 0), Key.arrived("pg/1/0", 1),
            Key.pick(1, 1), Key.finished(1, 0), Key.finished(1, 1), Key.group(1, 0), Key.group(1, 1),
            Key.heal_group(1, 0, 0), Key.heal_group(1, 0, 1), Key.heal_group(1, 1, 0), Key.replica_group(1),
            Key.plan(2)]
    assert len(set(keys)) == len(keys)


def test_mesh_names_parse_back_to_their_replica_and_monarchs_own_do_not():
    _, control, actor = mesh_names(12)
    assert replica_of_mesh(control) == replica_of_mesh(actor) == 12
    assert replica_of_mesh("logger_mesh") is None


def test_the_meshes_a_controller_spawns_are_told_from_a_users():
    names = [*mesh_names(3), *watcher_names(1), *watcher_names(1, 2), "logger"]  # a watcher, and its second successor
    assert all(spawned_by_controller(f"{name}-e8XgET6cdYv") for name in names)  # Monarch suffixes an id
    assert not any(spawned_by_controller(name) for name in ("user_actor-x1", "replicas-x1", "loggers", "trainer"))


def test_phases_and_states_compare_with_their_wire_text():
    assert "reduce" in WAITING_ON_PEERS and Phase.COMPUTE not in WAITING_ON_PEERS
    assert [s.live for s in ReplicaState] == [True, True, True, True, False, False, False]


def test_an_outcome_pickles_as_a_monarch_endpoint_returns_it():
    outcome = Outcome("stopped", 1.5, reason="the controller gave up", checkpoint="/ckpt/step00000007.ckpt")
    assert pickle.loads(pickle.dumps(outcome)) == outcome


def test_rng_state_restores_python_numpy_and_torch():
    state = rng_state(torch.device("cpu"))
    drawn = (random.random(), np.random.rand(), torch.rand(1).item())
    set_rng_state(state, torch.device("cpu"))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == drawn


def test_drain_reports_read_back_in_the_order_they_were_appended():
    lines = Drain(2, 0, "SIGTERM", 41).line() + Drain(0, 1, "SIGUSR1", 42).line()
    assert Drain.parse(lines) == [Drain(2, 0, "SIGTERM", 41), Drain(0, 1, "SIGUSR1", 42)]
