"""Read a run's events back as recoveries: when each phase of each worker death happened.

Used by `monarch-run` to print what happened and by the benchmarks to measure it, so the numbers in
docs/benchmarks.md are exactly what a user sees in their own events file.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Recovery", "recoveries", "format_recovery", "run_summary"]


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
    healed_at: float | None = None
    heal_seconds: float | None = None
    heal_bytes: int | None = None
    participating_at: float | None = None  # the replacement's first committed step
    participating_step: int | None = None
    replacement_joined: bool = False  # a generation admitted it (else the run ended, or it died, while starting)
    replacement_died: bool = False  # the replacement itself died (before training, when it never did)

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
        }


def recoveries(events: list[dict]) -> list[Recovery]:
    found: list[Recovery] = []
    quorums = [e for e in events if e["event"] == "quorum"]
    for death in (e for e in events if e["event"] == "death"):
        rid = death["replica"]
        kills = [e for e in events if e["event"] in ("fault_injected", "kill") and e.get("replica") == rid]
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
            resumed_at=None,
        )
        if shrink:
            firsts = [e for e in events if e["event"] == "first_commit" and e["gen"] == shrink["gen"]]
            rec.resumed_at = min((e["ts"] for e in firsts), default=None)
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
            heal = next((e for e in events if e["event"] == "heal" and new in e["recipients"]), None)
            if heal:
                rec.healed_at, rec.heal_seconds, rec.heal_bytes = heal["ts"], heal["seconds"], heal["bytes"]
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

    lines = [f"replica {rec.replica} died (noticed by {rec.detected_by}"
             + (f", {ms(p['kill_to_detected'])} after the kill)" if rec.killed_at else ")")]
    if rec.survivors:
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

    lines = [line for rec in recoveries(read_events(result.events_path)) for line in format_recovery(rec).split("\n")]
    lines.append(f"finished in {result.seconds:.1f}s: {result.generations} generation(s), {result.deaths} death(s), "
                 f"{result.replicas_spawned} replica(s) spawned; events in {result.events_path}")
    return lines
