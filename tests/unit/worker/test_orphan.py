"""How a worker learns that the controller on its machine is gone (`worker.orphan.watch`): by the controller's
process ending, seen through its pidfd, at once."""

from __future__ import annotations

import subprocess
import threading
import time

from monarch_plugin.worker import orphan


def test_the_controllers_end_is_told_at_once_and_once():
    controller = subprocess.Popen(["sleep", "30"])
    told: list[str] = []
    done = threading.Event()
    orphan.watch(controller.pid, lambda why: (told.append(why), done.set()))
    try:
        time.sleep(0.3)
        assert not told
        controller.kill()
        t0 = time.monotonic()
        assert done.wait(5) and time.monotonic() - t0 < 0.5
    finally:
        controller.kill()
        controller.wait()
    time.sleep(0.2)
    assert told == ["the controller's process ended"]
