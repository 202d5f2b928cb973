"""`procs.pidwatch`: a death seen by its pidfd."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(60)


def test_pidwatch_reports_a_death_whose_pidfd_is_numbered_past_select_s_limit():
    """A controller of a few hundred procs holds over 1,024 fds (a store connection per proc, their pidfds):
    select() refuses those, which ended the watch thread and every death notice with it."""
    import os
    import queue
    import resource
    import subprocess

    from monarch_plugin.procs.pidwatch import PidWatch

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"this machine allows {hard} open files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    proc = subprocess.Popen(["sleep", "60"])
    deaths: queue.Queue = queue.Queue()
    watch = PidWatch(lambda replica, pid: deaths.put((replica, pid)))
    try:
        watch.watch(7, [proc.pid])
        assert max(watch._running) > 1024
        proc.kill()
        assert deaths.get(timeout=5) == (7, proc.pid)
    finally:
        watch.close()
        proc.kill()
        proc.wait()
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
