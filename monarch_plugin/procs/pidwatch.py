"""`PidWatch`: pidfds of the worker procs on one machine, for the fastest death notice there is.

A pidfd becomes readable the moment its process exits (milliseconds, where Monarch's supervision takes 0.5-3 s),
and signalling through it can never hit another process that reused the pid. The controller keeps one for the
procs on its own machine; a `HostWatcher` keeps one on every other host.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from typing import Callable

__all__ = ["PidWatch"]


class PidWatch:
    """Calls `on_exit(replica, pid)` once for each watched process that exits, from its own thread."""

    def __init__(self, on_exit: Callable[[int, int], None], name: str = "monarch-plugin-pidfd"):
        self._on_exit = on_exit
        self._lock = threading.Lock()
        self._running: dict[int, tuple[int, int]] = {}  # pidfd -> (replica, pid), processes not seen to exit
        self._held: dict[int, list[int]] = {}  # replica -> its pidfds, open until close()
        self._closed = threading.Event()
        threading.Thread(target=self._watch, name=name, daemon=True).start()

    def watch(self, replica: int, pids: list[int]) -> None:
        """Report the exit of any of `pids` from now on; one already gone is reported at once."""
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                self._on_exit(replica, pid)
                continue
            with self._lock:
                self._held.setdefault(replica, []).append(fd)
                self._running[fd] = (replica, pid)

    def forget(self, replica: int) -> None:
        """Stop reporting the replica's procs (its death is already known); they can still be killed."""
        with self._lock:
            for fd in self._held.get(replica, []):
                self._running.pop(fd, None)

    def kill(self, replica: int) -> None:
        """SIGKILL the replica's procs, and stop reporting them."""
        self.forget(replica)
        with self._lock:
            for fd in self._held.get(replica, []):
                try:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            self._running.clear()
            for fds in self._held.values():
                for fd in fds:
                    os.close(fd)
            self._held.clear()

    def _watch(self) -> None:
        # poll, not select: select takes no fd numbered past 1,023, and a controller with a few hundred procs holds
        # that many (a store connection per proc besides their pidfds); select's ValueError ended this thread, and
        # with it every death notice of the run.
        while not self._closed.is_set():
            with self._lock:
                fds = list(self._running)
            if not fds:
                time.sleep(0.01)
                continue
            poller = select.poll()
            for fd in fds:
                poller.register(fd, select.POLLIN)
            for fd, mask in poller.poll(50):
                if mask & select.POLLNVAL:  # closed meanwhile
                    continue
                with self._lock:
                    entry = self._running.pop(fd, None)
                if entry is not None:
                    self._on_exit(*entry)
