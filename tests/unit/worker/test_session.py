"""`worker/session.py`: the procs of a multi-proc replica follow the generation its local rank 0 picks, waiting for
that pick as long as local rank 0 itself waits. A real store; the session is built around it alone."""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch.distributed as dist

from monarch_plugin.errors import ProtocolError
from monarch_plugin.wire.protocol import Key, Plan
from monarch_plugin.worker import session as session_module
from monarch_plugin.worker.session import ReplicaSession

JOIN_TIMEOUT_S = 0.2


def _second_proc(replica: int, gen: int, store) -> ReplicaSession:
    """Local rank 1 of `replica`, in generation `gen` (-1: a spare, or a replacement not admitted yet)."""
    lane = object.__new__(ReplicaSession)
    lane.ctx = types.SimpleNamespace(replica_id=replica, local_rank=1, store=store,
                                     config=types.SimpleNamespace(join_timeout_s=JOIN_TIMEOUT_S))
    lane.flags = types.SimpleNamespace(stop=False)
    lane.intra, lane.gen, lane._picks = object(), gen, 0
    return lane


def test_a_members_other_procs_wait_a_bounded_time_and_a_spares_as_long_as_it_is_kept(monkeypatch):
    monkeypatch.setattr(session_module, "FORMATION_BOUND_S", 0.0)
    store = dist.HashStore()
    member, spare = _second_proc(1, 4, store), _second_proc(2, -1, store)
    with pytest.raises(ProtocolError, match="picked no generation"):  # local rank 0 gave up (or died): so does it
        member._agreed_plan(4, waiting=False)

    picked: dict = {}
    follower = threading.Thread(target=lambda: picked.update(plan=spare._agreed_plan(-1, waiting=False)))
    follower.start()
    time.sleep(5 * JOIN_TIMEOUT_S)  # a spare's local rank 0 waits for a plan that includes it, unbounded
    assert follower.is_alive() and not picked
    plan = Plan(gen=7, members=[0, 2], holders=[0])
    store.set(Key.pick(2, 1), plan.dumps())
    follower.join(timeout=10)
    assert picked["plan"] == plan
