"""`monarch-run` launched as a real subprocess, and always cleaned up: every test that starts processes goes through
`ElasticRun`, which records the worker pids the controller reports in its events file and, on teardown (pass or fail),
SIGKILLs any of them still alive, then the controller itself, by pid. `SmallDisk` is a 1 MiB tmpfs for full-disk
tests."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .procs import alive

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "elastic_loop.py"
WORKLOADS = REPO / "tests" / "workloads"
"""Training scripts the end-to-end tests run in replicas."""


class ElasticRun:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.events_path = tmp / "events.jsonl"
        self.out = tmp / "out"
        self.out.mkdir(parents=True)
        self.proc: subprocess.Popen | None = None
        self.output = ""

    def start(self, *args: str, script: Path | str = RECIPE, script_args: tuple[str, ...] = (),
              cwd: Path | None = None) -> "ElasticRun":
        cmd = [sys.executable, "-m", "monarch_plugin.tools.cli", "--events", str(self.events_path),
               "--checkpoint-dir", str(self.tmp / "ckpt"), *args, str(script), *script_args]
        self.log = open(self.tmp / "run.log", "w")
        self.proc = subprocess.Popen(cmd, cwd=cwd or self.tmp, stdout=self.log, stderr=subprocess.STDOUT,
                                     text=True)
        return self

    def wait(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"run still going after {timeout}s:\n{self._tail()}") from None
        self.log.close()
        self.output = (self.tmp / "run.log").read_text()
        return rc

    def events(self, kind: str | None = None) -> list[dict]:
        if not self.events_path.exists():
            return []
        with open(self.events_path) as f:
            records = [json.loads(line) for line in f if line.strip()]
        return [e for e in records if kind is None or e["event"] == kind]

    def pids(self) -> dict[int, list[int]]:
        return {e["replica"]: e["pids"] for e in self.events("spawn")}

    def wait_for(self, predicate, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            if self.proc.poll() is not None:
                raise AssertionError(f"run exited ({self.proc.returncode}) before {what}:\n{self._tail()}")
            time.sleep(0.05)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}:\n{self._tail()}")

    def progress(self, replica: int) -> int:
        path = self.out / f"progress-{replica}"
        try:
            return int(path.read_text() or -1)
        except (FileNotFoundError, ValueError):
            return -1

    def results(self) -> dict[int, dict]:
        found = {}
        for path in self.out.glob("result-*.json"):
            r = json.loads(path.read_text())
            found[r["replica"]] = r
        return found

    def _tail(self) -> str:
        try:
            return (self.tmp / "run.log").read_text()[-4000:]
        except FileNotFoundError:
            return ""

    def kill_controller(self, within: float = 30.0) -> None:
        """SIGKILL the controller (its machine is gone), unless the test did already, and wait for every replica, and
        the forkserver they were forked from, to end after it (`worker.orphan`: once they saved the run)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.wait(timeout=30)
        deadline = time.monotonic() + within
        servers = [e["pid"] for e in self.events("forkserver")]
        while any(alive(p) for pids in self.pids().values() for p in pids):
            assert time.monotonic() < deadline, f"replicas outlived their controller: {self.pids()}"
            time.sleep(0.1)
        while any(alive(p) for p in servers):
            assert time.monotonic() < deadline, f"the forkserver {servers} outlived its controller"
            time.sleep(0.1)

    def cleanup(self) -> None:
        for pids in self.pids().values():
            for pid in pids:
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


def saved_on_controller_loss(lost: list[dict], replicas, lanes: int = 1) -> dict:
    """Check the `controller_lost` events of a run whose controller was killed, one from each of the `lanes` procs of
    each replica in `replicas` (ids), and return the writer's: replica 0's local rank 0 (the generation's first
    replica), which names the checkpoint. Its replica's other procs wrote their shards of the same step; every other
    replica wrote nothing and says so (`worker.orphan`)."""
    assert sorted((e["replica"], e["lane"]) for e in lost) == [(r, k) for r in sorted(replicas) for k in range(lanes)], lost
    [writer] = [e for e in lost if e["checkpoint"]]
    assert (writer["replica"], writer["lane"]) == (0, 0), lost
    assert all(e["step"] == writer["step"] and "skipped" not in e for e in lost if e["replica"] == 0), lost
    assert all(e["skipped"] == "another replica writes it" for e in lost if e["replica"] != 0), lost
    return writer


def run_factory(tmp_path: Path, cls):
    """Yield a maker of `cls` runs, each in its own folder; clean every one up afterwards, pass or fail."""
    runs = []

    def make():
        run = cls(tmp_path / f"run{len(runs)}")
        runs.append(run)
        return run

    yield make
    for run in runs:
        run.cleanup()


def front_end_runs(tmp_path: Path, framework: str, module: str, cls: str):
    """Runs of a front end's harness (`module.cls`, from its test module), skipped where its framework is not
    installed."""
    pytest.importorskip(framework)
    yield from run_factory(tmp_path, getattr(importlib.import_module(module), cls))


class SmallDisk:
    def __init__(self, path: Path):
        self.path = path
        path.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)], check=True, timeout=30)

    def fill(self) -> None:
        fd = os.open(self.path / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            while os.write(fd, bytes(4096)):
                pass
        except OSError:  # full
            pass
        finally:
            os.close(fd)

    def free(self) -> None:
        (self.path / "filler").unlink(missing_ok=True)
