"""Planned departures against a crash, side by side in one invocation: what a SIGTERM costs where a SIGKILL costs a
step, and what stopping the controller costs a relaunch.

On N replicas of benchmarks/workloads/mlp.py (one process each), at step K, `--repeats` times each, interleaved:
  sigkill   replica 1 SIGKILLed from here (recovery/sigkill.py's `elastic` run)
  drain     replica 1 SIGTERMed from here: it leaves at the next step boundary
  stop      monarch-run SIGTERMed from here: the run stops with a checkpoint; relaunched with `--resume auto`

    python -m benchmarks.recovery.drain --replicas 3 --repeats 3 --out benchmarks/results

Writes <out>/drain.json and prints a markdown table of medians (pasted into docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from benchmarks.harness import (BIN, add_out, events, finished, interleave, median, reap, spawned, step_log,
                                wait_for, write_json)
from benchmarks.recovery.sigkill import WORKLOAD, run_elastic, step_time, wait_steps


def _start(out: Path, size: str, replicas: int, steps: int, *extra: str) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([str(BIN / "monarch-run"), "--replicas", str(replicas), "--min-replicas", "1",
                             "--events", str(out / "events.jsonl"), "--checkpoint-dir", str(out.parent / "ckpt"),
                             *extra, str(WORKLOAD), "--mode", "elastic", "--size", size, "--steps", str(steps),
                             "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=out)


def _first(found: list[dict], kind: str, **match) -> dict | None:
    return next((e for e in found if e["event"] == kind and all(e.get(k) == v for k, v in match.items())), None)


def run_drain(work: Path, size: str, replicas: int, steps: int, at: int) -> dict:
    out = work / "run"
    proc = _start(out, size, replicas, steps)
    path = out / "events.jsonl"
    try:
        wait_steps(out / "steps-0.txt", at, proc, timeout=1800)
        told = time.time()
        os.kill(spawned(path)[1][0], signal.SIGTERM)
        finished(proc, 1800, "the drained run", out)
    finally:
        reap(proc, spawned(path))
    found = events(path)
    drain = _first(found, "drain")
    smaller = min(e["ts"] for e in found if e["event"] == "first_commit" and e["gen"] == drain["gen"])
    replacement = min((e["ts"] for e in found if e["event"] == "first_commit" and e["replica"] == replicas),
                      default=None)  # replica N: the first spawned after the initial 0..N-1
    before = [(s, t) for s, t in step_log(out / "steps-0.txt") if s < at]
    return {"signal_to_noticed": _first(found, "notice")["ts"] - told,
            "signal_to_smaller_first_commit": smaller - told,
            "signal_to_left": _first(found, "drained")["ts"] - told,
            "signal_to_replacement_first_commit": None if replacement is None else replacement - told,
            "dropped_steps": sorted({e["step"] for e in found if e["event"] == "dropped_step"}),
            "step_s": step_time(before)}


def run_stop(work: Path, size: str, replicas: int, steps: int, at: int) -> dict:
    out = work / "stopped"
    proc = _start(out, size, replicas, steps)
    path = out / "events.jsonl"
    try:
        wait_steps(out / "steps-0.txt", at, proc, timeout=1800)
        told = time.time()
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=600)
        ended = time.time()
    finally:
        reap(proc, spawned(path))
    give_up = _first(events(path), "give_up")
    committed = max(s for s, _ in step_log(out / "steps-0.txt")) + 1
    saved = int(Path(give_up["checkpoint"]).name.split("-")[0].removeprefix("step"))
    again = work / "resumed"
    started = time.time()
    proc = _start(again, size, replicas, steps, "--resume", "auto")
    try:
        wait_for("the relaunch's first step", lambda: step_log(again / "steps-0.txt"), proc, 1800)
        first_step = time.time()
        finished(proc, 1800, "the relaunch", again)
    finally:
        reap(proc, spawned(again / "events.jsonl"))
    resumed_at = min(s for s, _ in step_log(again / "steps-0.txt"))
    return {"status": status, "signal_to_exit": ended - told, "committed": committed, "checkpoint_step": saved,
            "steps_lost": committed - resumed_at, "relaunch_to_first_step": first_step - started}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="10m")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--at", type=int, default=15, help="the step the signal comes at")
    p.add_argument("--repeats", type=int, default=3)
    add_out(p)
    p.add_argument("--work", default="/tmp/monarch_plugin_bench_drain")
    args = p.parse_args()

    def folder(name: str, i: int) -> Path:
        work = Path(args.work) / f"{name}-{i}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        return work

    def sigkill(i: int) -> dict:
        r = run_elastic(folder("sigkill", i), args.size, args.replicas, args.steps, args.at, min_replicas=1)
        return {"signal_to_noticed": r["kill_to_detected"], "signal_to_smaller_first_commit": r["kill_to_next_commit"],
                "dropped_steps": r["dropped_steps"], "step_s": r["step_s"]}

    runs = interleave({
        "sigkill": sigkill,
        "drain": lambda i: run_drain(folder("drain", i), args.size, args.replicas, args.steps, args.at),
        "stop": lambda i: run_stop(folder("stop", i), args.size, args.replicas, args.steps, args.at),
    }, args.repeats)
    write_json(args.out, "drain", runs)
    print(table(runs, args.replicas, args.size))


def table(runs: dict[str, list[dict]], replicas: int, size: str) -> str:
    def ms(name: str, key: str) -> str:
        value = median(r.get(key) for r in runs[name])
        return "–" if value is None else f"{value * 1000:.0f} ms"

    def dropped(name: str) -> str:
        return " / ".join(str(len(r["dropped_steps"])) for r in runs[name])

    n = len(runs["sigkill"])
    return "\n".join([
        f"| {size}, {replicas} replicas (median of {n}) | SIGKILL a replica | SIGTERM a replica (drain) |",
        "|---|---|---|",
        f"| signal → noticed | {ms('sigkill', 'signal_to_noticed')} | {ms('drain', 'signal_to_noticed')} |",
        f"| signal → smaller generation's first committed step | {ms('sigkill', 'signal_to_smaller_first_commit')}"
        f" | {ms('drain', 'signal_to_smaller_first_commit')} |",
        f"| signal → the replica left | – | {ms('drain', 'signal_to_left')} |",
        f"| signal → replacement's first committed step | – "
        f"| {ms('drain', 'signal_to_replacement_first_commit')} |",
        f"| steps dropped, each run | {dropped('sigkill')} | {dropped('drain')} |",
        f"| steady step | {ms('sigkill', 'step_s')} | {ms('drain', 'step_s')} |",
        "",
        f"| SIGTERM to monarch-run (median of {len(runs['stop'])}) | |",
        "|---|---|",
        f"| exit status | {', '.join(str(r['status']) for r in runs['stop'])} |",
        f"| signal → exit, checkpoint written | {ms('stop', 'signal_to_exit')} |",
        f"| steps lost (committed before the stop − the relaunch's first step), each run | "
        f"{' / '.join(str(r['steps_lost']) for r in runs['stop'])} |",
        f"| relaunch (`--resume auto`) → its first step | {ms('stop', 'relaunch_to_first_step')} |",
    ])


if __name__ == "__main__":
    main()
