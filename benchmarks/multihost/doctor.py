"""How long `monarch-plugin doctor` takes: 1, 2 and 3 namespace hosts, then 3 and an address with no agent.

    sudo python -m benchmarks.multihost.doctor [--timeout 10]

Hosts are Linux network namespaces with a real `monarch-plugin host` agent each (`tests/support/netns.py`, as the
multi-host tests make them; root needed), all removed at the end. Each row is one invocation of the installed
command, timed from outside (start-up included) and as the command reports its own checking.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.support import netns  # the namespace hosts the multi-host tests make


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--timeout", type=float, default=10.0, help="the doctor's --timeout per host")
    args = p.parse_args()
    why = netns.available()
    if why:
        raise SystemExit(f"benchmarks.multihost.doctor: {why}")
    with tempfile.TemporaryDirectory() as tmp:
        net = netns.NetnsHosts(3, Path(tmp))
        try:
            net.start_agents()
            nowhere = f"tcp://{net.ip(2)}:{netns.AGENT_PORT + 9}"
            cases = {"1 host": [net.address(0)], "2 hosts": [net.address(i) for i in range(2)],
                     "3 hosts": [net.address(i) for i in range(3)],
                     "3 hosts + 1 without an agent": [*(net.address(i) for i in range(3)), nowhere]}
            print("| hosts | whole command | checking (its own report) | exit |\n|---|---|---|---|")
            for name, addresses in cases.items():
                t0 = time.monotonic()
                done = subprocess.run([sys.executable, "-c", "import sys; from monarch_plugin.tools.cli import plugin; "
                                       "sys.exit(plugin(sys.argv[1:]))", "doctor", "--hosts", ",".join(addresses),
                                       "--timeout", str(args.timeout)], capture_output=True, text=True, timeout=300)
                took = time.monotonic() - t0
                own = re.search(r"checked in ([0-9.]+) s", done.stdout)
                print(f"| {name} | {took:.1f} s | {own.group(1) if own else '?'} s | {done.returncode} |", flush=True)
        finally:
            net.close()


if __name__ == "__main__":
    main()
