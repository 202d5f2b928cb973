"""Liveness under a burst of failures: SIGKILL a live member from outside every few seconds, for minutes.

    python -m benchmarks.soak.kill_storm --every 15 --duration 180 --spares 0 1 --out benchmarks/results

Runs `monarch-run --replicas 4 --min-replicas 2 benchmarks/workloads/mlp.py --mode elastic` and, every `--every`
seconds, SIGKILLs one member of the newest generation (drawn with a seeded RNG, never one that would take
the run below min_replicas) by its pid. When the duration is over it lets the run finish its steps and
reports, from the step logs the replicas write, the longest pause between two committed steps (the figure
a stall shows up in), committed steps per second, and the generations the events file records.

Writes <out>/kill_storm.json and prints one markdown row per variant (pasted into docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import threading
import time
from pathlib import Path

from benchmarks.harness import BIN, WORKLOADS, add_out, first_commits, kill, reap, spawned, wait_for, write_json
from monarch_plugin.events import read_events

WORKLOAD = WORKLOADS / "mlp.py"
REPLICAS, MIN_REPLICAS = 4, 2
WARMUP_STEPS = 30  # committed before the first kill; their rate is the run's failure-free rate


def _commits(out: Path) -> list[float]:
    """The time each global step was first committed by any replica, in step order."""
    first = first_commits(out)
    return [first[s] for s in sorted(first)]


def members(events: list[dict]) -> list[int]:
    """Members of the newest generation that have not died since."""
    quorums = [e for e in events if e["event"] == "quorum"]
    if not quorums:
        return []
    dead = {e["replica"] for e in events if e["event"] == "death"}
    return [m for m in quorums[-1]["members"] if m not in dead]


def _dump_pauses(out: Path, events_path: Path, proc: subprocess.Popen, after_s: float, done: threading.Event) -> None:
    """While the run lasts: once no step has committed for `after_s`, write every live worker's Python and
    native stacks (py-spy) to <out>/pause-dumps.txt, once per pause, so a stall can be read after the fact."""
    spy = shutil.which("py-spy") or str(BIN / "py-spy")
    dumped_for = None
    while not done.wait(0.5) and proc.poll() is None:
        commits = _commits(out)
        if not commits or time.time() - commits[-1] < after_s or dumped_for == commits[-1]:
            continue
        dumped_for = commits[-1]
        pids = [p for e in read_events(str(events_path)) if e["event"] == "spawn" for p in e["pids"]]
        with open(out / "pause-dumps.txt", "a") as f:
            f.write(f"=== no commit for {time.time() - commits[-1]:.1f}s (last at {commits[-1]:.3f})\n")
            for pid in pids:
                if os.path.exists(f"/proc/{pid}"):
                    r = subprocess.run([spy, "dump", "--native", "--pid", str(pid)], capture_output=True,
                                       text=True, timeout=60)
                    f.write(f"--- pid {pid}\n{r.stdout}{r.stderr}\n")


def storm(work: Path, spares: int, every: float, duration: float, steps: int, seed: int,
          dump_after_s: float = 0.0) -> dict:
    out = work / f"storm-spares{spares}"
    out.mkdir(parents=True)
    events_path = out / "events.jsonl"
    rng = random.Random(seed)
    cmd = [str(BIN / "monarch-run"), "--replicas", str(REPLICAS), "--min-replicas", str(MIN_REPLICAS),
           "--spares", str(spares), "--max-restarts", "1000", "--events", str(events_path),
           str(WORKLOAD), "--mode", "elastic", "--size", "10m", "--steps", str(steps), "--out", str(out)]
    log = open(out / "run.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=out)
    kills: list[dict] = []
    watching = threading.Event()
    if dump_after_s > 0:
        threading.Thread(target=_dump_pauses, args=(out, events_path, proc, dump_after_s, watching),
                         daemon=True).start()
    try:
        # The storm starts once training runs at full speed.
        wait_for(f"step {WARMUP_STEPS} (see {out / 'run.log'})", lambda: len(_commits(out)) >= WARMUP_STEPS, proc,
                 timeout=600, poll_s=0.1)
        t0 = time.time()
        next_kill = t0 + every
        while time.time() < t0 + duration and proc.poll() is None:
            time.sleep(max(0.0, min(next_kill, t0 + duration) - time.time()))
            if time.time() >= t0 + duration or proc.poll() is not None:
                break
            next_kill += every
            started = spawned(events_path)
            live = [m for m in members(read_events(str(events_path))) if m in started]
            if len(live) <= MIN_REPLICAS:
                kills.append({"ts": time.time(), "skipped": f"only {len(live)} live members"})
                continue
            victim = rng.choice(live)
            pid = started[victim][0]
            if not kill(pid, events_path, replica=victim):
                continue
            kills.append({"ts": time.time(), "replica": victim, "pid": pid})
        rc = proc.wait(timeout=1800)
    finally:
        watching.set()
        reap(proc, spawned(events_path))
        log.close()
    commits = _commits(out)
    storm_end = t0 + duration
    during = [t for t in commits if t0 <= t <= storm_end]
    gaps = [(b - a, a - t0) for a, b in zip(commits, commits[1:]) if a >= t0 - 1 and a <= storm_end]
    longest, at = max(gaps, default=(0.0, 0.0))
    events = read_events(str(events_path))
    return {
        "spares": spares, "every_s": every, "duration_s": duration, "seed": seed, "rc": rc,
        "kills": len([k for k in kills if "pid" in k]), "skipped_kills": len([k for k in kills if "skipped" in k]),
        "steps_committed": len(commits), "steps_target": steps,
        "steps_per_s_during_storm": len(during) / duration,
        "steps_per_s_before_storm": _rate_before(commits, t0),
        "longest_pause_s": round(longest, 3), "longest_pause_at_s": round(at, 1),
        "pauses_over_2s": [(round(g, 2), round(a, 1)) for g, a in gaps if g > 2.0],
        "generations": len([e for e in events if e["event"] == "quorum"]),
        "join_retries": len([e for e in events if e["event"] == "join_retry"]),
        "hangs": len([e for e in events if e["event"] == "hang"]),
    }


def _rate_before(commits: list[float], t0: float) -> float:
    before = [t for t in commits if t < t0]
    if len(before) < 2:
        return 0.0
    return (len(before) - 1) / (before[-1] - before[0])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--every", type=float, default=15.0, help="seconds between kills")
    p.add_argument("--duration", type=float, default=180.0, help="seconds of kills")
    p.add_argument("--steps", type=int, default=0, help="steps to train (default: enough to outlast the storm)")
    p.add_argument("--spares", type=int, nargs="+", default=[0, 1])
    p.add_argument("--seed", type=int, default=0)
    add_out(p)
    p.add_argument("--dump-after", type=float, default=0.0,
                   help="seconds without a commit after which every worker's stacks are dumped (py-spy); 0: off")
    args = p.parse_args()
    steps = args.steps or int(args.duration * 6 + 60 + WARMUP_STEPS)  # ~0.2 s a step here: the run outlasts the storm
    work = args.out / "kill_storm_runs"
    if work.exists():
        shutil.rmtree(work)
    results = []
    for spares in args.spares:
        r = storm(work, spares, args.every, args.duration, steps, args.seed, args.dump_after)
        results.append(r)
        print(json.dumps(r), flush=True)
    write_json(args.out, "kill_storm", results)
    print("\n| variant | kills | longest pause between commits | pauses > 2 s | steps/s before / during "
          "| generations |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['spares']} spare(s), kill every {r['every_s']:.0f} s for {r['duration_s']:.0f} s | {r['kills']} "
              f"| {r['longest_pause_s']:.2f} s | {len(r['pauses_over_2s'])} | {r['steps_per_s_before_storm']:.2f} / "
              f"{r['steps_per_s_during_storm']:.2f} | {r['generations']} |")


if __name__ == "__main__":
    main()
