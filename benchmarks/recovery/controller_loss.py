"""What losing the controller costs, side by side in one invocation: the replicas saving the step they hold against
the periodic checkpoint alone.

On N replicas of benchmarks/workloads/mlp.py (one process each, `ElasticLoop`, a checkpoint every `--every` steps),
`monarch-run` is SIGKILLed from here once replica 0 logged `--at` steps, then relaunched at once with
`--resume auto`, as a job script's `monarch-run ... || monarch-run --resume auto ...` would, `--repeats` times
each, interleaved:
  save       the default: the first replica writes the step it holds, every proc ends (`controller_loss_save_s`)
  periodic   `--controller-loss-save 0`: the replicas end with the controller; the relaunch has the newest periodic
             checkpoint

    python -m benchmarks.recovery.controller_loss --replicas 3 --repeats 3 --out benchmarks/results

Columns: steps lost (committed before the kill, by any replica's log, less the step the relaunch resumed), seconds
from the kill to the last replica proc gone, and from the kill to the relaunched run's first committed step (its
start, model build and resume included). Writes <out>/controller_loss.json and prints a markdown table of medians.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from benchmarks.harness import BIN, add_out, events, interleave, median, reap, spawned, step_log, wait_for, write_json
from benchmarks.recovery.sigkill import WORKLOAD

VARIANTS = {"save": (), "periodic": ("--controller-loss-save", "0")}


def _start(out: Path, events_path: Path, args, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([str(BIN / "monarch-run"), "--replicas", str(args.replicas), "--events", str(events_path),
                             "--checkpoint-dir", str(out / "ckpt"), "--checkpoint-steps", str(args.every), *extra,
                             str(WORKLOAD), "--mode", "elastic", "--size", args.size, "--steps", str(args.steps),
                             "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=out)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _logged(out: Path, before: float = float("inf"), after: float = 0.0) -> list[int]:
    return [s for path in out.glob("steps-*.txt") for s, ts in step_log(path) if after <= ts < before]


def run_once(work: Path, variant: str, args) -> dict:
    out = work / variant
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    killed_events, resumed_events = out / "events.jsonl", out / "events-resumed.jsonl"
    proc = _start(out, killed_events, args, *VARIANTS[variant])
    resumed = None
    try:
        wait_for(f"{args.at} steps", lambda: len(step_log(out / "steps-0.txt")) >= args.at, proc, timeout=600)
        pids = spawned(killed_events)
        os.kill(proc.pid, signal.SIGKILL)
        t_kill = time.time()
        proc.wait()
        while any(_alive(p) for ps in pids.values() for p in ps):
            time.sleep(0.01)
        gone_s = time.time() - t_kill
        t_relaunch = time.time()
        committed = max(_logged(out, before=t_relaunch)) + 1  # the step in flight may commit after the kill
        resumed = _start(out, resumed_events, args, "--resume", "auto", *VARIANTS[variant])
        wait_for("the relaunch's first step", lambda: _logged(out, after=t_relaunch), resumed, timeout=600)
        first_s = min(ts for path in out.glob("steps-*.txt") for _, ts in step_log(path) if ts >= t_relaunch) - t_kill
        if resumed.wait(timeout=600) != 0:
            raise RuntimeError(f"the relaunch failed (rc {resumed.returncode}); see {out}")
    finally:
        reap(proc, spawned(killed_events))
        if resumed is not None:
            reap(resumed, spawned(resumed_events))
    [resume] = [e for e in events(resumed_events) if e["event"] == "resume"]
    start = int(os.path.basename(resume["path"])[4:]) if resume["path"] else 0
    return {"lost": committed - start, "committed": committed, "resumed_at": start, "gone_s": gone_s,
            "first_step_s": first_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--size", default="10m")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--every", type=int, default=25, help="periodic checkpoint every this many steps")
    p.add_argument("--at", type=int, default=37, help="kill the controller once replica 0 logged this many steps")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work", type=Path, default=Path("/tmp/monarch-controller-loss"))
    add_out(p)
    args = p.parse_args()
    runs = interleave({v: lambda i, v=v: run_once(args.work / str(i), v, args) for v in VARIANTS}, args.repeats)
    write_json(args.out, "controller_loss", {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs})
    print("| controller SIGKILLed | steps lost | kill -> replicas gone | kill -> relaunch's first step |")
    print("|---|---|---|---|")
    for variant, rs in runs.items():
        lost = ", ".join(str(r["lost"]) for r in rs)
        print(f"| {variant} | {median(r['lost'] for r in rs):g} ({lost}) | {median(r['gone_s'] for r in rs):.2f} s "
              f"| {median(r['first_step_s'] for r in rs):.1f} s |")


if __name__ == "__main__":
    main()
