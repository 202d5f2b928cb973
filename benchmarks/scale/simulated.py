"""The generation protocol at 64 to 1,024 replicas: the real controller and store, simulated replicas.

A machine of 2 cores holds 16 real replicas at most. Here `ElasticController` runs unchanged, with its real store,
but its `launch` seam starts light replicas instead of Monarch proc meshes: threads in a few worker processes
(`--procs`), each with its own TCPStore client, speaking the protocol a real worker speaks with the same code:
`Flags` for the controller's pushes (`plan` / `abort` / `regroup` / `shutdown`, carried here by a pipe per worker
process instead of a Monarch message), `collectives.barrier` to form each generation, `Key` and `Plan` for the
store, `Key.formed` and the `finished` barrier. What they do not do is everything a real replica does besides
the protocol: no torch group is built (gloo over a thousand ranks on one machine is not a thing to time), no heal,
and a "step" is a wait of `--step-ms` that a push ends at once.

Each simulated replica has a real proc for the controller to watch by pidfd and to kill: a `sleep` that does
nothing, whose end the mesh's `stop` carries to the protocol thread (which then ends, closing its store connection).
For each count N: start N replicas, let them train, SIGKILL replica 1's proc, and let the controller's replacement
grow the run back. From the events file:

  detected        kill -> the controller's death event (the pidfd)
  shrink plan     kill -> the generation without it published
  all survivors   kill -> the last survivor through that generation's barrier (in its new group)
  grow            the generation admitting the replacement published -> the last member through its barrier

    python -m benchmarks.scale.simulated --replicas 64 128 256 512 1024 --out benchmarks/results

Writes <out>/scale_sim.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import threading
import time
from pathlib import Path

from benchmarks.harness import add_out, write_json
from monarch_plugin.config import ElasticConfig
from monarch_plugin.controller import ElasticController
from monarch_plugin.events import EventLog, read_events
from monarch_plugin.target import Target
from tests.support.simulated import Fleet, wait_for  # the simulated replicas, shared with the controller's unit tests


# -- one count ----------------------------------------------------------------------------------------------------

def run(work: Path, replicas: int, procs: int, step_ms: float) -> dict:
    here = work / f"sim-{replicas}"
    here.mkdir(parents=True)
    events_path = str(here / "events.jsonl")
    config = ElasticConfig(replicas=replicas, min_replicas=1, forkserver=False, join_timeout_s=120,
                           events_path=events_path, restart_backoff_s=0.5, checkpoint_dir=str(here / "ckpt"))
    config.env.update(MONARCH_PLUGIN_EVENTS=events_path, MONARCH_PLUGIN_JOIN_TIMEOUT_S="120")
    fleet = Fleet(procs, step_ms / 1000)
    controller = ElasticController(config, Target.function(print), launch=fleet.launch)
    log = EventLog(events_path, source="benchmark")
    result: dict = {}

    def drive():
        try:
            def gens_with(predicate):
                return [q for q in read_events(events_path) if q["event"] == "quorum" and predicate(q)]

            def wait(what, predicate, timeout=300):
                return wait_for(f"{what} of {replicas} replicas", predicate, timeout, events_path)

            def joined(gen):
                return [e for e in read_events(events_path) if e["event"] == "join" and e["gen"] == gen]

            start = wait("first generation", lambda: gens_with(lambda q: len(q["members"]) == replicas))[0]
            wait("first generation formed", lambda: len(joined(start["gen"])) == replicas)
            time.sleep(1.0)
            log.emit("kill", replica=1)
            fleet.kill(1)
            def regrown(q: dict) -> bool:
                return q["gen"] > start["gen"] and len(q["members"]) == replicas

            grow = wait("regrown generation", lambda: gens_with(regrown))[0]
            wait("regrown generation formed", lambda: len(joined(grow["gen"])) == replicas)
            result["ok"] = True
        finally:
            fleet.finish()

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    t0 = time.monotonic()
    try:
        controller.run()
    finally:
        fleet.close()
    driver.join(5)
    if not result.get("ok"):
        raise RuntimeError(f"{replicas} replicas: the run ended before it regrew; see {events_path}")
    events = read_events(events_path)
    kill = next(e["ts"] for e in events if e["event"] == "kill")
    death = next(e["ts"] for e in events if e["event"] == "death")
    quorums = [e for e in events if e["event"] == "quorum"]
    shrink = next(q for q in quorums if q["ts"] >= death and 1 not in q["members"])
    grow = next(q for q in quorums if q["gen"] > shrink["gen"] and len(q["members"]) == replicas)
    joins: dict[int, list[float]] = {}
    for e in events:
        if e["event"] == "join":
            joins.setdefault(e["gen"], []).append(e["ts"])
    return {
        "replicas": replicas,
        "procs": procs,
        "run_s": round(time.monotonic() - t0, 1),
        "detected_s": death - kill,
        "shrink_plan_s": shrink["ts"] - kill,
        "all_survivors_s": max(joins[shrink["gen"]]) - kill,
        "grow_s": max(joins[grow["gen"]]) - grow["ts"],
        "shrink_gens": grow["gen"] - shrink["gen"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    p.add_argument("--procs", type=int, default=8, help="worker processes the simulated replicas share")
    p.add_argument("--step-ms", type=float, default=100.0)
    add_out(p)
    p.add_argument("--work", type=Path, default=Path("/tmp/monarch_plugin_scale_sim"))
    args = p.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    results = []
    for n in args.replicas:
        results.append(run(args.work, n, args.procs, args.step_ms))
        print(json.dumps(results[-1]), flush=True)
    write_json(args.out, "scale_sim", results)
    print("\n| simulated replicas | kill -> shrink plan | kill -> every survivor in the new group | "
          "grow plan -> every member in the grown group |\n|---|---|---|---|")
    for r in results:
        ms = [f"{r[k] * 1000:.0f} ms" for k in ("shrink_plan_s", "all_survivors_s", "grow_s")]
        print(f"| {r['replicas']} | " + " | ".join(ms) + " |")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
