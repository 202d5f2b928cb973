"""monarch-plugin: training runs that survive a dead worker, on PyTorch Monarch's single controller.

The controller side (`ElasticController`, `monarch-run`) spawns and supervises replica groups; the worker
side (`ElasticLoop`, and the framework integrations built on the same session) trains inside them.
"""

from monarch_plugin.checksum import weights_checksum
from monarch_plugin.config import ElasticConfig
from monarch_plugin.controller import ElasticController, RunResult
from monarch_plugin.errors import BackendUnavailableError, ConfigError, ElasticRunAborted, ReplicaCodeError
from monarch_plugin.events import read_events
from monarch_plugin.faults import FaultSpec, InjectedFault
from monarch_plugin.sampler import ElasticSampler
from monarch_plugin.target import Target
from monarch_plugin.worker.context import current as worker_context
from monarch_plugin.worker.loop import ElasticLoop, Step

__all__ = [
    "BackendUnavailableError",
    "ConfigError",
    "ElasticConfig",
    "ElasticController",
    "ElasticLoop",
    "ElasticRunAborted",
    "ElasticSampler",
    "FaultSpec",
    "InjectedFault",
    "ReplicaCodeError",
    "RunResult",
    "Step",
    "Target",
    "read_events",
    "weights_checksum",
    "worker_context",
]
