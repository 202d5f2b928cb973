"""Semi-synchronous training (DiLoCo, `monarch-run --sync-every H`) against every-step reduction, side by side in one
invocation, interleaved, on the same work, data and kill schedule.

    python -m benchmarks.semi_sync run --repeats 3 --out benchmarks/results/semi_sync
    python -m benchmarks.semi_sync run --quick --out /tmp/semi_sync       # a smoke test: 1 repeat, 40 steps
    python -m benchmarks.semi_sync tables --out benchmarks/results/semi_sync

Every variant trains `workloads/mlp.py --mode elastic --size 10m --log-loss` (8.4M parameters, Adam, global batch
32, no stand-in for device time) on `monarch-run --replicas 4 --min-replicas 2`, with MLP_TIME_COLLECTIVES=1:

  sync-free     every step reduced (sync_every 1), no failure
  diloco-free   `--sync-every 20` (DiLoCo: outer Nesterov SGD, lr 0.7, momentum 0.9), no failure
  sync-kill     sync, one replica's worker SIGKILLed from outside by pid about every `--every` s from the first step
                on (seeded, 0.5-1.5 x apart, a random live member, none while only 2 train)
  diloco-kill   DiLoCo under the same schedule (the same seed: the same kill times from each run's first step)

Each repeat runs the four in that order (its own seed). What each leg reads:

1. collectives (the failure-free runs): per committed inner step, the bytes each replica sends in cross-replica
   collectives, computed (a gloo ring allreduce of the parameters' float32 bytes and the control word: each rank
   sends 2(n-1)/n of it) and measured (`wchar` of the worker's /proc/self/io from the first step to the loop's end:
   gloo writes with writev); the seconds a worker was blocked in the reductions (the workload's `CollectiveTimer`);
   steps/s and the median step interval (DiLoCo's split into local steps and those with a sync in them).
2. goodput (the killed runs): committed samples per second over the same mode's failure-free rate in the same
   repeat. A sync run's samples are learned at each step's commit (its step logs); a DiLoCo run's at its syncs (the
   workload's syncs-<id>.txt), never at a local step. Per kill: kill -> the next commit (a step; for DiLoCo the
   next sync, when the dead replica's samples are learned by the survivors), steps dropped (an interrupted
   reduction), and samples trained again: a dropped step's global batch, or the dead replica's samples since the
   last sync that the survivors train before it (the workload's loss logs, `extra` 1).
3. loss against steps (every run): the mean of the replicas' local losses at each step, weighted by their samples
   (the re-trained samples left out), plotted to `--plot`.

Writes <out>/semi_sync.json and prints the markdown tables docs/benchmarks.md quotes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from benchmarks.harness import (BIN, REPO, WORKLOADS, add_out, events, first_commits, kill, median, median_range,
                                mlp_workers, reap, spawned, step_log, wait_for, write_json)
from benchmarks.soak.kill_storm import members

WORKLOAD = WORKLOADS / "mlp.py"
REPLICAS, MIN_REPLICAS, GLOBAL_BATCH, SIZE = 4, 2, 32, "10m"
VARIANTS = ("sync-free", "diloco-free", "sync-kill", "diloco-kill")
SMOOTH = 10
"""The loss plot's moving mean, in steps: each step is another batch, so the raw curve is mostly batch noise."""
EXIT_GRACE_S = 20.0
"""How long a run that committed its last step may take to exit before it is stopped."""


# -- pure functions (tests/unit/benchmarks/test_semi_sync.py) ----------------------------------------------------

def ring_bytes(params: int, replicas: int, reductions: int, steps: int, element_size: int = 4) -> float:
    """Bytes each replica sends per committed step: `reductions` gloo ring allreduces of the `params` gradients (or
    pseudo-gradients) and the control word, each `element_size` bytes, over `steps` steps. A ring allreduce of N
    bytes over n ranks (a reduce-scatter, then an allgather) has each rank send 2(n-1)/n x N."""
    if replicas < 2 or steps == 0:
        return 0.0
    return 2 * (replicas - 1) / replicas * (params + 1) * element_size * reductions / steps


