"""A process without the run's secret steers the run's store, from outside, as an attacker would: a second,
unprivileged user of this machine, created for the test and removed after it, connected to the store's port with a plain
TCPStore client (`tests/support/attacker.py`). It writes forged plans, reports and decisions under the runtime's own
keys, and overwrites the members' addresses in a formation's rendezvous. No forged value is acted on: the run either
finishes with identical replicas, the exact step count and every sample once, or, where the attacker took a key before
the run could write it, stops naming it, with a checkpoint.

Real Monarch procs, real gloo groups, the real store under `monarch-run`.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from support.procs import alive
from support.runs import REPO, WORKLOADS
from monarch_plugin.storage.checkpoint import complete

pytestmark = pytest.mark.timeout(240)

SAMPLES, BATCH, EPOCHS = 240, 24, 6  # 10 steps an epoch
STEPS = EPOCHS * SAMPLES // BATCH
LOOP = ("--samples", str(SAMPLES), "--batch", str(BATCH), "--epochs", str(EPOCHS), "--step-sleep", "0.1")
SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.fixture
def stranger():
    """A user of this machine who is not the run's, removed afterwards; runs `tests/support/attacker.py` with the
    system's Python and the project's packages (the venv's interpreter lives under the run user's home)."""
    if os.geteuid() != 0:
        pytest.skip("creating a second user needs root")
    found = subprocess.run([SYSTEM_PYTHON, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                           text=True)
    assert found.stdout.strip() == str(sys.version_info[:2]), \
        f"{SYSTEM_PYTHON} is not this Python's version: the stranger could not import torch ({found})"
    name = f"mpattack{secrets.token_hex(3)}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    try:
        assert pwd.getpwnam(name).pw_uid != os.geteuid()

        def attack(*args: str, on=lambda did: None) -> list[dict]:
            """What the stranger did, a dict a line; `on(did)` is called as each line comes."""
            proc = subprocess.Popen(
                ["runuser", "-u", name, "--", "env", f"PYTHONPATH={sysconfig.get_paths()['purelib']}",
                 SYSTEM_PYTHON, str(REPO / "tests" / "support" / "attacker.py"), *args],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
            did = []
            try:
                for line in proc.stdout:
                    did.append(json.loads(line))
                    on(did[-1])
                assert proc.wait(timeout=90) == 0, proc.stderr.read()[-3000:]
            finally:
                proc.kill()
                proc.wait()
            return did

        yield attack
    finally:
        subprocess.run(["pkill", "-KILL", "-u", name], check=False)
        subprocess.run(["userdel", name], check=True)


def _steps(run) -> list[dict]:
    path = run.out / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _start(run, replicas: int):
    run.start("--replicas", str(replicas), "--min-replicas", "1", script=WORKLOADS / "logged_loop.py",
              script_args=(*LOOP, "--out", str(run.out)))
    run.wait_for(lambda: len(run.events("join")) >= replicas, timeout=120, what="the first generation")
    return run.events("run_start")[0]["store_port"]


def test_forged_plans_reports_and_rendezvous_addresses_are_never_acted_on(elastic_run, stranger):
    """The stranger forges a plan and `latest`, a raised exception, a SIGTERM, an unfit report and a stall (its count
    and a key it cannot sign); then, the moment each member publishes its address in the next formation (replica 2,
    told to go, brings it about), the stranger overwrites it. Each forged value is reported (`forged_value`) and left:
    no replica is replaced, drained, probed or trusted for it, the overwritten formation is abandoned and formed
    again, and the run ends as an unattacked one does."""
    run = elastic_run()
    port = _start(run, replicas=3)
    drain = run.pids()[2][0]
    did = stranger("--port", str(port), "--replicas", "3", "steer",
                   on=lambda did: did["did"] == "read" and os.kill(drain, signal.SIGTERM))
    assert run.wait(timeout=180) == 0, run.output

    g = next(d["gen"] for d in did if d["did"] == "read")
    forged = {e["key"] for e in run.events("forged_value")}
    assert {"raised", "drains", f"stalled/{g}/0/0", f"stalled/{g + 1}/unfit"} <= forged, forged
    overwritten = [d["key"] for d in did if d["did"] == "overwrote"]
    assert overwritten and forged & set(overwritten), (overwritten, forged)  # a member read a forged address
    assert not run.events("death") and not run.events("give_up")
    assert [n["replica"] for n in run.events("notice")] == [2]  # the test's SIGTERM, not the stranger's
    assert [d["replica"] for d in run.events("drained")] == [2] and len(run.pids()) == 4  # its replacement
    quorums = run.events("quorum")
    assert all(q["action"] == "train" and not q["interrupt"] for q in quorums[:g + 1]), quorums  # no probe
    assert any(q["reason"].startswith("stalled reduction") for q in quorums[g + 1:]), quorums  # the forged addresses'
    assert all(q["gen"] < g + 5 for q in quorums)  # the forged plan was never anyone's generation
    steps = _steps(run)
    assert [r["step"] for r in steps] == list(range(STEPS))
    for epoch in range(EPOCHS):
        assert sorted(i for r in steps if r["epoch"] == epoch for i in r["batch"]) == list(range(SAMPLES)), epoch
    results = run.results()
    assert {r["step"] for r in results.values()} == {STEPS} and len({r["checksum"] for r in results.values()}) == 1


def test_a_formations_decision_taken_before_its_members_stops_the_run_naming_it_with_a_checkpoint(elastic_run,
                                                                                                   stranger):
    """An unauthenticated store cannot keep a key from being written first: the stranger decides the next formation
    "go" before its members can (replica 1, told to go, brings it about). The member finds the decision unsigned, and
    the run stops, naming the key and the store, with a checkpoint of the step its state holds; nothing is left
    running."""
    run = elastic_run()
    port = _start(run, replicas=2)
    did = stranger("--port", str(port), "preempt")
    os.kill(run.pids()[1][0], signal.SIGTERM)
    assert run.wait(timeout=180) != 0
    [key] = next(d["keys"] for d in did if d["did"] == "forged")
    assert key in run.output and "does not carry the run's signature" in run.output, run.output[-3000:]
    assert f"127.0.0.1:{port}" in run.output
    assert key in {e["key"] for e in run.events("forged_value")}
    [give_up] = run.events("give_up")
    assert give_up["checkpoint"] and complete(give_up["checkpoint"]), give_up
    assert Path(give_up["checkpoint"]).name.startswith("step")
    assert len(_steps(run)) < STEPS  # it stopped: nothing trained on after the forged decision
    for pids in run.pids().values():
        assert not any(alive(p) for p in pids), run.pids()
