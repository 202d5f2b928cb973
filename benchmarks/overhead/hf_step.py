"""Step time of one HF `Trainer.train()` under `torchrun` (DDP) and under `monarch-run` + `MonarchElasticCallback`.

    python -m benchmarks.overhead.hf_step --replicas 2 --steps 60 --repeats 3 --out benchmarks/results

What the elastic callback costs a failure-free HF run: the same script (a GPT-2 built from `GPT2Config`, HF's
AdamW and schedule, random token data), the same per-device batch and `max_steps`, on the same CPU, once as
`torchrun --nproc-per-node N -m this.module` (accelerate's DDP; the callback says it is inactive) and once as
`monarch-run --replicas N -m this.module`. One invocation runs both sides one after the other, alternating
`--repeats` times, so the ratio shares one machine state. The main process of each run appends
"<global step> <unix time>" per step to steps.txt; a run's step time is the median interval after a warm-up, a
side's the median over its runs. Each process uses one thread (OMP_NUM_THREADS=1 on both sides, as torchrun
sets it), so N replicas need N cores. Writes <out>/hf_overhead.json and prints a markdown table (pasted into
docs/hf.md).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from benchmarks.harness import REPO, add_out, alternate, alternate_table, write_json

SIZES = {"gpt2-tiny": dict(n_embd=32, n_layer=2, n_head=2), "gpt2-4m": dict(n_embd=256, n_layer=4, n_head=4),
         "gpt2-20m": dict(n_embd=512, n_layer=6, n_head=8)}
VOCAB, SEQ = 2048, 128


def train(size: str, steps: int, batch: int, work: Path) -> None:
    """One training run: what every process of either launcher executes."""
    import torch
    from torch.utils.data import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from monarch_plugin.integrations.hf import MonarchElasticCallback

    class Tokens(Dataset):
        def __len__(self) -> int:
            return 1 << 16

        def __getitem__(self, i: int) -> dict:
            x = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": x, "labels": x}

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                with open(work / "steps.txt", "a") as f:
                    f.write(f"{state.global_step} {time.time()}\n")

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, **SIZES[size]))
    args = TrainingArguments(output_dir=str(work / "hf"), per_device_train_batch_size=batch, max_steps=steps,
                             logging_steps=10 * steps, save_strategy="no", report_to="none", disable_tqdm=True,
                             use_cpu=True, seed=0)
    Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[MonarchElasticCallback(), StepClock()]).train()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--replicas", type=int, default=2, help="torchrun --nproc-per-node / monarch-run --replicas")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--size", choices=tuple(SIZES), default="gpt2-4m")
    p.add_argument("--batch", type=int, default=8, help="per_device_train_batch_size")
    p.add_argument("--repeats", type=int, default=3, help="runs of each side, alternating")
    p.add_argument("--train", action="store_true", help="run one training process (the launchers use this)")
    p.add_argument("--work", default="/tmp/monarch_plugin_hf_bench")
    add_out(p)
    args = p.parse_args()
    work = Path(args.work)
    if args.train:
        train(args.size, args.steps, args.batch, work)
        return
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    script = ["--train", "--size", args.size, "--steps", str(args.steps), "--batch", str(args.batch)]
    launchers = {
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone",
                     f"--nproc-per-node={args.replicas}", "-m", __spec__.name],
        "monarch-run": [sys.executable, "-m", "monarch_plugin.tools.cli", "--replicas", str(args.replicas),
                        "--events", "events.jsonl", "-m", __spec__.name],
    }
    # One thread per process on both sides (both launchers' default), whatever this shell says; each run's folder
    # is its working directory, so the checkout goes on the path for `-m`.
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    commands = {side: [*launcher, *script, "--work", "."] for side, launcher in launchers.items()}
    results = {"replicas": args.replicas, "steps": args.steps, "size": args.size, "batch_per_replica": args.batch,
               "repeats": args.repeats, **alternate(commands, args.repeats, args.steps, work, env)}
    header = f"{args.size}, {args.replicas} CPU replicas, batch {args.batch}/replica, {args.steps} steps"
    table = alternate_table(results, {"torchrun": "`torchrun`", "monarch-run": "`monarch-run`"}, header)
    write_json(args.out, "hf_overhead", results)
    print(table)


if __name__ == "__main__":
    main()
