"""The Trainer features HF users set most, each trained under `monarch-run` with a replica SIGKILLed mid-epoch.

    python -m benchmarks.frontends.hf_features [--only bf16,tensorboard] [--out runs/hf_features]

Each feature is `tests/workloads/hf_train.py` (a tiny GPT-2 from `GPT2Config`, SGD with momentum and a step-wise
LR schedule, the per-epoch sample counter of `--count`) with that feature's `TrainingArguments`, run twice: once
under plain `python` with the whole global batch in one process (the reference: how many optimizer steps HF takes),
and once under `monarch-run --replicas 2` with replica 1 SIGKILLed from outside once it has committed step 4 of
the first epoch (each step sleeps 0.5 s there, so the replacement joins well before the end). A feature *survives*
when the elastic run exits 0 with a death and a replacement, `train()` returned on the survivor and the
replacement at the reference's `global_step` with identical weights, every sample was in exactly one committed
step of each epoch, and the feature's own check holds (below); it is *refused* when the run stops before training
with an error naming the fix. Prints one row per feature (docs/hf.md has the
table); the runs' logs stay under `--out`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from benchmarks.harness import REPO, kill, progress, reap, spawned, wait_for

WORKLOAD = REPO / "tests" / "workloads" / "hf_train.py"  # a script passed by path: the HF tests' own
REPLICAS, BATCH, SAMPLES, EPOCHS, KILL_AFTER, STEP_SLEEP_S = 2, 4, 96, 3, 4, 0.5


def _checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "hf").glob("checkpoint-*"))


def _best_loaded(out: Path, results: dict) -> str:
    history = results["0"]["log_history"]
    evals = [e for e in history if "eval_loss" in e]
    kept = _checkpoints(out)
    assert evals, "no evaluation ran"
    assert len(kept) <= 2, f"save_total_limit=2 kept {kept}"
    return f"{len(evals)} evaluations, checkpoints kept {kept}"


def _tensorboard(out: Path, results: dict) -> str:
    files = list((out / "hf").rglob("events.out.tfevents.*"))
    assert files, "no TensorBoard event file"
    return f"{len(files)} TensorBoard event file(s)"


def _tokens_seen(out: Path, results: dict) -> str:
    seen = [e["num_input_tokens_seen"] for e in results["0"]["log_history"] if "num_input_tokens_seen" in e]
    assert seen, "num_input_tokens_seen not logged"
    return f"num_input_tokens_seen {seen[-1]} at the end"


FEATURES: dict[str, tuple[dict, tuple[str, ...], Callable[[Path, dict], str] | None]] = {
    # name: (TrainingArguments fields, more script arguments, the feature's own check)
    "gradient_accumulation_steps=2": ({}, ("--accumulate", "2"), None),  # the counter's lr counts it
    'eval_strategy="steps", load_best_model_at_end, save_total_limit=2': (
        {"eval_strategy": "steps", "eval_steps": 4, "save_strategy": "steps", "save_steps": 4,
         "load_best_model_at_end": True, "save_total_limit": 2}, ("--eval", "16"), _best_loaded),
    "dataloader_num_workers=2": ({}, ("--workers", "2"), None),
    "bf16 on CPU": ({"bf16": True}, (), None),
    'report_to="tensorboard"': ({"report_to": "tensorboard"}, (), _tensorboard),
    "include_num_input_tokens_seen": ({"include_num_input_tokens_seen": True}, (), _tokens_seen),
    "torch_compile": ({"torch_compile": True}, (), None),
}


def _results(out: Path) -> dict[str, dict]:
    return {p.stem.removeprefix("result-"): json.loads(p.read_text()) for p in out.glob("result-*.json")}


def _script(out: Path, fields: dict, more: tuple[str, ...], replicas: int, batch: int, sleep: float = 0.0) -> list[str]:
    return [str(WORKLOAD), "--out", str(out), "--count", "--max-grad-norm", "0", "--replicas", str(replicas),
            "--batch", str(batch), "--samples", str(SAMPLES), "--epochs", str(EPOCHS), "--logging-steps", "2",
            "--step-sleep", str(sleep), "--training-args", json.dumps(fields), *more]


def _reference(root: Path, fields: dict, more: tuple[str, ...]) -> int:
    out = root / "reference"
    out.mkdir(parents=True)
    with open(out / "run.log", "w") as log:
        rc = subprocess.call([sys.executable, *_script(out, fields, more, 1, BATCH * REPLICAS)], cwd=out,
                             stdout=log, stderr=subprocess.STDOUT, timeout=900)
    if rc != 0:
        raise RuntimeError(f"the reference run failed (rc {rc}); see {out / 'run.log'}")
    return _results(out)["single"]["global_step"]


def _elastic(root: Path, fields: dict, more: tuple[str, ...], steps: int, check) -> str:
    out, events = root / "elastic", root / "elastic" / "monarch_events.jsonl"
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "monarch_plugin.tools.cli", "--replicas", str(REPLICAS), "--min-replicas", "1",
           "--join-timeout", "600", "--collective-timeout", "300", "--events", str(events),
           "--checkpoint-dir", str(out / "ckpt"), *_script(out, fields, more, REPLICAS, BATCH, STEP_SLEEP_S)]
    log = open(out / "run.log", "w")
    proc = subprocess.Popen(cmd, cwd=out, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        try:
            wait_for(f"replica 1 committing step {KILL_AFTER}", lambda: progress(out, "1") >= KILL_AFTER, proc, 900)
        except RuntimeError as e:
            text = (out / "run.log").read_text()
            refused = [line for line in text.splitlines() if "Error" in line or "refuse" in line]
            return f"refused? {e}: {refused[-1] if refused else 'see ' + str(out / 'run.log')}"
        killed_at = progress(out, "1")
        kill(spawned(events)[1][0], events, replica=1)
        if proc.wait(timeout=900) != 0:
            return f"FAILED: rc {proc.returncode}, see {out / 'run.log'}"
    finally:
        reap(proc, spawned(events))
        log.close()
    results = _results(out)
    problems = []
    if set(results) != {"0", "2"}:
        problems.append(f"train() returned on replicas {sorted(results)}, not the survivor 0 and replacement 2")
    if {r["global_step"] for r in results.values()} != {steps}:
        problems.append(f"global_step {[r['global_step'] for r in results.values()]}, the reference took {steps}")
    if len({r["checksum"] for r in results.values()}) != 1:
        problems.append("the replicas' weights differ")
    for ident, r in results.items():
        counts = torch.tensor(r["counts"])
        if not torch.allclose(counts, torch.ones_like(counts), atol=1e-2):
            problems.append(f"replica {ident}: samples not each trained once per epoch "
                            f"(counts {counts.min().item():.3f}..{counts.max().item():.3f})")
    note = ""
    if check is not None and not problems:
        try:
            note = check(out, results)
        except AssertionError as e:
            problems.append(str(e))
    if problems:
        return "FAILED: " + "; ".join(problems)
    return f"survived: killed after step {killed_at}, {steps} steps, identical replicas{', ' + note if note else ''}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=None, help="comma-separated words picking features by name")
    p.add_argument("--out", type=Path, default=Path("runs/hf_features"))
    args = p.parse_args()
    import transformers

    chosen = {name: spec for name, spec in FEATURES.items()
              if args.only is None or any(word in name for word in args.only.split(","))}
    rows = []
    for i, (name, (fields, more, check)) in enumerate(chosen.items()):
        root = args.out / f"feature{i}"
        if root.exists():
            subprocess.call(["rm", "-rf", str(root)])
        t0 = time.monotonic()
        try:
            outcome = _elastic(root, fields, more, _reference(root, fields, more), check)
        except Exception as e:  # one feature's failure is that row's, not the table's
            outcome = f"FAILED: {e}"
        rows.append((name, outcome, time.monotonic() - t0))
        print(f"{name}: {outcome} ({rows[-1][2]:.0f} s)", flush=True)
    print(f"\ntransformers {transformers.__version__}, torch {torch.__version__}, {REPLICAS} replicas x batch {BATCH}, "
          f"{SAMPLES} samples, {EPOCHS} epochs, replica 1 SIGKILLed after step {KILL_AFTER}\n")
    print("| feature | outcome |\n|---|---|")
    for name, outcome, _ in rows:
        print(f"| {name} | {outcome} |")


if __name__ == "__main__":
    main()
