"""Hosts checked before they train, against real host agents in network namespaces, each with a problem induced:
by `monarch-plugin doctor`, and by a run as it attaches them (`preflight`).

Host 0 is sound; host 1's agent sees a torch of another version (a shadowing dist-info first on its `PYTHONPATH`)
and lacks the run's directory (an empty tmpfs over it, in the agent's own mount namespace: a machine without the
shared filesystem); host 2 cannot open connections to the controller's machine (an iptables rule in its namespace:
a firewall), though its agent answers; the last address has no agent. The doctor must name each problem with its
fix, on that host's row only, and exit non-zero; with only the sound host, exit 0.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from support import netns
from support.runs import WORKLOADS

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))]


def _doctor(*args: str) -> subprocess.CompletedProcess:
    """`monarch-plugin doctor ARGS`, run as the installed command is."""
    command = "from monarch_plugin.tools.cli import plugin_command; plugin_command()"
    return subprocess.run([sys.executable, "-c", command, "doctor", *args, "--timeout", "15"],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(shutil.which("iptables") is None, reason="needs iptables (the firewalled host)")
def test_doctor_names_each_hosts_problem_with_its_fix_and_fails_only_on_errors(hosts, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    script = shared / "train.py"
    script.write_text("print('training')\n")
    shadow = tmp_path / "shadow" / "torch-9.9.9.dist-info"
    shadow.mkdir(parents=True)
    (shadow / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 9.9.9\n")
    net = hosts(3)
    net.start_agent(0)
    net.start_agent(1, env={"PYTHONPATH": str(shadow.parent)}, hide=shared)
    net.start_agent(2)
    net.wait_listed(3)
    net.wall_off(2)
    nowhere = f"tcp://{net.ip(1)}:{netns.AGENT_PORT + 7}"

    done = _doctor("--hosts", ",".join([*(net.address(i) for i in range(3)), nowhere]), "--script", str(script))
    assert done.returncode == 1, done.stdout + done.stderr
    rows = {line.split()[0]: line for line in done.stdout.splitlines() if line.startswith("tcp://") and
            not line.split()[0].endswith(":")}
    assert rows[net.address(0)].split()[1] == "ok" and "reached" in rows[net.address(0)]
    assert rows[net.address(1)].split()[1] == "ERROR" and "9.9.9" in rows[net.address(1)]
    assert rows[net.address(2)].split()[1] == "ERROR" and rows[nowhere].split()[1] == "ERROR"
    found = [line for line in done.stdout.splitlines() if ": error: " in line or ": warning: " in line]
    import torch

    public = torch.__version__.split("+")[0]
    assert sorted(found[:2]) == sorted([
        f"{net.address(1)}: error: {script} not found there: the script, working directory, events and checkpoint "
        "directories must be at the same paths on every host (mount the shared filesystem there)",
        f"{net.address(1)}: error: torch 9.9.9 there, {torch.__version__} here: install torch=={public} there",
    ]), done.stdout
    [walled_off, unreachable] = found[2:]
    # Not "start an agent there": its agent runs, and the way back to this machine is what is closed.
    assert walled_off.startswith(f"{net.address(2)}: error: its agent answers, but the attach failed ("), done.stdout
    assert walled_off.endswith(f"the host cannot open connections back to this machine, where Monarch and a run's "
                               f"store listen on free ports of {net.controller_ip}: open this machine's TCP ports to "
                               "the host (a firewall?), or set `store_host` to an address it reaches"), done.stdout
    fix = f"start `monarch-plugin host --address {nowhere}` there, on the address this machine reaches it by"
    assert unreachable.startswith(f"{nowhere}: error: unreachable (") and unreachable.endswith(fix), done.stdout
    assert "3 with errors" in done.stdout

    sound = _doctor("--hosts", net.address(0), "--script", str(script))
    assert sound.returncode == 0, sound.stdout + sound.stderr
    assert "1 host(s) checked" in sound.stdout and "no errors" in sound.stdout


def test_a_run_checks_each_host_as_it_attaches_it_and_refuses_one_with_an_error(elastic_run, hosts, tmp_path):
    """`preflight` (on by default with `hosts`): the watcher each host gets is the doctor's probe, so a run checks
    a host as the doctor does. Host 1's agent sees another torch: it is refused, naming the version and the fix,
    the doctor's table is logged, and the run trains on host 0 alone. With `--no-preflight` the same host is used."""
    shadow = tmp_path / "shadow" / "torch-9.9.9.dist-info"
    shadow.mkdir(parents=True)
    (shadow / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 9.9.9\n")
    net = hosts(2)
    net.start_agent(0)
    net.start_agent(1, env={"PYTHONPATH": str(shadow.parent)})
    net.wait_listed(2)
    import torch

    def run_on_both(*flags: str):
        run = elastic_run()
        run.start("--hosts", f"{net.address(0)},{net.address(1)}", "--store-host", net.controller_ip, "--replicas",
                  "2", "--min-replicas", "1", "--replicas-per-host", "2", *flags,
                  script=WORKLOADS / "logged_loop.py",
                  script_args=("--epochs", "1", "--samples", "48", "--batch", "12", "--out", str(run.out)))
        assert run.wait(timeout=150) == 0, run.output
        return run

    checked = run_on_both()
    [refused] = checked.events("host_refused")
    assert refused["address"] == net.address(1)
    public = torch.__version__.split("+")[0]
    assert refused["reason"] == f"torch 9.9.9 there, {torch.__version__} here: install torch=={public} there"
    assert [e["address"] for e in checked.events("host_up")] == [net.address(0)]
    assert {s["host"] for s in checked.events("spawn")} == {net.address(0)}
    assert "hosts checked (`preflight`" in checked.output and "ERROR" in checked.output

    unchecked = run_on_both("--no-preflight")
    assert not unchecked.events("host_refused")
    assert sorted(e["address"] for e in unchecked.events("host_up")) == [net.address(0), net.address(1)]
