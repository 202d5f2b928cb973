"""The two Monarch actors each worker process hosts.

`ReplicaActor.run` executes the user's training code and stays busy for the whole run. An actor handles
one message at a time, so the controller's interrupts go to a second actor, `ControlActor`, whose thread
stays reachable while training runs and which only flips flags in `context.flags`.
"""

from __future__ import annotations

import os
import socket
import time
import traceback

import torch
from monarch.actor import Actor, current_rank, endpoint

from monarch_plugin.protocol import Outcome
from monarch_plugin.target import Target
from monarch_plugin.worker import context
from monarch_plugin.procs.lease import Lease

__all__ = ["ReplicaActor", "ControlActor"]


class ControlActor(Actor):
    @endpoint
    def info(self) -> dict:
        return {"pid": os.getpid(), "host": socket.gethostname()}

    @endpoint
    def plan(self, gen: int) -> None:
        context.flags.plan(gen)

    @endpoint
    def abort(self, gen: int) -> None:
        context.flags.abort(gen)

    @endpoint
    def regroup(self, gen: int) -> None:
        context.flags.regroup(gen)

    @endpoint
    def shutdown(self) -> None:
        context.flags.request_stop()

    @endpoint
    def newest_checkpoint(self) -> str | None:
        """The newest checkpoint the training code's front end holds on disk (None: none, or no front end yet)."""
        ctx = context._current
        finder = ctx.newest_checkpoint if ctx is not None else None
        return finder() if finder is not None else None

    @endpoint
    def status(self) -> dict:
        f = context.flags
        return {"phase": f.phase.value, "since": f.phase_since, "step": f.step, "forming": f.forming, "now": time.time()}


class ReplicaActor(Actor):
    """Runs the target once, in a torch.distributed environment scoped to its own replica group."""

    def __init__(self, env: dict[str, str]):
        local_rank = current_rank().rank  # position in this replica's ProcMesh
        os.environ.update(env)
        os.environ.update({"RANK": str(local_rank), "LOCAL_RANK": str(local_rank)})
        # torch sized its thread pool when this process imported it, before the environment above arrived.
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        self._lease = None
        if "MONARCH_PLUGIN_LEASE_S" in env:  # on another host: cut off from the controller, this proc ends itself
            self._lease = Lease(env["MONARCH_PLUGIN_STORE_HOST"], int(env["MONARCH_PLUGIN_STORE_PORT"]),
                                int(env["MONARCH_PLUGIN_HOST"]), float(env["MONARCH_PLUGIN_LEASE_S"]),
                                f"replica {env['MONARCH_PLUGIN_REPLICA_ID']} proc {local_rank}")

    @endpoint
    def run(self, target: Target) -> Outcome:
        """`stage` of an error tells the controller whether the target could not even be loaded here (a
        module the replica cannot import) or the training code raised."""
        context.reset()
        t0 = time.time()
        stage = "load"
        try:
            main = target.load()
            stage = "run"
            value = main()
        except BaseException as e:  # noqa: BLE001 - reported to the controller, never swallowed
            from monarch_plugin.worker.session import StopReplica

            if isinstance(e, StopReplica):
                return Outcome("stopped", time.time() - t0, reason=str(e), checkpoint=e.checkpoint)
            return Outcome("error", time.time() - t0, stage=stage, error=f"{type(e).__name__}: {e}",
                           traceback=traceback.format_exc())
        return Outcome("ok", time.time() - t0, value=value, gen=context.flags.finished_gen)
