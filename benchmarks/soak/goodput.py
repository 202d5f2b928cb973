"""Goodput under a failure schedule: how long the same training takes when a worker is SIGKILLed every N seconds.

    python -m benchmarks.soak.goodput --steps 450 --every 60 15 --seed 0 --out benchmarks/results
    python -m benchmarks.soak.goodput --lightning --steps 300 --every 15 --seed 0 --out benchmarks/results
    python -m benchmarks.soak.goodput --steps 300 --every 15 --checkpoint-every --repeats 3   # no restart variants

Every variant trains the 10M MLP of `workloads/mlp.py` to the same step count on 4 workers with the same global batch,
one after another in this invocation (so every ratio compares runs on one machine state):

  ddp            torchrun DDP, no failure: the baseline, goodput 1
  elastic-free   monarch-run + ElasticLoop, no failure
  elastic        monarch-run, a cold replacement for each death (forked from the forkserver)
  elastic-spare  the same with --spares 1
  restart-N      torchrun --max-restarts + DDP writing a checkpoint every N steps; a death restarts every worker
                 from the newest checkpoint

With --lightning, the same MLP as a LightningModule (`workloads/lightning_mlp.py`) instead, 4 CPU devices:

  lightning-ddp            Trainer(strategy="ddp") under torchrun, no failure: the baseline, goodput 1
  lightning-monarch-free   Trainer(strategy=MonarchStrategy(min_replicas=2)), no failure
  lightning-monarch        the same, a cold replacement for each death
  lightning-restart-N      strategy="ddp" under torchrun --max-restarts, ModelCheckpoint every N steps, and each
                           start resumes from the newest (`fit(ckpt_path=".../last.ckpt")`)

In the failure variants this script SIGKILLs one worker by pid every `--every` seconds from the first step on
(times and victims drawn from `--seed`), until the run ends; a kill that finds no victim (a torchrun restart in
progress, or an elastic run at `--min-replicas`) waits until there is one, as a failure on a cluster would.
Goodput is committed samples per second, from the first step to the last (or to the stop of a variant that has
not finished after `--cap` times the baseline's time, counting the steps it had reached), as a fraction of
failure-free DDP's (Lightning's DDP with --lightning). Steps lost per failure: the steps a restart redid (a
dropped step for the elastic runs). Writes <out>/goodput.json and <out>/goodput-<every>s.png (steps over time, kills
marked; goodput-lightning.* with --lightning), and prints a markdown table (pasted into docs/benchmarks.md).
With --repeats R every variant runs R times, interleaved (each repeat its own seed and its own baseline, so its
ratios share one machine state), and the table gives medians: single runs here spread widely between invocations.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness import (BIN, WORKLOADS, add_out, events, first_commits, grouped, kill, median_range,
                                mlp_workers, plot_steps, reap, spawned, step_log, wait_for, write_json)
from benchmarks.soak.kill_storm import members
from monarch_plugin.events import read_events

WORKLOAD = WORKLOADS / "mlp.py"
LIGHTNING = WORKLOADS / "lightning_mlp.py"
REPLICAS, MIN_REPLICAS = 4, 2


def _lines(out: Path) -> dict[str, list[tuple[int, float]]]:
    """Each step log's (step, time) lines, by file name."""
    return {path.stem: step_log(path) for path in out.glob("steps-*.txt")}


def _elastic(variant: str) -> bool:
    """Run by the Monarch controller (its events name the members), rather than restarted by torchrun."""
    return variant.startswith(("elastic", "lightning-monarch"))


def _command(variant: str, out: Path, steps: int) -> list[str]:
    if variant.startswith("lightning-monarch"):
        return [sys.executable, str(LIGHTNING), "--strategy", "monarch", "--steps", str(steps), "--out", str(out)]
    if variant.startswith("lightning-"):
        every = variant.removeprefix("lightning-restart-") if "restart" in variant else "0"
        return [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(REPLICAS), "--max-restarts", "1000",
                str(LIGHTNING), "--strategy", "ddp", "--steps", str(steps), "--ckpt-every", every, "--out", str(out)]
    if variant.startswith("elastic"):
        spares = "1" if variant == "elastic-spare" else "0"
        return [str(BIN / "monarch-run"), "--replicas", str(REPLICAS), "--min-replicas", str(MIN_REPLICAS),
                "--spares", spares, "--max-restarts", "1000", "--crash-loop-limit", "1000",
                "--events", str(out / "events.jsonl"), str(WORKLOAD), "--mode", "elastic", "--steps", str(steps),
                "--out", str(out)]
    every = variant.removeprefix("restart-") if variant.startswith("restart-") else "0"
    return [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(REPLICAS), "--max-restarts", "1000",
            str(WORKLOAD), "--mode", "ddp", "--steps", str(steps), "--ckpt-every", every, "--out", str(out)]


