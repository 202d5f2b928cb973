"""torchtitan front end: a `monarch` config section that makes a torchtitan job elastic across replicas, each an
FSDP x CP x TP mesh of its own procs.

    python -m torchtitan.train --module monarch_plugin.integrations.torchtitan --config llama3_debugmodel_cpu \
        --monarch.enable --monarch.procs_per_replica 2

`--module monarch_plugin.integrations.torchtitan` selects this package's `config_registry` the torchtitan way;
its config functions return `MonarchTrainer.Config` (torchtitan's `Trainer.Config` plus the `monarch`
section), and any job of your own can do the same. See docs/torchtitan.md.
"""

from monarch_plugin.integrations.torchtitan import compat

compat.require_triton()

from monarch_plugin.integrations.torchtitan.config import MonarchConfig  # noqa: E402
from monarch_plugin.integrations.torchtitan.data import ElasticDataLoader  # noqa: E402
from monarch_plugin.integrations.torchtitan.launch import ElasticLauncher  # noqa: E402
from monarch_plugin.integrations.torchtitan.trainer import CommittedStep, MonarchTrainer  # noqa: E402

__all__ = ["CommittedStep", "ElasticDataLoader", "ElasticLauncher", "MonarchConfig", "MonarchTrainer"]
