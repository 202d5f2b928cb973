"""Structured events: one JSON object per line, plus a log line, for each step of a recovery.

The controller and the workers append to the same file (O_APPEND, one write per line), so the phases of
a recovery (death -> quorum -> dropped step -> spawn -> heal -> join) can be read back in order and timed.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from typing import Any

from monarch_plugin.storage.filemodes import file_mode, make_dirs

__all__ = ["EventLog", "LEVELS", "read_events"]

logger = logging.getLogger("monarch_plugin")

LEVELS = {
    **dict.fromkeys(("spawn", "ready", "quorum", "join", "join_retry", "dropped_step", "heal", "first_commit",
                     "progress", "respawn_scheduled", "finished", "death", "hang", "forkserver", "restored",
                     "checkpoint_pruned", "checkpoint_damaged", "forkserver_lost"),
                    logging.DEBUG),
    **dict.fromkeys(("host_lost", "no_room", "no_respawn", "heal_abandoned", "checkpoint_failed",
                     "checkpoint_skipped", "give_up", "host_unreachable", "host_refused", "unfit", "host_watch_error",
                     "forged_value", "watcher_replaced", "watcher_unreplaced"), logging.WARNING),
}
"""The log level of each event kind (INFO if not listed). The steps of a recovery are DEBUG: the controller logs
one WARNING line for each failure instead, saying what happened and what the run did. `--log-level DEBUG` shows
every event."""


class EventLog:
    """Append-only JSON-lines sink shared by the controller and the workers of one run."""

    def __init__(self, path: str | None, source: str, share: bool = False):
        """`share`: create the file (and its directory, if missing) readable by others too; else by this user only
        (`filemodes`). A run's controller creates it before the first event (`runlock.hold`), as its settings say."""
        self.path = path
        self.source = source
        self.share = share
        self._lock = threading.Lock()
        self._lost = False  # the last write failed (said once, until one succeeds again)

    def _append(self, line: str) -> str | None:
        """Append one line; None, or why it could not be (whole: a full disk may cut it short)."""
        try:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, file_mode(self.share))
            except FileNotFoundError:  # its directory is not there yet: made on the first event
                make_dirs(os.path.dirname(os.path.abspath(self.path)), self.share)
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, file_mode(self.share))
            data = (("\n" if self._lost else "") + line).encode()  # after a line cut short: a line of its own
            try:
                written = os.write(fd, data)
            finally:
                os.close(fd)
        except OSError as e:
            return e.strerror
        return None if written == len(data) else os.strerror(errno.ENOSPC)  # the rest would fail the same way

    def emit(self, kind: str, message: str | None = None, level: int | None = None, **fields: Any) -> dict:
        record = {"ts": time.time(), "event": kind, "source": self.source, **fields}
        if message:
            record["message"] = message
        line = json.dumps(record, default=str) + "\n"
        if self.path:
            with self._lock:
                why = self._append(line)
                if why and not self._lost:  # a full disk: the run goes on, its events are lost until there is room
                    logger.warning("the events file %s cannot be written (%s): events are lost until it can be (free "
                                   "space on its filesystem)", self.path, why)
                self._lost = why is not None
        level = LEVELS.get(kind, logging.INFO) if level is None else level
        if logger.isEnabledFor(level):  # most events are DEBUG lines nobody shows: don't format them
            details = " ".join(f"{k}={v}" for k, v in fields.items() if k not in ("traceback",))
            logger.log(level, "[%s] %s%s", self.source, kind, f": {message}" if message else f" {details}")
        return record


def read_events(path: str) -> list[dict]:
    """All events of a run in file order (which is time order); a line a full disk cut short is left out."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [record for line in f if line.strip() and (record := _parsed(line)) is not None]


def _parsed(line: str) -> dict | None:
    try:
        return json.loads(line)
    except ValueError:
        return None
