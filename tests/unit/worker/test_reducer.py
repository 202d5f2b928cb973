"""The step transaction's reducer on a real (single-rank) gloo group: weighting, overlap, accumulation; and the
groups it reduces over (construction abandoned, a group let go with a reduction in flight), on real gloo ranks."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch import nn

from monarch_plugin.worker.context import Flags
from monarch_plugin.worker.reducer import GradientReducer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pg():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return dist.ProcessGroupGloo(dist.PrefixStore("t", store), 0, 1, datetime.timedelta(seconds=10))


def _signed(store):
    """A store as the run's processes see it, signing with a test secret."""
    from monarch_plugin.wire.signing import SignedStore

    return SignedStore(store, b"test secret")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_overlapped_reduction_weights_and_writes_back(pg):
    model = _model()
    x = torch.randn(6, 4)
    model(x).sum().backward()
    expected = [g * 0.25 for g in _grads(model)]
    model.zero_grad(set_to_none=True)

    reducer = GradientReducer(list(model.parameters()), torch.device("cpu"))
    reducer.arm(pg, 0.25, Flags(), 0, 10)
    model(x).sum().backward()  # hooks launch the buckets; the end of backward writes them back
    for got, want in zip(_grads(model), expected):  # already reduced when backward returns, as DDP
        torch.testing.assert_close(got, want)
    grow, side = reducer.reduce([1.0, 2.5])
    assert side == [1.0, 2.5] and grow is False
    for got, want in zip(_grads(model), expected):
        torch.testing.assert_close(got, want)


def test_second_backward_without_no_sync_is_refused_with_the_fix(pg):
    model = _model()
    reducer = GradientReducer(list(model.parameters()), torch.device("cpu"))
    reducer.arm(pg, 1.0, Flags(), 0, 10)
    x = torch.randn(3, 4)
    model(x).sum().backward()
    model(x).sum().backward()
    with pytest.raises(RuntimeError, match="no_sync"):
        reducer.reduce([0.0])


def test_gradient_accumulation_with_no_sync(pg):
    model = _model()
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    model(a).sum().backward()
    model(b).sum().backward()
    expected = _grads(model)
    model.zero_grad(set_to_none=True)

    reducer = GradientReducer(list(model.parameters()), torch.device("cpu"))
    reducer.arm(pg, 1.0, Flags(), 0, 10)
    with reducer.no_sync():
        model(a).sum().backward()
    model(b).sum().backward()
    reducer.reduce([0.0])
    for got, want in zip(_grads(model), expected):
        torch.testing.assert_close(got, want)


def test_edits_after_backward_survive_the_commit(pg):
    """Clipping after backward acts on reduced gradients and is not overwritten at commit (DDP semantics)."""
    model = _model()
    reducer = GradientReducer(list(model.parameters()), torch.device("cpu"))
    reducer.arm(pg, 1.0, Flags(), 0, 10)
    model(torch.randn(5, 4)).sum().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    clipped = _grads(model)
    reducer.reduce([0.0])
    for got, want in zip(_grads(model), clipped):
        torch.testing.assert_close(got, want)


def test_the_control_word_rides_in_the_last_bucket(pg):
    """A waiting grow is agreed inside the gradient reduction itself: no extra collective per step."""
    model = _model()
    reducer = GradientReducer(list(model.parameters()), torch.device("cpu"))
    flags = Flags()
    flags.regroup(1)
    reducer.arm(pg, 1.0, flags, 0, 10)
    model(torch.randn(2, 4)).sum().backward()
    assert reducer.reduce([]) == (True, [])
    reducer.arm(pg, 1.0, flags, 1, 10)  # already in generation 1: nothing is waiting
    model(torch.randn(2, 4)).sum().backward()
    assert reducer.reduce([]) == (False, [])


