"""Two launches of the same training job, alternated in one invocation and compared by their median step.

Alternating (A, B, A, B, ...) lets a slow spell of this shared machine hit both sides. Each run writes one line
per step, "<step> <seconds>", to `steps.txt` in its own folder; a run's step time is the median interval after
the warm-up steps, and a side's the median over its runs.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from pathlib import Path

WARMUP = 10


def median_step(path: Path, steps: int) -> float:
    ts = [float(line.split()[1]) for line in path.read_text().splitlines() if line]
    if len(ts) != steps:
        raise RuntimeError(f"{path} has {len(ts)} steps, expected {steps}")
    ts = ts[WARMUP:]
    return statistics.median(b - a for a, b in zip(ts, ts[1:]))


def alternate(commands: dict[str, list[str]], repeats: int, steps: int, work: Path,
              env: dict[str, str] | None = None) -> dict[str, dict]:
    """Run each side's command `repeats` times, alternating, each in `work/<side>-<repeat>` with its log there."""
    results = {side: {"step_s": [], "wall_s": []} for side in commands}
    for repeat in range(repeats):
        for side, command in commands.items():
            run = work / f"{side}-{repeat}"
            run.mkdir()
            t0 = time.monotonic()
            with open(run / "log.txt", "w") as log:
                subprocess.run(command, check=True, cwd=run, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, **(env or {})})
            results[side]["wall_s"].append(time.monotonic() - t0)
            results[side]["step_s"].append(median_step(run / "steps.txt", steps))
            print(json.dumps({side: {k: v[-1] for k, v in results[side].items()}}), flush=True)
    for side in commands:
        results[side]["median_step_s"] = statistics.median(results[side]["step_s"])
    return results


def report(results: dict, labels: dict[str, str], header: str, out: Path, name: str) -> str:
    """Add the ratio of the second side to the first, write `<out>/<name>.json`, return the markdown table.

    `labels` maps each side (baseline first) to its row label; `header` names the job in the first cell."""
    (baseline, base_label), (elastic, elastic_label) = labels.items()
    results["ratio"] = results[elastic]["median_step_s"] / results[baseline]["median_step_s"]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=2))

    def row(side: str) -> str:
        each = ", ".join(f"{x * 1000:.0f}" for x in results[side]["step_s"])
        walls = ", ".join(f"{x:.1f}" for x in results[side]["wall_s"])
        return f"| {labels[side]} | {results[side]['median_step_s'] * 1000:.0f} ms | {each} | {walls} |"

    return "\n".join([
        f"| {header} | median step | per run (ms) | whole launch per run (s) |",
        "|---|---|---|---|",
        row(baseline),
        row(elastic),
        f"| ratio {elastic} / {baseline} | {results['ratio']:.2f} | | |",
    ])