def _victims(variant: str, out: Path) -> list[int]:
    """The pids a kill may hit now: members of the newest elastic generation above `min_replicas`, or the workers
    of torchrun's newest round once it trains."""
    if _elastic(variant):
        run_events = events(out / "events.jsonl")
        started = spawned(out / "events.jsonl")
        live = [started[m][0] for m in members(run_events) if m in started]
        return live if len(live) > MIN_REPLICAS else []
    rounds = [int(p.name.split("-")[2]) for p in out.glob("pid-*-*")]
    if not rounds:
        return []
    newest = max(rounds)
    if not any(name.endswith(f"-{newest}") and lines for name, lines in _lines(out).items()):
        return []  # that round has not trained a step yet: it is still restarting
    return [int(p.read_text()) for p in out.glob(f"pid-*-{newest}")]


def run(work: Path, variant: str, steps: int, every: float | None, seed: int, cap_s: float) -> dict:
    """One variant to `steps` steps, or for `cap_s` seconds from its first step if it gets no further by then
    (a restart that never reaches its next checkpoint before the next kill makes no progress at all)."""
    out = work / f"{variant}-every{every or 0:.0f}"
    out.mkdir(parents=True)
    log = open(out / "run.log", "w")
    proc = subprocess.Popen(_command(variant, out, steps), stdout=log, stderr=subprocess.STDOUT, cwd=out)
    rng = random.Random(seed)
    kills: list[dict] = []
    capped = False
    try:
        wait_for(f"{variant}'s first step (see {out / 'run.log'})", lambda: any(_lines(out).values()), proc,
                 timeout=600, poll_s=0.05)
        first = time.time()
        due = first + every * rng.uniform(0.5, 1.5) if every else None
        while proc.poll() is None:
            time.sleep(0.05)
            if time.time() - first > cap_s:
                capped = True
                break
            if due is None or time.time() < due:
                continue
            victims = _victims(variant, out)
            if not victims:
                continue  # still due: it fires once there is someone to hit
            pid = rng.choice(victims)
            if not kill(pid, out / "events.jsonl" if _elastic(variant) else None):
                continue
            kills.append({"ts": time.time(), "pid": pid})
            due += every * rng.uniform(0.5, 1.5)
        if capped:
            proc.terminate()  # monarch-run and torchrun each stop their workers on SIGTERM
        rc = proc.wait(timeout=60)
    finally:
        reap(proc, mlp_workers(out))
        log.close()
    if rc != 0 and not capped:
        raise RuntimeError(f"{variant} failed (rc {rc}); see {out / 'run.log'}")
    lines = _lines(out)
    start = min(t for series in lines.values() for _, t in series)  # the first step, by whoever logged it first
    end = first + cap_s if capped else max(t for series in lines.values() for s, t in series if s == steps - 1)
    result = {"variant": variant, "every_s": every, "seconds": end - start, "kills": len(kills), "capped": capped,
              "kill_times": [k["ts"] - start for k in kills]}
    if _elastic(variant):
        events = read_events(str(out / "events.jsonl"))
        result["steps_lost"] = len({(e["gen"], e["step"]) for e in events if e["event"] == "dropped_step"})
        result["deaths"] = len([e for e in events if e["event"] == "death"])
        progress = sorted(first_commits(out).items())
    else:
        rounds = sorted((int(name.split("-")[2]), series) for name, series in lines.items()
                        if name.split("-")[1] == "0")  # rank 0 of each round: steps-<rank>-<round>
        result["steps_lost"] = sum(prev[-1][0] + 1 - nxt[0][0] for (_, prev), (_, nxt) in zip(rounds, rounds[1:])
                                   if prev and nxt)
        result["restarts"] = max((int(p.name.split("-")[2]) for p in out.glob("pid-*-*")), default=0)
        progress = [(s, t) for _, series in rounds for s, t in series]
    result["series"] = [(round(t - start, 3), s) for s, t in progress]
    result["steps_done"] = progress[-1][0] + 1 if capped else steps  # where it stood when stopped
    print(json.dumps({k: v for k, v in result.items() if k not in ("series", "kill_times")}), flush=True)
    return result


