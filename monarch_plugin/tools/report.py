"""Read a run's events back: when each phase of each worker death happened, and what the run's rate was.

Used by `monarch-run` to print what happened, by the benchmarks to measure it (so the numbers in
docs/benchmarks.md are exactly what a user sees in their own events file), and by `monarch-plugin summary`,
which prints every failure as a table with the run's goodput. The goodput is defined from the events alone:
committed steps per second over the whole run against the run's own rate before its first failure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["Recovery", "recoveries", "format_recovery", "run_summary", "Commit", "commits", "Stretch", "Goodput",
           "goodput", "started_at", "host_name", "format_summary", "GOODPUT_DEFINITION", "MIN_STRETCH_S",
           "MIN_STRETCH_STEPS"]

MIN_STRETCH_S = 3.0
"""A rate is measured over a stretch of training only if its first and last recorded commits are at least this
many seconds (and MIN_STRETCH_STEPS steps) apart; a shorter one would be a guess, not a measurement."""

MIN_STRETCH_STEPS = 3


@dataclass
class Recovery:
    replica: int
    detected_by: str
    killed_at: float | None  # from a fault_injected / kill event, when one was recorded
    detected_at: float
    quorum_at: float | None  # the generation without the dead replica was published
    survivors: list[int]
    dropped_steps: list[int]
    resumed_at: float | None  # first step committed in that generation
    replacement: int | None = None
    hot_spare: bool = False  # the replacement was already running and waiting when the death came
    spawn_started_at: float | None = None
    spawned_at: float | None = None
    ready_at: float | None = None  # the replacement's training code reached its loop (model built), ready to join
    healed_at: float | None = None
    heal_seconds: float | None = None
    heal_bytes: int | None = None
    participating_at: float | None = None  # the replacement's first committed step
    participating_step: int | None = None
    replacement_joined: bool = False  # a generation admitted it (else the run ended, or it died, while starting)
    replacement_died: bool = False  # the replacement itself died (before training, when it never did)
    host: str | None = None  # where the dead replica ran ("this machine", or its host agent's address)
    was_member: bool = True  # it was in the generation (else it died starting, and no one had to shrink)
    restored_step: int | None = None  # no replica held the run's state after it: the next generation restored
    restored_by: list[int] | None = None  # ... this checkpoint, on these replicas
    redone_steps: int | None = None  # the steps committed after that checkpoint (as recorded), trained again
    waited: bool = False  # the survivors trained nothing until the replacement came (a WAIT generation: out of memory)

    @property
    def replace_started_at(self) -> float | None:
        """When replacing began: the spawn for a cold replacement, the detection for a hot spare."""
        return self.detected_at if self.hot_spare else self.spawn_started_at

    def phases(self) -> dict[str, float | None]:
        """Durations in seconds (None where a phase did not happen)."""
        t0 = self.killed_at if self.killed_at is not None else self.detected_at

        def since(a, b):
            return None if a is None or b is None else b - a

        return {
            "kill_to_detected": since(self.killed_at, self.detected_at),
            "kill_to_next_commit": since(t0, self.resumed_at),
            "spawn": None if self.hot_spare else since(self.spawn_started_at, self.spawned_at),
            "replace_to_healed": since(self.replace_started_at, self.healed_at),
            "replace_to_participating": since(self.replace_started_at, self.participating_at),
            "heal": self.heal_seconds,
            # a cold replacement's phases, one after the other: spawn, then these
            "spawned_to_ready": None if self.hot_spare else since(self.spawned_at, self.ready_at),
            "ready_to_healed": None if self.hot_spare else since(self.ready_at, self.healed_at),
            "healed_to_participating": since(self.healed_at, self.participating_at),
        }


def recoveries(events: list[dict]) -> list[Recovery]:
    """Each death of the run (a hang ends in one too), in order, with the phases of what followed it."""
    found: list[Recovery] = []
    quorums = [e for e in events if e["event"] == "quorum"]
    for death in (e for e in events if e["event"] == "death"):
        rid = death["replica"]
        # The failure: an injected fault, a kill the benchmarks recorded, or the training code's own exception.
        kills = [e for e in events if e["event"] in ("fault_injected", "kill", "raised") and e.get("replica") == rid]
        before = [q for q in quorums if q["ts"] <= death["ts"]]
        members_before = before[-1]["members"] if before else []
        after = [q for q in quorums if q["ts"] >= death["ts"] and rid not in q["members"]]
        shrink = after[0] if after else None
        rec = Recovery(
            replica=rid, detected_by=death["detected_by"],
            killed_at=kills[0]["ts"] if kills else None, detected_at=death["ts"],
            quorum_at=shrink["ts"] if shrink else None,
            survivors=[m for m in shrink["members"] if m in members_before] if shrink else [],
            dropped_steps=sorted({e["step"] for e in events if e["event"] == "dropped_step"
                                  and e["gen"] == death.get("gen")}),
            resumed_at=None, host=death.get("host"), was_member=death.get("was_member", True),
        )
        if shrink:
            rec.waited = shrink.get("action") == "wait"
            # A WAIT generation trains nothing: the survivors' next commit is in the first that trains.
            trains = next((q for q in quorums if q["ts"] >= shrink["ts"] and q.get("action") != "wait"), shrink)
            firsts = [e for e in events if e["event"] == "first_commit" and e["gen"] == trains["gen"]]
            rec.resumed_at = min((e["ts"] for e in firsts), default=None)
            if shrink.get("action") == "restore":
                restore = next(e for e in events if e["event"] == "restore" and e["gen"] == shrink["gen"])
                rec.restored_step, rec.restored_by = restore["step"], shrink["members"]
                # The steps committed after the checkpoint: the newest recorded (progress is recorded once a
                # second), or seen by a restoring replica when it last joined a holder.
                recorded = [c.step + 1 for c in commits(events) if c.ts <= death["ts"]]
                seen = [e.get("newest_seen", -1) for e in events
                        if e["event"] == "restored" and e["gen"] == shrink["gen"]]
                rec.redone_steps = max(0, max(recorded + seen, default=0) - restore["step"])
        claimed = {r.replacement for r in found}
        new = next((m for q in after for m in q["members"] if m not in members_before and m not in claimed), None)
        rec.replacement_joined = new is not None
        if new is None:  # spawned for this death but never admitted: the run ended (or it died) before it joined
            new = next((e["replica"] for e in events if e["event"] == "spawn" and not e.get("initial")
                        and e["ts"] >= death["ts"] and e["replica"] not in claimed), None)
        if new is not None:
            rec.replacement = new
            spawn = next((e for e in events if e["event"] == "spawn" and e["replica"] == new), None)
            if spawn:
                rec.spawned_at, rec.spawn_started_at = spawn["ts"], spawn["ts"] - spawn["seconds"]
                rec.hot_spare = rec.spawn_started_at < death["ts"]
            ready = next((e for e in events if e["event"] == "ready" and e["replica"] == new), None)
            rec.ready_at = ready["ts"] if ready else None
            heal = next((e for e in events if e["event"] == "heal" and new in e["recipients"]), None)
            if heal:  # one event per share and per lane: the heal is done when the last is
                parts = [e for e in events if e["event"] == "heal" and e["gen"] == heal["gen"]
                         and new in e["recipients"]]
                rec.healed_at = max(e["ts"] for e in parts)
                rec.heal_seconds = max(e["seconds"] for e in parts)
                rec.heal_bytes = sum(e["bytes"] for e in parts)
            first = next((e for e in events if e["event"] == "first_commit" and e["replica"] == new), None)
            if first:
                rec.participating_at, rec.participating_step = first["ts"], first["step"]
            rec.replacement_died = any(e["event"] == "death" and e["replica"] == new for e in events)
        found.append(rec)
    return found


def format_recovery(rec: Recovery) -> str:
    p = rec.phases()

    def ms(x):
        return "n/a" if x is None else f"{x * 1000:.0f} ms"

    if rec.detected_by.startswith(("raised ", "its monarch-plugin ")):  # an exception: the replica was alive
        lines = [f"replica {rec.replica} {rec.detected_by}"
                 + (f" (noticed {ms(p['kill_to_detected'])} after it was raised)" if rec.killed_at else "")]
    else:
        lines = [f"replica {rec.replica} died (noticed by {rec.detected_by}"
                 + (f", {ms(p['kill_to_detected'])} after the kill)" if rec.killed_at else ")")]
    if rec.restored_step is not None:
        lines.append(f"  no live replica held the run's trained state any more: replicas {rec.restored_by} restored "
                     f"the checkpoint of step {rec.restored_step}, and train again the {rec.redone_steps} step(s) "
                     f"committed after it (as far as recorded); next committed step "
                     f"{ms(p['kill_to_next_commit'])} after the {'kill' if rec.killed_at else 'detection'}")
    elif rec.waited:
        lines.append(f"  survivors {rec.survivors} waited for the replacement, training nothing (fewer would each "
                     f"take a larger share of the global batch): next committed step {ms(p['kill_to_next_commit'])} "
                     f"after the {'failure' if rec.killed_at else 'detection'}")
    elif rec.survivors:
        dropped = f"dropped step {rec.dropped_steps}" if rec.dropped_steps else "no step lost"
        lines.append(f"  survivors {rec.survivors} kept training: next committed step {ms(p['kill_to_next_commit'])} "
                     f"after the {'kill' if rec.killed_at else 'detection'} ({dropped})")
    if rec.replacement is not None:
        heal = (f"healed from a live peer in {ms(rec.heal_seconds)} ({rec.heal_bytes / 1e6:.1f} MB)"
                if rec.heal_seconds is not None else "not healed")
        since = "after the death was noticed" if rec.hot_spare else "after spawn began"
        if rec.participating_step is not None:
            training = f"training at step {rec.participating_step} {ms(p['replace_to_participating'])} {since}"
        else:
            ended = "died" if rec.replacement_died else "the run ended"
            training = f"{ended} before it {'trained' if rec.replacement_joined else 'joined'}"
        if not rec.replacement_joined:
            lines.append(f"  replacement replica {rec.replacement}: spawned in {ms(p['spawn'])}, {training}")
        elif rec.hot_spare:
            lines.append(f"  hot spare replica {rec.replacement} took its place: {heal}, {training}")
        else:
            lines.append(f"  replacement replica {rec.replacement}: spawned in {ms(p['spawn'])}, {heal}, {training}")
    return "\n".join(lines)


def run_summary(result) -> list[str]:
    """What every front end prints when a run ends: each recovery, then the run's totals (a `RunResult`)."""
    from monarch_plugin.events import read_events

    found = read_events(result.events_path)
    lines = [line for rec in recoveries(found) for line in format_recovery(rec).split("\n")]
    lines += drains(found)
    lines.append(f"finished in {result.seconds:.1f}s: {result.generations} generation(s), {result.deaths} death(s), "
                 f"{result.replicas_spawned} replica(s) spawned; events in {result.events_path}")
    return lines


