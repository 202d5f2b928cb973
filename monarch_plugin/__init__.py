"""monarch-plugin: training runs that survive a dead worker, on PyTorch Monarch's single controller.

The controller side (`ElasticController`, `monarch-run`) spawns and supervises replica groups; the worker
side (`ElasticLoop`, and the framework integrations built on the same session) trains inside them.

The names below are imported when first used (PEP 562), so a tool that only reads a run's events
(`monarch-plugin summary`, `timeline`) loads neither torch nor Monarch.
"""

from __future__ import annotations

import importlib
import os

# Monarch reads these when its runtime starts, in whichever process of a run imports this package (the
# controller, a host agent, a worker; the procs they start inherit them): the defaults notice a dead proc 7-30 s late.
os.environ.setdefault("HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY", "1s")
os.environ.setdefault("HYPERACTOR_MESH_GET_ACTOR_STATE_MAX_IDLE", "2s")

_WHERE = {
    "BackendUnavailableError": ("monarch_plugin.errors", "BackendUnavailableError"),
    "ConfigError": ("monarch_plugin.errors", "ConfigError"),
    "ElasticConfig": ("monarch_plugin.config", "ElasticConfig"),
    "ElasticController": ("monarch_plugin.controller", "ElasticController"),
    "ElasticLoop": ("monarch_plugin.worker.loop", "ElasticLoop"),
    "ElasticRunAborted": ("monarch_plugin.errors", "ElasticRunAborted"),
    "ElasticSampler": ("monarch_plugin.data.sampler", "ElasticSampler"),
    "FaultSpec": ("monarch_plugin.faults", "FaultSpec"),
    "InjectedFault": ("monarch_plugin.faults", "InjectedFault"),
    "ReplicaCodeError": ("monarch_plugin.errors", "ReplicaCodeError"),
    "RunResult": ("monarch_plugin.controller", "RunResult"),
    "Step": ("monarch_plugin.worker.loop", "Step"),
    "Sync": ("monarch_plugin.worker.loop", "Sync"),
    "Target": ("monarch_plugin.target", "Target"),
    "read_events": ("monarch_plugin.events", "read_events"),
    "weights_checksum": ("monarch_plugin.storage.checksum", "weights_checksum"),
    "worker_context": ("monarch_plugin.worker.context", "current"),
}
"""Each public name: the module that defines it, and its name there."""

__all__ = list(_WHERE)


def __getattr__(name: str):
    """A public name, imported from its module on first use (and kept here after)."""
    if name not in _WHERE:
        raise AttributeError(f"module 'monarch_plugin' has no attribute {name!r}")
    module, attribute = _WHERE[name]
    value = globals()[name] = getattr(importlib.import_module(module), attribute)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
