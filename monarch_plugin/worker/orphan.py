"""What a worker proc does when its controller is lost: it saves the run's last committed step, then ends.

The controller is one process on one machine, and Monarch's root has no failover: the OOM killer, a panic or a lost
node takes it like any other process. Its replicas hold the trained state in memory, and until this module they
ended with it, so a relaunch went back to the last periodic checkpoint (or to the start). Now a proc that loses its
controller (`lost`: its process ended on its machine, `watch`; elsewhere its lease on the controller's store ran
out, `procs.lease`):
- ends at once if it is not a proc of the generation's first replica (rank 0): only that one writes, and a proc
  behind a cut link is gone as soon as its lease is, as before the save existed;
- otherwise ends every wait of its training thread as a stop does (`Flags.lose_controller`): a step whose reduction
  had completed commits (the reduction needs no controller), one still waiting for it is dropped;
- and at its next step boundary (`StepTransaction.sync`) writes the step its state holds with the front end's own
  checkpoint, as when the run gives up (`save`). It holds the run's locks while it writes (`runlock.hold`): a
  controller that is alive but cut off holds them still, and so does a relaunch already started on the same files;
  then nothing is written, and the run's files never get a second writer;
- ends (`os._exit`) once that is done, and at the latest `controller_loss_save_s` after the loss, written or not.
  A proc too wedged to run that thread is ended by whoever started it: its forkserver client or its watchdog on
  the controller's machine (`procs.forkserver`, `procs.notice`), its host agent elsewhere.
"""

from __future__ import annotations

import os
import select
import sys
import threading
import time

from monarch_plugin.errors import ConfigError
from monarch_plugin.storage import runlock
from monarch_plugin.wire.protocol import Phase
from monarch_plugin.worker import context

__all__ = ["EXIT_CODE", "lost", "returned", "save", "watch"]

EXIT_CODE = 17
"""How a proc that lost its controller exits (as one whose lease ran out)."""


def watch(pid: int, on_lost) -> None:
    """Call `on_lost(why)` when the process `pid` (the controller, on this machine) ends: at once, by its pidfd."""

    def wait() -> None:
        try:
            select.select([os.pidfd_open(pid)], [], [])
        except OSError:
            pass  # gone already
        on_lost("the controller's process ended")

    threading.Thread(target=wait, name="monarch-plugin-controller-watch", daemon=True).start()


_told = threading.Lock()
_saving = threading.Lock()
HELD_UP_S = 2.0
"""How long after the loss a writer's training thread still in the runtime's join or reduction is taken as held up
in a store call (`_save_if_held_up`)."""


def lost(why: str, bound_s: float, what: str) -> None:
    """The controller is lost (`why`): stop training, save at the next step boundary, end within `bound_s`."""
    if not _told.acquire(blocking=False):
        return
    context.flags.lose_controller(why)
    ctx = context._current
    if ctx is None or ctx.rank != 0:  # not a writer: nothing to wait for a step boundary for
        _say(f"{what}: {why}: the generation's first replica writes the last committed step; this proc ends now")
        if ctx is not None:
            _record(ctx, ctx.transaction, None, "another replica writes it")
        _end()
    _say(f"{what}: {why}: writing the last committed step at the next step boundary; this proc ends within "
         f"controller_loss_save_s {bound_s:g} s")
    threading.Thread(target=_end_after, args=(bound_s,), name="monarch-plugin-orphan-bound", daemon=True).start()
    threading.Thread(target=_save_if_held_up, args=(ctx, time.time()), name="monarch-plugin-orphan-save",
                     daemon=True).start()


def _save_if_held_up(ctx, lost_at: float) -> None:
    """Write from this thread if the training thread is held up in a call to the controller's store that nothing will
    answer (its machine gone or cut off: no reset comes back, and the call waits out the store's timeout). A training
    thread in the runtime's join or reduction when the controller was lost, and still there `HELD_UP_S` later, is
    in such a call (every wait of its own ends within a second of the loss), holding a committed step's state
    (`held`): the state is not moving, and this thread writes it. Replicas of one proc only: the procs of a larger
    one write together, from their training threads."""
    time.sleep(HELD_UP_S)
    tx, flags = ctx.transaction, ctx.flags
    if tx is None or ctx.procs_per_replica > 1 or tx.held is None:
        return
    if flags.phase in (Phase.JOIN, Phase.REDUCE) and flags.phase_since < lost_at:
        save(tx)


def save(tx) -> None:
    """At a step boundary of a proc whose controller is lost: write the run's checkpoint if this proc is one of the
    generation's first replica and holds a committed step, then end the process. Never returns: a second thread
    (`_save_if_held_up` and the training thread) waits here for the first, which ends the process."""
    _saving.acquire()
    ctx, path, skipped = tx.ctx, None, None
    if tx.rank != 0:
        skipped = "another replica writes it"
    elif tx.held is None:
        skipped = "the state was being replaced (a heal or a restore) when the controller was lost"
    else:
        locks, refused = [], None
        if ctx.local_rank == 0:
            try:
                locks = runlock.hold(ctx.config)
            except ConfigError as e:  # held: the controller is alive (cut off), or a relaunch has started
                refused = f"the run's files are held: {e}"
        try:
            if tx.session.any_of(refused is not None):  # a replica's procs write together or not at all
                skipped = refused or "its local rank 0 could not take the run's locks"
            else:
                path = tx.write_held()
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is one; said in the event, the proc ends
            skipped = f"the write failed: {type(e).__name__}: {e}"
        finally:
            for lock in locks:
                lock.release()
    _record(ctx, tx, path, skipped)
    if path is not None:
        _say(f"replica {ctx.replica_id}: the controller was lost; wrote the last committed step {tx.held} to "
             f"{path}: relaunch from it (`monarch-run --resume auto`, or the framework's own resume from that path)")
    _end()


def _record(ctx, tx, path: str | None, skipped: str | None) -> None:
    """This proc's `controller_lost` event: the step it held, the checkpoint it wrote or why it wrote none."""
    ctx.events.emit("controller_lost", replica=ctx.replica_id, lane=ctx.local_rank, gen=tx.gen if tx else -1,
                    step=tx.held if tx else None, checkpoint=path, reason=ctx.flags.lost,
                    **({"skipped": skipped} if skipped else {}))


def returned(status: str) -> None:
    """The training code returned (`status`: ok, stopped, error) after the controller was lost, with no step boundary
    between (a stop's checkpoint it was writing, its code after the loop): nobody is left to hear of it; end now."""
    _say(f"the training code returned ({status}) after the controller was lost: ending now")
    _end()


def _end_after(bound_s: float) -> None:
    time.sleep(bound_s)
    _say(f"the controller was lost {bound_s:g} s ago (`controller_loss_save_s`): ending now")
    _end()


def _say(message: str) -> None:
    print(f"monarch-plugin: {message}", file=sys.stderr, flush=True)


def _end() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(EXIT_CODE)
