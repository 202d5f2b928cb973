"""`procs.agent`: an agent started for one run (`--run-store`, as `procs.slurm` starts each node's) ends once that
run's store refuses connections, after the procs it started have ended, and at the latest at its bound; while the
store answers, or does not answer at all, it stays.

Each case runs the agent's watch (`_outlive_run`) in a process of its own, with a child standing in for a proc, and
a listener of the test's standing in for the run's store.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from support.procs import alive

pytestmark = pytest.mark.timeout(60)

_AGENT = """
import subprocess, sys
from monarch_plugin.procs import agent
agent.ORPHAN_MARGIN_S = 0.5
proc = subprocess.Popen(["sleep", sys.argv[3]])
print(proc.pid, flush=True)
agent._outlive_run(("127.0.0.1", int(sys.argv[1])), 0.5, float(sys.argv[2]))
"""


def _agent(port: int, save_s: float, proc_s: float) -> tuple[subprocess.Popen, int]:
    """The watch of an agent with one proc that ends `proc_s` after it starts; (the agent, its proc's pid)."""
    agent = subprocess.Popen([sys.executable, "-c", _AGENT, str(port), str(save_s), str(proc_s)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return agent, int(agent.stdout.readline())


def _store() -> socket.socket:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)  # never accepts: the kernel completes the connections, as for a controller busy elsewhere
    return listener


def test_an_agent_of_one_run_exits_once_its_store_refuses_and_its_procs_have_ended():
    store = _store()
    agent, proc = _agent(store.getsockname()[1], 30.0, 3.0)
    try:
        with pytest.raises(subprocess.TimeoutExpired):  # the store answers: the agent serves on
            agent.wait(timeout=1.5)
        store.close()  # the controller's process is gone
        t0 = time.monotonic()
        assert agent.wait(timeout=10) == 0
        took = time.monotonic() - t0
        # not before its proc ended (3 s after it started), long before the bound (30 s)
        assert 0.5 < took < 5 and not alive(proc), took
        assert "waiting for this host's 1 proc(s)" in agent.stderr.read()
    finally:
        agent.kill()
        agent.wait()


def test_an_agent_of_one_run_ends_a_proc_still_there_at_its_bound():
    store = _store()
    port = store.getsockname()[1]
    store.close()
    agent, proc = _agent(port, 1.0, 60.0)
    try:
        t0 = time.monotonic()
        assert agent.wait(timeout=10) == 0
        took = time.monotonic() - t0
        assert 1.5 < took < 5, took  # the lease (0.5 s), the save (1 s) and the margin (0.5 s)
        deadline = time.monotonic() + 5
        while alive(proc):
            assert time.monotonic() < deadline, "the proc outlived its agent"
            time.sleep(0.05)
        assert "killed 1 process(es) still here past the bound" in agent.stderr.read()
    finally:
        agent.kill()
        agent.wait()


def test_an_agent_of_one_run_does_not_judge_a_store_that_does_not_answer():
    """No answer at all (a cut link, a machine gone) is the replicas' leases' to judge, not the agent's: a store whose
    backlog is full drops the agent's connections unanswered, and the agent stays."""
    store = socket.socket()
    store.bind(("127.0.0.1", 0))
    store.listen(0)
    filling = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(store.getsockname())
        filling.append(filler)
    agent, proc = _agent(store.getsockname()[1], 0.0, 60.0)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            agent.wait(timeout=5)
        assert alive(proc)
    finally:
        agent.kill()
        agent.wait()
        os.kill(proc, signal.SIGKILL)
        for filler in filling:
            filler.close()
        store.close()