def learned(sync_logs: list[list[tuple[int, float]]]) -> dict[int, float]:
    """From the replicas' sync logs ("<committed steps> <unix time>" at each sync each saw): the run's committed
    step count after each sync -> when the first replica saw it."""
    first: dict[int, float] = {}
    for log in sync_logs:
        for steps, ts in log:
            first[steps] = min(ts, first.get(steps, ts))
    return first


def split_intervals(times: list[float], syncs: list[float], skip: int = 2) -> tuple[list[float], list[float]]:
    """A replica's step-log times cut into the intervals between consecutive steps with no sync in them (local
    steps) and those a sync fell in (`syncs`: when it was seen committed), after `skip` warm-up steps."""
    local, synced = [], []
    kept = times[skip:]
    for a, b in zip(kept, kept[1:]):
        (synced if any(a < s <= b for s in syncs) else local).append(b - a)
    return local, synced


def loss_curve(loss_logs: list[list[tuple[int, float, int, int]]]) -> dict[int, float]:
    """Each step's loss over the global batch: the replicas' local losses ("<step> <loss> <samples> <extra>") at
    that step, weighted by their samples; the re-trained samples (extra 1) left out."""
    sums: dict[int, list[float]] = {}
    for log in loss_logs:
        for step, loss, n, extra in log:
            if not extra:
                acc = sums.setdefault(step, [0.0, 0])
                acc[0] += loss * n
                acc[1] += n
    return {s: total / n for s, (total, n) in sorted(sums.items()) if n}


def moving_mean(values: list[float], window: int) -> list[float]:
    """Each value's mean with the `window - 1` before it (fewer at the start)."""
    return [statistics.mean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def lost_samples(steps: list[tuple[int, float]], losses: list[tuple[int, float, int, int]], done: dict[int, float],
                 killed_at: float) -> int:
    """A replica killed at `killed_at`: the samples of its local steps committed after the last sync before the kill
    (`done`: committed steps -> when), which the synced model never learned from it. Its step log and loss log have a
    line per local step, in the same order."""
    last_sync = max((t for t in done.values() if t <= killed_at), default=0.0)
    return sum(n for (_, ts), (_, _, n, _) in zip(steps, losses) if last_sync < ts <= killed_at)


def rate(done: dict[int, float], start: float, steps: int) -> float | None:
    """Committed steps per second: `steps` over the time from `start` (the run's first step) to the commit that
    reached them (`done`: committed steps -> time); None if the run never got there."""
    return steps / (done[steps] - start) if steps in done and done[steps] > start else None


# -- a run ---------------------------------------------------------------------------------------------------------

def _loss_log(path: Path) -> list[tuple[int, float, int, int]]:
    return [(int(a), float(b), int(c), int(d)) for a, b, c, d in
            (line.split() for line in path.read_text().splitlines() if line)]


def run(out: Path, variant: str, steps: int, every: float | None, seed: int, sync_every: int) -> dict:
    """One variant to `steps` steps, killed every ~`every` s from its first step; what it measured."""
    out.mkdir(parents=True)
    semi = variant.startswith("diloco")
    cmd = [str(BIN / "monarch-run"), "--replicas", str(REPLICAS), "--min-replicas", str(MIN_REPLICAS),
           "--max-restarts", "1000", "--crash-loop-limit", "1000", "--events", str(out / "events.jsonl"),
           *(("--sync-every", str(sync_every), "--semi-sync", "diloco") if semi else ()),
           str(WORKLOAD), "--mode", "elastic", "--size", SIZE, "--global-batch", str(GLOBAL_BATCH),
           "--steps", str(steps), "--log-loss", "--out", str(out)]
    rng = random.Random(seed)
    kills: list[dict] = []
    log = open(out / "run.log", "w")
    proc = subprocess.Popen(cmd, cwd=out, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "MLP_TIME_COLLECTIVES": "1"})
    trained_at = None
    try:
        wait_for(f"{variant}'s first step (see {out / 'run.log'})", lambda: first_commits(out), proc, timeout=300,
                 poll_s=0.05)
        first = time.time()
        due = first + every * rng.uniform(0.5, 1.5) if every else None
        checked = 0.0
        while proc.poll() is None:
            time.sleep(0.02)
            now = time.time()
            if now - checked > 0.5:
                checked = now
                trained_at = trained_at or (now if _done(out, semi, steps) else None)
                if trained_at and now - trained_at > EXIT_GRACE_S:
                    break
                if now - first > 600:
                    raise RuntimeError(f"{variant} ran past 600 s; see {out / 'run.log'}")
            if due is None or now < due or trained_at:
                continue
            started = spawned(out / "events.jsonl")
            live = [(m, started[m][0]) for m in members(events(out / "events.jsonl")) if m in started]
            if len(live) <= MIN_REPLICAS:
                continue  # still due: it fires once there is someone to hit
            replica, pid = rng.choice(live)
            if kill(pid, out / "events.jsonl", replica=replica):
                kills.append({"ts": time.time(), "replica": replica})
                due += every * rng.uniform(0.5, 1.5)
    finally:
        rc = proc.poll()
        reap(proc, mlp_workers(out))
        log.close()
    if rc not in (None, 0) and not trained_at:
        raise RuntimeError(f"{variant} failed (rc {rc}); see {out / 'run.log'}")
    return measure(out, variant, steps, kills)


