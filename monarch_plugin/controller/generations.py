"""Generations and give-up: publishing who trains together next, whether training ended, and how a run stops.

It decides what a generation after a loss does (train on, heal from the members that hold the run's trained state;
wait for replacements after an out-of-memory; restore the run's newest checkpoint when none holds it), whether
training ended (an end barrier passed), and who writes the checkpoint of a run that stops. It writes the run's
generation state (`gen`, `members`, `plans`, `action`, `finished_gen`, the open end barriers) and the store's plans;
it may not start, kill or count a replica's death: a writer lost while it writes is left to the run's report intake
(`ElasticController.handle`), and the deaths to `deaths`.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Callable, NoReturn

from monarch_plugin.controller import bootstrap, policies
from monarch_plugin.controller.faults import first_line
from monarch_plugin.controller.hangs import PROBE_TIMEOUT_S
from monarch_plugin.controller.replica import Replica
from monarch_plugin.errors import ElasticRunAborted, RunStopped
from monarch_plugin.events import read_events
from monarch_plugin.storage.checkpoint import newest_written, step_of
from monarch_plugin.wire.handshake import passed, supersede
from monarch_plugin.wire.protocol import Action, Key, Plan, Raised, ReplicaState, Returned
from monarch_plugin.wire.signing import Forged, SignedStore

__all__ = ["EndedFirst", "announce", "check_floor", "close_ends", "ended", "formed", "give_up", "holds", "replan",
           "stop_everything", "verified"]

logger = logging.getLogger("monarch_plugin")


class EndedFirst(Exception):
    """A stop found the run's training already ended: its end barrier passed before the stop could close it."""


def verified(store: SignedStore, keys: list[str]) -> bool:
    """Every key is set to a value signed with the run's secret (one that is not was reported: `forged_value`)."""
    try:
        return store.verified(keys)
    except Forged:
        return False


def formed(run, g: int) -> bool:
    """Every proc of generation g's members formed its group (workers count `formed/<g>`)."""
    if g not in run.formed_gens and verified(
            run.store, [Key.formed(g, m, lane) for m in run.plans[g] for lane in range(run.config.procs_per_replica)]):
        run.formed_gens.add(g)
    return g in run.formed_gens


def holds(run, replica: Replica) -> bool:
    """Whether the replica holds the run's trained state: once every one of its procs has said so, it does."""
    if not replica.holds and verified(run.store, [Key.holds(replica.rid, lane)
                                                  for lane in range(run.config.procs_per_replica)]):
        replica.holds = True
    return replica.holds


def ended(run) -> bool:
    """Training is over: every member of a generation reached the end of training together. A replica that returned
    from training says so (`ElasticController.handle`); before one has, the store does, once that generation's end
    barrier passed in every lane (`handshake.passed`): its members may still be running their own code after
    training (an evaluation, an upload, a slow exit), and whatever happens to them then is no failure of the run's.
    Asked where a decision is taken, not on every turn of the supervision loop."""
    if run.finished_gen is None and run.store is not None:
        newest_formed = max(run.formed_gens, default=-1)  # members that formed it left every older generation's end
        run.open_ends = [g for g in run.open_ends if g >= newest_formed]
        lanes = range(run.config.procs_per_replica)
        run.finished_gen = next((g for g in run.open_ends
                                 if all(passed(run.store, Key.finished(g, lane)) for lane in lanes)), None)
    return run.finished_gen is not None


def close_ends(run) -> bool:
    """Supersede every end barrier still open, so that no member passes one from now on: whether training ended
    before (one had passed already: `finished_gen` is then set). The supersede is the moment that decides a race
    between the last member arriving at the end and a decision to replace or stop its generation."""
    for g in run.open_ends:
        for lane in range(run.config.procs_per_replica):
            supersede(run.store, Key.finished(g, lane))
    return ended(run)