def test_group_construction_is_abandoned_when_a_newer_generation_comes():
    """A member that dies after the arrival barrier leaves its peers in gloo's constructor until the group
    timeout (30 s here); the controller's newer generation must get them out at once instead."""
    import threading
    import time

    from monarch_plugin.wire.handshake import GenerationChanged
    from monarch_plugin.worker.collectives import new_group

    store = _signed(dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False))
    store.set("g/arrived/1", b"1")  # the peer (rank 1) arrived at the barrier, then died before constructing
    superseded = threading.Event()
    threading.Timer(0.5, superseded.set).start()
    t0 = time.monotonic()
    with pytest.raises(GenerationChanged, match="abandoned during construction"):
        new_group(store, "g", 0, 2, "gloo", 30.0, superseded=superseded.is_set)
    assert time.monotonic() - t0 < 5


def test_a_barrier_blocks_on_its_decision_and_every_outcome_reaches_every_member():
    """Members wait on the barrier's decision in the store, not by polling it: the last arrival releases them
    within milliseconds, the controller's `supersede` gets them out of one a member never reaches, and a timeout
    is one decision all of them see."""
    import threading
    import time

    from monarch_plugin.wire.handshake import CollectiveTimedOut, GenerationChanged, barrier, supersede

    store = _signed(dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False))

    def members(prefix: str, n: int, timeout_s: float = 30.0) -> tuple[list, list[threading.Thread]]:
        """`n` members (ranks 1..n), each with its own client, as each proc has: a client serves one request at a
        time."""
        outcomes = []

        def member(rank):
            own = _signed(dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False))
            try:
                barrier(own, prefix, rank, 3, timeout_s, superseded=lambda: False)
                outcomes.append(("go", time.monotonic()))
            except (GenerationChanged, CollectiveTimedOut) as e:
                outcomes.append((type(e).__name__, time.monotonic()))

        threads = [threading.Thread(target=member, args=(rank,)) for rank in range(1, n + 1)]
        for t in threads:
            t.start()
        return outcomes, threads

    outcomes, threads = members("all", 2)
    time.sleep(0.5)
    assert not outcomes  # two of three arrived: both wait
    last = time.monotonic()
    barrier(store, "all", 0, 3, 30.0, superseded=lambda: False)
    for t in threads:
        t.join(5)
    assert [o for o, _ in outcomes] == ["go", "go"] and max(t for _, t in outcomes) - last < 0.5

    outcomes, threads = members("replaced", 2)
    time.sleep(0.3)
    superseded_at = time.monotonic()
    supersede(store, "replaced")  # the third member died: the controller's next plan supersedes the formation
    for t in threads:
        t.join(5)
    assert [o for o, _ in outcomes] == ["GenerationChanged"] * 2 and max(t for _, t in outcomes) - superseded_at < 0.5
    with pytest.raises(GenerationChanged):  # a late arrival leaves on arriving
        barrier(store, "replaced", 0, 3, 30.0, superseded=lambda: False)

    outcomes, threads = members("short", 2, timeout_s=0.5)
    for t in threads:
        t.join(5)
    assert [o for o, _ in outcomes] == ["CollectiveTimedOut"] * 2
    with pytest.raises(CollectiveTimedOut):  # decided once: the member who comes last does not go on alone
        barrier(store, "short", 0, 3, 30.0, superseded=lambda: False)


def test_a_waiting_worker_learns_of_its_next_generation_from_the_push():
    import threading
    import time

    from monarch_plugin.worker.context import Flags

    flags = Flags()
    assert not flags.wait_for_plan(-1, 0.1)
    pushed = []
    threading.Timer(0.3, lambda: (pushed.append(time.monotonic()), flags.abort(2))).start()
    assert flags.wait_for_plan(-1, 10.0) and time.monotonic() - pushed[0] < 0.1
    assert (flags.latest, flags.abort_gen, flags.regroup_gen) == (2, 2, -1)
    flags.plan(1)  # an older generation's push, arriving late, changes nothing
    assert flags.latest == 2 and not flags.wait_for_plan(2, 0.1)
    threading.Timer(0.2, flags.request_stop).start()
    assert flags.wait_for_plan(2, 10.0) and flags.stop


