"""benchmarks/semi_sync.py's pure parts on made-up logs: the bytes a ring allreduce sends, the samples a DiLoCo run
learned at its syncs, local steps told from those with a sync in them, and the loss over the global batch without
the re-trained samples."""

from __future__ import annotations

import pytest

from benchmarks.semi_sync import learned, loss_curve, moving_mean, rate, ring_bytes, split_intervals


def test_ring_allreduce_bytes_per_step():
    # 4 ranks: each sends 2 x 3/4 of the buffer (parameters and the control word, float32) per reduction.
    assert ring_bytes(999, 4, reductions=10, steps=10) == pytest.approx(1.5 * 4000)
    # One sync every 20 steps: a twentieth of that per step.
    assert ring_bytes(999, 4, reductions=2, steps=40) == pytest.approx(1.5 * 4000 / 20)
    assert ring_bytes(999, 2, reductions=1, steps=1) == pytest.approx(4000)
    assert ring_bytes(999, 1, reductions=5, steps=5) == 0.0


def test_learned_takes_each_sync_when_the_first_replica_saw_it():
    logs = [[(20, 10.0), (40, 20.5)], [(20, 10.2), (40, 20.1)], [(20, 9.9)]]  # the third died before the second
    assert learned(logs) == {20: 9.9, 40: 20.1}
    done = learned(logs)
    assert rate(done, start=0.1, steps=40) == pytest.approx(40 / 20.0)
    assert rate(done, start=0.1, steps=60) is None


def test_split_intervals_puts_the_step_a_sync_fell_in_apart():
    times = [0.0, 1.0, 2.0, 3.0, 4.0, 6.5, 7.5, 8.5]
    local, synced = split_intervals(times, syncs=[5.9], skip=2)
    assert synced == [2.5]
    assert local == [1.0, 1.0, 1.0, 1.0]


def test_loss_curve_weights_by_samples_and_leaves_retrained_samples_out():
    logs = [
        [(0, 1.0, 8, 0), (1, 0.5, 8, 0), (1, 9.0, 4, 1)],  # its re-trained samples at step 1 are left out
        [(0, 2.0, 8, 0), (1, 1.0, 24, 0)],
    ]
    assert loss_curve(logs) == {0: pytest.approx(1.5), 1: pytest.approx((0.5 * 8 + 1.0 * 24) / 32)}


def test_moving_mean():
    assert moving_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_lost_samples_are_the_dead_replicas_local_steps_since_the_last_sync():
    from benchmarks.semi_sync import lost_samples

    steps = [(0, 1.0), (1, 2.0), (2, 3.0), (3, 4.0), (4, 5.0)]
    losses = [(s, 1.0, 8, 0) for s, _ in steps]
    done = {2: 3.5}  # a sync after its third step committed the first two rounds' steps
    assert lost_samples(steps, losses, done, killed_at=5.2) == 16  # steps 3 and 4
    assert lost_samples(steps, losses, done, killed_at=3.2) == 24  # before the sync: all three
    assert lost_samples(steps, losses, {}, killed_at=0.5) == 0
