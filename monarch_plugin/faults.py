"""Opt-in fault injection, for demos, tests and benchmarks of recovery.

A fault is a string so it can travel through a CLI flag or an environment variable; several are joined
with commas::

    sigkill:replica=1:step=20     SIGKILL the replica's own process at the start of global step 20
    exit:replica=0:step=5         os._exit(1) (a crash that skips Python cleanup)
    segv:replica=0:step=5         SIGSEGV (a crash in native code)
    hang:replica=2:step=7         stop making progress (sleep) inside the step; the process stays reachable
    stop:replica=2:step=7         SIGSTOP: the whole process freezes, as a stall from outside would
    gil:replica=2:step=7          hold Python's GIL and never let go (a C call that never returns): the process
                                  and Monarch's own runtime in it answer, its Python threads (the controller's
                                  probes included) do not
    raise:step=3                  raise an exception in the training code (every initial replica if no replica=:
                                  the same exception at the same step in two replicas, the code's own bug)
    oom:replica=1:step=3          raise torch.OutOfMemoryError, as a device that ran out of memory does

`at=forward` and `at=backward` move a fault of the step into its forward (when the model's first layer with
parameters runs) or its backward (when the gradient reaches the model's last layer with parameters); `step=` is
exact, as for a fault at the step's start:

    raise:replica=1:step=20:at=backward

The other points of `at=` move it to a point of the recovery protocol, the first time the replica reaches it
(after its committed step reaches `step=`, when given):

    arrived          the generation's arrival barrier passed, its group not yet built
    construct        inside the generation's group construction (its own address published)
    heal_donor       serving its state to a newcomer, after the header, before the tensors
    heal_recipient   receiving state, after the header, before the tensors
    stop_checkpoint  writing the checkpoint of a run that stops (a give-up, a signal), before its files
    sync             a semi-synchronous replica's sync, its pseudo-gradients computed, before it reduces them

    sigkill:replica=3:at=construct,sigkill:replica=4:at=arrived

A fault that names `replica=` hits that replica id, a replacement or a spare included (ids are given in
spawn order: the initial replicas, then the spares, then each replacement). One without `replica=` hits
only replicas spawned at the start, so a replacement that heals past the step does not die again. `lane=`
narrows it to one proc of a replica of several (its local rank): "hang:replica=1:lane=1:step=5" stalls
that proc alone while its siblings go on. Each fault fires at most once per process. Nothing fires unless a fault is configured (``--fault`` /
``ElasticConfig.fault`` / ``$MONARCH_PLUGIN_FAULT``).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from monarch_plugin.errors import ConfigError

__all__ = ["FaultSpec", "InjectedFault", "parse_faults", "MODES", "POINTS"]

MODES = ("sigkill", "exit", "segv", "hang", "stop", "gil", "raise", "oom")
POINTS = ("step", "forward", "backward", "arrived", "construct", "heal_donor", "heal_recipient", "stop_checkpoint",
          "sync")
_IN_STEP = ("step", "forward", "backward")


class InjectedFault(RuntimeError):
    """Raised by a "raise" fault: stands in for an exception in the training code (a CUDA error, a flaky disk)."""


@dataclass(frozen=True)
class FaultSpec:
    mode: str
    step: int | None = None
    replica: int | None = None
    at: str = "step"
    lane: int | None = None

    @classmethod
    def parse(cls, text: str) -> "FaultSpec":
        parts = text.strip().split(":")
        mode, fields = parts[0], {}
        if mode not in MODES:
            raise ConfigError(f"unknown fault mode {mode!r} in {text!r}: choose one of {', '.join(MODES)}")
        for part in parts[1:]:
            key, sep, value = part.partition("=")
            if key == "at" and sep:
                if value not in POINTS:
                    raise ConfigError(f"unknown fault point at={value!r} in {text!r}: choose one of {', '.join(POINTS)}")
                fields["at"] = value
                continue
            if not sep or key not in ("replica", "step", "lane") or not value.lstrip("-").isdigit():
                raise ConfigError(
                    f"bad fault field {part!r} in {text!r}: write it as e.g. 'sigkill:replica=1:step=20' "
                    "or 'sigkill:replica=3:at=construct'"
                )
            fields[key] = int(value)
        if fields.get("at", "step") in _IN_STEP and "step" not in fields:
            raise ConfigError(f"fault {text!r} needs a step, e.g. '{mode}:replica=1:step=20', or a point (at=)")
        return cls(mode=mode, **fields)

    def targets(self, replica_id: int, initial: bool, lane: int = 0) -> bool:
        """Whether this proc (`lane` of replica `replica_id`) may be hit at all (see the module docstring)."""
        if self.lane is not None and self.lane != lane:
            return False
        return self.replica == replica_id if self.replica is not None else initial

    def applies(self, replica_id: int, step: int, at: str = "step") -> bool:
        if at != self.at or (self.replica is not None and self.replica != replica_id):
            return False
        if at in _IN_STEP:
            return step == self.step
        return self.step is None or step >= self.step

    def fire(self) -> None:
        """Act out the fault in the calling process."""
        if self.mode == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.mode == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        elif self.mode == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
            return  # continued from outside (SIGCONT): carry on, as a process that was only stalled
        elif self.mode == "exit":
            os._exit(1)
        elif self.mode == "hang":
            while True:
                time.sleep(3600)
        elif self.mode == "gil":
            import re

            re.match(r"(a|aa)+$", "a" * 80 + "b")  # backtracks for ages inside one C call, the GIL held
        elif self.mode == "oom":
            import torch

            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB (injected at {self._where})")
        raise InjectedFault(f"injected fault {self.mode} at {self._where}")

    @property
    def _where(self) -> str:
        if self.at == "step":
            return f"step {self.step}"
        return f"the {self.at} of step {self.step}" if self.at in _IN_STEP else self.at


def parse_faults(text: str | None) -> tuple[FaultSpec, ...]:
    """Every fault of a comma-separated list; ConfigError (naming the bad one) on any mistake."""
    if not text:
        return ()
    return tuple(FaultSpec.parse(part) for part in text.split(",") if part.strip())
