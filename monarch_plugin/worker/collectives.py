"""Cross-replica collectives that a controller decision can interrupt.

On gloo, when a peer dies mid all-reduce only its ring neighbours see an error; the other survivors block
until the gloo timeout, and `abort()` does not release them. So every collective here is issued async and
waited on through its future's callback *or* the worker's abort flag, whichever comes first. The abandoned
group is never reused; it is kept until its stuck gloo threads end at its own timeout, then dropped.

Group construction waits on the store, and a TCPStore client serves one request at a time: a blocking
`get` holds the worker's one connection until its key appears. So construction sees the store through
`_AbandonableStore`, whose waits are short polls that give up as soon as the formation is superseded.
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from monarch_plugin.wire.handshake import (CollectiveFailed, CollectiveInterrupted, CollectiveTimedOut,
                                      GenerationChanged, barrier)
from monarch_plugin.wire.signing import SignedStore
from monarch_plugin.worker.context import Flags

__all__ = ["CollectiveInterrupted", "GenerationChanged", "CollectiveFailed", "CollectiveTimedOut", "wait_all",
           "new_group"]


def wait_all(works: list, flags: Flags, gen: int, timeout_s: float, interruptible: bool = True) -> None:
    """Block until every work completes, the generation is superseded, or the timeout passes.

    `interruptible=False` ignores a superseded generation (only a stop ends the wait early): for votes
    whose outcome every participant must learn, where walking away would let them decide differently.
    """
    done = threading.Event()
    state = {"left": len(works), "error": None}
    lock = threading.Lock()

    def on_done(fut: torch.futures.Future) -> None:
        with lock:
            try:
                fut.value()
            except Exception as e:  # noqa: BLE001 - any backend error fails the step
                state["error"] = state["error"] or e
            state["left"] -= 1
            if state["left"] == 0 or state["error"] is not None:
                done.set()

    flags.install_waiter(done)
    try:
        for work in works:
            work.get_future().add_done_callback(on_done)
        deadline = time.monotonic() + timeout_s
        while True:
            # A lost controller (`worker.orphan`) ends the waits an abort ends, not a vote among a replica's own
            # procs: the writer of the run's last step needs its siblings' votes to write it.
            if (interruptible and (flags.abort_gen > gen or flags.lost)) or (flags.stop and not flags.lost):
                raise GenerationChanged(f"generation {gen} superseded by {flags.abort_gen}" if not flags.lost
                                        else f"the controller was lost: {flags.lost}")
            if done.is_set():
                with lock:
                    if state["error"] is not None:
                        raise CollectiveFailed(str(state["error"]))
                    if state["left"] == 0:
                        return
            left = deadline - time.monotonic()
            if left <= 0:
                raise CollectiveTimedOut(f"cross-replica collective took longer than {timeout_s:.0f}s")
            done.wait(min(left, 1.0))
    finally:
        flags.install_waiter(None)


def new_group(
    store: SignedStore,
    prefix: str,
    rank: int,
    world: int,
    backend: str,
    timeout_s: float,
    superseded,
    fault_point: Callable[[str], None] | None = None,
    construct_bound_s: float | None = None,
    address: str = "127.0.0.1",
) -> dist.ProcessGroup | None:
    """A fresh group over `world` ranks named by `prefix`, with an abortable arrival barrier first.

    Group construction starts only once every member is known to be alive and waiting (`barrier`). A member that
    dies after the barrier leaves the others inside the constructor: they leave it within milliseconds of
    the controller's next plan (`superseded()`), never at the group timeout. Returns None for a group of
    one: nothing to reduce with. `fault_point(where)` is called after the barrier ("arrived") and inside
    construction ("construct"), for fault injection. Construction that takes longer than
    `construct_bound_s` (default `timeout_s`) raises CollectiveTimedOut: every member has arrived, so a
    group that is not built by then is wedged, and waiting for the backend's timeout only stalls the run.
    A gloo group listens on `address` only: loopback when every member is on this host, the host's own address on
    the job's network otherwise (gloo's default, the hostname's address, may be another interface or none).
    """
    barrier(store, prefix, rank, world, timeout_s, superseded)
    if fault_point is not None:
        fault_point("arrived")
    if world == 1:
        return None
    timeout = datetime.timedelta(seconds=timeout_s)
    polling = _AbandonableStore(store, superseded, timeout_s, fault_point)
    sub = dist.PrefixStore(prefix, polling)

    def construct():
        if backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(sub, rank, world, opts)
            # NCCL exchanges its unique id at the first collective unless connected now: here, on this
            # thread, where an abandoned formation surfaces as a construction error, not in a step.
            if hasattr(pg, "eager_connect_single_device") and torch.cuda.is_available():
                pg.eager_connect_single_device(torch.device("cuda", torch.cuda.current_device()))
            return pg
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
        return dist.ProcessGroupGloo(sub, rank, world, opts)

    # Store waits end once superseded (above); a connect to a peer that died can still block inside the
    # backend, so construction runs on a thread that is abandoned, left to time out, when the plan moves on.
    built: dict = {}
    done = threading.Event()

    def run() -> None:
        try:
            built["pg"] = construct()
        except Exception as e:  # noqa: BLE001 - a member died mid-construction: a runtime event, not a bug
            built["error"] = e
        done.set()

    threading.Thread(target=run, name=f"construct {prefix}", daemon=True).start()
    bound = construct_bound_s if construct_bound_s is not None else timeout_s
    built_by = time.monotonic() + bound
    while not done.wait(0.005):
        if superseded():
            raise GenerationChanged(f"{prefix}: abandoned during construction (a newer generation)")
        if time.monotonic() > built_by:
            raise CollectiveTimedOut(f"{prefix}: group not built {bound:.0f}s after every member arrived")
    if "error" in built:
        if superseded():  # the constructor's own store wait saw the newer plan first, and ended the thread
            raise GenerationChanged(f"{prefix}: abandoned during construction (a newer generation)") from built["error"]
        raise CollectiveFailed(f"{prefix}: group construction failed: {built['error']}") from built["error"]
    pg = built["pg"]
    _store_of[id(pg)] = polling
    try:
        _prove_members(pg, store, prefix, rank, world, backend, time.monotonic() + bound, superseded)
    except CollectiveInterrupted:
        abandon(pg)
        raise
    return pg


def _prove_members(pg, store: SignedStore, prefix: str, rank: int, world: int, backend: str, by: float,
                   superseded) -> None:
    """Every member of the new group holds the run's secret: one all-gather of each rank's token
    (`SignedStore.member_token`), checked by every member, before the group carries anything. The rendezvous values
    are signed already; this catches a process that took a rank some other way (a connection to a member's
    listening socket that beat the real peer's). A group that fails it is abandoned, and the generation re-formed."""
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    mine = torch.frombuffer(bytearray(store.member_token(prefix, rank)), dtype=torch.uint8).to(device)
    theirs = [torch.empty_like(mine) for _ in range(world)]
    work = pg.allgather([theirs], [mine])
    while not work.is_completed():
        if superseded():
            raise GenerationChanged(f"{prefix}: abandoned while its members proved themselves (a newer generation)")
        if time.monotonic() > by:
            raise CollectiveTimedOut(f"{prefix}: its members did not prove themselves in time")
        time.sleep(0.0005)
    try:
        work.wait()
    except Exception as e:  # noqa: BLE001 - a member died right after construction: a runtime event, not a bug
        raise CollectiveFailed(f"{prefix}: the members' proof failed: {e}") from e
    for r, token in enumerate(theirs):
        if not store.is_member_token(prefix, r, token.cpu().numpy().tobytes()):
            raise CollectiveFailed(f"{prefix}: the member at rank {r} does not hold the run's secret; the group is "
                                   "abandoned")


# A Python store lives only as long as its Python object, and the group keeps just the C++ side (NCCL may
# still read the store after construction): the object is held here until the group is abandoned.
_store_of: dict[int, _AbandonableStore] = {}


class _AbandonableStore(dist.Store):
    """The controller's store as group construction sees it: every wait is a poll that a newer plan ends.

    A TCPStore client serves one request at a time, and a blocking `get`/`wait` holds the connection until
    its key appears or the store timeout passes. Construction waits on keys (gloo's peer addresses, NCCL's
    unique id) that a member who died after the arrival barrier never writes; through the worker's one
    client that wait held every other store call of the process, the check for a newer generation
    included, for the whole timeout: survivors sat 60 s in a formation the controller had abandoned. Here
    a wait is a series of short `check` requests, and it raises GenerationChanged once `superseded()`,
    so the constructor itself returns and its thread ends.
    """

    def __init__(self, inner: dist.Store, superseded, timeout_s: float, fault_point=None):
        super().__init__()
        self._inner = inner
        self._superseded = superseded
        self._timeout_s = timeout_s
        self._fault_point = fault_point

    def _wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        if self._fault_point is not None:  # our own part is published: peers now wait on us
            point, self._fault_point = self._fault_point, None
            point("construct")
        limit = timeout.total_seconds() if timeout else self._timeout_s
        deadline = time.monotonic() + limit
        pause = 0.001
        while not self._inner.check(keys):
            if self._superseded():
                raise GenerationChanged("abandoned during construction (a newer generation)")
            if time.monotonic() > deadline:
                raise CollectiveTimedOut(f"store keys {keys} missing after {limit:.0f}s")
            time.sleep(pause)
            pause = min(pause * 2, 0.01)

    def set(self, key, value):
        self._inner.set(key, value)

    def get(self, key):
        self._wait([key])
        return self._inner.get(key)

    def wait(self, keys, timeout=None):
        self._wait(list(keys), timeout)

    def add(self, key, value):
        return self._inner.add(key, value)

    def check(self, keys):
        return self._inner.check(keys)

    def compare_set(self, key, expected, desired):
        return self._inner.compare_set(key, expected, desired)

    def delete_key(self, key):
        return self._inner.delete_key(key)

    def num_keys(self):
        return self._inner.num_keys()

    def set_timeout(self, timeout):
        self._timeout_s = timeout.total_seconds()


def abandon(pg) -> None:
    """Give up on a group after an interruption: NCCL/RCCL can abort; a gloo group is kept until its timeout has
    passed, and then dropped on a clock (`_reap`), not at the next abandonment.

    Gloo cannot abort an operation in flight, and destroying a gloo group waits for the operations it has queued:
    after a step interrupted mid-reduction, one that ends only at the group's timeout (or when a peer's socket
    closes). Dropped at once, that wait fell on whichever thread freed the group last: under Lightning, whose
    objects hold the group in reference cycles, a garbage collection in the middle of a later step, holding the
    GIL, which froze every thread of the proc (its control actor's included) for 10-20 s at a time. Kept until
    its timeout, a group has nothing left to wait for when it goes. Kept longer, its transport thread can go on
    spinning on its dead peers' sockets (docs/benchmarks.md): with one failure a minute, a group waited a minute
    more for the next abandonment to drop it."""
    store = _store_of.pop(id(pg), None)
    if pg is None:
        return
    if hasattr(pg, "abort") and isinstance(pg, getattr(dist, "ProcessGroupNCCL", ())):
        try:
            pg.abort()
        except Exception:  # noqa: BLE001 - the group is already broken; nothing more to do
            pass
        return
    timeout_s = pg.options._timeout.total_seconds() if hasattr(pg, "options") else 0.0
    with _graves_lock:
        _graves.append((time.monotonic() + timeout_s + 1.0, pg, store))
        global _reaper
        if _reaper is None:
            _reaper = threading.Thread(target=_reap, name="monarch-plugin-graves", daemon=True)
            _reaper.start()
    _buried.set()


_graves: list[tuple[float, object, object]] = []
"""Abandoned gloo groups, with the stores they were built over, each until its timeout has passed (`abandon`)."""
_graves_lock = threading.Lock()
_buried = threading.Event()
_reaper: threading.Thread | None = None


def _reap() -> None:
    """Drop each abandoned group once its timeout has passed: every operation it queued has ended by then, so
    freeing it (here, off the training thread) waits for nothing."""
    while True:
        with _graves_lock:
            now = time.monotonic()
            due = [grave for grave in _graves if grave[0] <= now]
            _graves[:] = [grave for grave in _graves if grave[0] > now]
            wake_at = min((grave[0] for grave in _graves), default=None)
        del due  # the groups go here, outside the lock
        _buried.wait(None if wake_at is None else max(wake_at - time.monotonic(), 0.0))
        _buried.clear()
