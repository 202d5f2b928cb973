"""What losing the controller costs each front end, side by side in one invocation: the replicas saving the step
they hold against the periodic checkpoint alone.

Each front end (`--front-ends`, default all four: plain ElasticLoop under monarch-run, Lightning, HF Trainer,
torchtitan) trains the small CPU job of its own lost-controller e2e test with the framework's periodic checkpoint
every `--every` steps (controller_loss_frontends.py has each recipe). Once replica 0 committed `--at` steps, its
controller (monarch-run, or the Lightning / torchtitan process the user launched) is SIGKILLed from here; once
every replica proc (the pids of the run's `spawn` events) is gone, the job is relaunched at once with the
framework's own resume on the same folders (`--resume auto`, `fit(ckpt_path=<newest .ckpt>)`,
`train(resume_from_checkpoint=True)`, `--checkpoint.enable`), as a job script's retry would, and trains to its end.
Each front end x variant, `--repeats` times, interleaved (a front end's two variants back to back):
  save       the default: the first replica writes the step it holds, every proc ends (`controller_loss_save_s`)
  periodic   `controller_loss_save_s` 0, the front end's way: the replicas end with the controller; the relaunch has
             the newest periodic checkpoint

    python -m benchmarks.recovery.controller_loss --front-ends plain,lightning,hf,torchtitan --repeats 3
    python -m benchmarks.recovery.controller_loss --front-ends plain --every 25 --at 37 --steps 80  # docs/benchmarks.md

Columns:
  steps lost               committed before the relaunch (by the furthest replica's progress log: plain's step
                           logs, Lightning's and HF's progress-<replica>, torchtitan's probe step records) less
                           the step the relaunch resumed from, read from its first committed step (the earliest
                           `first_commit` event in its events file; torchtitan's steps count from 1): the median,
                           then each run's
  kill -> procs gone       seconds from the SIGKILL to the last replica proc gone (the save, if any, included)
  kill -> relaunch's       seconds from the SIGKILL to that `first_commit` event: the wait above, the relaunch's
  first step               start, spawn, model build and resume

Each run is a launch, the kill and a relaunch to the end: plain (40 steps of 0.2 s) and Lightning (40 of 0.1 s and
more) take about half a minute each on 2 cores, HF (32 of 0.2 s and more) under a minute, torchtitan (25 of 0.4 s and
more, 4 procs) about two, most of it start-up; so about 20 minutes for all four at 3 repeats (an estimate: each
recipe's step sleep and length are its e2e test's, not timed here as a whole). A run that fails is recorded with its
error (its logs are run.log and run-resumed.log in its folder under `--work`) and the rest go on; the exit status is
then 1. Writes <out>/controller_loss.json and prints a markdown table of medians.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness import add_out, events, interleave, median, reap, spawned, wait_for, write_json
from benchmarks.recovery.controller_loss_frontends import FRONT_ENDS, FrontEnd

VARIANTS = {"save": None, "periodic": 0.0}
"""Each variant's `controller_loss_save_s`: None leaves the default."""
GONE_TIMEOUT_S = 120.0
"""Longer than the default `controller_loss_save_s` (60 s), past which the procs end written or not."""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _pids(events_path: Path) -> list[int]:
    """Every proc the run reported: its replicas' and its forkserver's."""
    found = events(events_path)
    return [*(p for ps in spawned(events_path).values() for p in ps),
            *(e["pid"] for e in found if e["event"] == "forkserver" and e.get("pid"))]


def _start(fe: FrontEnd, run: Path, events_path: Path, save_s, resume: bool, args) -> subprocess.Popen:
    log = open(run / ("run-resumed.log" if resume else "run.log"), "w")
    with log:  # the child keeps its own descriptor
        return subprocess.Popen(fe.command(run, run / "out", events_path, save_s, resume, args), cwd=run,
                                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **fe.env})


