"""`monarch-plugin doctor` against real host agents in network namespaces, each with a problem induced.

Host 0 is sound; host 1's agent sees a torch of another version (a shadowing dist-info first on its `PYTHONPATH`)
and lacks the run's directory (an empty tmpfs over it, in the agent's own mount namespace: a machine without the
shared filesystem); the third address has no agent. The doctor must name each problem with its fix, on that
host's row only, and exit non-zero; with only the sound host, exit 0.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import netns

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))]


def _doctor(*args: str) -> subprocess.CompletedProcess:
    """`monarch-plugin doctor ARGS`, run as the installed command is."""
    command = "import sys; from monarch_plugin.cli import plugin; sys.exit(plugin(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", command, "doctor", *args, "--timeout", "10"],
                          capture_output=True, text=True, timeout=120)


def test_doctor_names_each_hosts_problem_with_its_fix_and_fails_only_on_errors(hosts, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    script = shared / "train.py"
    script.write_text("print('training')\n")
    shadow = tmp_path / "shadow" / "torch-9.9.9.dist-info"
    shadow.mkdir(parents=True)
    (shadow / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 9.9.9\n")
    net = hosts(2)
    net.start_agent(0)
    net.start_agent(1, env={"PYTHONPATH": str(shadow.parent)}, hide=shared)
    net.wait_listed(2)
    nowhere = f"tcp://{net.ip(1)}:{netns.AGENT_PORT + 7}"

    done = _doctor("--hosts", f"{net.address(0)},{net.address(1)},{nowhere}", "--script", str(script))
    assert done.returncode == 1, done.stdout + done.stderr
    rows = {line.split()[0]: line for line in done.stdout.splitlines() if line.startswith("tcp://") and
            not line.split()[0].endswith(":")}
    assert rows[net.address(0)].split()[1] == "ok" and "reached" in rows[net.address(0)]
    assert rows[net.address(1)].split()[1] == "ERROR" and "9.9.9" in rows[net.address(1)]
    assert rows[nowhere].split()[1] == "ERROR"
    found = [line for line in done.stdout.splitlines() if ": error: " in line or ": warning: " in line]
    import torch

    assert sorted(found) == sorted([
        f"{net.address(1)}: error: {script} not found there: the script, working directory, events and checkpoint "
        "directories must be at the same paths on every host (mount the shared filesystem there)",
        f"{net.address(1)}: error: torch 9.9.9 there, {torch.__version__} here: install torch=={torch.__version__} "
        "there",
        f"{nowhere}: error: unreachable (TimeoutError): start `monarch-plugin host --address {nowhere}` there, on the "
        "address this machine reaches it by",
    ]), done.stdout
    assert "2 with errors" in done.stdout

    sound = _doctor("--hosts", net.address(0), "--script", str(script))
    assert sound.returncode == 0, sound.stdout + sound.stderr
    assert "1 host(s) checked" in sound.stdout and "no errors" in sound.stdout
