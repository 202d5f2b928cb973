"""torchtitan's own integration flag sets under `--monarch.enable`, each with a replica SIGKILLed, or refused.

    python -m benchmarks.frontends.torchtitan_features [PATH] [--only tp2,compile]

PATH is the `features` list of torchtitan's integration tests at the installed version (torchtitan 0.3.0 ships it
as `torchtitan_recipes/tests/features.py`, the default): one config function per test, each a full
`Trainer.Config` written for GPUs. Each is made to run on this machine as this repo's `llama3_debugmodel_cpu` is
(the tokenizer and corpus under `recipes/data/torchtitan`, local batch 2, sequences of 128 x the context parallel
degree, float32, spmd_types' type checking off: on torch 2.13 it rejects FSDP's own autograd function with or
without the plugin; its parallelism, checkpoint, compile and other settings kept, its accumulation steps too), with
`--monarch.enable`: 2 replicas of 1 proc each, or of the set's tensor x context parallel degree on the
`partial_dtensor` backend (the sets pick `spmd_types`, which cannot FSDP-shard a replica over procs with torch
2.13: a set that shards explicitly is refused),
`--monarch.min_replicas 1`, and replica 1 SIGKILLing itself at step 4 of 12 (`--monarch.fault`, a real SIGKILL).
A `*_load` set resumes its `*_save` set's checkpoint at step 12 and trains to 20, the kill at 16 (one that loads
only the model starts again at step 1). A set *survives* when the run exits 0 with that death, a replacement healed
from the survivor, the first step committed where it should be, and the last logged loss of every replica that
finished equal; it is *refused* when the front end stops it before anything is spawned, with the reason it gives. A
set whose elastic run fails is run again without the plugin (torchrun, one replica's procs): when that fails too,
it is a set this machine cannot run.
This module is also the runs' `--module`: `--config <name>` is torchtitan's function of that name, converted
(`__getattr__`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness import REPO

FEATURES_ENV = "MONARCH_PLUGIN_TORCHTITAN_FEATURES"
ROOT_ENV = "MONARCH_PLUGIN_TORCHTITAN_ROOT"
STEPS, KILL_AT = 12, 4


def _features(path: str):
    """torchtitan's features module, loaded from `path` as the package it belongs to (it imports `from . import`)."""
    import torchtitan_recipes.tests  # noqa: F401 - the package its relative imports resolve in

    spec = importlib.util.spec_from_file_location("torchtitan_recipes.tests.features", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _default_path() -> str:
    import torchtitan_recipes.tests

    return str(Path(torchtitan_recipes.tests.__file__).parent / "features.py")


def _loads(name: str) -> str | None:
    """The set whose checkpoint a `*_load` set resumes (torchtitan's runner runs them one after the other)."""
    return name[: -len("_load")] + "_save" if name.endswith("_load") else None


def elastic(name: str, base, root: Path):
    """`base` (torchtitan's `Trainer.Config` of set `name`) made to run here, with `--monarch.enable` and a kill;
    its dump folder is `root/name` (a `*_load` set's is its `*_save` set's, whose checkpoint it resumes at step
    `STEPS`, then trains 8 steps more with the kill 4 steps in)."""
    from monarch_plugin.integrations.torchtitan.config import MonarchConfig
    from monarch_plugin.integrations.torchtitan.config_registry import llama3_debugmodel_cpu
    from monarch_plugin.integrations.torchtitan.trainer import MonarchTrainer

    cpu, saved = llama3_debugmodel_cpu(), _loads(name)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    # The sets are written for GPUs: `global_batch_size` over 2 of them asks for accumulation steps, kept here.
    accumulate = max(1, base.training.global_batch_size // (2 * base.training.local_batch_size))
    shard, tp = base.parallelism.data_parallel_shard_degree, base.parallelism.tensor_parallel_degree
    cp = base.parallelism.context_parallel_degree
    dp = 1 if shard in (1, -1) else 2  # the sets' spmd_types backend cannot shard a replica (refused)
    training = dataclasses.replace(base.training, local_batch_size=2, seq_len=128 * cp,  # CPU CP: 128 per proc
                                   steps=STEPS + 8 * bool(saved),
                                   mixed_precision_param="float32",
                                   global_batch_size=2 * 2 * dp * accumulate if accumulate > 1 else -1)
    # A TP or CP set's spmd_types backend fails on torch 2.13 with or without the plugin (torchrun, 2 procs: "all
    # parameters must be DTensors on the full SPMD mesh"): it runs on the partial_dtensor backend here.
    parallelism = dataclasses.replace(base.parallelism, data_parallel_shard_degree=-1 if shard == -1 else dp,
                                      **({"spmd_backend": "partial_dtensor"} if tp * cp > 1 else {}))
    # spmd_types' type checking rejects FSDP's own RegisterPostBackwardFunction on torch 2.13, with or without
    # the plugin (torchrun, 1 proc): a checking aid, off here so that the set's training features run.
    debug = dataclasses.replace(base.debug, spmd_typechecking=False)
    checkpoint = base.checkpoint
    if base.checkpoint.initial_load_path:  # into torchtitan's runner's output (`.../<folder>/step-10/`): the
        folder = Path(base.checkpoint.initial_load_path.rstrip("/")).parent.name  # save set's, here
        checkpoint = dataclasses.replace(checkpoint, initial_load_path=str(root / saved / folder / f"step-{STEPS}"))
    return MonarchTrainer.Config(**{
        **fields, "hf_assets_path": cpu.hf_assets_path, "dump_folder": str(root / (saved or name)),
        "training": training, "parallelism": parallelism, "debug": debug, "checkpoint": checkpoint,
        "dataloader": cpu.dataloader if type(base.dataloader) is type(cpu.dataloader) else base.dataloader,
        "monarch": MonarchConfig(enable=True, replicas=2, min_replicas=1, procs_per_replica=dp * cp * tp,
                                 fault=f"sigkill:replica=1:step={KILL_AT + STEPS * bool(saved)}",
                                 join_timeout_s=600),
    })


def __getattr__(name: str):
    """`--config <name>`: torchtitan's config function of that name, converted by `elastic`."""
    if name.startswith("__"):
        raise AttributeError(name)
    module = _features(os.environ[FEATURES_ENV])
    fn = getattr(module, name, None)
    if fn is None:
        raise AttributeError(name)

    def converted():
        return elastic(name, fn(), Path(os.environ.get(ROOT_ENV, "runs/torchtitan_features")))

    return converted


def _losses(text: str) -> dict[str, float]:
    """Each replica's last logged loss, from torchtitan's `step: N loss: X` lines (`[replica R]` prefixed)."""
    last: dict[str, float] = {}
    for line in re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines():  # its metrics lines are coloured
        m = re.search(r"\br(\d+)_replica\b.*step:\s*(\d+)\s+loss:\s*([0-9.]+)", line)
        if m:
            last[f"replica {m.group(1)}"] = float(m.group(3))
    return last


def _error(text: str) -> str | None:
    """The last line of `text` naming an error, shortened."""
    error = [line for line in text.splitlines() if "Error" in line or "error:" in line]
    return error[-1].strip()[:200] if error else None


def _plain(name: str, procs: int, env: dict, root: Path) -> str | None:
    """Set `name` without the plugin (`--monarch.no-enable`, torchrun with one replica's procs): None when it
    trains, else its error, which tells a set this machine's torch cannot run from one the plugin breaks."""
    out = root / f"{name}.plain"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs), "-m", "torchtitan.train",
           "--module", __spec__.name, "--config", name, "--monarch.no-enable",
           "--dump_folder", str(out)]
    with open(out / "run.log", "w") as log:
        rc = subprocess.call(cmd, cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=900)
    return None if rc == 0 else (_error((out / "run.log").read_text()) or f"exit {rc}")


