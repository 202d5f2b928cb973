"""`monarch-run`: torchrun's job, elastic, on Monarch.

    monarch-run --replicas 4 --min-replicas 2 [--procs-per-replica k] train.py --lr 3e-4
    monarch-run --replicas 4 -m my_pkg.train --lr 3e-4
    monarch-run --hosts tcp://10.0.0.2:26600,tcp://10.0.0.3:26600 --replicas 4 train.py

The calling process becomes the single controller; each replica's procs get the usual torch.distributed
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) scoped to their own replica group, and
reach the elastic runtime through `monarch_plugin.ElasticLoop`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from monarch_plugin.config import (BACKENDS, BATCH_POLICIES, ElasticConfig, cli_flag, field_default, field_docs,
                                   spell_fields)
from monarch_plugin.errors import ConfigError, ElasticRunAborted, ReplicaCodeError

__all__ = ["main", "build_parser"]

_CHOICES = {"backend": BACKENDS, "batch_policy": BATCH_POLICIES}
_TYPES = {"int": int, "int | None": int, "float": float, "str": str, "str | None": str,
          "list[str]": lambda text: [item.strip() for item in text.split(",") if item.strip()]}
_NOT_FLAGS = {"env"}  # the worker environment is the caller's own (export it, as under torchrun)


def build_parser() -> argparse.ArgumentParser:
    """One flag per `ElasticConfig` field, its help the field's docstring and its default the field's."""
    p = argparse.ArgumentParser(
        prog="monarch-run",
        description="Run a training script on elastic replica groups supervised by a Monarch controller.",
    )
    for f in dataclasses.fields(ElasticConfig):
        if f.name in _NOT_FLAGS:
            continue
        flag = cli_flag(f.name)
        # The docstrings name other fields in ``double backticks``: here they are flags too.
        doc = spell_fields(field_docs()[f.name].replace("``", "`"), cli_flag)
        if f.type == "bool":
            p.add_argument(flag, dest=f.name, action="store_true", help=doc)
            continue
        if f.type == "bool | None":  # --flag / --no-flag, and neither leaves the field's automatic choice
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=doc)
            continue
        default = field_default(f)
        p.add_argument(flag, dest=f.name, type=_TYPES[f.type], default=default, choices=_CHOICES.get(f.name),
                       metavar=None if f.name in _CHOICES else flag[2:].upper().replace("-", "_"),
                       help=doc if default in (None, []) else f"{doc} (default: %(default)s)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="what the run logs: INFO (default) the run's start and end and one line for each failure "
                        "(what happened, what the run did); DEBUG every event; WARNING only failures and give-ups")
    p.add_argument("--quiet", dest="log_level", action="store_const", const="WARNING", help="--log-level WARNING")
    p.add_argument("-m", dest="module", action="store_true", help="run the target as a module (python -m)")
    p.add_argument("target", help="training script (or module with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the training script")
    return p


def config_from_args(ns: argparse.Namespace) -> ElasticConfig:
    return ElasticConfig(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(ElasticConfig)
                            if f.name not in _NOT_FLAGS})


def _spelled(error: Exception) -> str:
    return spell_fields(str(error), cli_flag)


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from monarch_plugin.target import Target

    try:
        config = config_from_args(ns)
        target = Target.module(ns.target, ns.args) if ns.module else Target.script(ns.target, ns.args)
    except ConfigError as e:
        print(f"monarch-run: error: {_spelled(e)}", file=sys.stderr)
        return 2
    from monarch_plugin import forkserver

    forkserver.for_run(config, target.imports)  # its imports run beside the controller's, which follow
    from monarch_plugin.controller import ElasticController

    try:
        result = ElasticController(config, target).run()
    except ConfigError as e:
        print(f"monarch-run: error: {_spelled(e)}", file=sys.stderr)
        return 2
    except (ElasticRunAborted, ReplicaCodeError) as e:
        print(f"monarch-run: {_spelled(e)}", file=sys.stderr)
        return 1
    from monarch_plugin.report import run_summary

    for line in run_summary(result):
        print(f"monarch-run: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
