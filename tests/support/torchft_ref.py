"""torchft's own DiLoCo / LocalSGD on the toy problem, as a reference to check our semi-sync training against.

`run_torchft_reference` starts one `torchft_lighthouse` and the two replica groups of `workloads/torchft_semi_sync.py`,
all on loopback, and returns the parameters after each sync. Every process it starts is killed by pid when it
returns, pass or fail. The caller skips when torchft is not installed (`pytest.importorskip("torchft")`).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from .runs import WORKLOADS

LIGHTHOUSE_TIMEOUTS = ("--heartbeat_timeout_ms", "1000", "--join_timeout_ms", "1000", "--quorum_tick_ms", "10")
"""As benchmarks/vs_torchft.py: quorums are checked every 10 ms and issued once both groups ask (min_replicas 2)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchft_reference(tmp_path: Path, method: str, sync_every: int, syncs: int, samples: int = 96,
                          batch: int = 16, timeout: float = 120) -> dict[int, dict[str, torch.Tensor]]:
    """{sync (from 1): {name: parameter}} after each of `syncs` syncs of `method` ("diloco" or "local_sgd"), every
    `sync_every` inner steps, two groups of one process each; the groups' parameters are asserted equal."""
    out = tmp_path / f"torchft-{method}"
    out.mkdir(parents=True)
    port = _free_port()
    bin_dir = Path(sys.executable).parent
    procs: list[tuple[subprocess.Popen, Path]] = []

    def start(name: str, cmd: list[str]) -> subprocess.Popen:
        log = out / f"{name}.log"
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=out)
        procs.append((proc, log))
        return proc

    def output() -> str:
        return "\n".join(f"--- {log.name} (rc {proc.poll()}):\n{log.read_text()[-4000:]}" for proc, log in procs)

    try:
        start("lighthouse", [str(bin_dir / "torchft_lighthouse"), "--min_replicas", "2",
                             "--bind", f"127.0.0.1:{port}", *LIGHTHOUSE_TIMEOUTS])
        groups = [start(f"group{g}", [sys.executable, str(WORKLOADS / "torchft_semi_sync.py"), "--method", method,
                                      "--sync-every", str(sync_every), "--syncs", str(syncs),
                                      "--samples", str(samples), "--batch", str(batch), "--group", str(g),
                                      "--groups", "2", "--lighthouse", f"http://127.0.0.1:{port}", "--out", str(out)])
                  for g in range(2)]
        deadline = time.monotonic() + timeout
        # Until both are done, or one failed: the other would wait for it in the next quorum until its timeout.
        while any(proc.poll() is None for proc in groups) and not any(proc.poll() for proc in groups):
            if time.monotonic() > deadline:
                raise AssertionError(f"torchft {method} run still going after {timeout}s:\n{output()}")
            time.sleep(0.05)
        if any(proc.returncode for proc in groups) or not all((out / f"done-{g}").exists() for g in range(2)):
            raise AssertionError(f"torchft {method} run failed:\n{output()}")
        result = {}
        for k in range(1, syncs + 1):
            mine, theirs = (torch.load(out / f"params-{g}-{k}.pt") for g in range(2))
            assert all(torch.equal(mine[n], theirs[n]) for n in mine), f"the groups differ after sync {k}"
            result[k] = mine
        return result
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