def announce(run, members: list[int], reason: str, interrupt: bool, action: Action = Action.TRAIN,
             checkpoint: str | None = None) -> None:
    """Publish generation gen+1. `interrupt` aborts the steps in flight (a death); otherwise members
    move at the next step boundary they all agree on (a grow). `checkpoint`: what a RESTORE generation loads."""
    holders = [] if action == Action.RESTORE else [m for m in members if holds(run, run.replicas[m])]
    if not holders and action != Action.RESTORE:
        raise RuntimeError(f"generation {run.gen + 1} of {members} would have no member holding the run's "
                           "trained state: a bug in monarch-plugin")
    run.gen += 1
    g = run.gen
    previous = [m for m in run.members if run.replicas[m].state == ReplicaState.MEMBER]
    # A draining replica is in its last step with the members until the generation without it forms: it is told as
    # they are (an interrupt left it in a step with a dead peer until `drain_grace_s`).
    previous += [r.rid for r in run.replicas.values() if r.state == ReplicaState.DRAINING]
    run.members = list(members)
    run.action = action
    run.plans[g] = run.members
    run.store.set(Key.plan(g), Plan(gen=g, members=run.members, action=action, reason=reason,
                                    target=run.wanted, holders=holders, checkpoint=checkpoint).dumps())
    run.store.set(Key.LATEST, str(g))
    run.announced_at = time.monotonic()
    for m in run.members:
        replica = run.replicas[m]
        if replica.state == ReplicaState.WAITING and not replica.initial:
            replica.admitted = True
            run.early_deaths = 0
        replica.state = ReplicaState.MEMBER
    # Formations of the generation this one replaces end now: their waiting members block on the store.
    lanes = range(run.config.procs_per_replica)
    for lane in lanes if g > 0 else ():
        supersede(run.store, Key.group(g - 1, lane))
        for share in range(run.config.heal_donors):
            supersede(run.store, Key.heal_group(g - 1, lane, share))
    if interrupt:  # so does every end barrier still open (a grow or a drain leaves members that reached it there)
        close_ends(run)
        run.open_ends.clear()
    run.open_ends.append(g)
    # Each proc concerned is told as a message: a waiting one then reads the plan, never polls for it.
    for m in dict.fromkeys(previous + run.members):
        control = run.replicas[m].control
        tell = control.plan if m not in previous else control.abort if interrupt else control.regroup
        try:
            tell.broadcast(g)
        except Exception:  # noqa: BLE001 - a member that cannot be told is about to be found dead
            pass
    run.events.emit("quorum", gen=g, members=run.members, reason=reason, interrupt=interrupt,
                    action=action.value, holders=holders, **({"checkpoint": checkpoint} if checkpoint else {}))


def replan(run, members: list[int], reason: str, what: str) -> str:
    """Publish the generation that goes on after a loss, dropping the steps in flight: with its members that
    hold the run's trained state, whom the others heal from. When none holds it (the last that did died before
    another had healed from it), they restore the run's newest checkpoint instead, and without one the run
    stops: never does a generation train from weights the run never trained. Returns what a restore costs, to
    log (empty when training simply goes on)."""
    if any(holds(run, run.replicas[m]) for m in members):
        if len(members) < run.oom_floor:
            announce(run, members, reason=f"{reason}; waiting for replacements: {policies.WAIT_WHY}",
                     interrupt=True, action=Action.WAIT)
            return (f": replicas {members} wait, training nothing, for {run.oom_floor - len(members)} "
                    f"replacement(s) ({policies.WAIT_WHY})")
        announce(run, members, reason=reason, interrupt=True)
        return ""
    checkpoint = _run_checkpoint(run)
    stop = policies.state_lost(checkpoint)
    if stop:
        logger.warning("%s: the run stops (%s)", what, stop)
        give_up(run, stop)
    announce(run, members, reason=f"{reason}; no replica holds the run's trained state: restoring {checkpoint}",
             interrupt=True, action=Action.RESTORE, checkpoint=checkpoint)
    run.events.emit("restore", members=members, path=checkpoint, step=step_of(checkpoint), gen=run.gen)
    return (f", and no live replica holds the run's trained state any more: replicas {members} restore "
            f"{checkpoint} and train again what the run trained after its step {step_of(checkpoint)}")