def test_an_abandoned_group_with_a_reduction_in_flight_costs_nothing_to_let_go():
    """Destroying a gloo group waits for what it queued, and a step interrupted mid-reduction leaves an operation
    that ends only at the group's timeout (20 s here): freed by a garbage collection mid-step, that wait froze a
    Lightning proc, GIL held. `abandon` keeps the group until then. Two real ranks of one gloo group, one of them
    reducing alone."""
    import gc
    import threading
    import time

    from monarch_plugin.worker.collectives import abandon

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    groups = {}

    def build(rank):  # a client each: one TCPStore client serves one request at a time
        client = dist.TCPStore("127.0.0.1", master.port, is_master=False)
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("t", client), rank, 2, datetime.timedelta(seconds=20))

    builders = [threading.Thread(target=build, args=(rank,)) for rank in (0, 1)]
    for t in builders:
        t.start()
    for t in builders:
        t.join(timeout=30)
    assert set(groups) == {0, 1}
    pg = groups.pop(0)
    in_flight = pg.allreduce([torch.ones(4)])  # rank 1 never joins it
    t0 = time.monotonic()
    abandon(pg)
    del pg, in_flight
    gc.collect()
    assert time.monotonic() - t0 < 5


def test_an_abandoned_group_is_dropped_on_a_clock_once_its_timeout_has_passed():
    """Not at the next abandonment, which with one failure a minute kept a group (and its transport thread, which
    can spin on dead peers' sockets) a minute past its timeout."""
    import time

    from monarch_plugin.worker import collectives

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("clock", store), 0, 1, datetime.timedelta(seconds=1))
    key = id(pg)
    t0 = time.monotonic()
    collectives.abandon(pg)
    del pg
    assert any(id(grave[1]) == key for grave in collectives._graves)
    while any(id(grave[1]) == key for grave in collectives._graves):
        assert time.monotonic() - t0 < 10, "the abandoned group was never dropped"
        time.sleep(0.1)
    assert time.monotonic() - t0 > 1.5  # kept for its timeout (1 s) and a second more, then dropped


def test_buffers_are_averaged_at_commit_and_a_retried_attempt_starts_from_the_first_ones(pg):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    bn = model[1]
    reducer = GradientReducer(list(model.parameters()), torch.device("cpu"), buffers_of=[model])
    x = torch.randn(6, 4)

    reducer.begin_attempt(0)
    model(x).sum().backward()  # an attempt that is dropped: its statistics must not count
    reducer.begin_attempt(0)
    assert torch.equal(bn.running_mean, torch.zeros(8)) and int(bn.num_batches_tracked) == 0
    model.zero_grad(set_to_none=True)
    reducer.arm(pg, 0.5, Flags(), 0, 10)
    model(x).sum().backward()
    local_mean = bn.running_mean.clone()
    _, side = reducer.reduce([3.0])
    # One rank of weight 0.5: the commit writes back the weighted sum the live replicas' weights make a mean of.
    assert side == [3.0]
    torch.testing.assert_close(bn.running_mean, 0.5 * local_mean)
    assert bn.num_batches_tracked.dtype == torch.int64 and int(bn.num_batches_tracked) == 0  # round(0.5 * 1)

    reducer.begin_attempt(1)  # the next step keeps what step 0 committed
    model(x)
    moved = bn.running_mean.clone()
    with reducer.first_attempt_buffers():  # an evaluation inside the attempt sees the committed statistics
        torch.testing.assert_close(bn.running_mean, 0.5 * local_mean)
    torch.testing.assert_close(bn.running_mean, moved)  # and the attempt goes on with its own
    reducer.begin_attempt(1)
    torch.testing.assert_close(bn.running_mean, 0.5 * local_mean)


