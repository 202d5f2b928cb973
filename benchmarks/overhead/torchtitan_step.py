"""Step time of one torchtitan job as plain torchtitan (torchrun, HSDP) and as `--monarch.enable`, side by side;
with `--heal`, what healing a replacement replica of that shape moves and how long it takes.

    python -m benchmarks.overhead.torchtitan_step --procs-per-replica 2 --steps 40 --repeats 2
    python -m benchmarks.overhead.torchtitan_step --procs-per-replica 4 --tp 2 --steps 20 --repeats 2 --heal

What elasticity costs a failure-free torchtitan run with the same parallel dims: llama3's debug model
(`--config llama3_debugmodel_cpu`), 2 replicas of `--procs-per-replica` procs (an FSDP x TP mesh: `k / tp` x
`tp`), the same global batch and sequence length, gloo, one torch thread per proc. The plain side is torchtitan's
own HSDP (x TP) under torchrun (`data_parallel_replicate_degree 2` x `data_parallel_shard_degree k / tp` x
`tensor_parallel_degree tp`, FSDP reducing across replicas inside backward); the elastic side is
`python -m torchtitan.train ... --monarch.enable` (each replica an FSDP x TP mesh, the cross-replica sum one
transaction after backward, the loader reading the global batch on every proc). `--heal` adds one elastic run
whose replica 1 SIGKILLs itself (`--monarch.fault`) and reads its replacement's heal from the `heal` events: one
per proc, each from the donor proc holding the same shard.
One invocation runs both, alternating `--repeats` times so the ratio shares one machine state. A step's time is
the interval between the first "step: N" log lines (any rank) of consecutive steps, after a warm-up; a side's
median and 10th percentile pool its runs' steps. On a machine shared with other work the median carries that
work's noise; the 10th percentile (the side's unhindered pace) is the steadier estimate of the overhead.
Writes <out>/torchtitan_overhead.json (`_tp<N>.json` with TP) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
from datetime import datetime
from pathlib import Path

from benchmarks.harness import add_out, decile, interleave, intervals, launch, write_json

WARMUP = 5
STEP_LINE = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*step:\s+(\d+)\s+.*loss:")


def command(side: str, k: int, tp: int, steps: int, seq_len: int, batch: int, work: Path) -> list[str]:
    job = ["-m", "torchtitan.train", "--module", "monarch_plugin.integrations.torchtitan", "--config",
           "llama3_debugmodel_cpu", "--training.steps", str(steps), "--training.seq_len", str(seq_len),
           "--training.local_batch_size", str(batch), "--metrics.log_freq", "1", "--debug.seed", "0",
           "--dump_folder", str(work), "--parallelism.tensor_parallel_degree", str(tp)]
    if side == "torchtitan":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(2 * k), *job,
                "--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree",
                str(k // tp)]
    fault = ["--monarch.fault", f"sigkill:replica=1:step={steps // 2}"] if side == "heal" else []
    return [sys.executable, *job, "--monarch.enable", "--monarch.replicas", "2", "--monarch.procs_per_replica",
            str(k), "--monarch.events_path", str(work / "events.jsonl"), *fault]


def heal_of(events: Path, k: int) -> dict:
    """The replacement's heal, from the donors' `heal` events (one per proc): bytes summed, the slowest proc's time."""
    heals = [e for e in map(json.loads, events.read_text().splitlines()) if e.get("event") == "heal"
             and e["step"] > 0]
    if len(heals) != k:
        raise RuntimeError(f"expected one heal per proc ({k}), the events show {len(heals)}")
    return {"bytes": sum(h["bytes"] for h in heals), "per_proc_bytes": [h["bytes"] for h in heals],
            "seconds": max(h["seconds"] for h in heals), "transfer_s": max(h["transfer_s"] for h in heals)}


