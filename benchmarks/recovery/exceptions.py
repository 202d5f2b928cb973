"""A replica that raises against one that is SIGKILLed, side by side in one invocation (the ratios share one
machine state): what an exception costs the survivors, and what an out-of-memory's wait for the replacement costs.

On N replicas of benchmarks/workloads/mlp.py (one process each), replica 1 fails at step K, `--repeats` times each:
  sigkill     SIGKILLed from here (recovery/sigkill.py's `elastic` run)
  raise       its backward raises (`--fault raise:replica=1:step=K:at=backward`): the proc lives on and tells the
              controller through the store; it is replaced as the dead one is
  oom         it runs out of memory at step K (`--fault oom:...`): the survivors wait, training nothing, until the
              replacement is healed in (a constant global batch on fewer replicas would be larger shares)
  oom+spare   the same with `--spares 1`: the hot spare fills the gap at once, nobody waits

    python -m benchmarks.recovery.exceptions --replicas 3 --repeats 3 --out benchmarks/results

Writes <out>/exceptions.json and prints a markdown table of medians (pasted into docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from benchmarks.harness import add_out, interleave, median, write_json
from benchmarks.recovery.sigkill import run_elastic

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
    add_out(p)
    p.add_argument("--work", default="/tmp/monarch_plugin_bench_exceptions")
    args = p.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)

    def run(name: str, i: int) -> dict:
        result = run_elastic(work, args.size, args.replicas, args.steps, args.at, name=f"-{name}-{i}",
                             min_replicas=1, **VARIANTS[name])
        return {k: result[k] for k in (*PHASES, "step_s", "detected_by", "dropped_steps")}

    runs = interleave({name: lambda i, name=name: run(name, i) for name in VARIANTS}, args.repeats)
    write_json(args.out, "exceptions", runs)
    print(table(runs, args.replicas, args.size))


def table(runs: dict[str, list[dict]], replicas: int, size: str) -> str:
    def ms(name: str, key: str) -> str:
        value = median(r[key] for r in runs[name])
        return "n/a" if value is None else f"{value * 1000:.0f} ms"

    rows = [f"| {size}, {replicas} replicas (median of {len(runs['sigkill'])}) | " + " | ".join(runs) + " |",
            "|---|" + "---|" * len(runs)]
    for label, key in (("failure -> noticed", "kill_to_detected"),
                       ("failure -> survivors' next committed step", "kill_to_next_commit"),
                       ("replacement: spawn began (a spare: noticed) -> its first step", "replace_to_participating"),
                       ("steady step", "step_s")):
        rows.append(f"| {label} | " + " | ".join(ms(name, key) for name in runs) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