def check_floor(run) -> None:
    """Members waiting for replacements (`Action.WAIT`) that can no longer all come (restarts used up, or the
    replacements died): the run stops, as below `min_replicas`, with the waiting members' checkpoint."""
    if run.action != Action.WAIT or run.closing.is_set():
        return
    coming = len(run.respawn_at) + sum(r.state in (ReplicaState.SPAWNING, ReplicaState.WAITING)
                                       for r in run.replicas.values())
    waited = time.monotonic() - run.announced_at
    stop = policies.short_of_floor(len(run.members), coming, run.oom_floor, waited, run.config)
    if stop:
        logger.warning("the run stops: %s", stop)
        give_up(run, stop)


def _run_checkpoint(run) -> str | None:
    """The newest complete checkpoint of this run's own (every file recorded by its `checkpoint` events and
    still on disk), else the one it resumed from: what a generation left without a holder restores. Never
    another run's: a checkpoint in the same directory that this run did not write was never its state. Checked
    by its files' sizes only: this runs on the supervision loop, which must not read the whole checkpoint."""
    paths = [e["path"] for e in read_events(run.config.events_path or "") if e["event"] == "checkpoint"]
    return newest_written(paths, skipped=partial(bootstrap.damaged, run.events), hashed=False) or run.config.resume