def _done(out: Path, semi: bool, steps: int) -> bool:
    if semi:
        return steps in learned([step_log(p) for p in out.glob("syncs-*.txt")])
    return steps - 1 in first_commits(out)


def measure(out: Path, variant: str, steps: int, kills: list[dict]) -> dict:
    semi = variant.startswith("diloco")
    logs = {p.stem.removeprefix("steps-"): step_log(p) for p in sorted(out.glob("steps-*.txt"))}
    start = min(ts for log in logs.values() for _, ts in log)
    if semi:
        done = learned([step_log(p) for p in out.glob("syncs-*.txt")])
    else:
        done = {s + 1: ts for s, ts in first_commits(out).items()}  # steps committed -> when
    syncs = sorted(done.values()) if semi else []
    first_replica = logs.get("0", [])
    local, synced = split_intervals([ts for _, ts in first_replica], syncs)
    stats = [json.loads(p.read_text()) for p in sorted(out.glob("collectives-*.json"))]
    run_events = events(out / "events.jsonl")
    dropped = sorted({(e["gen"], e["step"]) for e in run_events if e["event"] == "dropped_step"})
    losses = [_loss_log(p) for p in sorted(out.glob("loss-*.txt"))]
    taken_over = sum(n for log in losses for _, _, n, extra in log if extra)
    extra_steps = {step for log in losses for step, _, _, extra in log if extra}
    lost = []
    for k in kills:
        following = min((s for s, t in done.items() if t > k["ts"]), default=None)
        if following is not None and following - 1 not in extra_steps:
            lost.append(0)  # nobody took its samples over: its part of the next sync had gone out, they were learned
            continue
        path = out / f"loss-{k['replica']}.txt"
        lost.append(lost_samples(logs.get(str(k["replica"]), []), _loss_log(path) if path.exists() else [], done,
                                 k["ts"]))
    result = {
        "variant": variant, "steps": steps, "kills": len(kills), "kill_times": [k["ts"] - start for k in kills],
        "seconds": done[steps] - start if steps in done else None, "steps_per_s": rate(done, start, steps),
        "commits": [[s, round(t - start, 3)] for s, t in sorted(done.items())],
        "step_s": median(local), "sync_step_s": median(synced),
        "collectives": stats,
        "bytes_per_step": median(s["wchar"] / s["steps"] for s in stats if s["steps"]),
        "blocked_s_per_step": median(s["blocked_s"] / s["steps"] for s in stats if s["steps"]),
        # The replica that waited least: at a sync, the last to arrive, whose wait is the reduction's own time.
        "least_blocked_s_per_step": min((s["blocked_s"] / s["steps"] for s in stats if s["steps"]), default=None),
        "params": stats[0]["params"] if stats else None, "syncs": max((s["syncs"] for s in stats), default=0),
        "steps_dropped": len(dropped),
        # Sync: a dropped step's global batch is trained again. DiLoCo: the dead replica's share of the round, which
        # the survivors take over before the sync (the loss logs' extra lines), and of it the samples the dead
        # replica had trained since the last sync (its step and loss logs up to the kill), trained twice.
        "samples_taken_over": taken_over if semi else 0,
        "samples_retrained": sum(lost) if semi else len(dropped) * GLOBAL_BATCH,
        "next_commit_s": [min((t for t in done.values() if t > k["ts"]), default=None) for k in kills],
        "loss": loss_curve(losses),
    }
    result["next_commit_s"] = [None if t is None else t - k["ts"] for t, k in zip(result["next_commit_s"], kills)]
    result["computed_bytes_per_step"] = (ring_bytes(result["params"], REPLICAS, result["syncs"] if semi else steps,
                                                    steps) if result["params"] else None)
    shown = {k: v for k, v in result.items() if k not in ("commits", "collectives", "loss", "kill_times")}
    print(json.dumps(shown), flush=True)
    return result