def _run(name: str, path: str, root: Path) -> str:
    from monarch_plugin.events import read_events
    from monarch_plugin.integrations.torchtitan.config import validate

    module = _features(path)
    try:
        config = elastic(name, getattr(module, name)(), root)
        validate(config)
    except ImportError as e:
        return f"not run: {str(e).splitlines()[0]}"
    except ValueError as e:  # the front end's refusal
        return f"refused: {str(e).splitlines()[0]}"
    if not _loads(name):  # a set's own run starts from nothing (a load set resumes its save set's folder)
        shutil.rmtree(root / name, ignore_errors=True)
    out = root / f"{name}.run"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    events = out / "monarch_events.jsonl"
    env = {**os.environ, FEATURES_ENV: path, ROOT_ENV: str(root),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torchtitan.train", "--module", __spec__.name, "--config", name,
           "--monarch.events_path", str(events)]
    with open(out / "run.log", "w") as log:
        try:
            rc = subprocess.call(cmd, cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=900)
        except subprocess.TimeoutExpired:
            return f"FAILED: no end within 900 s, see {out / 'run.log'}"
    text = (out / "run.log").read_text()
    if rc != 0:
        procs = config.monarch.procs_per_replica
        plain = _plain(name, procs, env, root)
        if plain is not None:
            return f"fails without the plugin too (torchrun, {procs} proc(s)): {plain}"
        return f"FAILED: exit {rc}: {_error(text) or 'see ' + str(out / 'run.log')}"
    found = read_events(str(events))
    deaths = [e for e in found if e["event"] == "death"]
    heals = [e for e in found if e["event"] == "heal" and any(r >= 2 for r in e.get("recipients", []))]
    finished = {f"replica {e['replica']}" for e in found if e["event"] == "finished"}
    losses = {r: loss for r, loss in _losses(text).items() if r in finished}
    problems = []
    if [d["replica"] for d in deaths] != [1]:
        problems.append(f"deaths {[d['replica'] for d in deaths]}, not replica 1's")
    if not heals:
        problems.append("no replacement was healed")
    # A `*_load` set resumes the save set's step, unless it loads only the model (its steps then start at 1).
    resumes = _loads(name) and not (config.checkpoint.initial_load_path and config.checkpoint.initial_load_model_only)
    first = min((e["step"] for e in found if e["event"] == "first_commit"), default=None)
    if first != 1 + STEPS * bool(resumes):
        problems.append(f"first committed step {first}, not {1 + STEPS * bool(resumes)}")
    if len(set(losses.values())) != 1:  # (a replacement healed at the last step has no step left to log)
        problems.append(f"last losses differ: {losses}")
    if problems:
        return "FAILED: " + "; ".join(problems)
    resumed = (f", resumed after step {STEPS}" if resumes else
               f", its model loaded from step {STEPS}" if _loads(name) else "")
    return (f"survived: replica 1 killed, a replacement healed at step {heals[-1]['step']}{resumed}, the same last "
            f"loss on all ({next(iter(losses.values()))})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path", nargs="?", default=None, help="torchtitan's integration features list (features.py)")
    p.add_argument("--only", default=None, help="comma-separated words picking sets by name")
    p.add_argument("--out", type=Path, default=Path("runs/torchtitan_features"))
    args = p.parse_args()
    import torchtitan

    path = str(Path(args.path or _default_path()).resolve())
    module = _features(path)
    names = [n for n, f in vars(module).items() if callable(f) and getattr(f, "__module__", "") == module.__name__
             and not n.startswith("_")]
    if args.only:
        names = [n for n in names if any(w in n for w in args.only.split(","))]
    rows = []
    for name in names:
        t0 = time.monotonic()
        outcome = _run(name, path, args.out.resolve())
        rows.append((name, outcome))
        print(f"{name}: {outcome} ({time.monotonic() - t0:.0f} s)", flush=True)
    print(f"\ntorchtitan {torchtitan.__version__ if hasattr(torchtitan, '__version__') else ''} ({path})\n")
    print("| flag set | outcome |\n|---|---|")
    for name, outcome in rows:
        print(f"| `{name}` | {outcome} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(dict(rows), indent=1))


if __name__ == "__main__":
    main()
