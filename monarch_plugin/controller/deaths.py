"""Deaths and hosts: a replica lost (its procs died, its host was lost, its training code raised, it hung), its
replacement, a host joining, and the ready replicas admitted.

It decides who is lost together (one generation change for a host's replicas, or for the members a probe found
hung), when a replacement starts (`policies.respawn_*`), when the run grows onto a new machine, when a ready replica
is admitted, and when to probe the members for a hang (the verdict is `hangs`'; what raised is judged by `triage`).
It writes the replicas' states, the run's death and restart counts, `respawn_at` and `wanted`, and kills a lost
replica's procs; generations are published, and the run stopped, only through `generations`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import NoReturn

from monarch_plugin.controller import hangs, policies, triage
from monarch_plugin.controller.generations import (
    announce,
    check_floor,
    ended,
    formed,
    give_up,
    holds,
    replan,
    stop_everything,
    verified,
)
from monarch_plugin.controller.replica import Replica
from monarch_plugin.controller.spawning import spawn, stop_mesh
from monarch_plugin.errors import ReplicaCodeError
from monarch_plugin.wire.handshake import FORMATION_BOUND_S
from monarch_plugin.wire.protocol import Action, Key, Probed, Raised, ReplicaState, unfit_members

__all__ = ["admit_ready", "check_stalled", "check_starting", "check_wedged", "end", "on_deaths",
           "on_host_lost", "on_host_up", "on_probed", "read_raised", "respawn_due", "schedule_respawn"]

logger = logging.getLogger("monarch_plugin")


# -- what raised ---------------------------------------------------------------------------------------------------


def read_raised(run) -> None:
    """What the store says raised: a proc of a replica of several tells it there at once, while its siblings may
    be stuck in a collective with it, so that the replica's actor call never returns."""
    for raised in run.appended(Raised, Key.RAISED, Key.RAISED_COUNT):
        if raised.replica in run.replicas:
            on_raised(run, run.replicas[raised.replica], raised)


def on_raised(run, replica: Replica, raised: Raised) -> None:
    """A replica's training code raised (a CUDA, NCCL or out-of-memory error, a flaky disk), or the runtime's own
    part of it failed: that replica's failure, replaced as after a death, unless it is the code's own bug
    (`triage`), which stops the run."""
    if replica.raised is not None or not replica.state.live:
        return  # one report a replica: its first proc's
    replica.raised = raised
    if triage.at_once(raised, replica.initial):
        _stop_on_code_error(run, replica, raised)
    twin = triage.twin(run.raises, replica.rid, raised)
    run.raises.append((replica.rid, raised))
    replica.kept = raised.held is not None and run.config.procs_per_replica == 1 and holds(run, replica)
    if raised.runtime == "store":  # someone steers the run from outside: nothing the store says can be trusted
        replica.state = ReplicaState.STOPPED
        give_up(run, policies.forged(replica.rid, raised.error, f"{run.config.store_host}:{run.store.port}"))
    if twin is not None:
        replica.state = ReplicaState.STOPPED
        give_up(run, policies.same_error(twin[0], replica.rid, raised),
                triage.tracebacks([twin, (replica.rid, raised)]), ReplicaCodeError)
    logger.warning("replica %d raised %s: %s\n--- replica %d traceback ---\n%s", replica.rid, triage.where(raised),
                   raised.error, replica.rid, raised.traceback.rstrip())
    if raised.oom and replica.state == ReplicaState.MEMBER:  # sized by the generation it ran out of memory in
        world = len(run.plans.get(raised.gen, run.members))
        run.oom_floor = max(run.oom_floor, policies.oom_floor(world, run.config))
    on_deaths(run, [replica], triage.how(raised))


def _stop_on_code_error(run, replica: Replica, raised: Raised) -> NoReturn:
    """The code fails wherever it runs: stop the run at once, respawning nobody."""
    replica.state = ReplicaState.DEAD
    run.events.emit("user_error", replica=replica.rid, error=raised.error, stage=raised.stage)
    stop_everything(run)
    raise ReplicaCodeError(triage.code_error(replica.rid, raised))


# -- deaths and hosts ----------------------------------------------------------------------------------------------