def run_all(args) -> list[dict]:
    results = []
    for repeat in range(args.repeats):  # interleaved: each repeat's ratios share one machine state
        for variant in VARIANTS:
            every = args.every if variant.endswith("-kill") else None
            r = run(Path(args.work) / f"repeat{repeat}" / variant, variant, args.steps, every, args.seed + repeat,
                    args.sync_every)
            r["repeat"] = repeat
            results.append(r)
        free = {r["variant"].split("-")[0]: r["steps_per_s"] for r in results[-4:] if r["variant"].endswith("-free")}
        for r in results[-4:]:
            mode = r["variant"].split("-")[0]
            r["own"] = r["steps_per_s"] / free[mode] if r["steps_per_s"] and free.get(mode) else None
            r["of_sync_free"] = r["steps_per_s"] / free["sync"] if r["steps_per_s"] and free.get("sync") else None
    return results


# -- tables and the plot -------------------------------------------------------------------------------------------

def _rows(results: list[dict], variant: str) -> list[dict]:
    return [r for r in results if r["variant"] == variant]


def collectives_table(results: list[dict]) -> str:
    sync, semi = _rows(results, "sync-free"), _rows(results, "diloco-free")
    h = semi[0]["steps"] // max(semi[0]["syncs"], 1)

    def cell(rows, key, fmt, scale=1.0):
        return median_range([r[key] * scale if r.get(key) is not None else None for r in rows], fmt)

    def ratio(key):
        values = [b[key] / a[key] for a, b in zip(sync, semi) if a.get(key) and b.get(key)]
        return median_range(values, "{:.3f}")

    steps = semi[0]["steps"]
    lines = [f"| failure-free, {REPLICAS} replicas, {steps} steps (medians of {len(sync)}, range in brackets) | "
             f"sync (every step) | DiLoCo, H={h} | DiLoCo / sync |", "|---|---|---|---|",
             f"| bytes sent per replica per step, computed (ring allreduce: 2(n-1)/n x 4 B x (params+1) per "
             f"reduction) | {sync[0]['computed_bytes_per_step'] / 1e6:.2f} MB | "
             f"{semi[0]['computed_bytes_per_step'] / 1e6:.2f} MB | "
             f"{semi[0]['computed_bytes_per_step'] / sync[0]['computed_bytes_per_step']:.3f} |",
             f"| bytes written per replica per step, measured (/proc/<pid>/io wchar) | "
             f"{cell(sync, 'bytes_per_step', '{:.2f} MB', 1e-6)} | {cell(semi, 'bytes_per_step', '{:.2f} MB', 1e-6)} | "
             f"{ratio('bytes_per_step')} |",
             f"| seconds blocked in reductions per step (the median replica) | {cell(sync, 'blocked_s_per_step', '{:.0f} ms', 1e3)} | "
             f"{cell(semi, 'blocked_s_per_step', '{:.1f} ms', 1e3)} | {ratio('blocked_s_per_step')} |",
             f"| the same, the least-blocked replica (at a sync the last to arrive: no wait for a straggler) | "
             f"{cell(sync, 'least_blocked_s_per_step', '{:.0f} ms', 1e3)} | "
             f"{cell(semi, 'least_blocked_s_per_step', '{:.1f} ms', 1e3)} | {ratio('least_blocked_s_per_step')} |",
             f"| committed steps per second | {cell(sync, 'steps_per_s', '{:.2f}')} | "
             f"{cell(semi, 'steps_per_s', '{:.2f}')} | {ratio('steps_per_s')} |",
             f"| median step interval (DiLoCo: local steps) | {cell(sync, 'step_s', '{:.0f} ms', 1e3)} | "
             f"{cell(semi, 'step_s', '{:.0f} ms', 1e3)} | {ratio('step_s')} |",
             f"| median interval of a step with a sync in it | - | {cell(semi, 'sync_step_s', '{:.0f} ms', 1e3)} | |",
             f"| seconds for {steps} steps (first step to the last commit) | {cell(sync, 'seconds', '{:.1f}')} | "
             f"{cell(semi, 'seconds', '{:.1f}')} | {ratio('seconds')} |"]
    return "\n".join(lines)


