"""tests/workloads/held_loop.py, except that replica REPLICA (the first argument) hangs before its training loop
starts: it imports, then sleeps where a model build or a data loader could wedge, its process answering the
controller all the while. `hangs_when_replaced.py 2 --replicas 2 ...`: the first replacement never gets ready."""

import os
import runpy
import sys
import time
from pathlib import Path

stuck = sys.argv.pop(1)
if os.environ.get("MONARCH_PLUGIN_REPLICA_ID") == stuck:
    while True:
        time.sleep(3600)
runpy.run_path(str(Path(__file__).with_name("held_loop.py")), run_name="__main__")