def drains(events: list[dict]) -> list[str]:
    """A line per replica that left on a signal with notice (`drained`): when, after the signal, and what it cost."""
    notices = {e["replica"]: e for e in events if e["event"] == "notice"}
    dropped = sum(e["event"] == "dropped_step" for e in events)
    return [f"replica {e['replica']} drained on {notices[e['replica']]['signal'] if e['replica'] in notices else 'a signal'}: "
            f"left at a step boundary {e['seconds']:.2f} s after it" + ("" if dropped else ", nothing dropped")
            for e in events if e["event"] == "drained"]


def started_at(events: list[dict]) -> float:
    """When the run started (its `run_start` event; else its first event): the zero of every time shown."""
    return next((e["ts"] for e in events if e["event"] == "run_start"), events[0]["ts"] if events else 0.0)


class Commit(NamedTuple):
    """A step recorded as committed: when, which step (the front end's number), in which generation."""

    ts: float
    step: int
    gen: int | None


def commits(events: list[dict]) -> list[Commit]:
    """Each step recorded as committed, the first time it was, in time order: `first_commit` and `progress`
    events are both written right after their step committed, so between two of them the run committed exactly
    the steps in between. Events files from before `progress` existed hold only each generation's first."""
    found: list[Commit] = []
    for e in sorted((e for e in events if e["event"] in ("first_commit", "progress")), key=lambda e: e["ts"]):
        if not found or e["step"] > found[-1].step:
            found.append(Commit(e["ts"], e["step"], e.get("gen")))
    return found


