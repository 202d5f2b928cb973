"""`sampler`: shares of a global batch, and a cursor that never skips or repeats a sample across resizes."""

from __future__ import annotations

import pytest

from monarch_plugin import ElasticSampler
from monarch_plugin.data.sampler import shard_bounds, share, weight

pytestmark = pytest.mark.timeout(60)


def test_shards_cover_the_batch_exactly():
    for n in range(0, 40):
        for world in range(1, 6):
            bounds = [shard_bounds(n, r, world) for r in range(world)]
            assert bounds[0][0] == 0 and bounds[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            sizes = [e - s for s, e in bounds]
            assert max(sizes) - min(sizes) <= 1


def test_sampler_never_skips_or_repeats_across_resizes():
    sampler = ElasticSampler(100, shuffle=True, seed=3)
    seen: list[int] = []
    worlds = [3, 3, 2, 2, 4, 1, 3, 3, 3, 2, 2]
    for world in worlds:
        if sampler.epoch:
            break
        (batch,) = sampler.window(16)
        for rank in range(world):
            seen += share(batch, rank, world)
        assert sum(weight([batch], rank, world) for rank in range(world)) == pytest.approx(1.0)
        sampler.advance(16)
    assert sorted(seen) == list(range(100))


def test_a_window_of_micro_batches_stops_at_the_epoch_end_and_commits_whole():
    sampler = ElasticSampler(10, shuffle=False, drop_last=True)
    assert sampler.batches_per_epoch(3) == 3
    assert sampler.window(3, 2) == [[0, 1, 2], [3, 4, 5]]
    sampler.advance(3, 2)
    assert sampler.window(3, 2) == [[6, 7, 8]]  # the epoch's last whole micro-batch; sample 9 is dropped
    assert weight(sampler.window(3, 2), 0, 2) == pytest.approx(2 / 3)
    sampler.advance(3, 2)
    assert (sampler.epoch, sampler.cursor) == (1, 0)


def test_sampler_state_moves_the_cursor():
    a = ElasticSampler(50, seed=1)
    a.advance(8)
    a.advance(8)
    b = ElasticSampler(50, seed=1)
    b.load_state_dict(a.state_dict())
    assert b.window(8, 2) == a.window(8, 2)
    with pytest.raises(ValueError, match="same dataset"):
        ElasticSampler(49).load_state_dict(a.state_dict())


def test_a_share_sampler_remembers_what_it_issued_and_knows_a_batch_in_hand_from_a_passed_one():
    from monarch_plugin.data.sampler import ShareSampler

    sampler = ElasticSampler(12, shuffle=False)
    group = {"rank": 0, "world": 2}
    batches = ShareSampler(sampler, 4, lambda batch: share(batch, group["rank"], group["world"]))
    it = iter(batches)
    assert [next(it), next(it)] == [[0, 1], [4, 5]]
    assert batches.in_hand(0) == [0, 1]  # a framework taking batches in order holds micro-batch 0's share
    assert batches.in_hand(1) == [4, 5]
    assert batches.in_hand(0) is None  # passed: a window redone holds its last batch, not micro-batch 0's
    group["world"] = 1  # a resize: the next share is cut for the new group
    assert next(it) == [8, 9, 10, 11] and batches.in_hand(2) == [8, 9, 10, 11]
    sampler.advance(4, 3)
    batches.forget()
    assert batches.issued == {} and len(batches) == 3
