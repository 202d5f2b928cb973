"""How the generation protocol's turnaround grows with the replica count, on real replicas of a tiny model.

For each count N, one `monarch-run --replicas N` of workloads/mlp.py's `tiny` MLP (global batch 32, so each replica
trains on 32/N samples), replica 1 SIGKILLed by this script once it has committed `--kill-at` steps; the
replacement is cold (forked from the forkserver). Read from the run's events, each from the kill or the grow:

  detected        kill -> the controller's death event (a pidfd)
  shrink plan     kill -> the generation without it published (quorum event)
  all survivors   kill -> the last survivor's first committed step in that generation: every survivor is in the
                  new group and training
  grow            the generation admitting the replacement published -> the last member's first committed step in
                  it (the newcomer healed and every member training together)

    python -m benchmarks.scale.replicas --replicas 2 4 8 16 --out benchmarks/results

Writes <out>/scale.json and prints a markdown table. All N replicas share this machine's cores, so the step
itself grows with N here; the turnaround columns are what the protocol adds around it.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from benchmarks.harness import add_out, write_json
from benchmarks.recovery.sigkill import run_elastic
from monarch_plugin.events import read_events


def run(work: Path, replicas: int, steps: int, kill_at: int) -> dict:
    here = work / f"scale-{replicas}"
    elastic = run_elastic(here, "tiny", replicas, steps, kill_at, min_replicas=1)  # kills replica 1 at `kill_at`
    out = next(here.glob("elastic-tiny-*"))
    events = read_events(str(out / "events.jsonl"))
    kill = next(e["ts"] for e in events if e["event"] == "kill")
    death = next(e["ts"] for e in events if e["event"] == "death")
    quorums = [e for e in events if e["event"] == "quorum"]
    shrink = next(q for q in quorums if q["ts"] >= death and 1 not in q["members"])
    grow = next(q for q in quorums if q["gen"] > shrink["gen"] and len(q["members"]) == replicas)
    firsts: dict[int, list[float]] = {}
    for e in events:
        if e["event"] == "first_commit":
            firsts.setdefault(e["gen"], []).append(e["ts"])
    if len(firsts.get(shrink["gen"], [])) < replicas - 1 or len(firsts.get(grow["gen"], [])) < replicas:
        raise RuntimeError(f"{replicas} replicas: not every member committed in the new generations; see {out}")
    return {
        "replicas": replicas,
        "step_s": elastic["step_s"],
        "detected_s": death - kill,
        "shrink_plan_s": shrink["ts"] - kill,
        "all_survivors_s": max(firsts[shrink["gen"]]) - kill,
        "grow_s": max(firsts[grow["gen"]]) - grow["ts"],
        "shrink_gens": grow["gen"] - shrink["gen"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--kill-at", type=int, default=40)
    add_out(p)
    p.add_argument("--work", type=Path, default=Path("/tmp/monarch_plugin_scale"))
    args = p.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    results = []
    for n in args.replicas:
        results.append(run(args.work, n, args.steps, args.kill_at))
        print(json.dumps(results[-1]), flush=True)
    write_json(args.out, "scale", results)
    print("\n| replicas | step | kill -> detected | kill -> shrink plan | kill -> every survivor training | "
          "grow plan -> every member training |\n|---|---|---|---|---|---|")
    for r in results:
        ms = [f"{r[k] * 1000:.0f} ms" for k in ("step_s", "detected_s", "shrink_plan_s", "all_survivors_s", "grow_s")]
        print(f"| {r['replicas']} | " + " | ".join(ms) + " |")


if __name__ == "__main__":
    main()
