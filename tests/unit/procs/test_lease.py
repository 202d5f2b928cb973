"""A proc's lease on the controller's store (`procs.lease`), with a real store in a process of its own as the
controller: a worker that loses it is told (`on_lost`) and goes on to save the run; only its host declared lost by the
controller ends it at once (`test_signing.py`)."""

from __future__ import annotations

import subprocess
import sys
import time

CONTROLLER = """
import datetime, sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10))
print(store.port, flush=True)
time.sleep(60)
"""

PROC = """
import sys, time
from monarch_plugin.procs.lease import Lease
Lease("127.0.0.1", int(sys.argv[1]), 0, 1.0, "a test proc", "00" * 32, on_lost=lambda why: print("lost:", why,
      flush=True))
print("leased", flush=True)
time.sleep(30)
"""


def test_a_worker_that_loses_the_controllers_store_is_told_once_and_is_not_ended():
    controller = subprocess.Popen([sys.executable, "-c", CONTROLLER], stdout=subprocess.PIPE, text=True)
    proc = None
    try:
        port = controller.stdout.readline().strip()
        proc = subprocess.Popen([sys.executable, "-c", PROC, port], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "leased"
        time.sleep(1.5)  # three touches answered: nothing said
        controller.kill()
        t0 = time.monotonic()
        assert proc.stdout.readline().strip() == "lost: no contact with the controller for 1.0 s"
        assert 0.4 < time.monotonic() - t0 < 4  # a lease (1 s) after its last answered touch (<= a beat ago)
        time.sleep(1.5)
        assert proc.poll() is None  # told, not ended: the worker saves the run, then ends itself (`worker.orphan`)
    finally:
        for p in (controller, proc):
            if p is not None:
                p.kill()
                p.wait()
    assert proc.stdout.read() == ""  # told once
