"""The two Monarch actors each worker process hosts.

`ReplicaActor.run` executes the user's training code and stays busy for the whole run. An actor handles
one message at a time, so the controller's interrupts go to a second actor, `ControlActor`, whose thread
stays reachable while training runs and which only flips flags in `context.flags`.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import time
import traceback

import torch
from monarch.actor import Actor, current_rank, endpoint

from monarch_plugin.errors import ProtocolError
from monarch_plugin.wire.protocol import CONTROLLER_PID_ENV, ORPHAN_ENV, START_METHOD_ENV, Key, Outcome, Raised
from monarch_plugin.target import Target
from monarch_plugin.worker import context, orphan
from monarch_plugin.procs.lease import Lease
from monarch_plugin.procs.stores import serve
from monarch_plugin.wire.signing import SECRET_ENV

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
        tx = _transaction()
        return tx.newest_checkpoint() if tx is not None else None

    @endpoint
    def checkpoint_held(self) -> str | None:
        """The training code raised, and the run stops with no replica in training left to write its checkpoint:
        write it from this proc's state, if that is still a committed step's (`StepTransaction.checkpoint_held`)."""
        tx = _transaction()
        return tx.checkpoint_held() if tx is not None else None

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
        # Monarch's bootstrap makes multiprocessing start processes from a forkserver in every proc. The training code
        # gets the start method it had in the user's process (Python's default unless that process chose one), as
        # under torchrun: DataLoader workers then use a Dataset defined in the script's __main__, and end with their
        # replica (a forkserver's workers watch the forkserver, which outlives it).
        multiprocessing.set_start_method(env.get(START_METHOD_ENV) or multiprocessing.get_all_start_methods()[0],
                                         force=True)
        # The store the training code's `init_process_group` meets its siblings on, on loopback only (`procs.stores`).
        self._replica_store = serve("127.0.0.1", int(env["MASTER_PORT"]), 300.0) if local_rank == 0 else None
        # The controller lost: this proc saves the run's last committed step and ends within the bound (`orphan`),
        # or, with no bound, ends at once.
        what = f"replica {env['MONARCH_PLUGIN_REPLICA_ID']} proc {local_rank}"
        bound = float(env.get(ORPHAN_ENV, 0))
        on_lost = (lambda why: orphan.lost(why, bound, what)) if bound else None
        self._lease = None
        if "MONARCH_PLUGIN_LEASE_S" in env:  # on another host: by its lease on the controller's store
            self._lease = Lease(env["MONARCH_PLUGIN_STORE_HOST"], int(env["MONARCH_PLUGIN_STORE_PORT"]),
                                int(env["MONARCH_PLUGIN_HOST"]), float(env["MONARCH_PLUGIN_LEASE_S"]),
                                what, env[SECRET_ENV], beat_keys=(Key.host_beat(int(env["MONARCH_PLUGIN_HOST"])),),
                                on_lost=on_lost)
        elif on_lost is not None:  # on the controller's machine: by its process's end
            orphan.watch(int(env[CONTROLLER_PID_ENV]), on_lost)

    @endpoint
    def run(self, target: Target) -> Outcome:
        """`stage` of an error tells the controller whether the target could not even be loaded here (a
        module the replica cannot import) or the training code raised."""
        context.reset()
        outcome = self._run(target)
        if context.flags.lost:  # no controller is left to hear it (a stop's checkpoint written meanwhile, say)
            orphan.returned(outcome.status)
        return outcome

    def _run(self, target: Target) -> Outcome:
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
            return Outcome("error", time.time() - t0, raised=_report(e, stage))
        return Outcome("ok", time.time() - t0, value=value, gen=context.flags.finished_gen)


def _transaction():
    ctx = context._current
    return ctx.transaction if ctx is not None else None


def _report(e: BaseException, stage: str) -> Raised:
    """What raised, told to the controller through the store at once: for a replica of several procs the others may
    be stuck in a collective with this one, and the actor call returns only once every proc of the mesh has."""
    ctx, tx, flags = context.current() if stage == "run" else None, _transaction(), context.flags
    oom = isinstance(e, (torch.OutOfMemoryError, MemoryError))
    raised = Raised(
        replica=int(os.environ.get("MONARCH_PLUGIN_REPLICA_ID", -1)), lane=int(os.environ.get("LOCAL_RANK", 0)),
        error=f"{type(e).__name__}: {e}", kind=f"{type(e).__module__}.{type(e).__qualname__}",
        traceback=traceback.format_exc(), stage=stage, step=flags.step, gen=tx.gen if tx is not None else -1,
        finished=flags.finished_gen >= 0, phase=flags.phase.value,
        runtime=e.phase if isinstance(e, ProtocolError) else "", oom=oom,
        held=tx.held if tx is not None else None,
    )
    if ctx is not None and stage == "run":
        ctx.events.emit("raised", replica=raised.replica, lane=raised.lane, step=raised.step, gen=raised.gen,
                        error=raised.error, type=raised.kind, phase=raised.phase, runtime=raised.runtime, oom=oom,
                        held=raised.held, pid=os.getpid())
        try:
            ctx.store.append(Key.RAISED, raised.line())
            ctx.store.add(Key.RAISED_COUNT, 1)
        except Exception:  # noqa: BLE001 - the returned outcome still tells the controller, once every proc returned
            pass
    return raised
