"""A proc's lease on the run: on another host, a proc that cannot reach the controller for `lease_s` exits.

The controller declares a host lost when its watcher's beats stop for `host_timeout_s`. A cut link stops them,
but the procs behind it keep running (Monarch's agent kills them as orphans only 70-95 s later, and
`ProcMesh.stop()` after the link returns did not), and when the link comes back they would find a run that has
moved on: a stale worker could write into the store, join a generation, or serve a heal. So every proc on
another host (the workers and the host's watcher) holds a lease: a thread that touches the controller's store
every `BEAT_S` over a connection of its own, and ends the process when its touches have failed or hung for
`lease_s`. That is shorter than `host_timeout_s` by two beats and a second, so the procs of a cut-off host are
gone before the controller declares the host lost, and so before anything could reach it again. A thread merely
starved of the GIL does not count: only a touch that was tried and failed or hung (see `Lease._judge`). A host the controller
declared lost anyway (`Key.host_lost`) ends its procs at their next touch.

A worker does not end when its lease runs out (`on_lost`): it saves the run's last committed step first
(`worker.orphan`). Only a host the controller declared lost ends its procs at once: that controller is alive and its
run has moved on.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from typing import Callable

from monarch_plugin.wire.protocol import Key
from monarch_plugin.wire.signing import Forged, SignedStore

__all__ = ["AGENT_PROBE_S", "BEAT_S", "Lease", "ORPHAN_MARGIN_S", "lease_s", "outlive_bound_s"]

BEAT_S = 0.5
"""How often a lease touches the store (and a watcher beats)."""

_MARGIN_S = 1.0


AGENT_PROBE_S = 0.5
"""How often a host agent that serves one run (`procs.agent`, `--run-store`) tries the run's store (a connection
opened and closed: the store takes it as a preflight's, `hostfacts.report`)."""
ORPHAN_MARGIN_S = 5.0
"""What such an agent gives its procs beyond their `controller_loss_save_s`: their own leases run out up to a beat or
two after the agent's judge, and a proc that has written still has to exit."""


def outlive_bound_s(host_timeout_s: float, controller_loss_save_s: float) -> float:
    """How long a host agent that serves one run stays after its run's controller process ends, at most: the run's
    lease of refusals (and a probe), its procs' `controller_loss_save_s`, the margin (`procs.agent`, `procs.slurm`)."""
    return lease_s(host_timeout_s) + AGENT_PROBE_S + controller_loss_save_s + ORPHAN_MARGIN_S


def lease_s(host_timeout_s: float) -> float:
    """How long a proc on another host keeps running without reaching the controller: the host timeout less two
    beats (its last touch may come a beat after the last beat the controller saw, and its hung touch may start a
    beat after that) and a margin for the judge's own granularity."""
    return host_timeout_s - 2 * BEAT_S - _MARGIN_S


class Lease:
    """Touch the store every `BEAT_S` (adding to each of `beat_keys`); `os._exit` when out of touch for `lease_s`.

    Two threads: one touches, one judges. A touch on a cut link does not fail, it blocks (the TCP connection
    retransmits for minutes and the store client sets no deadline), so only a second thread can tell how long
    the last successful touch is ago. Both need the GIL to run, so one starved of it does not judge the other.
    """

    def __init__(self, store_host: str, store_port: int, host: int, lease: float, what: str, secret: str,
                 beat_keys: tuple[str, ...] = (), on_lost: Callable[[str], None] | None = None):
        """`on_lost(why)` is called once when the controller is out of reach (default: end the process)."""
        import torch.distributed as dist

        self._store = SignedStore(dist.TCPStore(store_host, store_port, is_master=False, wait_for_workers=False,
                                                timeout=datetime.timedelta(seconds=lease)), bytes.fromhex(secret))
        self._lost_key = Key.host_lost(host)
        self._lease, self._what, self._beat_keys = lease, what, beat_keys
        self._last_ok = time.monotonic()
        self._since: float | None = None  # when the touch in flight began
        self._failing = False
        self._on_lost, self._lost = on_lost, threading.Event()
        threading.Thread(target=self._touch, name="monarch-plugin-lease", daemon=True).start()
        threading.Thread(target=self._judge, name="monarch-plugin-lease-judge", daemon=True).start()

    def _touch(self) -> None:
        while not self._lost.is_set():
            self._since = time.monotonic()
            try:
                for key in self._beat_keys:
                    self._store.add(key, 1)
                try:
                    lost = self._store.peek(self._lost_key) is not None
                except Forged:  # not the controller's word: whoever wrote it cannot end this proc
                    lost = False
                if lost:
                    self._end("its host was declared lost")
                self._last_ok, self._failing = time.monotonic(), False
            except Exception:  # noqa: BLE001 - the link may be down: the judge counts for how long
                self._failing = True
            self._since = None
            time.sleep(BEAT_S)

    def _judge(self) -> None:
        """End the process when a touch has hung for the lease, or touches have failed for it. When this thread
        itself ran late (the GIL held by a long C call: an import, a kernel), the toucher was held up too, so it
        gets two beats to touch before anything is judged."""
        previous, grace = time.monotonic(), 0.0
        while not self._lost.is_set():
            time.sleep(BEAT_S / 2)
            now = time.monotonic()
            if now - previous > 2 * BEAT_S:
                grace = now + 2 * BEAT_S
            previous = now
            if now < grace:
                continue
            since = self._since
            if since is not None and now - since >= self._lease:
                self._lose(f"a touch of the controller's store hung for {self._lease:.1f} s")
            elif self._failing and now - self._last_ok >= self._lease:
                self._lose(f"no contact with the controller for {self._lease:.1f} s")

    def _lose(self, why: str) -> None:
        if self._lost.is_set():
            return
        self._lost.set()
        if self._on_lost is None:
            self._end(why)
        self._on_lost(why)

    def _end(self, why: str) -> None:
        print(f"monarch-plugin: {self._what}: {why}; exiting", file=sys.stderr,
              flush=True)
        os._exit(17)