def on_host_lost(run, host: int, how: str) -> None:
    """Every replica on the host is gone at once: one generation change, not one per replica."""
    lost = [r for r in run.replicas.values() if r.host == host and r.state.live]
    run.events.emit("host_lost", host=run.hosts.hosts[host].name, replicas=[r.rid for r in lost], reason=how)
    on_deaths(run, lost, how, host_lost=True)


def on_host_up(run, host: int, returning: bool) -> None:
    """A host joined: replicas waiting for room can go there; a new machine (not one that came back) also
    grows the run, up to `max_replicas`."""
    if run.closing.is_set():
        return
    if not returning:
        grown = policies.grown(run.wanted, run.hosts.hosts[host].slots, run.config)
        if grown > run.wanted:
            run.events.emit("grow", host=run.hosts.hosts[host].name, replicas=grown, was=run.wanted)
            run.respawn_at += [(time.monotonic(), False)] * (grown - run.wanted)
            run.wanted = grown
    schedule_respawn(run)


def on_deaths(run, replicas: list[Replica], how: str, why: str = "", host_lost: bool = False) -> None:
    """`how`: what noticed it (the events' `detected_by`); `why`: what the probe found in a hung one.
    `host_lost`: they went with their host, which says nothing of the training code: a replacement still
    starting there does not count towards the crash loop."""
    dead = [r for r in replicas if r.state not in (ReplicaState.DEAD, ReplicaState.FINISHED, ReplicaState.STOPPED)]
    if not dead:
        return
    spawning = len(run.respawn_at)
    lost_members = []
    for replica in dead:
        # One draining was a member while the generation without it has not formed: its peers may be in a step
        # with it.
        was_member = replica.state == ReplicaState.MEMBER or (
            replica.state == ReplicaState.DRAINING and not formed(run, replica.drain_gen))
        replica.state = ReplicaState.DEAD
        run.last_death = how
        run.deaths += 1
        run.events.emit("death", replica=replica.rid, pids=replica.pids, detected_by=how,
                        gen=run.gen, was_member=was_member, host=run.hosts.host_of(replica.rid).name)
        run.hosts.unwatch(replica.rid)
        if not replica.kept:  # a kept one goes once the run's decision is taken, below
            end(run, replica)
        if not replica.initial and not replica.admitted and not host_lost:
            run.early_deaths += 1
        if was_member:
            lost_members.append(replica.rid)
    if run.closing.is_set():
        return
    ids = [r.rid for r in dead]
    what = (f"replica {ids[0]}" if len(ids) == 1 else f"replicas {ids}") + (
        f" {how}" if dead[0].raised else f" died ({how}{': ' + why if why else ''})")
    where = sorted({run.hosts.host_of(r).name for r in ids})
    if (run.config.hosts or run.config.hosts_file) and not all(w in how for w in where):
        what += f" on {', '.join(where)}"
    if ended(run):
        logger.warning("%s after training ended, in its own code after training: the run's training is complete",
                       what)
        return
    if lost_members:
        survivors = [m for m in run.members if run.replicas[m].state == ReplicaState.MEMBER]
        members = policies.next_members(survivors, ready_waiting(run), run.wanted)
        # Who can train: the survivors and the ready replicas that heal from them.
        stop = policies.below_min(len(members), run.config)
        if stop:
            logger.warning("%s: the run stops (%s)", what, stop)
            # What raised, with its traceback: the stop's cause, which the message would otherwise not name.
            raised = [(r.rid, r.raised) for r in dead if r.raised is not None]
            give_up(run, f"{what}: {stop}", triage.tracebacks(raised))
            return
        who = f"replica {lost_members[0]}" if len(lost_members) == 1 else f"replicas {lost_members}"
        restoring = replan(run, members, f"{who} died", what)
        spares = [m for m in members if m not in survivors]
        what += restoring or (f": training goes on with replicas {members}"
                              + (f" (hot spare {spares} admitted)" if spares else ""))
    else:
        what += " before it trained"
    stop = policies.crash_loop(run.early_deaths, run.config)
    if stop:
        logger.warning("%s; the run stops (%s)", what, stop)
        give_up(run, stop)
        return
    for replica in dead:
        if replica.kept:  # the run goes on: the state it kept is not needed
            replica.kept = False
            end(run, replica)
        schedule_respawn(run)
    started = len(run.respawn_at) - spawning
    logger.warning("%s%s", what, f"; {started} replacement(s) starting" if started > 0 else "")
    check_floor(run)