def goodput_table(results: list[dict]) -> str:
    lines = ["| variant | kills | seconds | committed steps/s | of its own failure-free rate | of sync's failure-free "
             "rate | kill → next commit (sync: a step; DiLoCo: a sync) | steps dropped per kill | samples trained "
             "again per kill | samples the survivors took over per kill |", "|---|---|---|---|---|---|---|---|---|---|"]
    for variant in VARIANTS:
        rows = _rows(results, variant)
        killed = [r for r in rows if r["kills"]]
        waits = sorted(w for r in rows for w in r["next_commit_s"] if w is not None)
        lines.append(" | ".join([
            f"| {variant}", median_range([r["kills"] for r in rows], "{:.0f}", False),
            median_range([r["seconds"] for r in rows], "{:.1f}"), median_range([r["steps_per_s"] for r in rows],
                                                                              "{:.2f}"),
            median_range([r["own"] and r["own"] * 100 for r in rows], "{:.1f} %") if variant.endswith("kill") else "-",
            median_range([r["of_sync_free"] for r in rows], "{:.3f}"),
            (f"{median(waits):.2f} s ({waits[0]:.2f}-{waits[-1]:.2f})" if waits else "-"),
            median_range([r["steps_dropped"] / r["kills"] for r in killed], "{:.2f}") if killed else "-",
            median_range([r["samples_retrained"] / r["kills"] for r in killed], "{:.0f}") if killed else "-",
            median_range([r.get("samples_taken_over", 0) / r["kills"] for r in killed], "{:.0f}")
            if killed and variant.startswith("diloco") else "-"]) + " |")
    return "\n".join(lines)


def loss_table(results: list[dict], last: int = 10) -> str:
    def tail(r):
        curve = {int(s): v for s, v in r["loss"].items()}
        kept = [curve[s] for s in sorted(curve)[-last:]]
        return statistics.mean(kept) if kept else None

    def head(r):
        curve = {int(s): v for s, v in r["loss"].items()}
        return curve.get(0)

    lines = [f"| variant | loss at step 0 | mean loss, last {last} steps (medians over repeats) |", "|---|---|---|"]
    for variant in VARIANTS:
        rows = _rows(results, variant)
        lines.append(f"| {variant} | {median_range([head(r) for r in rows], '{:.4f}', False)} | "
                     f"{median_range([tail(r) for r in rows], '{:.4f}')} |")
    return "\n".join(lines)


