"""ElasticLoop's durable checkpoints on a GPU: the parts of their path that a CPU run never takes.

One process, one GPU, no Monarch needed (the checkpoint path imports none of it):
  plain      a model and its Adam state on the GPU: the step's copy to host memory (pageable, and into the pinned
             buffers the writer keeps), DCP's write, a relaunch's read back onto the GPU (bitwise equal), against
             one `torch.save` file
  fsdp       the same model sharded with FSDP2 on a one-GPU NCCL mesh: its DTensor shards copied to host memory and
             written, read back into a fresh FSDP2 model on the GPU and into a plain model (another shape)
  rng        the GPU's random generator through the checkpoint's portable form

    python -m benchmarks.gpu.checkpoints [--size 100m] [--device cpu]

Prints one markdown table; exits 2 naming what is missing when there is no GPU (unless --device cpu).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from benchmarks.workloads.mlp import build
from monarch_plugin import ElasticLoop
from monarch_plugin.storage.checkpoint import save_file, step_path
from monarch_plugin.worker import dcp_io
from monarch_plugin.worker.checkpoint_writer import detached_copy
from monarch_plugin.worker.transaction import rng_state, set_rng_state


def _loop(size: str, device: torch.device, fsdp: bool = False) -> ElasticLoop:
    torch.manual_seed(0)
    model = build(size).to(device)
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    return ElasticLoop(model, torch.optim.Adam(model.parameters(), lr=1e-3), dataset_size=64, global_batch_size=8,
                       max_steps=10)


def _train_once(loop: ElasticLoop, device: torch.device) -> None:
    width = next(loop.model.parameters()).shape[1]
    loop.model(torch.randn(8, width, device=device)).sum().backward()
    loop.optimizer.step()
    loop.optimizer.zero_grad(set_to_none=True)
    loop.step = 1


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _equal(a: ElasticLoop, b: ElasticLoop) -> bool:
    return all(torch.equal(_full(x).cpu(), _full(y).cpu()) for x, y in zip(a.model.parameters(), b.model.parameters()))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="100m")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_checkpoints: no GPU visible to this torch (a CUDA or ROCm build of torch and a GPU are needed; "
              "--device cpu runs the same checks on the CPU)", file=sys.stderr)
        return 2
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    rows: list[tuple[str, str]] = []
    if device.type == "cuda":
        rows.append(("device", f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
                               f"CUDA {torch.version.cuda or torch.version.hip}"))
    root = tempfile.mkdtemp(prefix="gpu-ckpt-")
    try:
        loop = _loop(args.size, device)
        _train_once(loop, device)
        params = sum(t.numel() for t in loop.model.parameters())
        copy: dict = {}
        rows.append((f"plain {args.size} ({params / 1e6:.0f}M params + Adam): the step's copy to pageable host memory",
                     f"{_timed(lambda: copy.update(s=detached_copy(loop.checkpoint_state())), device):.0f} ms"))
        staging: dict = {}  # what CheckpointWriter keeps: pinned host buffers, made at the first copy, reused after
        rows.append(("plain: the step's copy into pinned host memory, the first (pinning the buffers)",
                     f"{_timed(lambda: detached_copy(loop.checkpoint_state(), staging), device):.0f} ms"))
        pinned = _timed(lambda: copy.update(s=detached_copy(loop.checkpoint_state(), staging)), device)
        rows.append(("plain: the step's copy into pinned host memory, each one after", f"{pinned:.0f} ms"))
        path = step_path(root, 1)
        rows.append(("plain: DCP write (the thread's part)",
                     f"{_timed(lambda: dcp_io.save(copy['s'], path, None), device):.0f} ms"))
        fresh = _loop(args.size, device)
        rows.append(("plain: load onto the GPU (a relaunch)", f"{_timed(lambda: fresh.resume(path), device):.0f} ms"))
        rows.append(("plain: weights and Adam state equal after load",
                     str(_equal(loop, fresh) and all(
                         torch.equal(a["exp_avg"].cpu(), b["exp_avg"].cpu()) for a, b in
                         zip(loop.optimizer.state.values(), fresh.optimizer.state.values())))))
        old = os.path.join(root, "old.pt")
        rows.append(("plain: previous format, copy + torch.save",
                     f"{_timed(lambda: save_file(detached_copy(loop.state_dict()), old), device):.0f} ms"))

        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method="tcp://127.0.0.1:29561", rank=0, world_size=1)
        try:
            sharded = _loop(args.size, device, fsdp=True)
            _train_once(sharded, device)
            state = sharded.checkpoint_state()
            placed = next(v for v in state["model"].values() if hasattr(v, "device_mesh"))
            rows.append(("fsdp: a parameter as checkpointed", f"DTensor on {placed.device_mesh.device_type} mesh, "
                                                               f"{placed.placements}"))
            fpath = step_path(root, 2)
            written = _timed(lambda: dcp_io.save(detached_copy(state), fpath, None), device)
            rows.append(("fsdp: copy + DCP write", f"{written:.0f} ms"))
            again = _loop(args.size, device, fsdp=True)
            rows.append(("fsdp: load into a fresh FSDP2 model on the GPU",
                         f"{_timed(lambda: again.resume(fpath), device):.0f} ms, equal: {_equal(sharded, again)}"))
            plain = _loop(args.size, device)
            plain.resume(fpath)
            rows.append(("fsdp checkpoint into a plain model (another shape): equal", str(_equal(sharded, plain))))
        finally:
            dist.destroy_process_group()

        before = rng_state(device)
        expected = torch.rand(4, device=device)
        set_rng_state(detached_copy(before), device)
        rows.append(("rng: the GPU generator through the portable form", str(torch.equal(torch.rand(4, device=device),
                                                                                          expected))))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("| check | result |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
