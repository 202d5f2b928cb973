"""`stream`: the window every replica reads whole, moved at commit, and the check a newcomer makes of its position.

The front ends' own policies (HF's passes, torchtitan's exhausted loader) are tested with them; these drive the
window with plain sources, one with its own state and one without.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from monarch_plugin.data.stream import StreamWindow, fingerprint

pytestmark = pytest.mark.timeout(60)


class _Counting:
    """0..n-1, with its own position as state (as torchtitan's loaders and `datasets` streams keep one)."""

    def __init__(self, n: int, offset: int = 0):
        self.n, self.offset, self.at = n, offset, 0

    def __iter__(self):
        while self.at < self.n:
            self.at += 1
            yield {"x": torch.tensor([self.at - 1 + self.offset])}

    def state_dict(self) -> dict:
        return {"at": self.at}

    def load_state_dict(self, state: dict) -> None:
        self.at = state["at"]


class _Plain:
    """0..n-1 and nothing else: a newcomer is positioned by replaying it."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def _read(stream: StreamWindow, steps: int) -> list:
    out = []
    for _ in range(steps):
        window = stream.window()
        if window is None:
            break
        out.append([int(s["x"]) if isinstance(s, dict) else s for s in window])
        stream.commit()
    return out


@pytest.mark.parametrize("source", [lambda: _Counting(10), lambda: _Plain(10)], ids=["own state", "replayed"])
def test_a_newcomer_takes_the_position_of_the_last_commit_and_the_stream_ends_short_of_a_step(source):
    donor, newcomer = StreamWindow(source(), 3), StreamWindow(source(), 3)
    assert _read(donor, 2) == [[0, 1, 2], [3, 4, 5]]
    state = pickle.loads(pickle.dumps(donor.state_dict()))  # as a heal or a checkpoint carries it
    assert state["next"] == fingerprint(donor.window())
    newcomer.load_state_dict(state)
    assert _read(newcomer, 5) == _read(donor, 5) == [[6, 7, 8]]  # the last sample does not fill a step
    assert donor.window() is None and donor.state_dict()["next"] == ""


def test_a_survivor_holding_the_step_its_peer_committed_commits_it():
    donor, survivor = StreamWindow(_Counting(12), 4), StreamWindow(_Counting(12), 4)
    _read(donor, 1)
    survivor.window()  # read step 1's samples, then dropped the step the donor committed
    survivor.load_state_dict(donor.state_dict())
    assert (survivor.epoch, survivor.cursor) == (0, 4) and _read(survivor, 3) == [[4, 5, 6, 7], [8, 9, 10, 11]]


def test_a_stream_that_differs_between_replicas_is_refused_naming_the_fix():
    donor, other = StreamWindow(_Counting(12), 4), StreamWindow(_Counting(12, offset=1), 4)
    _read(donor, 1)
    with pytest.raises(RuntimeError, match=r"pass 0, sample 4 differs from the donor's.*seed its shuffling"):
        other.load_state_dict(donor.state_dict())
