"""A replica that raises against one that is SIGKILLed, side by side in one invocation (the ratios share one
machine state): what an exception costs the survivors, and what an out-of-memory's wait for the replacement costs.

On N replicas of benchmarks/workload.py (one process each), replica 1 fails at step K, `--repeats` times each:
  sigkill     SIGKILLed from here (benchmarks/recovery.py's `elastic` run)
  raise       its backward raises (`--fault raise:replica=1:step=K:at=backward`): the proc lives on and tells the
              controller through the store; it is replaced as the dead one is
  oom         it runs out of memory at step K (`--fault oom:...`): the survivors wait, training nothing, until the
              replacement is healed in (a constant global batch on fewer replicas would be larger shares)
  oom+spare   the same with `--spares 1`: the hot spare fills the gap at once, nobody waits

    python benchmarks/exceptions.py --replicas 3 --repeats 3 --out benchmarks/results

Writes <out>/exceptions.json and prints a markdown table of medians (pasted into docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

from recovery import run_elastic

HERE = Path(__file__).resolve().parent

VARIANTS = {
    "sigkill": {},
    "raise": {"fault": "raise:replica=1:step={step}:at=backward"},
    "oom": {"fault": "oom:replica=1:step={step}"},
    "oom+spare": {"fault": "oom:replica=1:step={step}", "spares": 1},
}
PHASES = ("kill_to_detected", "kill_to_next_commit", "replace_to_participating")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="10m")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--at", type=int, default=15, help="the step replica 1 fails at")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--work", default="/tmp/monarch_plugin_bench_exceptions")
    args = p.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for i in range(args.repeats):  # interleaved, so a slow spell of the machine hits every variant alike
        for name, knobs in VARIANTS.items():
            result = run_elastic(work, args.size, args.replicas, args.steps, args.at, name=f"-{name}-{i}",
                                 min_replicas=1, **knobs)
            runs[name].append({k: result[k] for k in (*PHASES, "step_s", "detected_by", "dropped_steps")})
            print(json.dumps({name: runs[name][-1]}), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "exceptions.json").write_text(json.dumps(runs, indent=2))
    print(table(runs, args.replicas, args.size))


def table(runs: dict[str, list[dict]], replicas: int, size: str) -> str:
    def median(name: str, key: str) -> str:
        values = [r[key] for r in runs[name] if r[key] is not None]
        return f"{statistics.median(values) * 1000:.0f} ms" if values else "n/a"

    rows = [f"| {size}, {replicas} replicas (median of {len(runs['sigkill'])}) | " + " | ".join(runs) + " |",
            "|---|" + "---|" * len(runs)]
    for label, key in (("failure -> noticed", "kill_to_detected"),
                       ("failure -> survivors' next committed step", "kill_to_next_commit"),
                       ("replacement: spawn began (a spare: noticed) -> its first step", "replace_to_participating"),
                       ("steady step", "step_s")):
        rows.append(f"| {label} | " + " | ".join(median(name, key) for name in runs) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
