"""Opt-in fault injection, for demos, tests and benchmarks of recovery.

A fault is a string so it can travel through a CLI flag or an environment variable::

    sigkill:replica=1:step=20     SIGKILL the replica's own process at the start of global step 20
    exit:replica=0:step=5         os._exit(1) (a crash that skips Python cleanup)
    hang:replica=2:step=7         stop making progress (sleep) inside the step
    raise:step=3                  raise an exception (a bug in user code; every replica if no replica=)

Only replicas spawned at the start of the run are hit, so a replacement does not die again. Nothing fires
unless a fault is configured (``--fault`` / ``ElasticConfig.fault`` / ``$MONARCH_PLUGIN_FAULT``).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from monarch_plugin.errors import ConfigError

__all__ = ["FaultSpec", "InjectedFault"]

MODES = ("sigkill", "exit", "hang", "raise")


class InjectedFault(RuntimeError):
    """Raised by a "raise" fault: stands in for a bug in the training code."""


@dataclass(frozen=True)
class FaultSpec:
    mode: str
    step: int
    replica: int | None = None

    @classmethod
    def parse(cls, text: str) -> "FaultSpec":
        parts = text.strip().split(":")
        mode, fields = parts[0], {}
        if mode not in MODES:
            raise ConfigError(f"unknown fault mode {mode!r} in {text!r}: choose one of {', '.join(MODES)}")
        for part in parts[1:]:
            key, sep, value = part.partition("=")
            if not sep or key not in ("replica", "step") or not value.lstrip("-").isdigit():
                raise ConfigError(
                    f"bad fault field {part!r} in {text!r}: write it as e.g. 'sigkill:replica=1:step=20'"
                )
            fields[key] = int(value)
        if "step" not in fields:
            raise ConfigError(f"fault {text!r} needs a step, e.g. '{mode}:replica=1:step=20'")
        return cls(mode=mode, step=fields["step"], replica=fields.get("replica"))

    def applies(self, replica_id: int, step: int) -> bool:
        return step == self.step and (self.replica is None or self.replica == replica_id)

    def fire(self) -> None:
        """Act out the fault in the calling process."""
        if self.mode == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.mode == "exit":
            os._exit(1)
        elif self.mode == "hang":
            while True:
                time.sleep(3600)
        raise InjectedFault(f"injected fault {self.mode} at step {self.step}")
