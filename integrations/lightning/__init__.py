"""Lightning front end: `Trainer(strategy="monarch")` trains on elastic Monarch replicas.

Importing this package registers the strategy by name in `lightning.pytorch`'s StrategyRegistry (Lightning has
no entry point for strategies, so the registration must run before `Trainer(...)` is built), and, when the
standalone `pytorch_lightning` package is installed, its twin (`_standalone`) in that package's own registry.
"""

import importlib.util

from lightning.pytorch.strategies import StrategyRegistry

from monarch_plugin.integrations.lightning.fsdp import MonarchFSDPStrategy
from monarch_plugin.integrations.lightning.strategy import MonarchStrategy

__all__ = ["MonarchFSDPStrategy", "MonarchStrategy"]

_DESCRIPTION = "Elastic data parallel on PyTorch Monarch: survives dead workers, regrows, heals live"
_FSDP_DESCRIPTION = "FSDP inside each replica, elastic across replicas, on PyTorch Monarch"

if "monarch" not in StrategyRegistry:
    StrategyRegistry.register("monarch", MonarchStrategy, description=_DESCRIPTION)
if "monarch_fsdp" not in StrategyRegistry:
    StrategyRegistry.register("monarch_fsdp", MonarchFSDPStrategy, description=_FSDP_DESCRIPTION)

if importlib.util.find_spec("pytorch_lightning") is not None:
    from pytorch_lightning.strategies import StrategyRegistry as _StandaloneRegistry

    from monarch_plugin.integrations.lightning._standalone import MonarchFSDPStrategy as _StandaloneFSDPStrategy
    from monarch_plugin.integrations.lightning._standalone import MonarchStrategy as _StandaloneStrategy

    if "monarch" not in _StandaloneRegistry:
        _StandaloneRegistry.register("monarch", _StandaloneStrategy, description=_DESCRIPTION)
    if "monarch_fsdp" not in _StandaloneRegistry:
        _StandaloneRegistry.register("monarch_fsdp", _StandaloneFSDPStrategy, description=_FSDP_DESCRIPTION)
