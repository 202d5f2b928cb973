"""Recovery and overhead, side by side in one invocation (so the ratios share one machine state).

For each model size, on N replicas of one process each:
  ddp      torchrun + torch DDP (gloo), no failure                     -> steady step time baseline
  elastic  monarch-run + ElasticLoop; replica 1 SIGKILLed by this script -> steady step time, and the
           recovery phases read from the run's own events file (monarch_plugin.tools.report)
  fresh    the same with --no-forkserver: the replacement starts as a fresh interpreter, as Monarch's own
           procs do, instead of forked from the warm forkserver
  warm     the same with --spares 1: a hot spare (training code started, waiting) replaces the dead
  restart  torchrun --max-restarts 1 + DDP checkpointing every K steps; same SIGKILL -> time from the
           kill to the next step, and the steps redone

    python -m benchmarks.recovery.sigkill --sizes 10m 100m --replicas 4 --out benchmarks/results

Writes <out>/recovery.json and prints a markdown table (pasted into docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from benchmarks.harness import (BIN, REPO, WORKLOADS, add_out, finished, interleave, intervals, kill, median, reap,
                                spawned, step_log, wait_for, write_json)
from monarch_plugin.events import read_events
from monarch_plugin.tools.report import recoveries

WORKLOAD = WORKLOADS / "mlp.py"


def step_time(points: list[tuple[int, float]], skip: int = 3) -> float:
    """The median interval of a step log's points, after `skip` steps of warm-up."""
    return median(intervals((t for _, t in points), skip))


def wait_steps(path: Path, n: int, proc: subprocess.Popen, timeout: float) -> None:
    wait_for(f"{path} to have {n} steps", lambda: len(step_log(path)) >= n, proc, timeout)