@dataclass
class Stretch:
    """The steps committed between two recorded commits."""

    first: Commit
    last: Commit

    @property
    def steps(self) -> int:
        return self.last.step - self.first.step

    @property
    def seconds(self) -> float:
        return self.last.ts - self.first.ts

    @property
    def rate(self) -> float:
        """Committed steps per second."""
        return self.steps / self.seconds

    @property
    def measurable(self) -> bool:
        return self.seconds >= MIN_STRETCH_S and self.steps >= MIN_STRETCH_STEPS

    def describe(self, t0: float) -> str:
        """Its steps and times, for a reader (times since `t0`, the run's start)."""
        return (f"steps {self.first.step}-{self.last.step} in {self.seconds:.1f} s, "
                f"t={self.first.ts - t0:.1f}-{self.last.ts - t0:.1f} s")


@dataclass
class Goodput:
    """Committed steps per second over the whole run against the run's own rate before its first failure."""

    run: Stretch | None  # the first to the last recorded commit
    baseline: Stretch | None
    baseline_is: str = ""  # which stretch the baseline is, in words
    unknown: str | None = None  # why these events cannot tell (then `value` is None)

    @property
    def value(self) -> float | None:
        if self.run is None or self.baseline is None:
            return None
        return self.run.rate / self.baseline.rate


