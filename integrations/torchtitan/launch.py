"""The launching side of an elastic torchtitan job: the process that ran `python -m torchtitan.train`.

With `--monarch.enable`, `MonarchTrainer.Config.build()` hands torchtitan's `main()` an `ElasticLauncher`
instead of a Trainer, so the user's one command is the single controller (torchrun's job and the elastic
agent's at once). Its `train()` spawns the replicas, each running that same command (same module or
script, same arguments) inside a Monarch proc mesh whose torch.distributed environment is scoped to the
replica, supervises them through deaths and regrowth, and returns when they finished `training.steps`.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from torchtitan.tools.logging import logger

from monarch_plugin.config import spell_fields
from monarch_plugin.controller import ElasticController, RunResult
from monarch_plugin.errors import ElasticRunAborted, RunStopped
from monarch_plugin.integrations.torchtitan.config import elastic_config, flag
from monarch_plugin.tools.report import run_summary
from monarch_plugin.target import Target

if TYPE_CHECKING:
    from monarch_plugin.integrations.torchtitan.trainer import MonarchTrainer

__all__ = ["ElasticLauncher", "this_command"]


def this_command() -> Target:
    """What each replica runs: the command that started this process, as torchrun would rerun it."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is not None and spec.name:
        return Target.module(spec.name.removesuffix(".__main__"), sys.argv[1:])
    return Target.script(sys.argv[0], sys.argv[1:])


class ElasticLauncher:
    """Stands where torchtitan's `main()` expects a Trainer: `train()` runs the elastic job, `close()` ends it."""

    def __init__(self, config: "MonarchTrainer.Config"):
        self.config = config
        self.result: RunResult | None = None

    def train(self) -> None:
        settings = elastic_config(self.config)  # the events file's folder is made with the controller's log
        logger.info(f"monarch: {settings.replicas} replica(s) x {settings.procs_per_replica} proc(s) (min "
                    f"{settings.min_replicas}, max {settings.max_replicas}); events in {settings.events_path}")
        try:
            self.result = ElasticController(settings, this_command()).run()
        except RunStopped:
            raise  # told to stop: it exits with its status, its checkpoint's path logged
        except ElasticRunAborted as e:
            raise SystemExit(f"monarch: {spell_fields(str(e), flag)}") from e
        for line in run_summary(self.result):
            logger.info(f"monarch: {line}")

    def close(self) -> None:
        """Nothing to release: the controller stopped every replica before `train()` returned."""
