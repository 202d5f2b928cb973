"""What the benchmarks share: start a run, wait for it to reach a point, kill a worker from outside as a failure
would, record the kill in the run's events (so its recoveries are read against it), and leave nothing behind.

    proc = subprocess.Popen(cmd, ...)
    try:
        wait_for("three replicas training", lambda: ..., proc, timeout=180)
        victim = spawned(events)[1]
        kill(victim[0], events, replica=1)
        finished(proc, 300, "the elastic run", out)
    finally:
        reap(proc, spawned(events))
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable, TypeVar

from monarch_plugin.events import EventLog, read_events

__all__ = ["events", "finished", "kill", "reap", "spawned", "wait_for"]

T = TypeVar("T")


def events(path: Path | str) -> list[dict]:
    """The run's events so far; none before the controller wrote its first."""
    return read_events(str(path)) if Path(path).exists() else []


def spawned(path: Path | str) -> dict[int, list[int]]:
    """Each replica's worker pids, from its (newest) spawn event."""
    return {e["replica"]: e["pids"] for e in events(path) if e["event"] == "spawn"}


def wait_for(what: str, predicate: Callable[[], T], proc: subprocess.Popen, timeout: float,
             poll_s: float = 0.02) -> T:
    """What `predicate()` returns once it is true; RuntimeError naming `what` if the run ends or `timeout` passes
    first."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended (rc {proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(poll_s)


def kill(pid: int, events_path: Path | str | None = None, **fields) -> bool:
    """SIGKILL `pid` from outside, as a failure would; False if it had already gone. With `events_path`, the kill
    is recorded there (`fields`: which replica), so the run's report measures its recovery from this moment."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    if events_path is not None:
        EventLog(str(events_path), source="benchmark").emit("kill", pid=pid, **fields)
    return True


def finished(proc: subprocess.Popen, timeout: float, what: str, where: Path | str) -> None:
    """Wait for the run to end; RuntimeError, pointing at `where`, unless it ended well."""
    if proc.wait(timeout=timeout) != 0:
        raise RuntimeError(f"{what} failed (rc {proc.returncode}); see {where}")


def reap(proc: subprocess.Popen, pids: dict[int, list[int]] | list[int] = ()) -> None:
    """Stop the run if it still runs, and SIGKILL every worker it spawned: nothing a benchmark started outlives it."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pid in (p for ps in pids.values() for p in ps) if isinstance(pids, dict) else pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
