"""Monarch's `unhandled_fault_hook`, routed: a failure of a mesh the controller spawned is a death report.

It decides only whose failure a supervision report is (the running controller's, a finished run's, or someone
else's); it may not touch a replica or the run's state: it puts a `Died` on the active run's queue, nothing more.
"""

from __future__ import annotations

import logging
import queue

from monarch_plugin.wire.protocol import Died, replica_of_mesh, spawned_by_controller

__all__ = ["FaultRouter", "first_line"]

logger = logging.getLogger("monarch_plugin")


class FaultRouter:
    """Monarch's `unhandled_fault_hook`, for the rest of the process once a controller has run in it.

    Monarch's default hook exits the process (a KeyboardInterrupt in the main thread) on any failure nobody
    handled. During a run a worker's death is news for the controller. After a run it is stale news: a replica
    killed as the run ended can be reported seconds after the shutdown, and restoring the default hook there
    turned a finished run into exit status 1. So the failures of meshes a controller spawned belong to the
    controller for the life of the process; any other mesh's failure goes to the hook that was there before."""

    def __init__(self, outer) -> None:
        self.outer = outer
        self.active: queue.Queue | None = None
        """The reports of the run now supervised in this process (None: none is)."""

    def __call__(self, failure) -> None:
        active = self.active
        if active is not None:
            # Monarch's own per-mesh actors (its logger) also fail; the replica's actors report it then.
            rid = replica_of_mesh(str(getattr(failure, "mesh_name", "")))
            if rid is not None:
                active.put(Died(rid, f"supervision ({first_line(failure)})"))
        elif spawned_by_controller(str(getattr(failure, "mesh_name", ""))):
            logger.debug("after the run: %s", first_line(failure))
        else:
            self.outer(failure)

    @classmethod
    def installed(cls) -> FaultRouter:
        import monarch.actor

        if not isinstance(monarch.actor.unhandled_fault_hook, cls):
            monarch.actor.unhandled_fault_hook = cls(monarch.actor.unhandled_fault_hook)
        return monarch.actor.unhandled_fault_hook


def first_line(failure) -> str:
    """Monarch's own words for a failure it supervised: the first line of its report (the rest is a stack dump)."""
    text = str(failure).strip()
    return text.splitlines()[0][:200] if text else type(failure).__name__
