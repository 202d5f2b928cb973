"""A replica that starts a process the way a user's code may (multiprocessing with an explicit "forkserver" context,
as a DataLoader given `multiprocessing_context="forkserver"` does) and writes OUT/pids-<replica>.json: its own pid
and its child's. Replica 0 returns after a few seconds; the others wait to be killed.

    monarch-run --replicas 2 --min-replicas 1 spawns_children.py OUT
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time

from monarch_plugin import worker_context


def sleeper() -> None:
    time.sleep(1000)


def main() -> None:
    ctx = worker_context()
    child = multiprocessing.get_context("forkserver").Process(target=sleeper)
    child.start()
    with open(os.path.join(sys.argv[1], f"pids-{ctx.replica_id}.json"), "w") as f:
        json.dump({"replica": os.getpid(), "child": child.pid}, f)
    time.sleep(8 if ctx.replica_id == 0 else 1000)


if __name__ == "__main__":
    main()
