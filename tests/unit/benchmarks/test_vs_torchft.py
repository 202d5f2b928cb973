"""benchmarks/vs_torchft.py's accounting of lost time, on made-up commit times: a kill's phases sum to its window's
loss and, with the loss between windows, to the run's (its seconds less its steps times the steady step), so the
table docs/benchmarks.md prints names every lost second once."""

from __future__ import annotations

import pytest

from benchmarks.vs_torchft import account

STEP = 0.1


def _commits(gaps: dict[int, float], steps: int = 40) -> dict[int, float]:
    """Step s committed STEP after step s-1, plus `gaps[s]` seconds of extra wait before it."""
    out, t = {}, 0.0
    for s in range(steps):
        t += STEP + gaps.get(s, 0.0)
        out[s] = t
    return out


def test_a_kills_phases_sum_to_its_window_and_the_run():
    commits = _commits({21: 0.5, 22: 0.1})  # 0.6 s lost around a kill after step 20
    kill = commits[20] + 0.03
    marks = [commits[20], kill, kill + 0.04, kill + 0.1, commits[21], commits[21], commits[22]]
    names = ("in flight", "notice", "dropped", "redo", "shrunk", "grow")
    result = account([marks], commits, names)
    assert result["steady_step_s"] == pytest.approx(STEP)
    assert result["total_s"] == pytest.approx(0.6)
    assert sum(result["phases_s"].values()) == pytest.approx(0.6)
    assert result["between_s"] == pytest.approx(0.0, abs=1e-9)
    # No commit between the kill and the survivors' redo: each phase up to it lost all of its length.
    assert result["phases_s"]["notice"] == pytest.approx(0.04)
    assert result["phases_s"]["redo"] == pytest.approx(commits[21] - (kill + 0.1) - STEP)
    assert result["phases_s"]["grow"] == pytest.approx(0.1)


def test_loss_outside_every_window_is_between_and_overlapping_windows_count_once():
    commits = _commits({10: 0.3, 30: 0.2, 31: 0.2})
    first = [commits[29], commits[29] + 0.01, commits[30], commits[31]]
    overlapping = [commits[30] - 0.05, commits[30], commits[30], commits[31]]  # starts inside the first
    result = account([first, overlapping], commits, ("a", "b", "c"))
    assert result["total_s"] == pytest.approx(0.7)
    assert result["between_s"] == pytest.approx(0.3)  # the pause before step 10, in no window
    assert sum(result["phases_s"].values()) + result["between_s"] == pytest.approx(result["total_s"])
