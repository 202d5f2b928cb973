"""Exceptions the plugin raises to its users.

Every error that reaches a user names the fix; these types let front ends (CLI, Lightning, HF) tell a
configuration mistake (nothing was spawned) from a run that was stopped on purpose (the controller gave up)
and from a bug in the training code (re-raised with the worker's traceback).
"""

from __future__ import annotations

__all__ = ["ConfigError", "BackendUnavailableError", "ElasticRunAborted", "MissingExtraError", "ProtocolError",
           "ReplicaCodeError", "RunStopped"]


class ConfigError(ValueError):
    """A setting is invalid; raised before any process is spawned.

    ``field`` is the `ElasticConfig` field at fault, when one is; the message names fields as the runtime does,
    and each front end writes them in its own spelling (`config.spell_fields`)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field

    def __reduce__(self):  # pickled whole, from the run's controller process (`procs.apart`)
        return type(self), (self.args[0], self.field)


class BackendUnavailableError(RuntimeError):
    """The requested torch.distributed backend is not built into this torch."""


class MissingExtraError(ImportError):
    """An optional dependency a command needs is not installed; the message names the extra that brings it."""


class ElasticRunAborted(RuntimeError):
    """The controller stopped the run on purpose (too few replicas, a crash loop, no replica left holding the
    run's trained state).

    ``checkpoint`` is the checkpoint to resume the run from: the durable one written on the way out or, when no
    live replica held the run's state to write one, the newest one found on disk; None when there is none.
    """

    def __init__(self, message: str, checkpoint: str | None = None):
        super().__init__(message)
        self.checkpoint = checkpoint

    def __reduce__(self):  # pickled whole, from the run's controller process (`procs.apart`)
        return type(self), (self.args[0], self.checkpoint)


class ReplicaCodeError(ElasticRunAborted):
    """The training code fails wherever it runs, a bug that respawning cannot fix: it raised the same exception at
    the same step in two replicas (the run stops with its give-up checkpoint, ``checkpoint``), raised while setting
    up or after training ended, or could not be loaded in a replica (a module the replica cannot import). The message
    carries the replicas' tracebacks. (An exception in one replica alone is that replica's failure: it is replaced.)"""


class RunStopped(ElasticRunAborted, SystemExit):
    """The run was told to stop (SIGTERM or SIGUSR1 to the controller's process, or to every replica at once: a
    scheduler's preemption or time limit) and stopped with a checkpoint of its last committed step, ``checkpoint``,
    to resume from. A `SystemExit` too, as Lightning's `SIGTERMException` is: uncaught, the process exits with
    ``status``, 128 + the signal's number (143 for SIGTERM, 138 for SIGUSR1), as a shell reports a process the signal
    ended, and the message was logged before."""

    def __init__(self, message: str, checkpoint: str | None = None, signal: str = "SIGTERM"):
        super().__init__(message, checkpoint)
        import signal as signals

        self.signal = signal
        self.status = self.code = 128 + int(signals.Signals[signal])

    def __reduce__(self):
        return type(self), (self.args[0], self.checkpoint, self.signal)


class ProtocolError(RuntimeError):
    """The runtime's own part of a worker failed, not the training code: a bound it waited out, a store it could not
    reach, a protocol invariant broken. The controller replaces the replica, as after a death, and says which part:
    `phase` is "join" (entering a generation), "heal", "reduce" (the step's cross-replica reduction), "vote"
    (among a replica's procs) or "barrier" (leaving together at the end)."""

    def __init__(self, phase: str, message: str):
        super().__init__(f"monarch-plugin's {phase}: {message}")
        self.phase = phase
        self.detail = message