def end(run, replica: Replica) -> None:
    """A dead replica's procs go, and its slot with them: the rest of its group would only block its peers now."""
    replica.ended = True
    run.hosts.kill(replica.rid)
    run.hosts.release(replica.rid)
    threading.Thread(target=stop_mesh, args=(run.hosts, replica), daemon=True).start()


# -- replacements and admission ------------------------------------------------------------------------------------


def schedule_respawn(run, restart: bool = True) -> None:
    """`restart`: it replaces a failed replica (counted against `max_restarts`), not a drained one."""
    if run.finished_gen is not None:
        return
    live = sum(r.state.live and r.leaving is None for r in run.replicas.values())
    if not policies.respawn_wanted(live, len(run.respawn_at), run.wanted, run.config):
        return
    why = policies.respawn_refused(run.restarts, sum(r for _, r in run.respawn_at), run.config)
    if why:
        run.events.emit("no_respawn", reason=why)
        return
    delay = policies.respawn_delay(run.early_deaths, run.config)
    run.respawn_at.append((time.monotonic() + delay, restart))
    run.events.emit("respawn_scheduled", delay=delay, restarts=run.restarts, early_deaths=run.early_deaths)


def respawn_due(run) -> None:
    """Start the replacements whose time came, while a host has room for them."""
    now = time.monotonic()
    for due in [due for due in run.respawn_at if due[0] <= now]:
        if not spawn(run, initial=False, restart=due[1]):
            if not run.no_room:
                run.no_room = True
                run.events.emit("no_room", waiting=len(run.respawn_at),
                                reason="every live host is full: the run trains on fewer replicas (or, after "
                                       "an out-of-memory, waits) until a host joins or comes back")
            return  # it stays due: tried again when a host has room
        run.no_room = False
        run.respawn_at.remove(due)


def ready_waiting(run) -> list[int]:
    """The replicas ready to be admitted, in the order they became ready."""
    return [r.rid for r in run.replicas.values() if r.state == ReplicaState.WAITING]


def admit_ready(run) -> None:
    """Grow the current generation with ready replicas, up to `wanted`, at a step boundary its members share."""
    if not run.members or run.finished_gen is not None:
        return
    current = [m for m in run.members if run.replicas[m].state == ReplicaState.MEMBER]
    if len(current) != len(run.members):
        return  # the generation is finishing or changing; admit at the next one
    newcomers = policies.admit(current, ready_waiting(run), run.wanted)
    if run.action == Action.WAIT:  # nobody trains: the waiting members take replacements once there are enough
        if newcomers and len(current) + len(newcomers) >= run.oom_floor:
            announce(run, current + newcomers, reason=f"replica(s) {newcomers} ready", interrupt=False)
        return
    if newcomers and formed(run, run.gen):  # a grow moves members only at a step boundary they share
        announce(run, current + newcomers, reason=f"replica(s) {newcomers} ready", interrupt=False)


# -- hangs: when to probe, and acting on the verdict ---------------------------------------------------------------


def check_starting(run) -> None:
    """A replica not ready `join_timeout_s` after its spawn began (a replacement, a spare, an initial one the
    run started without) is stuck before its training loop (`hangs.never_ready`)."""
    starting = {r.rid: r.spawned_at for r in run.replicas.values() if r.state == ReplicaState.SPAWNING}
    stuck = hangs.never_ready(starting, time.time(), run.config.join_timeout_s)
    if stuck:
        _treat_as_hung(run, stuck, "hang (never ready)")


def check_stalled(run) -> None:
    """A member's proc said its collective or formation in the current generation failed (`Key.stalled_by`, signed):
    its peers are probed. The count it moves first only says when to look: anyone can move it."""
    g = run.gen
    if g < 0 or run.stall_probed == g:
        return
    if g not in run.stalls_seen:
        count = run.store.add(Key.stalled(g), 0)
        if count <= run.stall_counts.get(g, 0):
            return
        run.stall_counts[g] = count
        lanes = range(run.config.procs_per_replica)
        if not any(verified(run.store, [Key.stalled_by(g, m, lane)]) for m in run.plans[g] for lane in lanes):
            return  # only the count moved: nothing any member said
        run.stalls_seen[g] = time.monotonic()
    # A peer's death is what usually breaks a collective, and it reaches us by pidfd or supervision
    # within milliseconds of the survivors' report: let it, rather than probe a dead member.
    if time.monotonic() - run.stalls_seen[g] < hangs.STALL_GRACE_S:
        return
    run.stall_probed = run.gen
    _probe(run, wedged=False)


