"""A function target runs in the replicas as it would in the controller, and one that cannot be loaded
there stops the run with the replica's own error.

Each run is `tests/workloads/runtime_sys_path.py` as a subprocess: the user's process is the controller,
and its training function lives in a module it imported from a sys.path entry added at runtime. The
replicas inherit a marker in their environment, so the test finds every process the run started (also
one that never reported its pids) and the harness SIGKILLs any still alive, pass or fail.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from support.procs import alive
from support.runs import WORKLOADS, ElasticRun, run_factory

pytestmark = pytest.mark.timeout(120)
WORKLOAD = WORKLOADS / "runtime_sys_path.py"
_MARK = "MONARCH_PLUGIN_TEST_RUN"


def _marked(marker: str) -> list[int]:
    """Live processes whose environment carries this run's marker."""
    found = []
    needle = f"{_MARK}={marker}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return [pid for pid in found if alive(pid)]


class RuntimePathRun(ElasticRun):
    """`python runtime_sys_path.py DIR MODE`, run from DIR."""

    def __init__(self, tmp: Path):
        super().__init__(tmp)
        self.marker = uuid.uuid4().hex

    def start(self, mode: str) -> "RuntimePathRun":
        cmd = [sys.executable, str(WORKLOAD), str(self.tmp), mode, "--events", str(self.events_path)]
        self.log = open(self.tmp / "run.log", "w")
        self.proc = subprocess.Popen(cmd, cwd=self.tmp, env={**os.environ, _MARK: self.marker},
                                     stdout=self.log, stderr=subprocess.STDOUT, text=True)
        return self

    def result(self) -> dict:
        return json.loads((self.out / "result.json").read_text())

    def no_orphans(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while _marked(self.marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _marked(self.marker), f"processes of the run outlived it: {_marked(self.marker)}"

    def cleanup(self) -> None:
        super().cleanup()
        for pid in _marked(self.marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # exited since it was listed


@pytest.fixture
def runtime_path_run(tmp_path):
    yield from run_factory(tmp_path, RuntimePathRun)


def test_function_from_a_runtime_sys_path_entry_trains_in_the_replicas(runtime_path_run):
    """The controller's sys.path (here a relative entry added at runtime) and working directory reach the
    replicas, so the function unpickles there and trains: without them, every replica failed to start."""
    run = runtime_path_run().start("present")
    assert run.wait(timeout=90) == 0, run.output
    values = run.result()["values"]
    assert sorted(v["replica"] for v in values) == [0, 1]
    assert {v["step"] for v in values} == {6} and len({v["checksum"] for v in values}) == 1
    assert {v["cwd"] for v in values} == {str(run.tmp)}
    assert {v["module_file"] for v in values} == {str(run.tmp / "mods" / "runtime_models.py")}
    assert not run.events("death")
    run.no_orphans()


def test_target_the_replica_cannot_import_stops_with_its_error_and_no_respawn(runtime_path_run):
    """A module the controller imported but the replicas cannot (deleted before they start) is a failure
    of the user's code: the run stops at once with the replica's ModuleNotFoundError and traceback, and
    nothing is respawned, since every replacement would fail the same way."""
    run = runtime_path_run().start("gone")
    assert run.wait(timeout=90) == 1, run.output
    result = run.result()
    assert result["error"] == "ReplicaCodeError"
    message = result["message"]
    assert "could not load the target (ModuleNotFoundError: No module named 'vanished_models')" in message
    assert "sys.path" in message and "install the module" in message
    assert "Traceback (most recent call last)" in message and 'target.py", line' in message
    assert [e["stage"] for e in run.events("user_error")] == ["load"]
    assert not run.events("respawn_scheduled") and not run.events("give_up")
    assert all(s["initial"] for s in run.events("spawn"))
    run.no_orphans()