def _stretches(points: list[Commit], failures: list[float]) -> list[Stretch]:
    """The run's recorded commits cut at every generation change and failure: each piece as a stretch."""
    pieces: list[list[Commit]] = []
    for p in points:
        if pieces and pieces[-1][-1].gen == p.gen and not any(pieces[-1][-1].ts < f <= p.ts for f in failures):
            pieces[-1].append(p)
        else:
            pieces.append([p])
    return [Stretch(piece[0], piece[-1]) for piece in pieces if len(piece) > 1]


def goodput(events: list[dict]) -> Goodput:
    """The run's goodput, from its events alone: committed steps per second from its first to its last recorded
    commit, against its rate before its first failure. When training before the first failure was too short to
    measure, the baseline is the longest failure-free stretch at the run's starting size instead, and says so."""
    if not any(e["event"] == "progress" for e in events):
        return Goodput(None, None, unknown="this events file has no `progress` events (it was written before they "
                                           "existed), so the steps committed within each generation are unknown")
    t0, points = started_at(events), commits(events)
    need = f"a rate needs {MIN_STRETCH_STEPS} steps over {MIN_STRETCH_S:g} s or more"
    run = Stretch(points[0], points[-1])
    if not run.measurable:
        return Goodput(None, None, unknown=f"the run recorded too few commits to measure its rate ({need})")
    failures = [e["ts"] for e in events if e["event"] in ("death", "hang")]
    if not failures:
        return Goodput(run, run, "the whole run (nothing failed)")
    before = [p for p in points if p.ts < failures[0]]
    if len(before) > 1 and Stretch(before[0], before[-1]).measurable:
        baseline = Stretch(before[0], before[-1])
        return Goodput(run, baseline, f"before the first failure, {baseline.describe(t0)}")
    short = (f"the {failures[0] - before[0].ts:.1f} s of training before the first failure are too few ({need})"
             if before else "no step was committed before the first failure")
    quorums = [e for e in events if e["event"] == "quorum"]
    size = len(quorums[0]["members"]) if quorums else 0
    sizes = {q["gen"]: len(q["members"]) for q in quorums}
    fits = [s for s in _stretches(points, failures) if sizes.get(s.first.gen) == size and s.measurable]
    if not fits:
        return Goodput(run, None, unknown=f"{short}, and no failure-free stretch at the starting size ({size} "
                                          "replicas) is long enough either")
    baseline = max(fits, key=lambda s: s.seconds)
    return Goodput(run, baseline, f"{short}; used instead: generation {baseline.first.gen}, the longest "
                                  f"failure-free stretch at the starting size ({size} replicas), "
                                  f"{baseline.describe(t0)}")


GOODPUT_DEFINITION = ("goodput = committed steps per second over the whole run (its first to last recorded commit) "
                      "/ the run's own rate before its first failure; both from this events file alone")


def _format_goodput(g: Goodput, t0: float) -> list[str]:
    lines = [GOODPUT_DEFINITION]
    if g.value is None:
        return lines + [f"goodput: not measurable: {g.unknown}"]
    return lines + [
        f"goodput: {g.value:.0%} = {g.run.rate:.2f} steps/s over the run ({g.run.describe(t0)}) "
        f"/ {g.baseline.rate:.2f} steps/s",
        f"  baseline: {g.baseline_is}",
    ]


def _table(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in [header, *rows]]


def _seconds(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f} s"


def _shrink(rec: Recovery) -> str:
    if not rec.was_member:
        return "-"
    if rec.quorum_at is None:
        return "none"
    return "no commit" if rec.resumed_at is None else _seconds(rec.phases()["kill_to_next_commit"])


def _regrow(rec: Recovery) -> str:
    if rec.replacement is None:
        return "-"
    if rec.participating_at is not None:
        return _seconds(rec.phases()["replace_to_participating"])
    return "died" if rec.replacement_died else "run ended"


