"""Read a run's events back as recoveries: when each phase of each worker death happened.

Used by `monarch-run` to print what happened and by the benchmarks to measure it, so the numbers in
docs/benchmarks.md are exactly what a user sees in their own events file.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Recovery", "recoveries", "format_recovery"]


@dataclass
class Recovery:
    replica: int
    detected_by: str
    killed_at: float | None  # from a fault_injected / kill event, when one was recorded
    detected_at: float
    quorum_at: float | None  # the shrunken generation was published
    survivors: list[int]
    dropped_steps: list[int]
    resumed_at: float | None  # first step committed by the survivors in the new generation
    replacement: int | None = None
    spawn_started_at: float | None = None
    spawned_at: float | None = None
    healed_at: float | None = None
    heal_seconds: float | None = None
    heal_bytes: int | None = None
    participating_at: float | None = None  # the replacement's first committed step
    participating_step: int | None = None

    def phases(self) -> dict[str, float | None]:
        """Durations in seconds (None where a phase did not happen)."""
        t0 = self.killed_at if self.killed_at is not None else self.detected_at

        def since(a, b):
            return None if a is None or b is None else b - a

        return {
            "kill_to_detected": since(self.killed_at, self.detected_at),
            "kill_to_next_commit": since(t0, self.resumed_at),
            "spawn": since(self.spawn_started_at, self.spawned_at),
            "spawn_to_healed": since(self.spawn_started_at, self.healed_at),
            "spawn_to_participating": since(self.spawn_started_at, self.participating_at),
            "heal": self.heal_seconds,
        }


def recoveries(events: list[dict]) -> list[Recovery]:
    found = []
    for death in (e for e in events if e["event"] == "death"):
        rid = death["replica"]
        kills = [e for e in events if e["event"] in ("fault_injected", "kill") and e.get("replica") == rid]
        quorum = next((e for e in events if e["event"] == "quorum" and e["ts"] >= death["ts"]
                       and rid not in e["members"]), None)
        rec = Recovery(
            replica=rid, detected_by=death["detected_by"],
            killed_at=kills[0]["ts"] if kills else None, detected_at=death["ts"],
            quorum_at=quorum["ts"] if quorum else None,
            survivors=quorum["members"] if quorum else [],
            dropped_steps=sorted({e["step"] for e in events if e["event"] == "dropped_step"
                                  and e["gen"] == death.get("gen")}),
            resumed_at=None,
        )
        if quorum:
            firsts = [e for e in events if e["event"] == "first_commit" and e["gen"] == quorum["gen"]]
            rec.resumed_at = min((e["ts"] for e in firsts), default=None)
        later = [e for e in events if e["event"] == "spawn" and not e.get("initial") and e["ts"] > death["ts"]
                 and not any(r.replacement == e["replica"] for r in found)]
        if later:
            spawn = later[0]
            new = spawn["replica"]
            rec.replacement = new
            rec.spawned_at = spawn["ts"]
            rec.spawn_started_at = spawn["ts"] - spawn["seconds"]
            heal = next((e for e in events if e["event"] == "heal" and new in e["recipients"]), None)
            if heal:
                rec.healed_at, rec.heal_seconds, rec.heal_bytes = heal["ts"], heal["seconds"], heal["bytes"]
            first = next((e for e in events if e["event"] == "first_commit" and e["replica"] == new), None)
            if first:
                rec.participating_at, rec.participating_step = first["ts"], first["step"]
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
        lines.append(f"  replacement replica {rec.replacement}: spawned in {ms(p['spawn'])}, {heal}, "
                     f"training at step {rec.participating_step} {ms(p['spawn_to_participating'])} after spawn began")
    return "\n".join(lines)
