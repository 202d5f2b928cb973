"""benchmarks/gpu/check.py, the prepared GPU check, on this CPU machine: it refuses a CPU build of torch naming
what it needs, and its harness (the heal between two processes through the runtime's own `transfer_state`, the
slot plan, the build row) runs on CPU tensors and says the received state equals the donor's. The GPU rows
themselves run only on a GPU machine (docs/gpus.md)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from support.runs import REPO

CHECK = [sys.executable, "-m", "benchmarks.gpu.check"]


@pytest.mark.skipif(bool(torch.version.cuda or torch.version.hip), reason="a GPU build: the check would run")
def test_on_a_cpu_build_it_says_what_it_needs_and_exits_2():
    done = subprocess.run(CHECK, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "is a CPU build: install a CUDA or ROCm build of torch" in done.stderr and "--device cpu" in done.stderr


def test_its_harness_heals_state_between_two_processes_and_tables_it():
    done = subprocess.run([*CHECK, "--device", "cpu", "--rows", "build,slots,heal", "--size-mb", "16"], cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = dict(line.strip("|").split("|")[:2] for line in done.stdout.splitlines() if line.startswith("| "))
    rows = {k.strip(): v.strip() for k, v in rows.items()}
    assert rows["build"].startswith(f"torch {torch.__version__}") and rows["torchmonarch"] == "importable"
    assert rows["slots"].startswith("CPU: no GPU plan")
    assert "received on cpu, equal to the donor's" in rows["heal over gloo, one device"]
    assert "GB/s" in rows["copy within the device"]
