"""How long an abandoned gloo group's transport thread spins after a death, with abandoned groups dropped on a clock.

    python -m benchmarks.soak.gloo_spin --runs 8 --out benchmarks/results/gloo_spin

After a death, a survivor's transport thread of the generation it abandoned mid-reduction sometimes spins on its
dead peer's socket (~55 % of a core, docs/benchmarks.md), slowing the whole run while it lasts. Before abandoned
groups were dropped on a clock (`collectives._reap`) the spin lasted until the next abandonment after the group's
timeout, which at one kill a minute meant until that member died; now the group goes once its timeout (60 s) and a
second have passed. This measures how long the spins last.

Each run: `monarch-run` trains the 10M MLP (`workloads/mlp.py`) on 4 replicas; 20 s in, replica 3's worker is SIGKILLed
from outside; for the next `--watch` seconds every thread of every other worker is sampled once a second (utime +
stime of /proc/PID/task/TID/stat). A gloo thread (`gloo_tcp_loop`, a group's transport; `pt_gloo_runloop`, its
worker) spins while it uses over 30 % of a core; a spin is such a stretch of 3 s or more. Prints one line per run
and writes <out>/gloo_spin.json.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import time
from pathlib import Path

from benchmarks.harness import BIN, RESULTS, WORKLOADS, add_out, kill, spawned, wait_for, write_json

TICK = os.sysconf("SC_CLK_TCK")
SPIN_SHARE, SPIN_MIN_S = 0.30, 3


def _threads(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (name, CPU seconds so far) of every thread of `pid` (empty once it is gone)."""
    found = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return found
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                head, rest = f.read().rsplit(")", 1)
        except (FileNotFoundError, ProcessLookupError):
            continue
        fields = rest.split()
        found[int(tid)] = (head.split("(", 1)[1], (int(fields[11]) + int(fields[12])) / TICK)
    return found


def _spins(samples: list[dict[tuple[int, int], tuple[str, float]]]) -> list[dict]:
    """Stretches of SPIN_MIN_S or more in which one thread used over SPIN_SHARE of a core, from one sample a second:
    pid, tid, its name, the first and last second after the kill. (The training threads are busy too: only the gloo
    threads' are spins.)"""
    spins = []
    names = {k: name for s in samples for k, (name, _) in s.items()}
    for key in sorted(names):
        busy = [key in a and key in b and a[key][1] - b[key][1] > SPIN_SHARE for b, a in zip(samples, samples[1:])]
        start = None
        for t, on in enumerate([*busy, False]):
            if on and start is None:
                start = t
            elif not on and start is not None:
                if t - start >= SPIN_MIN_S:
                    spins.append({"pid": key[0], "tid": key[1], "name": names[key], "from_s": start, "to_s": t})
                start = None
    return spins


def one_run(out: Path, watch_s: float, kill_after_s: float) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    events = out / "events.jsonl"
    cmd = [str(BIN / "monarch-run"), "--replicas", "4", "--min-replicas", "2", "--events", str(events),
           str(WORKLOADS / "mlp.py"), "--mode", "elastic", "--steps", "100000", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=open(out / "run.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(f"the first step (see {out / 'run.log'})", (out / "steps-0.txt").exists, proc, 180, poll_s=0.2)
        time.sleep(kill_after_s)
        pids = spawned(events)
        others = [p for r, ps in pids.items() if r != 3 for p in ps]
        kill(pids[3][0])
        killed_at = time.time()
        samples = []
        for t in range(int(watch_s) + 1):
            samples.append({(pid, tid): v for pid in others for tid, v in _threads(pid).items()})
            time.sleep(max(0.0, killed_at + t + 1 - time.time()))
        busy = _spins(samples)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    return {"killed_at": killed_at, "watched_s": watch_s, "spins": [b for b in busy if "gloo" in b["name"]],
            "busy": busy}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=8)
    p.add_argument("--watch", type=float, default=100.0, help="seconds sampled after the kill")
    p.add_argument("--kill-after", type=float, default=20.0, help="seconds of training before the kill")
    add_out(p, RESULTS / "gloo_spin")
    args = p.parse_args()
    out = args.out
    results = []
    for i in range(args.runs):
        r = one_run(out / f"run{i}", args.watch, args.kill_after)
        results.append(r)
        spun = ", ".join(f"{s['from_s']}-{s['to_s']} s" for s in r["spins"]) or "none"
        others = sorted({b["name"] for b in r["busy"] if b not in r["spins"]})
        print(f"run {i}: gloo spins after the kill: {spun} (other busy threads: {', '.join(others) or 'none'})",
              flush=True)
    spinning = [r for r in results if r["spins"]]
    print(f"{len(spinning)} of {len(results)} runs had a spinning gloo thread; the longest ended "
          f"{max((s['to_s'] for r in spinning for s in r['spins']), default=0)} s after the kill "
          f"(watched {args.watch:.0f} s)")
    write_json(out, "gloo_spin", results)


if __name__ == "__main__":
    main()
