"""Process-global state of one worker: who it is, where the controller's store is, and the interrupt flags.

Two threads touch it. The training thread reads it at step boundaries and while it waits on a collective;
the control actor's thread sets `latest`, `abort_gen` and `regroup_gen` when the controller announces a new
generation. Setting a flag also wakes whatever the training thread is waiting on, which is how a survivor blocked
in an all-reduce with a dead peer gets out in milliseconds instead of at the gloo timeout, and how a worker waiting
for its next generation learns of it without asking the store.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist

from monarch_plugin.config import ElasticConfig
from monarch_plugin.events import EventLog
from monarch_plugin.faults import parse_faults
from monarch_plugin.wire.protocol import Phase
from monarch_plugin.wire.signing import SignedStore, forged_reporter, secret_from_env

__all__ = ["WorkerContext", "current", "flags"]


class Flags:
    """Interrupts from the controller; exists before the training code starts, so none is lost."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._announced = threading.Condition(self._lock)
        self.latest = -1
        """The newest generation the controller announced to this proc (its plan is in the store)."""
        self.abort_gen = -1
        self.regroup_gen = -1
        self.stop = False
        self.lost: str | None = None
        """Why the controller is lost (`worker.orphan`), once it is: the proc saves the run and ends."""
        self._waiter: threading.Event | None = None
        self.finished_gen = -1  # the generation whose members all reached the end together
        self.phase = Phase.STARTING
        self.phase_since = time.time()
        self.step = -1
        self.forming = -1  # the generation whose group this worker is forming (or last formed)

    def set_phase(self, phase: Phase, step: int | None = None) -> None:
        self.phase, self.phase_since = phase, time.time()
        if step is not None:
            self.step = step

    def plan(self, gen: int) -> None:
        """Generation `gen` is announced, and this proc is in it or was in the one it replaces."""
        with self._lock:
            self._note(gen)

    def abort(self, gen: int) -> None:
        """Generation `gen` replaces the current one: drop the step in flight."""
        with self._lock:
            self._note(gen)
            self.abort_gen = max(self.abort_gen, gen)
            if self._waiter is not None:
                self._waiter.set()

    def regroup(self, gen: int) -> None:
        """Generation `gen` (a grow) is waiting: move to it at the next step boundary."""
        with self._lock:
            self._note(gen)
            self.regroup_gen = max(self.regroup_gen, gen)

    def request_stop(self) -> None:
        with self._lock:
            self.stop = True
            self._announced.notify_all()
            if self._waiter is not None:
                self._waiter.set()

    def lose_controller(self, why: str) -> None:
        """The controller is gone: every wait ends as at a stop, and the next step boundary saves the run."""
        with self._lock:
            self.lost = why
        self.request_stop()

    def wait_for_plan(self, after: int, timeout_s: float) -> bool:
        """Block until a generation newer than `after` is announced (or a stop); False after `timeout_s`."""
        with self._lock:
            return self._announced.wait_for(lambda: self.latest > after or self.stop, timeout_s)

    def _note(self, gen: int) -> None:
        self.latest = max(self.latest, gen)
        self._announced.notify_all()

    def install_waiter(self, event: threading.Event | None) -> None:
        with self._lock:
            self._waiter = event


flags = Flags()


@dataclass
class WorkerContext:
    """Identity of this worker inside the elastic run, built from the environment the actor set."""

    replica_id: int
    local_rank: int
    procs_per_replica: int
    initial: bool
    config: ElasticConfig
    store_host: str
    store_port: int
    bind_address: str = "127.0.0.1"
    """This host's address on the job's network, which the cross-replica groups listen on (loopback on one
    machine)."""

    def __post_init__(self) -> None:
        self.events = EventLog(self.config.events_path, source=f"replica{self.replica_id}.{self.local_rank}")
        self.faults = [f for f in parse_faults(self.config.fault)
                       if f.targets(self.replica_id, self.initial, self.local_rank)]
        self.flags = flags
        self.transaction = None
        """This proc's `StepTransaction` once the front end built it: what the control actor asks, from its own thread,
        for the front end's newest checkpoint, and for a give-up checkpoint after the training code raised."""
        self._store: SignedStore | None = None

    @property
    def rank(self) -> int:
        """This replica's rank in the current generation; rank 0 logs and writes checkpoints. Before the first
        generation forms, the first initial replica is 0 and every other one above it (a newcomer never is)."""
        tx = self.transaction
        if tx is not None and tx.gen >= 0:
            return tx.rank
        return 0 if self.initial and self.replica_id == 0 else 1 + self.replica_id

    def fault_point(self, at: str, step: int) -> None:
        """Fire the configured fault for this point of the protocol, if any (each at most once)."""
        for fault in self.faults:
            if fault.applies(self.replica_id, step, at):
                self.faults.remove(fault)
                self.events.emit("fault_injected", replica=self.replica_id, step=step, at=at, mode=fault.mode,
                                 pid=os.getpid())
                fault.fire()
                return

    @property
    def store(self) -> SignedStore:
        # One cached client: fresh TCPStore connections sometimes stall for seconds.
        if self._store is None:
            self._store = SignedStore(
                dist.TCPStore(self.store_host, self.store_port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=self.config.join_timeout_s)),
                secret_from_env(), on_forged=forged_reporter(self.events),
            )
        return self._store

    @property
    def host(self) -> str:
        return socket.gethostname()


_current: WorkerContext | None = None


def current() -> WorkerContext | None:
    """The worker context when running under the elastic controller, None in a plain process."""
    global _current
    if _current is None and "MONARCH_PLUGIN_REPLICA_ID" in os.environ:
        config = ElasticConfig.from_env()
        _current = WorkerContext(
            replica_id=int(os.environ["MONARCH_PLUGIN_REPLICA_ID"]),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            procs_per_replica=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
            initial=os.environ.get("MONARCH_PLUGIN_INITIAL", "1") == "1",
            config=config,
            store_host=os.environ["MONARCH_PLUGIN_STORE_HOST"],
            store_port=int(os.environ["MONARCH_PLUGIN_STORE_PORT"]),
            bind_address=os.environ.get("MONARCH_PLUGIN_BIND_ADDR", "127.0.0.1"),
        )
    return _current


def reset() -> None:
    """Forget the context (the actor process may run another target later)."""
    global _current
    _current = None
