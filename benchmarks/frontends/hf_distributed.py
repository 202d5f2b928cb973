"""Transformers' own distributed Trainer check, `tests/trainer/test_trainer_distributed.py`, under `monarch-run`.

    python -m benchmarks.frontends.hf_distributed PATH [--replicas 2]

PATH is that file from a checkout of transformers' repository at the installed version (PyPI's packages carry no
tests, and CI cannot reach code hosts, so this is not part of the suite). HF runs its `__main__` block under
`torchrun --nproc_per_node N`; here `monarch-run --replicas N` runs it, every `Trainer` given a
`MonarchElasticCallback` as a user adds one (`callbacks=[MonarchElasticCallback()]`): every replica evaluates and
predicts datasets of 101, 40 and 7 samples and checks that it got every sample back in order (with and without
`eval_accumulation_steps`), then trains one step on a one-sample stream. The script's exit status is the check's;
prints its log and the verdict.
"""

from __future__ import annotations

import argparse
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path


def _as_replica(path: str, argv: list[str]) -> None:
    """In a replica: every Trainer gets the callback, then the check runs as its `__main__`."""
    import functools

    from transformers import Trainer

    from monarch_plugin.integrations.hf import MonarchElasticCallback

    original = Trainer.__init__

    @functools.wraps(original)
    def init(self, *args, **kwargs):
        kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), MonarchElasticCallback()]
        original(self, *args, **kwargs)

    Trainer.__init__ = init
    sys.argv = [path, *argv]
    runpy.run_path(path, run_name="__main__")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--as-replica":
        return _as_replica(sys.argv[2], sys.argv[3:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path", type=Path, help="tests/trainer/test_trainer_distributed.py of transformers' repository")
    p.add_argument("--replicas", type=int, default=2)
    args = p.parse_args()
    import transformers

    if not args.path.is_file():
        sys.exit(f"{args.path} not found: give tests/trainer/test_trainer_distributed.py of a checkout of "
                 "github.com/huggingface/transformers")
    with tempfile.TemporaryDirectory() as scratch:
        cmd = [sys.executable, "-m", "monarch_plugin.tools.cli", "--replicas", str(args.replicas),
               "--events", os.path.join(scratch, "monarch_events.jsonl"), "--checkpoint-dir",
               os.path.join(scratch, "ckpt"), str(Path(__file__).resolve()), "--as-replica", str(args.path.resolve()),
               "--output_dir", os.path.join(scratch, "out"), "--report_to", "none", "--use_cpu", "true"]
        rc = subprocess.call(cmd, cwd=scratch)
    print(f"\ntransformers {transformers.__version__}: {args.path.name} under monarch-run --replicas "
          f"{args.replicas}: {'passed' if rc == 0 else f'FAILED (exit {rc})'}")
    sys.exit(rc)


if __name__ == "__main__":
    main()
