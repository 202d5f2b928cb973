"""Soak the chaos tests: run each front end's seeded chaos test again and again, each time on a fresh seed.

    python -m benchmarks.soak.chaos --runs 8 --front-ends plain lightning hf torchtitan --out benchmarks/results

CI runs the plain loop's chaos test once per run, on a fresh seed; Lightning's, HF's and torchtitan's are `soak`
tests, left out of the default run for the suite's time. This runs any of them `--runs` times each, one pytest
process at a time (the tests are timing-sensitive on 2 cores: never two at once), and records every draw with its
outcome and time, so a failing seed can be replayed (`CHAOS_SEED=<seed>`).

Writes <out>/chaos_soak.json and prints one markdown row per front end (pasted into docs/reliability.md).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time

from benchmarks.harness import REPO, add_out, write_json

TESTS = {
    "plain": "test_plain_loop_survives_a_seeded_draw_of_failures",
    "lightning": "test_lightning_fit_survives_a_seeded_draw_of_failures",
    "hf": "test_hf_train_survives_a_seeded_draw_of_failures",
    "torchtitan": "test_torchtitan_train_survives_a_seeded_draw_of_failures",
}


def soak_one(front_end: str, seed: int) -> dict:
    node = f"tests/e2e/test_chaos.py::{TESTS[front_end]}"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-m",
                           "soak or not soak", node], cwd=REPO, env={**os.environ, "CHAOS_SEED": str(seed)},
                          capture_output=True, text=True, timeout=900)
    drawn = re.search(r"chaos seed \d+ \(replay: CHAOS_SEED=\d+\): (.*)", proc.stdout)
    failure = re.findall(r"^E\s+(.*)$", proc.stdout, re.MULTILINE)
    return {"front_end": front_end, "seed": seed, "passed": proc.returncode == 0,
            "seconds": round(time.monotonic() - t0, 1), "drawn": drawn.group(1) if drawn else None,
            "failure": failure[0][:400] if failure else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=8, help="draws per front end")
    p.add_argument("--front-ends", nargs="+", choices=sorted(TESTS), default=sorted(TESTS))
    add_out(p)
    args = p.parse_args()
    seeds = random.SystemRandom()
    results = []
    for _ in range(args.runs):
        for front_end in args.front_ends:
            result = soak_one(front_end, seeds.randrange(1 << 20))
            results.append(result)
            print(json.dumps(result), flush=True)
    write_json(args.out, "chaos_soak", results)
    print("\n| front end | draws | passed | seconds (min-max) | failing seeds |\n|---|---|---|---|---|")
    for front_end in args.front_ends:
        mine = [r for r in results if r["front_end"] == front_end]
        secs = [r["seconds"] for r in mine]
        failing = ", ".join(str(r["seed"]) for r in mine if not r["passed"]) or "none"
        print(f"| {front_end} | {len(mine)} | {sum(r['passed'] for r in mine)} | {min(secs):.0f}-{max(secs):.0f} "
              f"| {failing} |")


if __name__ == "__main__":
    main()
