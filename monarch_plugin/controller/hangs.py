"""Hang judgement, as pure functions of what the probed members answered: who is hung, and why.

The controller probes a generation's members when one reported a stalled reduction, or when the generation has not
formed well past the formation bound (`deaths` asks, on a thread of its own); it hands the answers here and acts on
the verdict. Nothing here touches a process, the store or the clock (`now` is given), so each judgement is
unit-tested as it is. A proc's answer is its control actor's status: `phase`, `since`, `now`, `step`, `forming`.
"""

from __future__ import annotations

from dataclasses import dataclass

from monarch_plugin.wire.protocol import WAITING_ON_PEERS, Phase

__all__ = ["PROBE_TIMEOUT_S", "STALL_GRACE_S", "Verdict", "judge_stall", "judge_wedged", "never_ready", "wedge_due"]

STALL_GRACE_S = 0.5
"""How long after a stall report the controller waits before it probes: a peer's death, which usually breaks a
collective, reaches it by pidfd or supervision within milliseconds of the survivors' report."""
PROBE_TIMEOUT_S = 5.0
"""How long a probed control actor may take to say what its proc is doing; a frozen (SIGSTOPped) proc never does."""

Answers = dict[int, list[dict] | None]
"""Replica -> what each of its procs said it was doing (None: its control actor did not answer in time)."""


@dataclass(frozen=True)
class Verdict:
    """What a probe of a stalled generation found."""

    hung: dict[int, str]
    """Each member that goes, and why; empty: every member is fine, and the same members form the generation again."""
    how: str = "hang"
    """What found them (the events' `detected_by`)."""
    probed: dict[int, str] | None = None
    """What every member answered was doing, so the events show why one was suspected and the others not."""


def judge_stall(answers: Answers, members: set[int], bound: float, unfit: dict[int, str]) -> Verdict:
    """The current generation stalled and its `members` (those still members) answered, or did not: the one stuck
    outside the reduction past `bound` (`collective_timeout_s`), or that answered nothing, is hung; with none, a
    member reported `unfit` (the recipients of a heal past its bound, a replica whose procs disagree) goes, and the
    others keep training; with none of those either, nobody goes."""
    suspects: dict[int, str] = {}  # replica -> why
    probed: dict[int, str] = {}  # replica -> what each of its procs was doing, and for how long
    for m, statuses in answers.items():
        if m not in members:
            continue  # it died while the probe was out: already dealt with
        if statuses is None:
            probed[m] = suspects[m] = f"no answer from its control actor in {PROBE_TIMEOUT_S:.0f} s (frozen)"
            continue
        probed[m] = ", ".join(f"{s['phase']} for {s['now'] - s['since']:.1f} s at step {s['step']}" for s in statuses)
        stuck = [s for s in statuses if s["phase"] not in WAITING_ON_PEERS and s["now"] - s["since"] > bound]
        if stuck:
            s = stuck[0]
            suspects[m] = (f"{s['phase']} at step {s['step']} for {s['now'] - s['since']:.1f} s, "
                           f"past collective_timeout_s {bound:g}, while its peers waited on it")
    if suspects:
        return Verdict(suspects, "hang", probed)
    return Verdict({r: why for r, why in unfit.items() if r in members}, "reported unfit", probed)


def judge_wedged(answers: Answers, members: set[int], gen: int) -> dict[int, str]:
    """The members of generation `gen` still inside the formation of an older one, and why: their training thread is
    stuck where it could neither see the newer plan nor give up (its control actor still answers), and the others
    would wait for it at every barrier it never reaches."""
    return {m: f"still forming generation {min(s['forming'] for s in statuses)} in generation {gen}"
            for m, statuses in answers.items() if m in members
            and statuses and any(s["phase"] == Phase.JOIN and s["forming"] < gen for s in statuses)}


def wedge_due(gen: int, checked: int, waiting: bool, since_announced: float, bound: float) -> bool:
    """Whether generation `gen`, published `since_announced` seconds ago, is due its one probe for wedged members:
    past the formation `bound` and twice the stall grace, not probed yet (`checked`: the last generation probed),
    and training (`waiting`: its members wait for replacements, training nothing, and form nothing)."""
    return gen >= 0 and gen != checked and not waiting and since_announced >= bound + 2 * STALL_GRACE_S


def never_ready(starting: dict[int, float], now: float, bound: float) -> dict[int, str]:
    """The replicas still starting (replica -> when its spawn began) that are not ready `bound` (`join_timeout_s`)
    seconds after: stuck before their training loop, and treated as hung rather than holding a slot and a restart
    forever, as the initial replicas are bounded by the same setting."""
    return {rid: f"not ready {bound:g} s after its spawn began (`join_timeout_s`): stuck before its training loop"
            for rid, began in starting.items() if now - began > bound}
