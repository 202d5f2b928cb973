"""Cross-replica collectives that a controller decision can interrupt.

On gloo, when a peer dies mid all-reduce only its ring neighbours see an error; the other survivors block
until the gloo timeout, and `abort()` does not release them. So every collective here is issued async and
waited on through its future's callback *or* the worker's abort flag, whichever comes first. The abandoned
group is dropped, never reused; its stuck gloo threads end at its own timeout.
"""

from __future__ import annotations

import datetime
import threading
import time

import torch
import torch.distributed as dist

from monarch_plugin.worker.context import Flags

__all__ = [
    "CollectiveInterrupted",
    "GenerationChanged",
    "CollectiveFailed",
    "CollectiveTimedOut",
    "wait_all",
    "new_group",
]


class CollectiveInterrupted(RuntimeError):
    """The collective did not complete; the step in flight must be dropped."""


class GenerationChanged(CollectiveInterrupted):
    """The controller formed a new generation (a peer died or was replaced)."""


class CollectiveFailed(CollectiveInterrupted):
    """The backend reported an error (typically: the ring neighbour died)."""


class CollectiveTimedOut(CollectiveInterrupted):
    """No completion within collective_timeout_s: some peer stopped making progress."""


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
            if (interruptible and flags.abort_gen > gen) or flags.stop:
                raise GenerationChanged(f"generation {gen} superseded by {flags.abort_gen}")
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
    store: dist.Store,
    prefix: str,
    rank: int,
    world: int,
    backend: str,
    timeout_s: float,
    superseded,
) -> dist.ProcessGroup | None:
    """A fresh group over `world` ranks named by `prefix`, with an abortable arrival barrier first.

    Group construction cannot be interrupted, so it starts only once every member is known to be alive
    and waiting. Whether the barrier completed or was abandoned (a newer generation, a timeout) is
    decided once, by compare-and-set on `<prefix>/decision`, so no member can start constructing while
    another walks away. Returns None for a group of one: nothing to reduce with.
    """
    store.add(f"{prefix}/arrived", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        if store.add(f"{prefix}/arrived", 0) >= world:
            decision = store.compare_set(f"{prefix}/decision", "", "go")
        elif superseded() or time.monotonic() > deadline:
            decision = store.compare_set(f"{prefix}/decision", "", "abandon")
        else:
            time.sleep(0.002)
            continue
        if decision == b"go":
            break
        raise GenerationChanged(f"{prefix}: formation abandoned (a newer generation, or a member missing)")
    if world == 1:
        return None
    timeout = datetime.timedelta(seconds=timeout_s)
    sub = dist.PrefixStore(prefix, store)

    def construct():
        if backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            return dist.ProcessGroupNCCL(sub, rank, world, opts)
        return dist.ProcessGroupGloo(sub, rank, world, timeout)

    # A member that dies after the barrier leaves the others inside the constructor (gloo connects to
    # every peer) until its timeout; it cannot be interrupted, so it runs on a thread that is abandoned,
    # left to time out on its own, when the controller moves on.
    built: dict = {}
    done = threading.Event()

    def run() -> None:
        try:
            built["pg"] = construct()
        except Exception as e:  # noqa: BLE001 - a member died mid-construction: a runtime event, not a bug
            built["error"] = e
        done.set()

    threading.Thread(target=run, name=f"construct {prefix}", daemon=True).start()
    while not done.wait(0.005):
        if superseded():
            raise GenerationChanged(f"{prefix}: abandoned during construction (a newer generation)")
    if "error" in built:
        raise CollectiveFailed(f"{prefix}: group construction failed: {built['error']}") from built["error"]
    return built["pg"]


def abandon(pg) -> None:
    """Give up on a group after an interruption: NCCL/RCCL can abort, gloo is just dropped."""
    if pg is not None and hasattr(pg, "abort") and isinstance(pg, getattr(dist, "ProcessGroupNCCL", ())):
        try:
            pg.abort()
        except Exception:  # noqa: BLE001 - the group is already broken; nothing more to do
            pass
