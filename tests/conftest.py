"""Shared harness: launch `monarch-run` as a real subprocess, and always clean up what it spawned.

Every test that starts processes goes through `ElasticRun`, which records the worker pids the controller
reports in its events file and, on teardown (pass or fail), SIGKILLs any of them still alive, then the
controller itself, by pid.
"""

from __future__ import annotations

import collections
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "elastic_loop.py"
WORKLOADS = REPO / "tests" / "workloads"
"""Training scripts the end-to-end tests run in replicas."""


def pytest_collection_modifyitems(items):
    """tests/e2e drives the front ends end to end, on real replica meshes (a few check a front end's settings in
    this process); `-m "not slow"` runs the unit tests alone, in seconds."""
    for item in items:
        if "e2e" in item.path.parts:
            item.add_marker(pytest.mark.slow)


def pytest_unconfigure(config):
    """The session's last line names what was skipped and why (the SLURM, browser and firewall tests skip where their
    Debian packages are missing; `.ci/run` installs them), so a green run on a fresh machine says what it left out."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    reasons = collections.Counter(report.longrepr[2].removeprefix("Skipped: ")
                                  for report in reporter.stats.get("skipped", []) if isinstance(report.longrepr, tuple))
    if reasons:
        reporter.write_line(f"skipped {sum(reasons.values())}: " + "; ".join(
            f"{count} because {reason}" for reason, count in reasons.most_common()))


WILDCARDS = ("0.0.0.0", "*", "[::]", "::", "[::ffff:0.0.0.0]")
"""How `ss` writes a listener bound to every interface."""


def listeners(pids: set[int] | None = None, ns: str | None = None) -> list[tuple[str, str]]:
    """(local address, process) of every TCP listener of `pids` (in the root namespace), or of namespace `ns`."""
    cmd = ["ss", "-ltnpH"] if ns is None else ["ip", "netns", "exec", ns, "ss", "-ltnpH"]
    found = []
    for line in subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=30).stdout.splitlines():
        fields = line.split()
        local, process = fields[3], " ".join(fields[5:])
        owners = {int(part.split("=")[1].rstrip(",)")) for part in process.split(",") if part.startswith("pid=")}
        if pids is None or owners & pids:
            found.append((local.rsplit(":", 1)[0], process))
    return found


def descendants(pid: int) -> set[int]:
    """`pid` and every process below it."""
    children: dict[int, list[int]] = {}
    for stat in subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout.splitlines():
        child, parent = map(int, stat.split())
        children.setdefault(parent, []).append(child)
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        found.add(p)
        todo += children.get(p, [])
    return found


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name: state, parent pid, ..."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    """True if pid runs and is not a zombie."""
    try:
        return _stat(pid)[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def stopped(pid: int) -> bool:
    """True if pid is stopped (SIGSTOP: state T)."""
    try:
        return _stat(pid)[0] == "T"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def parent(pid: int) -> int:
    return int(_stat(pid)[1])


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
        """SIGKILL the controller (its machine is gone) and wait for every replica, and the forkserver they were
        forked from, to end with it."""
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


@pytest.fixture
def elastic_run(tmp_path):
    yield from run_factory(tmp_path, ElasticRun)


@pytest.fixture
def small_disk(tmp_path):
    """A filesystem of its own (a 1 MiB tmpfs, which only root may mount), for what a full disk does to a run: `fill`
    takes every byte of it, `free` gives them back. Unmounted after the test, pass or fail."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = SmallDisk(tmp_path / "disk")
    yield disk
    subprocess.run(["umount", "--lazy", str(disk.path)], check=False, timeout=30)


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


@pytest.fixture
def hosts(tmp_path):
    """Network-namespace hosts (`netns.NetnsHosts`), made by `hosts(count)`; all removed after the test."""
    import netns

    made: list = []

    def make(count: int, token: bool = False):
        made.append(netns.NetnsHosts(count, tmp_path / f"hosts{len(made)}", token=token))
        return made[-1]

    yield make
    for net in made:
        net.close()
