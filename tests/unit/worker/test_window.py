"""`StepWindow`: the step in flight's window, cut for each proc of the live group, and each replica's weight."""

from __future__ import annotations

import pytest

from monarch_plugin.data.sampler import ElasticSampler
from monarch_plugin.data.stream import StreamWindow
from monarch_plugin.worker.window import StepWindow, short_tail

pytestmark = pytest.mark.timeout(60)


def _windows(batches: list[list[int]], world: int, lanes: int, flat: bool = False) -> list[list[StepWindow]]:
    """Every proc's view of one window: [replica][lane]."""
    return [[StepWindow(lambda: batches, lambda r=rank: (r, world), lane=lane, lanes=lanes, flat=flat)
             for lane in range(lanes)] for rank in range(world)]


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("size, world, lanes", [(12, 3, 1), (10, 2, 3), (7, 3, 2), (5, 2, 2), (4, 3, 1)])
def test_every_sample_of_the_window_goes_to_one_proc_and_the_weights_sum_to_one(size, world, lanes, flat):
    batches = [list(range(100, 100 + size)), list(range(200, 200 + size - 1))]  # the epoch's last is shorter
    procs = _windows(batches, world, lanes, flat)
    for micro, batch in enumerate(batches):
        cut = [proc.share(micro) for replica in procs for proc in replica]
        assert [i for share in cut for i in share] == batch  # contiguous, in order, each once
        if flat:  # every proc of the live replicas at once: their shares differ by one sample at most
            assert max(map(len, cut)) - min(map(len, cut)) <= 1
        for replica in procs:
            assert [i for proc in replica for i in proc.share(micro)] == replica[0].replica_share(micro)
    assert sum(replica[0].weight() for replica in procs) == pytest.approx(1.0)
    for replica in procs:  # the weight is the replica's fraction of the window's samples
        trained = sum(len(replica[0].replica_share(m)) for m in range(len(batches)))
        assert replica[0].weight() == pytest.approx(trained / sum(map(len, batches)))


def test_the_front_ends_cut_over_the_replicas_first_elastic_loop_over_every_proc_at_once():
    batch = list(range(10))
    nested, flat = _windows([batch], 2, 3), _windows([batch], 2, 3, flat=True)
    assert [p.share(0) for r in nested for p in r] == [[0, 1], [2, 3], [4], [5, 6], [7, 8], [9]]
    assert [p.share(0) for r in flat for p in r] == [[0, 1], [2, 3], [4, 5], [6, 7], [8], [9]]
    assert [r[0].weight() for r in nested] == [0.5, 0.5]
    assert [r[0].weight() for r in flat] == pytest.approx([0.6, 0.4])


def test_the_group_and_the_window_are_read_at_each_use():
    sampler = ElasticSampler(8, shuffle=False)
    group = [(0, 2)]
    window = StepWindow(lambda: sampler.window(4, 2), lambda: group[0])
    assert window.share(0) == [0, 1] and window.share(1) == [4, 5]
    group[0] = (0, 1)  # the peer died: the same samples, cut for the survivor
    assert window.share(0) == [0, 1, 2, 3] and window.weight() == 1.0
    sampler.advance(4, 2)  # committed: the next window is the next epoch's
    assert window.batches() == [[0, 1, 2, 3], [4, 5, 6, 7]] and sampler.epoch == 1
    assert window.cut([9, 8, 7]) == [9, 8, 7]


def test_a_streams_window_is_its_positions_and_each_proc_reads_its_share():
    stream = StreamWindow(list(range(100, 112)), 6)
    window = StepWindow(lambda: stream.positions(3), lambda: (1, 2))
    assert stream.positions(3) == [[0, 1, 2], [3, 4, 5]]
    assert [stream.samples(window.share(m)) for m in range(2)] == [[102], [105]]
    stream.commit()
    assert stream.positions(3) == [[6, 7, 8], [9, 10, 11]] and stream.samples(window.share(0)) == [108]


@pytest.mark.parametrize("samples, size, procs, drop_last, tail", [
    (10, 4, 3, False, 2),   # a last batch of 2 over up to 3 procs: one would get nothing
    (10, 4, 2, False, 0),   # 2 over 2: one each
    (10, 4, 3, True, 0),    # the loader drops it
    (12, 4, 8, False, 0),   # no tail
])
def test_a_tail_too_short_for_every_proc_is_named_by_its_size(samples, size, procs, drop_last, tail):
    assert short_tail(samples, size, procs, drop_last) == tail