def check_wedged(run) -> None:
    """A generation still not formed well past the formation bound: probe its members once, and treat as hung any
    member still inside the formation of an older generation (`hangs.judge_wedged`)."""
    g = run.gen
    if run.finished_gen is not None or not hangs.wedge_due(g, run.wedge_checked, run.action == Action.WAIT,
                                                           time.monotonic() - run.announced_at, FORMATION_BOUND_S):
        return
    run.wedge_checked = g
    if not formed(run, g):
        _probe(run, wedged=True)


def on_probed(run, probed: Probed) -> None:
    """The members answered a probe of the current generation: act on the verdict. A stall with nobody to blame
    forms the same members again; wedged members are lost (the deaths publish a new generation, checked in its
    own turn)."""
    members = {r.rid for r in run.replicas.values() if r.state == ReplicaState.MEMBER}
    if probed.wedged:
        wedged = hangs.judge_wedged(probed.statuses, members, run.gen)
        if wedged:
            _treat_as_hung(run, wedged, "hang (wedged)")
        return
    unfit = (unfit_members("\n".join(run.store.lines(Key.unfit(run.gen))))
             if run.store.check([Key.unfit(run.gen)]) else {})
    verdict = hangs.judge_stall(probed.statuses, members, run.config.collective_timeout_s, unfit)
    if not verdict.hung:
        replan(run, list(run.members), "stalled reduction, all members responsive",
               f"generation {run.gen} stalled with every member responsive")
        return
    _treat_as_hung(run, verdict.hung, verdict.how, verdict.probed)


def _probe(run, wedged: bool) -> None:
    """Ask the current generation's members what they are doing, on a thread of its own: the answers come back
    on the queue (`Probed`), and meanwhile the controller goes on noticing deaths and host losses
    (a probe of a frozen member takes `PROBE_TIMEOUT_S`, and one of a cut-off host's never answers)."""
    g = run.gen
    members = [run.replicas[m] for m in run.members if run.replicas[m].state == ReplicaState.MEMBER]
    threading.Thread(target=lambda: run.reports.put(Probed(g, _statuses(members), wedged)), daemon=True,
                     name=f"monarch-plugin-probe-{g}").start()


def _statuses(replicas: list[Replica]) -> dict[int, list[dict] | None]:
    """What each proc of each replica is doing, from its control actor (None: it did not answer). Every replica
    is asked at once and waited for under one deadline: frozen members cost `PROBE_TIMEOUT_S` together, not
    each."""
    asked = {}
    for replica in replicas:
        try:
            asked[replica.rid] = replica.control.status.call()
        except Exception:  # noqa: BLE001 - an unreachable control actor is itself the answer
            asked[replica.rid] = None
    deadline = time.monotonic() + hangs.PROBE_TIMEOUT_S
    answers: dict[int, list[dict] | None] = {}
    for rid, future in asked.items():
        try:
            answers[rid] = list(future.get(timeout=max(deadline - time.monotonic(), 0.01)).values())
        except Exception:  # noqa: BLE001 - as above
            answers[rid] = None
    return answers


def _treat_as_hung(run, suspects: dict[int, str], how: str, probed: dict | None = None) -> None:
    """`suspects`: each replica found hung and what the probe found in it; `probed`: what every member was doing
    then, so the events show causally which member was suspected and why the others were not. They are lost
    together, in one generation change."""
    for rid, why in suspects.items():
        replica = run.replicas[rid]
        run.events.emit("hang", replica=rid, pids=replica.pids, gen=run.gen, detected_by=how, why=why,
                        probed=probed)
        run.hosts.kill(rid)
    on_deaths(run, [run.replicas[rid] for rid in suspects], how, "; ".join(dict.fromkeys(suspects.values())))
