"""The controller-worker handshake: what both sides of a generation change agree on, imported by both.

A generation forms behind an arrival barrier in the run's store (`barrier`); the controller abandons a formation
it has replaced (`supersede`); and a formation that every member passed is bounded (`FORMATION_BOUND_S`), past
which the controller re-plans instead of waiting for the collective timeout. The outcomes a member sees are the
`CollectiveInterrupted` family: the step in flight is dropped, and the worker joins what the controller decides.
"""

from __future__ import annotations

import datetime
import time
from typing import TYPE_CHECKING, Callable

import torch.distributed as dist

from monarch_plugin.errors import ProtocolError
from monarch_plugin.wire.protocol import Key

if TYPE_CHECKING:
    from monarch_plugin.wire.signing import SignedStore

__all__ = ["CollectiveInterrupted", "GenerationChanged", "CollectiveFailed", "CollectiveTimedOut",
           "barrier", "passed", "supersede", "FORMATION_BOUND_S"]

FORMATION_BOUND_S = 10.0
"""Forming a generation's group among members that all passed its arrival barrier, and exchanging their
steps, takes milliseconds (4-300 ms measured here, under load). Past this bound it never will (a member's
construction wedged): the member reports a stall, and the controller re-plans instead of everyone waiting
for the collective timeout."""


class CollectiveInterrupted(RuntimeError):
    """The collective did not complete; the step in flight must be dropped."""


class GenerationChanged(CollectiveInterrupted):
    """The controller formed a new generation (a peer died or was replaced)."""


class CollectiveFailed(CollectiveInterrupted):
    """The backend reported an error (typically: the ring neighbour died)."""


class CollectiveTimedOut(CollectiveInterrupted):
    """No completion within collective_timeout_s: some peer stopped making progress."""


_GO, _SUPERSEDED, _TIMED_OUT = b"go", b"superseded", b"timed out"


def barrier(store: SignedStore, prefix: str, rank: int, world: int, timeout_s: float,
            superseded: Callable[[], bool]) -> None:
    """Return once all `world` members have arrived at `prefix`; raise GenerationChanged if it was superseded first,
    CollectiveTimedOut if a member did not arrive in `timeout_s`.

    Each member says it arrived under a key of its own (`Key.arrived`, signed like every value: a count of arrivals
    could be raised by anyone who reaches the store). The outcome is decided once, by compare-and-set on
    `<prefix>/decision`, so no member can go on while another walks away: a member that finds every member's arrival
    in place (the last to arrive always does) decides "go"; the controller (`supersede`), or a member that finds itself
    superseded on arriving, decides "superseded"; a member that waited `timeout_s` decides "timed out". Every member
    blocks on the decision in the store (one request, answered when the key is written), never polls: a thousand
    replicas polling a barrier every few milliseconds were hundreds of thousands of requests a second on the
    controller's one store, and the decision came only as fast as the store could answer them."""
    decision_key = Key.decision(prefix)
    store.set(Key.arrived(prefix, rank), b"1")
    if store.verified([Key.arrived(prefix, r) for r in range(world)]):
        decision = store.compare_set(decision_key, "", _GO)
    elif superseded():
        decision = store.compare_set(decision_key, "", _SUPERSEDED)
    else:
        # A wait also ends when anyone touches the key without setting it (a non-blocking read of it,
        # `SignedStore.peek`, wakes its waiters): it waits again until the decision is there or the time is up.
        deadline = time.monotonic() + timeout_s
        while not store.check([decision_key]) and (left := deadline - time.monotonic()) > 0:
            try:
                store.wait([decision_key], datetime.timedelta(seconds=left))
            except dist.DistStoreError:
                pass
        decision = store.compare_set(decision_key, "", _TIMED_OUT)
    if decision == _GO:
        return
    if decision == _SUPERSEDED:
        raise GenerationChanged(f"{prefix}: formation abandoned (a newer generation)")
    raise CollectiveTimedOut(f"{prefix}: formation abandoned (a member did not arrive in {timeout_s:.0f}s)")


def passed(store: SignedStore, prefix: str) -> bool:
    """Whether the barrier at `prefix` decided "go": every member arrived, and none can be superseded any more. Never
    blocks; a forged decision is no "go" (it is reported, `signing.Forged`)."""
    try:
        return store.peek(Key.decision(prefix)) == _GO
    except ProtocolError:
        return False


def supersede(store: SignedStore, prefix: str) -> None:
    """Decide the barrier at `prefix` "superseded" unless it is already decided: its waiting members leave it at
    once, and any that arrive later leave on arriving. The controller calls it for the formations of a
    generation it has just replaced."""
    try:
        store.compare_set(Key.decision(prefix), "", _SUPERSEDED)
    except ProtocolError:  # a forged decision (`signing.Forged`), reported: the members stop on it
        pass
