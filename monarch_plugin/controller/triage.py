"""Exception triage, as pure functions of the reports: whether what a replica's training code raised is the
replica's failure (it is replaced, as after a death) or the code's own bug, which no replacement fixes (the run stops).

A bug is what the target's load raised, or the code raised while setting up (an initial replica before its first
step: every replica runs the same set-up) or after training ended, or the same exception at the same step as another
replica raised (on other data: its twin). The runtime's own failures (`Raised.runtime`) are never the code's.
`deaths` gathers the reports and acts on these answers; nothing here touches a replica, the store or a process.
"""

from __future__ import annotations

from monarch_plugin.wire.protocol import Raised

__all__ = ["at_once", "code_error", "how", "tracebacks", "twin", "where"]


def at_once(raised: Raised, initial: bool) -> bool:
    """The code fails wherever it runs: the run stops at once, respawning nobody. `initial`: the replica that raised
    is one the run started with."""
    code = not raised.runtime
    return raised.stage == "load" or (code and (raised.finished or (raised.step < 0 and initial)))


def twin(raises: list[tuple[int, Raised]], rid: int, raised: Raised) -> tuple[int, Raised] | None:
    """The earlier report (replica, what it raised) of another replica whose training code raised the same exception
    at the same step as `raised` (replica `rid`'s), among `raises`, every report so far in order; None: no twin."""
    if raised.runtime or raised.step < 0:
        return None
    return next(((r, o) for r, o in raises if r != rid and not o.runtime
                 and (o.kind, o.step) == (raised.kind, raised.step)), None)


def where(raised: Raised) -> str:
    """When in training it raised, for a message."""
    return f"at step {raised.step}" if raised.step >= 0 else "before its first step"


def how(raised: Raised) -> str:
    """What the replica's death was, for a message and the events' `detected_by`."""
    what = f"its monarch-plugin {raised.runtime} failed" if raised.runtime else f"raised {raised.kind.rsplit('.')[-1]}"
    return f"{what} {where(raised)}"


def code_error(rid: int, raised: Raised) -> str:
    """The message of the `ReplicaCodeError` that stops a run whose code fails wherever it runs (`at_once`)."""
    if raised.stage == "load":
        what = (
            f"replica {rid} could not load the target ({raised.error}): replicas run in the "
            "controller's working directory with its sys.path, and what the target imports must be "
            "importable from there; install the module or keep it in a directory the replicas can read"
        )
    elif raised.finished:
        what = f"the training code raised in replica {rid} after training ended: {raised.error}"
    else:
        what = (f"the training code raised in replica {rid} before its first step, while setting up "
                f"(every replica runs the same set-up): {raised.error}")
    return f"{what}\n--- replica traceback ---\n{raised.traceback}"


def tracebacks(raises: list[tuple[int, Raised]]) -> str:
    """The tracebacks of what `raises` (replica, report) raised, each under its replica's name: a stop's detail."""
    return "".join(f"\n--- replica {r} traceback ---\n{o.traceback.rstrip()}" for r, o in raises)