def step_times(log: str, steps: int) -> list[float]:
    first: dict[int, float] = {}
    for stamp, step in STEP_LINE.findall(log):
        t = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
        first[int(step)] = min(t, first.get(int(step), t))
    if sorted(first) != list(range(1, steps + 1)):
        raise RuntimeError(f"the log shows steps {sorted(first)}, expected 1..{steps}")
    return intervals(first[s] for s in range(WARMUP, steps + 1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--procs-per-replica", type=int, default=2, help="procs in each of the 2 replicas")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel degree inside a replica (divides the procs)")
    p.add_argument("--heal", action="store_true", help="also time a replacement replica's heal")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=2, help="per data-parallel rank (training.local_batch_size)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each side, alternating")
    p.add_argument("--work", default="/tmp/monarch_plugin_torchtitan_bench")
    add_out(p)
    args = p.parse_args()
    work, k, tp = Path(args.work), args.procs_per_replica, args.tp
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = {"OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}

    def run(side: str, repeat: int) -> dict:
        folder = work / f"{side}-{repeat}"
        wall = launch(command(side, k, tp, args.steps, args.seq_len, args.batch, folder), folder, env)
        return {"steps": step_times((folder / "run.log").read_text(), args.steps), "wall_s": wall}

    sides = ("torchtitan", "monarch")
    runs = interleave({side: lambda repeat, side=side: run(side, repeat) for side in sides}, args.repeats,
                      shown=lambda r: {"median_s": statistics.median(r["steps"]), "p10_s": decile(r["steps"]),
                                       "wall_s": r["wall_s"]})
    results = {"replicas": 2, "procs_per_replica": k, "tp": tp, "steps": args.steps, "seq_len": args.seq_len,
               "batch_per_proc": args.batch, "repeats": args.repeats}
    for side, rs in runs.items():
        pooled = [s for r in rs for s in r["steps"]]
        results[side] = {"step_s": pooled, "median_s": [statistics.median(r["steps"]) for r in rs],
                         "wall_s": [r["wall_s"] for r in rs], "median_step_s": statistics.median(pooled),
                         "p10_step_s": decile(pooled)}
    results["ratio"] = results["monarch"]["median_step_s"] / results["torchtitan"]["median_step_s"]
    results["ratio_p10"] = results["monarch"]["p10_step_s"] / results["torchtitan"]["p10_step_s"]
    if args.heal:
        folder = work / "heal"
        launch(command("heal", k, tp, args.steps, args.seq_len, args.batch, folder), folder, env)
        results["heal"] = heal_of(folder / "events.jsonl", k)
    write_json(args.out, "torchtitan_overhead" + (f"_tp{tp}" if tp > 1 else ""), results)
    print(table(results))


def table(r: dict) -> str:
    def row(side: str, label: str) -> str:
        each = ", ".join(f"{x * 1000:.0f}" for x in r[side]["median_s"])
        walls = ", ".join(f"{x:.1f}" for x in r[side]["wall_s"])
        return (f"| {label} | {r[side]['median_step_s'] * 1000:.0f} ms | {r[side]['p10_step_s'] * 1000:.0f} ms "
                f"| {each} | {walls} |")

    k, tp = r["procs_per_replica"], r.get("tp", 1)
    shape = f"{k // tp} FSDP x {tp} TP" if tp > 1 else f"{k} FSDP"
    rows = [
        f"| llama3 debugmodel, 2 replicas x {shape} proc(s), seq {r['seq_len']}, batch {r['batch_per_proc']} per "
        f"{'data-parallel rank' if tp > 1 else 'proc'}, {r['steps']} steps | median step | 10th percentile "
        "| run medians (ms) | whole command per run (s) |",
        "|---|---|---|---|---|",
        row("torchtitan", f"torchtitan HSDP (torchrun, replicate 2 x shard {k // tp}"
                          f"{f' x tp {tp}' if tp > 1 else ''})"),
        row("monarch", "`--monarch.enable`"),
        f"| ratio monarch / torchtitan | {r['ratio']:.2f} | {r['ratio_p10']:.2f} | | |",
    ]
    if "heal" in r:
        h = r["heal"]
        rows.append(f"| heal of a replacement replica ({k} procs, each from its donor proc) | "
                    f"{h['seconds'] * 1000:.0f} ms for {h['bytes'] / 1e6:.1f} MB | tensors "
                    f"{h['transfer_s'] * 1000:.0f} ms | per proc "
                    f"{', '.join(f'{b / 1e6:.1f}' for b in h['per_proc_bytes'])} MB | |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
