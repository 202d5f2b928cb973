"""Drains and signals with notice: a replica, a host or this process told to go (a preemption, `scancel`, `kill`).

It decides when the replicas told to go leave (together, at the next step boundary they share, once their
generation formed), when one that does not is treated as dead (`drain_grace_s`), and when a notice stops the run
with a checkpoint instead (`policies.drain_stop`, or this process told). It writes the told replicas' `leaving` and
draining state, a host's `leaving`, and `told_to_stop`/`stop_by`; the generation without them is published by
`generations`, their replacements and deaths are `deaths`' to start and count: it may not spawn or kill by itself.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import replace
from functools import partial

from monarch_plugin.controller import policies
from monarch_plugin.controller.deaths import end, on_deaths, schedule_respawn
from monarch_plugin.controller.generations import announce, ended, formed, give_up, replan
from monarch_plugin.controller.replica import Replica
from monarch_plugin.errors import RunStopped
from monarch_plugin.wire.protocol import Action, Drain, Key, ReplicaState

__all__ = ["DRAIN_SETTLE_S", "check_drains", "check_told", "on_signal", "read_drains"]

logger = logging.getLogger("monarch_plugin")

DRAIN_SETTLE_S = 0.25
"""How long the controller gathers the first notices of a drain before it decides: a scheduler signals a whole job
within milliseconds, and every replica told to go at once means a stop with a checkpoint, not a drain each."""


def on_signal(run, signum: int, frame) -> None:
    """SIGTERM or SIGUSR1 to this process, on its main thread: acted on by the supervision loop (`check_told`)."""
    run.told_to_stop = run.told_to_stop or signal.Signals(signum).name


def check_told(run) -> None:
    """This process was told to stop: the run stops with a checkpoint of its last committed step (the step in
    flight is dropped), whatever the replicas are doing, and `RunStopped` says how to resume."""
    if run.told_to_stop is None or run.closing.is_set() or run.stop_by is not None:
        return
    name = run.told_to_stop
    if ended(run):  # nothing to save: the replicas still in their own code after training get a drain's grace
        run.stop_by = time.monotonic() + run.config.drain_grace_s
        logger.warning("%s received after training ended: the run's training is complete; replicas still in their "
                       "code after training may take `drain_grace_s` %g to return", name, run.config.drain_grace_s)
        return
    logger.warning("%s received: the run stops with a checkpoint of its last committed step", name)
    give_up(run, f"{name} received", error=partial(RunStopped, signal=name))


def read_drains(run) -> None:
    """The signals with notice the replicas' procs received (`procs.notice` tells them through the store)."""
    for drain in run.appended(Drain, Key.DRAINS, Key.DRAIN_COUNT):
        if drain.replica in run.replicas:
            _on_drain(run, run.replicas[drain.replica], drain)
        elif drain.replica < 0 and 0 <= drain.host < len(run.hosts.hosts):
            _on_host_drain(run, drain)


def _on_drain(run, replica: Replica, drain: Drain) -> None:
    """A proc of the replica was told to go: its replacement starts now, and the replica leaves at a step boundary
    (`check_drains`)."""
    if replica.leaving is not None or not replica.state.live or run.closing.is_set():
        return
    replica.leaving, replica.leaving_at = drain, time.monotonic()
    run.events.emit("notice", replica=replica.rid, signal=drain.signal, pid=drain.pid, lane=drain.lane,
                    state=replica.state.value)
    if ended(run):
        logger.warning("replica %d got %s (proc %d) after training ended: its own code after training goes on; the "
                       "run's training is complete", replica.rid, drain.signal, drain.pid)
        return
    logger.warning("replica %d got %s (proc %d): it leaves at the next step boundary", replica.rid, drain.signal,
                   drain.pid)
    schedule_respawn(run, restart=False)


def _on_host_drain(run, drain: Drain) -> None:
    """A host told to go (its agent passed the signal on to its procs, and its watcher told us): none of the run's
    replicas is placed there any more, and all of its replicas drain together, in one generation change."""
    host = run.hosts.hosts[drain.host]
    if host.leaving or not host.live or run.closing.is_set():
        return
    host.leaving = True
    going = [r for r in run.replicas.values() if r.host == drain.host and r.state.live]
    run.events.emit("host_drain", host=host.name, signal=drain.signal, replicas=[r.rid for r in going])
    for replica in going:
        _on_drain(run, replica, replace(drain, replica=replica.rid))


def check_drains(run) -> None:
    """Replicas told to go leave at the next step boundary, in one generation change for all told at once: the
    generation without them is published as a grow is (no step dropped: every member commits the step in flight,
    agreeing inside it to move), once the current one has formed. One not yet a member just goes. Past
    `drain_grace_s` a replica still there is treated as dead. Every replica told to go, or fewer than
    `min_replicas` left, stops the run with a checkpoint instead (`policies.drain_stop`)."""
    now = time.monotonic()
    told = [r for r in run.replicas.values() if r.leaving is not None and r.state.live]
    if not told or run.closing.is_set() or ended(run):
        return
    late = [r for r in told if now - r.leaving_at > run.config.drain_grace_s]
    if late:
        for r in late:
            run.hosts.kill(r.rid)
        on_deaths(run, late, f"no step boundary within `drain_grace_s` {run.config.drain_grace_s:g} after "
                             f"{late[0].leaving.signal}")
        return
    for r in told:
        if r.state in (ReplicaState.SPAWNING, ReplicaState.WAITING):  # it trained nothing: it just goes
            r.state = ReplicaState.STOPPED
            run.events.emit("drained", replica=r.rid, gen=-1, seconds=round(now - r.leaving_at, 3))
            end(run, r)
    pending = [r for r in told if r.state == ReplicaState.MEMBER]
    if not pending or now - min(r.leaving_at for r in pending) < DRAIN_SETTLE_S:
        return
    leaving = [r.rid for r in pending]
    staying = [m for m in run.members if run.replicas[m].state == ReplicaState.MEMBER and m not in leaving]
    name = pending[0].leaving.signal
    stop = policies.drain_stop(len(staying), leaving, name, run.config)
    if stop:
        logger.warning("the run stops: %s", stop)
        give_up(run, stop, error=partial(RunStopped, signal=name))
    if run.action != Action.WAIT and not formed(run, run.gen):
        return  # members leaving a half-formed generation would strand their peers in it: at its first boundary
    who = f"replica {leaving[0]}" if len(leaving) == 1 else f"replicas {leaving}"
    reason = f"{who} drained ({name})"
    if run.action == Action.WAIT:  # nobody trains: nothing in flight to finish
        replan(run, staying, reason, reason)
    else:
        announce(run, staying, reason=reason, interrupt=False)
    for r in pending:
        r.state, r.drain_gen = ReplicaState.DRAINING, run.gen
    run.events.emit("drain", replicas=leaving, gen=run.gen, members=staying, signal=name)
    logger.warning("%s leave(s) at the next step boundary (%s): training goes on with replicas %s", who, name,
                   staying)