def run_ddp(work: Path, size: str, replicas: int, steps: int) -> dict:
    out = work / f"ddp-{size}"
    out.mkdir(parents=True)
    subprocess.run([str(BIN / "torchrun"), "--nproc-per-node", str(replicas), str(WORKLOAD), "--mode", "ddp",
                    "--size", size, "--steps", str(steps), "--out", str(out)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=1800)
    return {"step_s": step_time(step_log(out / "steps-0-0.txt"))}


def run_elastic(work: Path, size: str, replicas: int, steps: int, kill_at: int, spares: int = 0,
                forkserver: bool = True, min_replicas: int = 2, heal_donors: int | None = None,
                fault: str | None = None, name: str = "", tree: Path | None = None) -> dict:
    """`heal_donors`: `--heal-donors`; None, the runtime's default. `fault`: the failure is this `--fault`, fired
    inside replica 1 (a `MODE` of `raise`, `oom`, ...: `MODE:replica=1:step=<kill_at>...`), instead of a SIGKILL
    from here; `name` tells the run's folder apart. `tree`: run monarch_plugin from this checkout (another commit's)
    instead of the installed one."""
    donors = () if heal_donors is None else ("--heal-donors", str(heal_donors))
    injected = () if fault is None else ("--fault", fault.format(step=kill_at))
    out = work / f"elastic-{size}-spares{spares}{'' if forkserver else '-fresh'}{''.join(donors)}{name}"
    out.mkdir(parents=True)
    events_path = out / "events.jsonl"
    proc = subprocess.Popen([str(BIN / "monarch-run"), "--replicas", str(replicas), "--min-replicas", str(min_replicas),
                             "--spares", str(spares), "--forkserver" if forkserver else "--no-forkserver",
                             *donors, *injected,
                             "--events", str(events_path), str(WORKLOAD), "--mode", "elastic", "--size", size,
                             "--steps", str(steps), "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=out,
                            env={**os.environ, "PYTHONPATH": str(tree)} if tree else None)
    try:
        if fault is None:
            wait_steps(out / "steps-1.txt", kill_at, proc, timeout=1800)
            kill(spawned(events_path)[1][0], events_path, replica=1)
        finished(proc, 1800, "the elastic run", out)
    finally:
        reap(proc, spawned(events_path))
    before = [(s, t) for s, t in step_log(out / "steps-0.txt") if s < kill_at]
    rec = recoveries(read_events(str(events_path)))[0]
    survivor = [(s, t - rec.killed_at) for s, t in step_log(out / "steps-0.txt")]
    newcomer = [(s, t - rec.killed_at) for s, t in step_log(out / f"steps-{rec.replacement}.txt")]
    return {"out": str(out), "step_s": step_time(before), **{k: v for k, v in rec.phases().items()},
            "series": {"survivor": survivor, "replacement": newcomer},
            "detected_by": rec.detected_by, "dropped_steps": rec.dropped_steps,
            "heal_mb": (rec.heal_bytes or 0) / 1e6, "replacement_joined_at_step": rec.participating_step}


def run_restart(work: Path, size: str, replicas: int, steps: int, kill_at: int, every: int) -> dict:
    out = work / f"restart-{size}"
    out.mkdir(parents=True)
    proc = subprocess.Popen([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(replicas),
                             "--max-restarts", "1",
                             str(WORKLOAD), "--mode", "ddp", "--size", size, "--steps", str(steps),
                             "--ckpt-every", str(every), "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_steps(out / "steps-1-0.txt", kill_at, proc, timeout=1800)
        kill(int((out / "pid-1-0").read_text()))
        killed_at = time.time()
        killed_step = len(step_log(out / "steps-1-0.txt"))
        finished(proc, 1800, "the restart run", out)
    finally:
        reap(proc)
    after = step_log(out / "steps-0-1.txt")
    series = [(s, t - killed_at) for s, t in step_log(out / "steps-0-0.txt") + after]
    return {"kill_to_next_commit": after[0][1] - killed_at, "steps_redone": killed_step - after[0][0],
            "series": {"rank0": series}}


PLAN = {"10m": dict(steps=80, kill_at=15, every=10), "100m": dict(steps=40, kill_at=8, every=5)}

COMPARED = ("step_s", "kill_to_detected", "kill_to_next_commit", "ready_to_healed", "replace_to_participating")
"""What `--against` compares: the steady step, and the generation changes of a recovery (the survivors' re-formation,
the newcomer's heal group and its admission)."""


def against(work: Path, rev: str, size: str, replicas: int, repeats: int) -> dict:
    """The elastic run with replica 1 SIGKILLed, on commit `rev` and on HEAD (each a checkout of its own, so what is
    not committed stays out), alternated `repeats` times: the median of each `COMPARED` metric per side, and HEAD's
    over `rev`'s."""
    sides = {rev: work / f"tree-{rev}", "HEAD": work / "tree-HEAD"}
    for name, tree in sides.items():
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), name], check=True, cwd=REPO,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        runs = interleave({name: lambda repeat, name=name, tree=tree: run_elastic(
            work, size, replicas, PLAN[size]["steps"], PLAN[size]["kill_at"], name=f"-{name}-{repeat}", tree=tree)
            for name, tree in sides.items()}, repeats, shown=None)
    finally:
        for tree in sides.values():
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=False)
    medians = {name: {k: median(r.get(k) for r in rs) for k in COMPARED} for name, rs in runs.items()}
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip()
    return {"size": size, "replicas": replicas, "repeats": repeats, "head": head, rev: medians[rev],
            "HEAD": medians["HEAD"], "ratio": {k: medians["HEAD"][k] / medians[rev][k] for k in COMPARED}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", nargs="+", default=["10m", "100m"])
    p.add_argument("--replicas", type=int, default=4)
    add_out(p)
    p.add_argument("--work", default="/tmp/monarch_plugin_bench")
    p.add_argument("--against", metavar="REV", help="compare HEAD's elastic run with commit REV's, alternated "
                   "(writes recovery-vs-REV.json)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    if args.against:
        result = against(work, args.against, args.sizes[0], args.replicas, args.repeats)
        write_json(args.out, f"recovery-vs-{args.against}", result)
        print(json.dumps(result, indent=2))
        return
    plan = PLAN
    results = {}
    for size in args.sizes:
        cfg = plan[size]
        results[size] = {
            "ddp": run_ddp(work, size, args.replicas, cfg["steps"] // 2),
            "elastic": run_elastic(work, size, args.replicas, cfg["steps"], cfg["kill_at"]),
            "fresh": run_elastic(work, size, args.replicas, cfg["steps"], cfg["kill_at"], forkserver=False),
            "warm": run_elastic(work, size, args.replicas, cfg["steps"], cfg["kill_at"], spares=1),
            "restart": run_restart(work, size, args.replicas, cfg["steps"] // 2, cfg["kill_at"], cfg["every"]),
        }
        print(json.dumps({size: results[size]}), flush=True)
    write_json(args.out, "recovery", results)
    print(table(results, args.replicas))


def table(results: dict, replicas: int) -> str:
    def ms(x):
        return "n/a" if x is None else f"{x * 1000:.0f} ms"

    rows = [f"| metric ({replicas} replicas) | " + " | ".join(results) + " |",
            "|---|" + "---|" * len(results)]

    def row(name, fn):
        rows.append(f"| {name} | " + " | ".join(fn(r) for r in results.values()) + " |")

    row("kill -> detected (elastic)", lambda r: ms(r["elastic"]["kill_to_detected"]))
    row("kill -> next committed step, survivors (elastic)", lambda r: ms(r["elastic"]["kill_to_next_commit"]))
    row("kill -> next step (checkpoint-restart)", lambda r: ms(r["restart"]["kill_to_next_commit"]))
    row("steps redone (elastic / checkpoint-restart)",
        lambda r: f"{len(r['elastic']['dropped_steps'])} / {r['restart']['steps_redone']}")
    for name, key in (("cold", "elastic"), ("cold, fresh interpreter (--no-forkserver)", "fresh")):
        row(f"{name}: procs up (spawn)", lambda r, key=key: ms(r[key]["spawn"]))
        row(f"{name}: training code started (procs up -> ready)", lambda r, key=key: ms(r[key]["spawned_to_ready"]))
        row(f"{name}: ready -> healed", lambda r, key=key: ms(r[key]["ready_to_healed"]))
        row(f"{name}: healed -> first committed step", lambda r, key=key: ms(r[key]["healed_to_participating"]))
        row(f"**{name}: spawn began -> first committed step**",
            lambda r, key=key: ms(r[key]["replace_to_participating"]))
    row("hot spare: death noticed -> healed", lambda r: ms(r["warm"]["replace_to_healed"]))
    row("hot spare: death noticed -> participating", lambda r: ms(r["warm"]["replace_to_participating"]))
    row("hot spare: kill -> next committed step", lambda r: ms(r["warm"]["kill_to_next_commit"]))
    row("heal transfer", lambda r: f"{ms(r['elastic']['heal'])} ({r['elastic']['heal_mb']:.0f} MB)")
    row("steady step: torchrun DDP", lambda r: ms(r["ddp"]["step_s"]))
    row("steady step: monarch elastic", lambda r: ms(r["elastic"]["step_s"]))
    row("overhead vs DDP", lambda r: f"{(r['elastic']['step_s'] / r['ddp']['step_s'] - 1) * 100:+.1f}%")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
