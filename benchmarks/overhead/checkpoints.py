"""ElasticLoop's durable checkpoints: torch.distributed.checkpoint (DCP) against the format it replaced (one
`torch.save` file per proc), and against DCP without the digests it is written with (`digests.json`: each file's
size and SHA-256, checked before a resume), side by side in one invocation, interleaved, at 10M and 100M parameters.

For each size, one proc holding benchmarks/workloads/mlp.py's model and its Adam state after one step:
  critical path   what the training thread pays at the step boundary: the state as each format takes it, copied
                  to memory the next step does not touch (`detached_copy`)
  background      the writer thread's part: the copy to disk, fsynced (DCP: its files and its metadata)
  load            a relaunch's read of it into a fresh model and optimizer (DCP: through its allow-listed readers;
                  with digests, after every file is checked against them)

    python -m benchmarks.overhead.checkpoints --repeats 3 --out benchmarks/results

Writes <out>/checkpoints.json and prints a markdown table of medians (pasted into docs/benchmarks.md). The files
are read back while still in the page cache: load times are of a warm read, as a relaunch on the same machine gets.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from benchmarks.harness import add_out, interleave, median, write_json
from benchmarks.workloads.mlp import build
from monarch_plugin import ElasticLoop
from monarch_plugin.storage.checkpoint import DIGESTS, save_file, step_path
from monarch_plugin.worker import dcp_io
from monarch_plugin.worker.checkpoint_writer import detached_copy


def _loop(size: str) -> ElasticLoop:
    torch.manual_seed(0)
    model = build(size)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    return ElasticLoop(model, optimizer, dataset_size=64, global_batch_size=8, max_steps=10)


def _trained(size: str) -> ElasticLoop:
    loop = _loop(size)
    width = next(loop.model.parameters()).shape[1]
    loop.model(torch.randn(8, width)).sum().backward()
    loop.optimizer.step()
    loop.optimizer.zero_grad(set_to_none=True)
    loop.step = 1
    return loop


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _previous(loop: ElasticLoop, size: str, directory: Path) -> dict:
    path = str(directory / "step00000001-local0-of1.pt")
    copy: dict = {}
    critical = _timed(lambda: copy.update(state=detached_copy(loop.state_dict())))
    background = _timed(lambda: save_file(copy["state"], path))
    fresh = _loop(size)
    load = _timed(lambda: fresh.load_state_dict(torch.load(path, weights_only=False)))
    return {"critical_s": critical, "background_s": background, "load_s": load, "bytes": os.path.getsize(path)}


def _undigested(state: dict, path: str) -> None:
    """DCP's own writer, as `dcp_io.save` wrote before it recorded digests."""
    os.makedirs(path)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)


def _dcp(loop: ElasticLoop, size: str, directory: Path, digests: bool = True) -> dict:
    path = step_path(str(directory), 1)
    copy: dict = {}
    critical = _timed(lambda: copy.update(state=detached_copy(loop.checkpoint_state())))
    background = _timed(lambda: dcp_io.save(copy["state"], path, None) if digests else
                        _undigested(copy["state"], path))
    assert os.path.exists(os.path.join(path, DIGESTS)) == digests
    fresh = _loop(size)
    load = _timed(lambda: fresh.resume(path))
    assert all(torch.equal(a, b) for a, b in zip(loop.model.parameters(), fresh.model.parameters()))
    size = sum(f.stat().st_size for f in Path(path).iterdir())
    return {"critical_s": critical, "background_s": background, "load_s": load, "bytes": size}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", default=["10m", "100m"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the checkpoints are written (a temporary directory)")
    add_out(p)
    args = p.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-bench-"))
    results: dict = {}
    for size in args.sizes:
        loop = _trained(size)
        params = sum(t.numel() for t in loop.model.parameters())

        def timed(fmt: str, fn, i: int, loop=loop, size=size) -> dict:
            directory = root / f"{size}-{fmt}-{i}"
            directory.mkdir(parents=True)
            result = fn(loop, size, directory)
            shutil.rmtree(directory)
            return result

        variants = {"previous": _previous, "undigested": lambda *a: _dcp(*a, digests=False), "dcp": _dcp}
        runs = interleave({fmt: lambda i, fmt=fmt, fn=fn: timed(fmt, fn, i) for fmt, fn in variants.items()},
                          args.repeats, shown=None)
        results[size] = {"params": params, **runs}
    shutil.rmtree(root, ignore_errors=True)
    write_json(args.out, "checkpoints", results)

    def med(size: str, fmt: str, key: str) -> float:
        return median(r[key] for r in results[size][fmt])

    fmts = ("previous", "undigested", "dcp")
    print(f"| median of {args.repeats} | " + " | ".join(f"{s} torch.save | {s} DCP, no digests | {s} DCP"
                                                          for s in args.sizes) + " |")
    print("|---|" + "---|---|---|" * len(args.sizes))
    for key, label in (("critical_s", "critical path (copy at the step)"), ("background_s", "background write"),
                       ("load_s", "load (relaunch)")):
        print(f"| {label} | " + " | ".join(f"{med(s, f, key) * 1e3:.0f} ms" for s in args.sizes for f in fmts) + " |")
    print("| on disk | " + " | ".join(f"{med(s, f, 'bytes') / 2**20:.0f} MiB" for s in args.sizes for f in fmts) + " |")


if __name__ == "__main__":
    main()
