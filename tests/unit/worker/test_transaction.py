"""`worker.transaction`: the commit-or-redo loop every framework front end runs, and the heal-state base.

The loop's decisions are tested on their own: `sync` and `reduce` are the session's (tested end to end under
real process deaths in tests/e2e), stood in for here by what they return.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from monarch_plugin.errors import ProtocolError
from monarch_plugin.wire.handshake import GenerationChanged
from monarch_plugin.worker.transaction import StepTransaction, TrainingState, _runtime_part

pytestmark = pytest.mark.timeout(60)


class _Loop:
    """A StepTransaction whose session answers from a script: `drops` attempts dropped, then committed; or a heal
    that hands the step over at the first sync after a drop."""

    def __init__(self, drops: int, handed_over: bool = False):
        self.tx = object.__new__(StepTransaction)
        self.tx.sync, self.tx.reduce = self._sync, self._reduce
        self.drops, self.handed_over = drops, handed_over
        self.committed, self.log = 0, []

    def _sync(self, committed: int) -> bool:
        self.log.append(("sync", committed))
        if self.handed_over and any(entry[0] == "dropped" for entry in self.log):
            self.committed += 1  # the heal brought this proc to its donor's step
        return False

    def _reduce(self, step: int, metrics: list[float], zero_grad) -> list[float] | None:
        if self.drops:
            self.drops -= 1
            zero_grad()
            self.log.append(("dropped", step))
            return None
        return [m * 2 for m in metrics]

    def attempt(self, redo: bool) -> list[float]:
        self.log.append(("attempt", redo))
        return [1.5]

    def commit(self, **kwargs):
        return self.tx.commit(7, lambda: self.committed, self.attempt, lambda: self.log.append(("zero_grad",)),
                              **kwargs)


def test_a_step_commits_on_its_first_attempt_when_nothing_fails():
    loop = _Loop(drops=0)
    assert loop.commit() == [3.0]
    assert loop.log == [("sync", 0), ("attempt", False)]


def test_a_dropped_step_is_redone_on_the_new_generation_until_it_commits():
    loop = _Loop(drops=2)
    assert loop.commit() == [3.0]
    assert [entry for entry in loop.log if entry[0] == "attempt"] == [("attempt", False), ("attempt", True),
                                                                      ("attempt", True)]
    assert loop.log.count(("sync", 0)) == 3 and loop.log.count(("zero_grad",)) == 2


def test_a_step_a_peer_committed_while_ours_was_dropped_is_handed_over_with_gradients_cleared():
    loop = _Loop(drops=1, handed_over=True)
    assert loop.commit() is None
    assert loop.log[-2:] == [("sync", 0), ("zero_grad",)] and loop.committed == 1


def test_a_first_attempt_computed_by_the_framework_is_reduced_before_anything_else():
    loop = _Loop(drops=1)
    assert loop.commit(computed=True) == [3.0]
    assert loop.log[:2] == [("zero_grad",), ("dropped", 7)]  # no sync, no attempt before the first reduction
    assert ("attempt", True) in loop.log and ("attempt", False) not in loop.log


class _State(TrainingState):
    def __init__(self, behind: bool):
        super().__init__(self, "committed", lambda: torch.device("cpu"), modules=lambda: [self.model],
                         optimizers=lambda: [self.optimizer])
        self.model = torch.nn.Linear(2, 2)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.behind, self.step, self.loaded = behind, 0, None

    def catching_up(self) -> bool:
        return self.behind

    def extra_state(self) -> dict:
        return {"cursor": 40}

    def load_extra(self, state: dict, whole: bool) -> None:
        self.loaded = (state["cursor"], whole)


@pytest.mark.parametrize("behind", [False, True])
def test_a_member_catching_up_keeps_its_own_learning_rate_and_rng_a_newcomer_takes_everything(behind):
    donor, receiver = _State(behind=False), _State(behind=behind)
    donor.model(torch.ones(1, 2)).sum().backward()
    donor.optimizer.step()
    donor.optimizer.param_groups[0]["lr"], donor.step = 0.05, 12
    torch.manual_seed(1)
    state = donor.state_dict()
    receiver.optimizer.param_groups[0]["lr"] = 0.07
    torch.manual_seed(2)
    receiver.load_state_dict(state)
    assert receiver.step == 12 and receiver.loaded == (40, not behind)
    torch.testing.assert_close(receiver.model.weight, donor.model.weight)
    assert receiver.optimizer.state_dict()["state"].keys() == donor.optimizer.state_dict()["state"].keys()
    assert receiver.optimizer.param_groups[0]["lr"] == (0.07 if behind else 0.05)
    expected = torch.Generator().manual_seed(2 if behind else 1)
    assert torch.equal(torch.get_rng_state(), expected.get_state())


def test_the_runtimes_own_failures_in_a_worker_are_protocol_errors_that_name_the_phase():
    with pytest.raises(ProtocolError, match="monarch-plugin's join: DistStoreError: store gone") as e:
        with _runtime_part("join"):
            raise dist.DistStoreError("store gone")
    assert e.value.phase == "join"
    with pytest.raises(ProtocolError, match="monarch-plugin's barrier: GenerationChanged"):
        with _runtime_part("barrier"):
            raise GenerationChanged("superseded")
    with pytest.raises(GenerationChanged):  # a dropped step: the reduction's own outcome, which the loop redoes
        with _runtime_part("reduce"):
            raise GenerationChanged("superseded")
    with pytest.raises(ValueError):  # the training code's own exceptions pass as they are
        with _runtime_part("join"):
            raise ValueError("the user's")


def test_the_state_is_held_for_a_give_up_checkpoint_from_a_step_boundary_until_the_next_commit():
    """A proc whose training code raised writes the give-up checkpoint only from a committed step's state: not from
    one its optimizer was stepping when it raised."""
    tx = object.__new__(StepTransaction)
    tx.session = types.SimpleNamespace(needs_join=lambda agreed_only=False: False, reduce=lambda reducer, weight, metrics: metrics,
                                       rank=1, world=2, device=torch.device("cpu"),
                                       flags=types.SimpleNamespace(lost=None))
    tx.ctx = types.SimpleNamespace(replica_id=0, events=types.SimpleNamespace(emit=lambda *a, **k: None),
                                   fault_point=lambda at, step: None)
    tx.reducer = types.SimpleNamespace()
    drawn = []
    tx._weight, tx.held, tx._step, tx._attempt_open = 1.0, None, 4, False
    tx._give_up = lambda committed: drawn.append(torch.rand(1).item()) or f"step{committed}.pt"
    assert tx.checkpoint_held() is None
    tx.sync(4)
    expected = torch.rand(1).item()  # the attempt draws from the RNG before it raises...
    assert tx.held == 4 and tx.checkpoint_held() == "step4.pt"
    assert drawn == [expected]  # ...and the checkpoint holds the generator as the step began
    assert tx.reduce(4, [1.0], zero_grad=lambda: None) == [1.0]
    assert tx.held is None and tx.checkpoint_held() is None  # the optimizer steps now
    tx.sync(5)
    assert tx.checkpoint_held() == "step5.pt"
    assert (tx.session.rank, tx.session.world) == (0, 1)  # out of every generation: it writes as the one writer


def test_a_dropped_attempts_draws_are_not_the_held_steps():
    """The generators held for a stop checkpoint are those of the first boundary at a step: an attempt that was dropped
    drew from them since, and the boundary it is retried from must not take those draws for the step's."""
    tx = object.__new__(StepTransaction)
    tx.session = types.SimpleNamespace(device=torch.device("cpu"))
    tx.held, tx._attempt_open = None, False
    torch.manual_seed(3)
    tx._hold(4)
    expected = torch.get_rng_state()
    torch.rand(5)  # the attempt's dropout, say, then the step is dropped
    tx._hold(4)
    assert torch.equal(tx._held_rng["torch"], expected)
    tx.held = None  # committed: the next boundary's are the next step's
    tx._hold(5)
    assert not torch.equal(tx._held_rng["torch"], expected)
