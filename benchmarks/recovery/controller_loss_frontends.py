"""How `controller_loss.py` launches each front end, kills its controller and relaunches it with the framework's own
resume: each one the small job of its lost-controller e2e test (tests/e2e/test_<front end>.py, "controller_lost"),
its periodic checkpoint every `--every` steps the framework's way.

  plain       `monarch-run --replicas R ... benchmarks/workloads/mlp.py --mode elastic` (ElasticLoop), a checkpoint
              every `--every` steps (`--checkpoint-steps`); relaunch: the same with `--resume auto`. Progress: each
              replica's "<0-based step> <time>" lines in out/steps-<replica>.txt.
  lightning   `python tests/workloads/lightning_fit.py` (the process is the controller), 3 devices x batch 8 of 240
              samples, 4 epochs (40 steps), 0.1 s a step, `ModelCheckpoint(every_n_train_steps=...)` into out/ckpts;
              relaunch: the same with `--resume <the newest .ckpt there>` (`fit(ckpt_path=...)`). Progress: each
              replica's global_step in out/progress-<replica>.
  hf          `monarch-run --replicas 3 tests/workloads/hf_train.py`, AdamW, 3 x batch 4 of 96 samples, 4 epochs (32
              steps), 0.2 s a step, `save_steps`; relaunch: the same with `--resume true`
              (`train(resume_from_checkpoint=True)`: the newest checkpoint-N in out/hf). Progress: as Lightning's.
  torchtitan  `python -m torchtitan.train --module torchtitan_probe --config llama3_probe` (2 replicas of 2 FSDP
              procs, 2 transformer blocks), 25 steps of 64 tokens, 0.4 s after each, `--checkpoint.enable
              --checkpoint.interval`; relaunch: the same command, so `--checkpoint.enable` loads the newest complete
              step-N of the same `--checkpoint.folder`. Progress: each proc's JSON line per committed (1-based) step
              in out/probe/steps-<replica>-<local rank>.jsonl.

`controller_loss_save_s` 0 (the `periodic` variant) is `--controller-loss-save 0` for monarch-run (plain, HF),
`--monarch.controller_loss_save_s 0` for torchtitan and `MonarchStrategy(controller_loss_save_s=0)` for Lightning:
lightning_fit.py takes no such flag, so it runs through `LIGHTNING`, which gives the strategy that keyword and runs
the script as its `__main__` (so Lightning pickles its classes by value, as under `python lightning_fit.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from benchmarks.harness import BIN, REPO, WORKLOADS, progress, step_log

__all__ = ["FRONT_ENDS", "FrontEnd"]

TESTS = REPO / "tests" / "workloads"
"""The e2e tests' workloads, run by path as the tests run them."""

LIGHTNING = """\
import functools, os, runpy, sys
save_s, script = sys.argv[1], sys.argv[2]
if save_s != "default":
    import monarch_plugin.integrations.lightning as lightning
    lightning.MonarchStrategy = functools.partial(lightning.MonarchStrategy, controller_loss_save_s=float(save_s))
sys.path.insert(0, os.path.dirname(script))
sys.argv = sys.argv[2:]
runpy.run_path(script, run_name="__main__")
"""
"""`python -c LIGHTNING <controller_loss_save_s | default> lightning_fit.py ARGS...`: the script, its strategy given
`controller_loss_save_s` (lightning_fit.py builds `MonarchStrategy(...)` by the name it imports)."""

Command = Callable[[Path, Path, Path, Optional[float], bool, argparse.Namespace], list[str]]
"""(run folder, its out folder, events file, controller_loss_save_s (None: the default), resume?, args) -> argv."""


@dataclass(frozen=True)
class FrontEnd:
    framework: str
    """The module it needs ("" for none): checked before anything starts."""
    steps: Callable[[argparse.Namespace], int]
    """The run's length in steps: `--at` must leave some."""
    command: Command
    progress: Callable[[Path], int]
    """Steps replica 0 committed so far, from the out folder: the kill comes once it is `--at`."""
    committed: Callable[[Path], int]
    """Steps committed by the furthest replica, from the out folder (read before the relaunch writes there)."""
    first_offset: int = 0
    """A relaunch that resumed N steps in commits step N + this first (its `first_commit` event): torchtitan counts
    steps from 1."""
    env: dict[str, str] = field(default_factory=dict)


def _save_flag(flag: str, save_s: Optional[float]) -> list[str]:
    return [] if save_s is None else [flag, f"{save_s:g}"]


# -- plain: ElasticLoop under monarch-run ---------------------------------------------------------------------------