def _newest_checkpoint(run, live: list[int]) -> str | None:
    """The checkpoint to resume a stopped run from, when none was written on the way out: the newest one the
    front end's own checkpointing holds (Lightning's, HF's, torchtitan's), as a live replica's control actor
    names it; else this run's own (`ElasticLoop`'s)."""
    for m in live:
        try:
            found = run.replicas[m].control.newest_checkpoint.call().get(timeout=PROBE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - an unreachable replica names nothing; ask the next
            continue
        path = next((p for p in found.values() if p), None)
        if path:
            return path
    return _run_checkpoint(run)


def give_up(run, reason: str, detail: str = "",
            error: Callable[[str, str | None], ElasticRunAborted] = ElasticRunAborted) -> NoReturn:
    """Stop the run on purpose: the live members that hold the run's state write one durable checkpoint, then
    everything stops; with none in training, a replica whose training code raised writes it from the state it
    held untouched (`Replica.kept`). With none holding it, nothing is written (a replica's own weights would be
    a checkpoint the run never trained) and the message names the newest checkpoint on disk to resume from.
    `detail` follows the message (the tracebacks of a bug); `error` is what is raised. Training that ended
    before the stop could close its end (`close_ends`) is not stopped: `EndedFirst`, and the run ends as any
    finished run does."""
    if close_ends(run):
        raise EndedFirst(reason)
    run.closing.set()  # what happens from here is recorded, and decides nothing but who writes
    checkpoint = _stop_checkpoint(run, reason) or _checkpoint_held(run)
    # Replicas whose training code raised still answer, unless ended: even one whose sibling is stuck.
    resume_from = checkpoint or _newest_checkpoint(
        run, [r.rid for r in run.replicas.values()
              if (r.state.live or (r.raised is not None and not r.ended)) and r.control is not None])
    run.events.emit("give_up", reason=reason, checkpoint=checkpoint, resume_from=resume_from)
    stop_everything(run)
    lost = (f"its checkpoint could not be written ({run.write_error})" if run.write_error else
            "no live replica held the run's trained state to write")
    if checkpoint:
        where = f"checkpoint written to {checkpoint}"
    elif resume_from:
        where = f"{lost}: resume from {resume_from}, the newest checkpoint"
    else:
        where = f"{lost}, and no checkpoint of it was found"
    stopped = error(f"monarch-plugin stopped the run: {reason}; {where}{detail}", resume_from)
    if isinstance(stopped, RunStopped):  # a `SystemExit`: uncaught, it ends the process without a word
        if resume_from:
            stopped.args = (f"{stopped}; relaunch with your front end's resume option to go on from it "
                            "(docs/runtime.md, \"Stopping a run\")",)
        logger.warning("%s", stopped)
    raise stopped


def _stop_checkpoint(run, reason: str) -> str | None:
    """The checkpoint of a run that stops: the live members that hold its state form a generation to write it
    (`Action.CHECKPOINT`), whose first member (its rank 0) writes while the others wait. A writer lost before it
    returns one (dead, its host lost, or its code raised) is replaced by the next holder, in a generation of the
    holders left, until one is written, none is left, or `join_timeout_s` has passed. None: nothing written."""
    holders = [m for m in run.members if run.replicas[m].state == ReplicaState.MEMBER
               and holds(run, run.replicas[m])]
    deadline = time.monotonic() + run.config.join_timeout_s
    while holders and time.monotonic() < deadline:
        announce(run, holders, reason=f"giving up: {reason}", interrupt=True, action=Action.CHECKPOINT)
        writer = run.replicas[holders[0]]
        while writer.state == ReplicaState.MEMBER and time.monotonic() < deadline:
            for raised in run.appended(Raised, Key.RAISED, Key.RAISED_COUNT):  # raised instead of writing
                if raised.replica in holders:
                    _raised_holding(run, run.replicas[raised.replica], raised)
            report = run.next_report(0.05)
            if not isinstance(report, Returned):
                if report is not None:
                    run.handle(report)  # a death or a host's loss, recorded (`closing`: nothing re-planned)
                continue
            replica = run.replicas[report.replica]
            # The first proc that wrote one (a replica writes one per proc when each holds its own state).
            path = next((o.checkpoint for o in report.outcomes if o.checkpoint), None)
            raised = next((o.raised for o in report.outcomes if o.status == "error"), None)
            if raised is not None:
                _raised_holding(run, replica, raised)
            replica.state = ReplicaState.STOPPED
            if replica is writer and (path or raised is None):
                return path  # None: the front end writes no checkpoint of its own
        if writer.raised is not None:
            run.write_error = writer.raised.error
        holders = [m for m in holders if run.replicas[m].state == ReplicaState.MEMBER]
        if holders and (writer.raised is None or run.config.procs_per_replica > 1):
            run.hosts.kill(writer.rid)  # its other procs may still be writing the files the next one writes
        if holders:
            why = f"raised {writer.raised.error}" if writer.raised else writer.state.value
            logger.warning("replica %d did not write the checkpoint (%s): replica %d writes it instead", writer.rid,
                           why, holders[0])
    return None


def _raised_holding(run, replica: Replica, raised: Raised) -> None:
    """A holder asked for the give-up checkpoint raised instead of writing it: it is waited for no longer, and
    writes it from the state it kept untouched (`_checkpoint_held`) if that was a committed step's."""
    if replica.raised is None:
        replica.raised = raised
        replica.kept = raised.held is not None and run.config.procs_per_replica == 1
    replica.state = ReplicaState.STOPPED


def _checkpoint_held(run) -> str | None:
    """The give-up checkpoint when no replica in training wrote one: from a replica whose training code raised
    while its state was still a committed step's, kept for this (None: there is none, or it wrote nothing)."""
    for replica in run.replicas.values():
        if not replica.kept or replica.control is None:
            continue
        try:
            found = replica.control.checkpoint_held.call().get(timeout=run.config.join_timeout_s)
        except Exception as e:  # noqa: BLE001 - a proc that cannot write it leaves the others to
            logger.warning("replica %d could not write the give-up checkpoint: %s", replica.rid, first_line(e))
            continue
        path = next((p for p in found.values() if p), None)
        if path:
            return path
    return None


def stop_everything(run) -> None:
    """From now on the run decides nothing: every live replica is told to shut down."""
    run.closing.set()
    for replica in run.replicas.values():
        if replica.state.live and replica.control is not None:
            try:
                replica.control.shutdown.broadcast()
            except Exception:  # noqa: BLE001 - it is being torn down either way
                pass