def run_once(work: Path, name: str, variant: str, args) -> dict:
    fe, save_s = FRONT_ENDS[name], VARIANTS[variant]
    run = work / f"{name}-{variant}"
    shutil.rmtree(run, ignore_errors=True)
    (run / "out").mkdir(parents=True)
    killed_events, resumed_events = run / "events.jsonl", run / "events-resumed.jsonl"
    proc = _start(fe, run, killed_events, save_s, False, args)
    resumed, killed_reaped = None, False
    try:
        wait_for(f"{args.at} steps (see {run / 'run.log'})", lambda: fe.progress(run / "out") >= args.at, proc,
                 timeout=600)
        pids = [p for ps in spawned(killed_events).values() for p in ps]
        os.kill(proc.pid, signal.SIGKILL)
        t_kill = time.time()
        proc.wait()
        while any(_alive(p) for p in pids):
            if time.time() - t_kill > GONE_TIMEOUT_S:
                raise RuntimeError(f"replica procs outlived their controller by {GONE_TIMEOUT_S:g} s: {pids}")
            time.sleep(0.01)
        gone_s = time.time() - t_kill
        committed = fe.committed(run / "out")  # the step in flight may have committed after the kill
        reap(proc, _pids(killed_events))  # its forkserver, if still there
        killed_reaped = True
        resumed = _start(fe, run, resumed_events, save_s, True, args)
        firsts = wait_for(f"the relaunch's first committed step (see {run / 'run-resumed.log'})",
                          lambda: [e for e in events(resumed_events) if e["event"] == "first_commit"], resumed,
                          timeout=600, poll_s=0.1)
        if resumed.wait(timeout=600) != 0:
            raise RuntimeError(f"the relaunch failed (rc {resumed.returncode}); see {run / 'run-resumed.log'}")
    finally:
        if not killed_reaped:
            reap(proc, _pids(killed_events))
        if resumed is not None:
            reap(resumed, _pids(resumed_events))
    start = min(e["step"] for e in firsts) - fe.first_offset
    saved = [e["step"] for e in events(killed_events) if e["event"] == "controller_lost" and e.get("checkpoint")]
    return {"lost": committed - start, "committed": committed, "resumed_at": start,
            "saved_step": saved[0] if saved else None, "gone_s": gone_s,
            "first_step_s": min(e["ts"] for e in firsts) - t_kill}


def _guarded(work: Path, name: str, variant: str, args) -> dict:
    """`run_once`'s result, or its error: one front end failing leaves the others' runs (the processes it started
    are reaped either way)."""
    try:
        return run_once(work, name, variant, args)
    except Exception as e:  # noqa: BLE001 - whatever it was, the table says which run and the JSON why
        return {"error": f"{type(e).__name__}: {e}"}


def _cell(values: list, fmt: str) -> str:
    m = median(values)
    return "failed" if m is None else format(m, fmt)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--front-ends", default=",".join(FRONT_ENDS),
                   help=f"comma-separated, of {', '.join(FRONT_ENDS)} (default all)")
    p.add_argument("--every", type=int, default=5, help="the framework's periodic checkpoint every this many steps")
    p.add_argument("--at", type=int, default=17, help="kill the controller once replica 0 committed this many steps")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--replicas", type=int, default=3, help="plain only (the others: their e2e test's)")
    p.add_argument("--size", default="10m", help="plain only: benchmarks/workloads/mlp.py's model")
    p.add_argument("--steps", type=int, default=40, help="plain only: the run's length")
    p.add_argument("--work", type=Path, default=Path("/tmp/monarch-controller-loss"))
    add_out(p)
    args = p.parse_args()
    names = [n.strip() for n in args.front_ends.split(",") if n.strip()]
    for name in names:
        if name not in FRONT_ENDS:
            p.error(f"unknown front end {name!r}: choose from {', '.join(FRONT_ENDS)}")
        fe = FRONT_ENDS[name]
        if fe.framework and importlib.util.find_spec(fe.framework) is None:
            p.error(f"{name} needs {fe.framework}, which is not installed here: leave it out of --front-ends")
        if not args.every < args.at <= fe.steps(args) - 3:
            p.error(f"{name} trains {fe.steps(args)} steps: --at must lie between --every + 1 and {fe.steps(args) - 3}")
    variants = {f"{n}/{v}": lambda i, n=n, v=v: _guarded(args.work / str(i), n, v, args)
                for n in names for v in VARIANTS}
    runs = interleave(variants, args.repeats)
    write_json(args.out, "controller_loss", {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs})
    print("| front end | variant | steps lost (median, each) | kill -> procs gone | kill -> relaunch's first step |")
    print("|---|---|---|---|---|")
    for key, rs in runs.items():
        name, variant = key.split("/")
        ok = [r for r in rs if "error" not in r]
        each = ", ".join(str(r["lost"]) if "error" not in r else "failed" for r in rs)
        print(f"| {name} | {variant} | {_cell([r['lost'] for r in ok], 'g')} ({each}) "
              f"| {_cell([r['gone_s'] for r in ok], '.2f')} s | {_cell([r['first_step_s'] for r in ok], '.1f')} s |")
    failed = [(key, i, r["error"]) for key, rs in runs.items() for i, r in enumerate(rs) if "error" in r]
    for key, i, error in failed:
        print(f"{key} (repeat {i}): {error}", file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