def plot_loss(results: list[dict], path: Path, sync_every: int) -> None:
    """Each variant's loss against the step (repeat 0), kills as thin vertical lines at the step the run had
    committed then, syncs as dots on the DiLoCo curves; a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    labels = {"sync-free": "sync (every step), no failure", "diloco-free": f"DiLoCo H={sync_every}, no failure",
              "sync-kill": "sync, a kill every ~15 s", "diloco-kill": f"DiLoCo H={sync_every}, a kill every ~15 s"}
    for variant in VARIANTS:
        rows = [r for r in _rows(results, variant) if r["repeat"] == 0]
        if not rows:
            continue
        r = rows[0]
        steps, losses = zip(*sorted((int(s), v) for s, v in r["loss"].items()))
        smooth = moving_mean(list(losses), SMOOTH)
        (line,) = ax.plot(steps, smooth, label=labels[variant], lw=1.4, ls="-" if variant.endswith("free") else "--")
        ax.plot(steps, losses, color=line.get_color(), lw=0.6, alpha=0.3)
        if variant.startswith("diloco"):
            synced = [s for s, _ in r["commits"]]
            ax.plot([s - 1 for s in synced], [dict(zip(steps, smooth)).get(s - 1) for s in synced], "o",
                    color=line.get_color(), ms=3)
        commits = r["commits"]
        for k in r["kill_times"]:
            at = max((s for s, t in commits if t <= k), default=0)
            ax.axvline(at, color=line.get_color(), alpha=0.3, lw=0.8)
    ax.set_xlabel("step (sync: committed step; DiLoCo: local step, dots at the syncs)")
    ax.set_ylabel(f"loss over the global batch ({SMOOTH}-step mean; thin: each step)")
    ax.set_title(f"10M MLP, {REPLICAS} replicas, global batch {GLOBAL_BATCH}, Adam lr 1e-4, repeat 0: loss against steps")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def print_tables(results: list[dict]) -> None:
    print(collectives_table(results))
    print()
    print(goodput_table(results))
    print()
    print(loss_table(results))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("leg", choices=("run", "tables"), help="tables: print the tables again from <out>/semi_sync.json")
    p.add_argument("--steps", type=int, default=None, help="per run (default 120; --quick 40)")
    p.add_argument("--sync-every", type=int, default=20)
    p.add_argument("--every", type=float, default=None, help="seconds between kills (default 15; --quick 8)")
    p.add_argument("--repeats", type=int, default=None, help="default 3; --quick 1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a smoke test: 40 steps, 1 repeat, a kill every ~8 s")
    p.add_argument("--plot", type=Path, default=REPO / "docs" / "semi_sync_loss.png")
    add_out(p, Path("benchmarks/results/semi_sync"))
    p.add_argument("--work", default="/tmp/monarch_plugin_semi_sync")
    args = p.parse_args()
    if args.leg == "tables":
        print_tables(json.loads((args.out / "semi_sync.json").read_text())["runs"])
        return
    args.steps = args.steps or (40 if args.quick else 120)
    args.every = args.every or (8.0 if args.quick else 15.0)
    args.repeats = args.repeats or (1 if args.quick else 3)
    shutil.rmtree(args.work, ignore_errors=True)
    results = run_all(args)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config.update(replicas=REPLICAS, min_replicas=MIN_REPLICAS, global_batch=GLOBAL_BATCH, size=SIZE)
    write_json(args.out, "semi_sync", {"config": config, "runs": results})
    plot_loss(results, args.plot, args.sync_every)
    print_tables(results)


if __name__ == "__main__":
    main()