def plot(results: list[dict], every: float, path: Path) -> None:
    plot_steps([(f"{r['variant']} ({r['goodput']:.2f})", r) for r in results if r["every_s"] in (every, None)], path,
               f"a SIGKILL every ~{every:.0f} s (thin lines), 4 workers, 10M MLP; goodput in brackets",
               ylabel="step being trained")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=450)
    p.add_argument("--every", type=float, nargs="+", default=[60.0, 15.0], help="seconds between kills")
    p.add_argument("--checkpoint-every", type=int, nargs="*", default=[10, 50],
                   help="torchrun's, in steps: one restart variant each (none: no restart variants)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run every variant this many times, interleaved (seed, seed+1, ...); the table gives medians")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cap", type=float, default=3.0, help="stop a variant after this many times the baseline's time")
    add_out(p)
    p.add_argument("--work", default="/tmp/monarch_plugin_goodput")
    p.add_argument("--lightning", action="store_true", help="the Lightning variants (workloads/lightning_mlp.py)")
    args = p.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    prefix, name = ("lightning-", "goodput-lightning") if args.lightning else ("", "goodput")
    free = "lightning-monarch-free" if args.lightning else "elastic-free"
    elastic = ("lightning-monarch",) if args.lightning else ("elastic", "elastic-spare")
    results = []
    for repeat in range(args.repeats):  # interleaved, so each repeat's ratios share one machine state
        here, seed = work / f"repeat{repeat}", args.seed + repeat
        baseline = run(here, f"{prefix}ddp", args.steps, None, seed, cap_s=3600)
        cap = args.cap * baseline["seconds"]
        batch = [baseline, run(here, free, args.steps, None, seed, cap)]
        for every in args.every:
            for variant in (*elastic, *(f"{prefix}restart-{n}" for n in args.checkpoint_every)):
                batch.append(run(here, variant, args.steps, every, seed, cap))
        rate = args.steps / baseline["seconds"]
        for r in batch:
            r["repeat"] = repeat
            r["goodput"] = r["steps_done"] / r["seconds"] / rate
            r["samples_per_s"] = r["steps_done"] * 32 / r["seconds"]
        results += batch
    write_json(args.out, name, results)
    for every in args.every:
        plot([r for r in results if r["repeat"] == 0], every, args.out / f"{name}-{every:.0f}s.png")
    print(table(results, args.steps))


def table(results: list[dict], steps: int) -> str:
    """One row per variant and schedule: medians over the repeats (and the range of goodput where there are several)."""
    def middle(rows, fn, fmt, spread=False):
        return median_range(map(fn, rows), fmt, spread)

    groups = grouped(results, "variant", "every_s")
    repeats = max(r["repeat"] for r in results) + 1
    lines = [f"Medians of {repeats} repeat(s); goodput's range in brackets.", "",
             f"| variant | kill every | kills | steps done (of {steps}) | seconds | samples/s | goodput | "
             "steps lost per kill |", "|---|---|---|---|---|---|---|---|"]
    for (variant, every), rows in groups.items():
        killed = [r for r in rows if r["kills"]]
        per_kill = middle(killed, lambda r: r["steps_lost"] / r["kills"], "{:.1f}") if killed else "-"
        stopped = " (stopped)" if any(r["capped"] for r in rows) else ""
        lines.append(" | ".join([
            f"| {variant}", "-" if every is None else f"{every:.0f} s", middle(rows, lambda r: r["kills"], "{:.0f}"),
            middle(rows, lambda r: r["steps_done"], "{:.0f}") + stopped, middle(rows, lambda r: r["seconds"], "{:.1f}"),
            middle(rows, lambda r: r["samples_per_s"], "{:.0f}"),
            middle(rows, lambda r: r["goodput"], "{:.3f}", spread=True), per_kill]) + " |")
    return "\n".join(lines)

if __name__ == "__main__":
    main()