def test_a_member_without_the_runs_secret_is_found_as_soon_as_the_group_is_built():
    """Two real gloo ranks; one signs with another secret (a process that took a seat some other way than through the
    signed rendezvous). Each finds the other out in the members' proof, and the group is never used."""
    import threading
    import time

    from monarch_plugin.wire.handshake import CollectiveFailed
    from monarch_plugin.wire.signing import SignedStore
    from monarch_plugin.worker.collectives import _prove_members

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    secrets = {"honest": (b"the run's", b"the run's"), "imposter": (b"the run's", b"a guess")}
    for case, keys in secrets.items():
        groups, outcomes = {}, {}

        def member(rank):  # a client each: one TCPStore client serves one request at a time
            client = dist.TCPStore("127.0.0.1", master.port, is_master=False)
            groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore(case, client), rank, 2, datetime.timedelta(seconds=20))
            try:
                _prove_members(groups[rank], SignedStore(client, keys[rank]), case, rank, 2, "gloo",
                               time.monotonic() + 10, lambda: False)
                outcomes[rank] = "proved"
            except CollectiveFailed as e:
                outcomes[rank] = str(e)

        threads = [threading.Thread(target=member, args=(rank,)) for rank in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        if case == "honest":
            assert outcomes == {0: "proved", 1: "proved"}
        else:
            assert "rank 1 does not hold the run's secret" in outcomes[0]
            assert "rank 0 does not hold the run's secret" in outcomes[1]


def test_a_bucket_an_abandoned_reduction_may_still_write_is_never_reused(monkeypatch):
    """A step interrupted with every peer alive (a newcomer lost in its grow, a stall re-planned with the same
    members): gloo cannot abort the reduction in flight, and a peer still in that step completes it later, writing
    the sum into the buckets it was given. Two real gloo ranks, a model of many buckets: rank 0 drops the step and
    redoes it in the next generation's group while rank 1, slower, still reduces in the old one; both must end with
    the gradients of a step never interrupted, exactly."""
    import threading
    import time

    from monarch_plugin.wire.handshake import CollectiveInterrupted
    from monarch_plugin.worker import reducer as reducer_module

    monkeypatch.setattr(reducer_module, "BUCKET_BYTES", 4 * 64)  # a bucket a parameter, about
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    torch.manual_seed(0)
    shares = [torch.randn(5, 16), torch.randn(5, 16)]

    def model():
        torch.manual_seed(1)
        return nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)])

    expected = []
    for x in shares:  # the step as a run never interrupted reduces it: the weighted sum of the two shares' gradients
        m = model()
        m(x).sum().backward()
        expected.append([p.grad * 0.5 for p in m.parameters()])
    expected = [a + b for a, b in zip(*expected)]

    groups: dict[tuple[str, int], dist.ProcessGroup] = {}

    def build(name, rank):  # a client each: one TCPStore client serves one request at a time
        client = dist.TCPStore("127.0.0.1", master.port, is_master=False)
        groups[name, rank] = dist.ProcessGroupGloo(dist.PrefixStore(name, client), rank, 2,
                                                   datetime.timedelta(seconds=20))

    builders = [threading.Thread(target=build, args=(n, r)) for n in ("gen0", "gen1") for r in (0, 1)]
    for t in builders:
        t.start()
    for t in builders:
        t.join(timeout=30)
    redoing = threading.Event()
    grads: dict[int, list[torch.Tensor]] = {}
    models = [model(), model()]  # here: torch's generator is one for every thread

    def rank(r: int) -> None:
        m, flags = models[r], Flags()
        reducer = GradientReducer(list(m.parameters()), torch.device("cpu"))
        assert len(reducer.buckets) > 8
        if r == 1:
            redoing.wait(10)
            time.sleep(0.3)  # rank 0's redo is launched and waits in generation 1 for this rank
        flags.abort(1)  # the controller's generation 1 replaces generation 0 with the same members
        reducer.arm(groups["gen0", r], 0.5, flags, 0, 20)
        m(shares[r]).sum().backward()  # rank 1 launches its buckets in generation 0 still: they complete there
        with pytest.raises(CollectiveInterrupted):
            reducer.reduce([])
        m.zero_grad(set_to_none=True)
        reducer.arm(groups["gen1", r], 0.5, flags, 1, 20)
        if r == 0:
            threading.Timer(0.1, redoing.set).start()
        m(shares[r]).sum().backward()
        reducer.reduce([])
        grads[r] = [p.grad.clone() for p in m.parameters()]

    ranks = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join(timeout=40)
    assert set(grads) == {0, 1}
    for r in (0, 1):
        for got, want in zip(grads[r], expected):
            assert torch.equal(got, want), f"rank {r}"
