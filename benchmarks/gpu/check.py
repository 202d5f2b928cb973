"""The prepared GPU check: the plugin's CUDA/ROCm path on the first GPU machine at hand, one table.

    python -m benchmarks.gpu.check                       # on a GPU machine: every row its GPUs allow
    python -m benchmarks.gpu.check --device cpu          # the same harness on CPU tensors (what CI runs)
    python -m benchmarks.gpu.check --rows build,slots,heal --size-mb 512

Needs a CUDA or ROCm build of torch with a GPU (it says so and exits 2 otherwise, unless `--device cpu`), and
for the `forkserver` and `lightning` rows torchmonarch for this Python (those rows say so when it is missing; the
others need only torch and this package). Rows:

  build       torch's version, its CUDA/HIP version, the GPUs seen (name, memory, memory other processes hold)
  slots       the GPU each replica slot of a 2-replica run gets (`procs.devices.plan_gpus`: CUDA_VISIBLE_DEVICES,
              or HIP_VISIBLE_DEVICES on ROCm), or the refusal with fewer GPUs than slots
  heal        the runtime's own heal (`worker.heal.transfer_state`) between two processes, donor to receiver,
              state on the device: over gloo (both on one GPU: the check-only way two replicas share one GPU;
              gloo carries CUDA tensors through the host), and over NCCL/RCCL with two GPUs (NCCL refuses two
              ranks of one communicator on one GPU). Bytes/s against a device-to-device copy of the same bytes
  forkserver  a 2-replica `monarch-run` with `--forkserver` (off by default on GPU builds) whose replicas use
              their GPU: the server never touches CUDA, so forked children must be able to
  lightning   `recipes/lightning_gpt.py --accelerator gpu` with 2 replicas and replica 1 SIGKILLed: exit 0, one
              weight checksum, the replacement among the finishers (2 GPUs; on `--device cpu`, on CPU)

A row that needs more GPUs than there are says so instead of failing. Prints a markdown table; `--out F` also
writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness import REPO

ROWS = ("build", "slots", "heal", "forkserver", "lightning")


def _kind(device: str) -> str:
    if device == "cpu":
        return "cpu"
    return "rocm" if torch.version.hip else "cuda"


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs(device: str) -> str | None:
    """What this machine lacks for the check on `device`, or None."""
    if device == "cpu":
        return None
    if not (torch.version.cuda or torch.version.hip):
        return f"torch {torch.__version__} is a CPU build: install a CUDA or ROCm build of torch"
    if not torch.cuda.is_available():
        return "torch sees no GPU (check the driver, and CUDA_VISIBLE_DEVICES/HIP_VISIBLE_DEVICES)"
    return None


def _monarch() -> str | None:
    """Why the Monarch rows cannot run, or None."""
    try:
        import monarch.actor  # noqa: F401
    except ImportError as e:
        return (f"torchmonarch is not importable for Python {sys.version_info.major}.{sys.version_info.minor} "
                f"({e}): pip install torchmonarch==0.7.0")
    return None


def row_build(args) -> list[tuple[str, str]]:
    build = f"torch {torch.__version__}, " + (f"CUDA {torch.version.cuda}" if torch.version.cuda else
                                                f"HIP {torch.version.hip}" if torch.version.hip else "CPU build")
    out = [("build", build)]
    for i in range(_gpus()):
        free, total = torch.cuda.mem_get_info(i)
        out.append((f"GPU {i}", f"{torch.cuda.get_device_name(i)}, {total / 2**30:.0f} GiB, "
                                f"{(total - free) / 2**30:.1f} GiB held by other processes"))
    out.append(("torchmonarch", _monarch() or "importable"))
    return out


def row_slots(args) -> list[tuple[str, str]]:
    from monarch_plugin.errors import ConfigError
    from monarch_plugin.procs.devices import plan_gpus

    kind = _kind(args.device)
    if kind == "cpu":
        return [("slots", "CPU: no GPU plan (replicas are CPU procs)")]
    out = []
    for slots in (1, 2):
        try:
            plan = plan_gpus(kind, _gpus(), os.environ, slots, 1)
            out.append((f"slots, {slots} replica(s)", str(plan)))
        except ConfigError as e:
            out.append((f"slots, {slots} replica(s)", f"refused: {e}"))
    return out


def _heal_proc(rank: int, port: int, backend: str, device: str, nbytes: int, out: str) -> None:
    """One side of the heal: rank 0 donates `nbytes` of state on its device, rank 1 receives it on its own."""
    import torch.distributed as dist

    from monarch_plugin.worker.context import Flags
    from monarch_plugin.worker.heal import transfer_state

    if device != "cpu":
        torch.cuda.set_device(int(device.split(":")[1]))
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.distributed_c10d._get_default_group()
    dev = torch.device(device)

    class State:
        step = 7

        def __init__(self):
            g = torch.Generator().manual_seed(0)
            chunk = 16 * 2**20 // 4
            self.tensors = [torch.rand(chunk, generator=g).to(dev) for _ in range(max(1, nbytes // (chunk * 4)))]

        def state_dict(self):
            return {"tensors": self.tensors, "step": self.step}

        def sharded(self):
            return {}

    provider = State()  # the receiver's is what it checks the received copy against

    def synced() -> None:  # NCCL's futures complete when the work is queued: time what the device finished
        if device != "cpu":
            torch.cuda.synchronize()
        dist.barrier()

    transfer_state([group], 0 if rank == 0 else None, 1, provider, dev, Flags(), gen=0)  # warms the group
    synced()
    t0 = time.perf_counter()
    state, moved = transfer_state([group], 0 if rank == 0 else None, 1, provider, dev, Flags(), gen=0)
    synced()
    result = {"bytes": moved.bytes, "seconds": time.perf_counter() - t0}
    if rank == 1:
        result["equal"] = all(torch.equal(a, b) for a, b in zip(state["tensors"], provider.tensors))
        result["on"] = str(state["tensors"][0].device)
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def _heal(backend: str, devices: tuple[str, str], nbytes: int) -> dict:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "heal.json")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_heal_proc, args=(r, port, backend, devices[r], nbytes, out)) for r in (0, 1)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(300)
            if p.is_alive():
                p.kill()
        if not os.path.exists(out):
            return {"error": f"exit codes {[p.exitcode for p in procs]}"}
        return json.loads(Path(out).read_text())


def _copy_rate(device: str, nbytes: int) -> float:
    """Bytes/s of a copy of `nbytes` within the device's memory (best of 3)."""
    src = torch.rand(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(3):
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device != "cpu":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def row_heal(args) -> list[tuple[str, str]]:
    nbytes = args.size_mb * 2**20
    first = "cpu" if args.device == "cpu" else "cuda:0"
    copy = _copy_rate(first, nbytes)
    out = [("copy within the device", f"{copy / 1e9:.1f} GB/s ({args.size_mb} MiB)")]
    cases = [("heal over gloo, one device", "gloo", (first, first))]
    if args.device != "cpu":
        cases.append(("heal over NCCL/RCCL, 2 GPUs", "nccl", ("cuda:0", "cuda:1")))
    for name, backend, devices in cases:
        if backend == "nccl" and _gpus() < 2:
            out.append((name, f"needs 2 GPUs, {_gpus()} here (NCCL refuses two ranks of one communicator on one GPU)"))
            continue
        got = _heal(backend, devices, nbytes)
        if "error" in got:
            out.append((name, f"FAILED: {got['error']}"))
            continue
        rate = got["bytes"] / got["seconds"]
        out.append((name, f"{rate / 1e9:.2f} GB/s, {rate / copy:.2f}x the copy; received on {got['on']}, "
                          f"{'equal' if got['equal'] else 'NOT EQUAL'} to the donor's"))
    return out


def _run(cmd: list[str], timeout: float, cwd: Path) -> tuple[int, str]:
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
        return done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return 124, f"no end within {timeout:.0f} s: {out[-500:]}"


def row_forkserver(args) -> list[tuple[str, str]]:
    if _monarch():
        return [("forkserver", f"skipped: {_monarch()}")]
    if args.device != "cpu" and _gpus() < 2:
        return [("forkserver", f"needs 2 GPUs (a GPU per replica), {_gpus()} here")]
    with tempfile.TemporaryDirectory() as tmp:
        events = os.path.join(tmp, "events.jsonl")
        rc, text = _run([sys.executable, "-m", "monarch_plugin.tools.cli", "--replicas", "2", "--forkserver",
                         "--events", events, str(REPO / "recipes" / "elastic_loop.py"), "--epochs", "2",
                         "--step-sleep", "0"], 300, REPO)
        from monarch_plugin.events import read_events

        found = read_events(events) if os.path.exists(events) else []
    server = [e for e in found if e["event"] == "forkserver"]
    if rc != 0:
        return [("forkserver", f"FAILED: exit {rc}: {text.strip().splitlines()[-1] if text.strip() else ''}")]
    if not server:
        return [("forkserver", "FAILED: exit 0 but no `forkserver` event: the procs did not start from the server")]
    return [("forkserver", f"replicas forked from the server (ready {server[0].get('ready')}, its imports "
                           f"{server[0].get('waited_s')} s) trained to the end on their devices: exit 0")]


def row_lightning(args) -> list[tuple[str, str]]:
    if _monarch():
        return [("lightning", f"skipped: {_monarch()}")]
    try:
        import lightning  # noqa: F401
    except ImportError:
        return [("lightning", 'skipped: lightning is not installed (pip install -e ".[lightning]")')]
    if args.device != "cpu" and _gpus() < 2:
        return [("lightning", f"needs 2 GPUs (a GPU per replica), {_gpus()} here")]
    accelerator = "cpu" if args.device == "cpu" else "gpu"
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        rc, text = _run([sys.executable, str(REPO / "recipes" / "lightning_gpt.py"), "--accelerator", accelerator,
                         "--devices", "2", "--min-replicas", "1", "--epochs", "2",
                         "--fault", "sigkill:replica=1:step=6"], 600, Path(tmp))
    took = time.monotonic() - t0
    m = re.search(r"replica weights \[([^\]]*)\] \(replicas \[([^\]]*)\]\)", text)
    if rc != 0 or not m:
        return [("lightning", f"FAILED: exit {rc}: {text.strip().splitlines()[-1] if text.strip() else ''}")]
    checksums, replicas = m.group(1).split(","), [int(r) for r in m.group(2).split(",")]
    ok = len(checksums) == 1 and max(replicas) >= 2
    return [("lightning", f"{'survived' if ok else 'FAILED'}: exit 0, {len(checksums)} weight checksum(s), finished "
                          f"replicas {replicas} ({took:.0f} s)")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (also ROCm: torch's cuda API is HIP there); cpu runs the same harness on CPU tensors")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    p.add_argument("--size-mb", type=int, default=256, help="the state the heal moves")
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = p.parse_args()
    missing = needs(args.device)
    if missing:
        print(f"gpu_check: {missing} (or run `--device cpu` for the harness alone)", file=sys.stderr)
        return 2
    rows: list[tuple[str, str]] = []
    for name in args.rows.split(","):
        rows += globals()[f"row_{name}"](args)
        print(f"{name}: done", file=sys.stderr, flush=True)
    print(f"\n| check ({args.device}) | result |\n|---|---|")
    for name, result in rows:
        print(f"| {name} | {result} |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 1 if any("FAILED" in r or "NOT EQUAL" in r for _, r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