def _dropped(rec: Recovery) -> str:
    dropped = ", ".join(map(str, rec.dropped_steps)) or "none"
    if rec.restored_step is None:
        return dropped
    return f"{dropped}; restored step {rec.restored_step}, {rec.redone_steps} redone"


_LEGEND = {
    ("shrink", "-"): "it was not in the generation yet (it died starting): nothing had to shrink",
    ("shrink", "none"): "no generation without it followed (the run ended or gave up)",
    ("shrink", "no commit"): "the generation without it committed no step (another change came first)",
    ("regrow", "-"): "no replacement was spawned for it",
    ("regrow", "died"): "its replacement died before its first committed step",
    ("regrow", "run ended"): "the run ended before its replacement committed a step",
}


def host_name(address: str | None) -> str:
    """How a host is shown: its agent's IP:PORT, or "this machine" (the controller's, or not recorded)."""
    return (address or "this machine").removeprefix("tcp://")


def format_summary(events: list[dict]) -> list[str]:
    """What `monarch-plugin summary` prints: each failure as a row (replica, host on a multi-host run, what
    noticed it, time to shrink, time to regrow, steps dropped), then the run's totals and goodput."""
    if not events:
        return ["no events: the file is empty"]
    t0 = started_at(events)
    multihost = any(e["event"] == "host_up" for e in events)
    found = recoveries(events)
    lines: list[str] = []
    if found:
        header = ["#", "at (s)", "replica", *(["host"] if multihost else []), "noticed by", "shrink", "regrow",
                  "dropped"]
        rows = [[str(i), f"{rec.detected_at - t0:.1f}", str(rec.replica), *([host_name(rec.host)] if multihost else []),
                 rec.detected_by, _shrink(rec), _regrow(rec), _dropped(rec)]
                for i, rec in enumerate(found, 1)]
        lines += [f"{len(found)} failure(s), times in seconds since the run started:",
                  *_table(header, rows, right={0, 1, 2}),
                  "  shrink: death noticed (or the kill, when recorded) -> the survivors' next committed step",
                  "  regrow: the replacement's spawn began (a hot spare's: the death was noticed) -> its first "
                  "committed step"]
        col = {"shrink": header.index("shrink"), "regrow": header.index("regrow")}
        lines += [f"  {name} {cell}: {why}" for (name, cell), why in _LEGEND.items()
                  if any(r[col[name]] == cell for r in rows)]
    else:
        lines.append("no failures: no replica died or hung in this run")
    lines += _totals(events, t0)
    lines += _format_goodput(goodput(events), t0)
    return lines


def _totals(events: list[dict], t0: float) -> list[str]:
    def count(kind: str) -> int:
        return sum(e["event"] == kind for e in events)

    end = next((e for e in reversed(events) if e["event"] == "run_end"), None)
    spawns = [e for e in events if e["event"] == "spawn"]
    dropped = sorted({(e["gen"], e["step"]) for e in events if e["event"] == "dropped_step"})
    points = commits(events)
    lines = [
        f"run: {(end or events[-1])['ts'] - t0:.1f} s" + ("" if end else " to its last event (no run_end: it was "
                                                                        "stopped, or is still going)")
        + f", {len({e['gen'] for e in events if e['event'] == 'quorum'})} generation(s), {count('death')} death(s) "
        f"({count('hang')} after a hang), {len(spawns)} replica(s) spawned "
        f"({sum(bool(e.get('initial')) for e in spawns)} at the start)",
        f"  {len(dropped)} step(s) dropped" + (": " + ", ".join(f"step {s} in generation {g}" for g, s in dropped)
                                                 if dropped else "")
        + (f"; steps {points[0].step}-{points[-1].step} recorded committed" if points else "; no step committed")
        + ("" if count("progress") or not points else " (only each generation's first commit is recorded)"),
    ]
    if any(e["event"] == "host_up" for e in events):
        ups = [e for e in events if e["event"] == "host_up"]
        first_spawn = spawns[0]["ts"] if spawns else float("inf")
        lines.append(f"  hosts: {sum(e['ts'] <= first_spawn for e in ups)} up at the start, {count('host_lost')} "
                     f"lost, {sum(e['ts'] > first_spawn for e in ups)} joined later, {count('grow')} grow(s)")
    lines += [f"  the controller gave up: {e['reason']}" + (f" (checkpoint {e['checkpoint']})" if e.get("checkpoint")
                                                             else f" (resume from {e['resume_from']})"
                                                             if e.get("resume_from") else "")
              for e in events if e["event"] == "give_up"]
    return lines