def _plain(run: Path, out: Path, events: Path, save_s: Optional[float], resume: bool, args) -> list[str]:
    return [str(BIN / "monarch-run"), "--replicas", str(args.replicas), "--events", str(events),
            "--checkpoint-dir", str(run / "ckpt"), "--checkpoint-steps", str(args.every),
            *_save_flag("--controller-loss-save", save_s), *(["--resume", "auto"] if resume else []),
            str(WORKLOADS / "mlp.py"), "--mode", "elastic", "--size", args.size, "--steps", str(args.steps),
            "--out", str(out)]


def _plain_committed(out: Path) -> int:
    return max(s for path in out.glob("steps-*.txt") for s, _ in step_log(path)) + 1  # 0-based steps


# -- Lightning: the user's process is the controller ---------------------------------------------------------------

LIGHTNING_STEPS = 4 * 240 // (3 * 8)


def _lightning(run: Path, out: Path, events: Path, save_s: Optional[float], resume: bool, args) -> list[str]:
    newest = []
    if resume:  # what a user passes to fit(ckpt_path=...): the newest file in ModelCheckpoint's folder
        newest = ["--resume", str(max((out / "ckpts").glob("*.ckpt"), key=lambda p: p.stat().st_mtime))]
    return [sys.executable, "-c", LIGHTNING, "default" if save_s is None else f"{save_s:g}",
            str(TESTS / "lightning_fit.py"), "--out", str(out), "--events", str(events), "--devices", "3",
            "--batch", "8", "--epochs", "4", "--samples", "240", "--checkpoint-every", str(args.every),
            "--step-sleep", "0.1", *newest]


def _replica_progress(out: Path) -> int:
    return max((progress(out, p.name.removeprefix("progress-")) for p in out.glob("progress-*")), default=-1)


# -- HF: Trainer + MonarchElasticCallback under monarch-run -------------------------------------------------------

HF_STEPS = 4 * 96 // (3 * 4)


def _hf(run: Path, out: Path, events: Path, save_s: Optional[float], resume: bool, args) -> list[str]:
    return [str(BIN / "monarch-run"), "--replicas", "3", "--events", str(events), "--checkpoint-dir", str(run / "ckpt"),
            "--join-timeout", "120", *_save_flag("--controller-loss-save", save_s), str(TESTS / "hf_train.py"),
            "--out", str(out), "--optimizer", "hf", "--samples", "96", "--epochs", "4", "--save-steps",
            str(args.every), "--replicas", "3", "--batch", "4", "--step-sleep", "0.2",
            *(["--resume", "true"] if resume else [])]


# -- torchtitan: `python -m torchtitan.train` is the controller ----------------------------------------------------

TITAN_STEPS = 25


def _torchtitan(run: Path, out: Path, events: Path, save_s: Optional[float], resume: bool, args) -> list[str]:
    # The relaunch is the same command: --checkpoint.enable loads the newest complete step-N of the folder.
    return [sys.executable, "-m", "torchtitan.train", "--module", "torchtitan_probe", "--config", "llama3_probe",
            "--dump_folder", str(out), "--monarch.events_path", str(events), "--training.steps", str(TITAN_STEPS),
            "--training.seq_len", "64", "--debug.seed", "7", "--metrics.log_freq", "1", "--checkpoint.enable",
            "--checkpoint.interval", str(args.every), "--checkpoint.last-save-model-only", "--probe.step_sleep",
            "0.4", *_save_flag("--monarch.controller_loss_save_s", save_s)]


def _titan_records(out: Path) -> list[dict]:
    return [json.loads(line) for path in (out / "probe").glob("steps-*.jsonl")
            for line in path.read_text().splitlines() if line.strip()]


def _titan_progress(out: Path) -> int:
    path = out / "probe" / "steps-0-0.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


_ON_PATH = {"PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH", "")]))}

FRONT_ENDS: dict[str, FrontEnd] = {
    "plain": FrontEnd("", lambda args: args.steps, _plain, lambda out: len(step_log(out / "steps-0.txt")),
                      _plain_committed),
    "lightning": FrontEnd("lightning", lambda args: LIGHTNING_STEPS, _lightning, lambda out: progress(out, 0),
                          _replica_progress, env=_ON_PATH),
    "hf": FrontEnd("transformers", lambda args: HF_STEPS, _hf, lambda out: progress(out, 0), _replica_progress),
    "torchtitan": FrontEnd("torchtitan", lambda args: TITAN_STEPS, _torchtitan, _titan_progress,
                           lambda out: max(r["step"] for r in _titan_records(out)), first_offset=1,
                           env={**_ON_PATH, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}),
}
"""Each front end's recipe, in the order the benchmark runs them."""
