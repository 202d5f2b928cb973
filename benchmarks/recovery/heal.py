"""The live heal against what this machine can move: the same bytes by memcpy and over a loopback socket.

For each model size (benchmarks/workloads/mlp.py's MLP with Adam: weights, exp_avg and exp_avg_sq), in one invocation:
  heal          monarch-run, D + 1 replicas for each D of `--donors` (`--heal-donors D`); replica 1 SIGKILLed; its
                replacement healed from the D survivors, one share of the state each, at once. Read from the donors'
                `heal` events (one per share): `transfer_s` (the tensors, one gloo broadcast each) and `seconds` (the
                whole heal: its process groups, the pickled skeleton, the tensors), the slowest share's
  memcpy        the same tensors copied in this process, one thread, tensor by tensor: into buffers already
                touched (the memory bandwidth; best of 3), and into fresh ones (what a receiver pays: allocation
                and first-touch page faults; best of 2)
  socket        the same tensors sent over one loopback TCP connection (and over two at once, half the bytes each:
                what several donors serving disjoint shards could reach here) to another process that receives them
                (`sendall` / `recv_into`, no serialisation, 4 MB socket buffers): into fresh buffers, then again
                into the same ones, touched; the kernel's copy in and out

    python -m benchmarks.recovery.heal --sizes 10m 100m 300m --donors 1 --out benchmarks/results
    python -m benchmarks.recovery.heal --sizes 10m 100m --donors 1 2 --out benchmarks/results/heal-donors

300m needs about 5 GB per replica (weights, gradients, Adam) and three of them at once (the survivor, the dead
replica's memory not yet returned, the replacement); with two donors, four (too many for 24 GB).
Writes <out>/heal.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import socket
import threading
import time
from pathlib import Path

import torch

from benchmarks.harness import add_out, write_json
from benchmarks.recovery.sigkill import run_elastic
from benchmarks.workloads.mlp import build
from monarch_plugin.events import read_events

PLAN = {"10m": dict(steps=30, kill_at=10), "100m": dict(steps=14, kill_at=5), "300m": dict(steps=10, kill_at=6)}


def state_tensors(size: str) -> list[torch.Tensor]:
    """What a heal moves for this model: its weights and Adam's two moments (after one step, so they exist)."""
    torch.manual_seed(0)
    model = build(size)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    moments = [t for s in optimizer.state.values() for k, t in s.items() if k != "step"]
    return [p.detach() for p in model.parameters()] + moments


def nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def memcpy(tensors: list[torch.Tensor]) -> dict:
    """Best of two copies into fresh buffers (allocated for it, as a receiver's are), best of three into touched."""
    torch.set_num_threads(1)
    fresh_s = []
    for _ in range(2):
        t0 = time.perf_counter()
        fresh = [torch.empty_like(t) for t in tensors]
        for d, s in zip(fresh, tensors):
            d.copy_(s)
        fresh_s.append(time.perf_counter() - t0)
        if len(fresh_s) < 2:
            del fresh
    warm = []
    for _ in range(3):
        t0 = time.perf_counter()
        for d, s in zip(fresh, tensors):
            d.copy_(s)
        warm.append(time.perf_counter() - t0)
    return {"fresh_s": min(fresh_s), "warm_s": min(warm)}


BUFFER = 4 << 20
"""Socket send and receive buffers: 4 MB, as a tuned bulk transfer would set them (the defaults are ~200 KB)."""


def _lanes(tensors: list[torch.Tensor], streams: int) -> list[list[int]]:
    """The tensors' indices cut into `streams` lanes of about equal bytes (largest first, each to the lightest)."""
    lanes: list[list[int]] = [[] for _ in range(streams)]
    load = [0] * streams
    for i in sorted(range(len(tensors)), key=lambda i: -tensors[i].numel()):
        lane = load.index(min(load))
        lanes[lane].append(i)
        load[lane] += tensors[i].numel() * tensors[i].element_size()
    return lanes


def _receive(port: int, shapes: list[tuple], dtypes: list[torch.dtype], lanes: list[list[int]]) -> None:
    buffers = [torch.empty(s, dtype=d) for s, d in zip(shapes, dtypes)]
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in lanes]

    def lane(sock: socket.socket, indices: list[int]) -> None:
        for i in indices:
            view = memoryview(buffers[i].numpy()).cast("B")
            got = 0
            while got < len(view):
                got += sock.recv_into(view[got:])

    for sock in socks:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER)
    for _ in range(2):  # into fresh buffers, then again into the same ones, touched
        threads = [threading.Thread(target=lane, args=(s, ix)) for s, ix in zip(socks, lanes)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        socks[0].sendall(b"k")
    for sock in socks:
        sock.close()


def loopback_socket(tensors: list[torch.Tensor], streams: int) -> dict:
    """`streams` TCP connections on loopback (each a thread at both ends, carrying about equal bytes) to a fresh
    interpreter (spawned, so it shares no pages with this one)."""
    lanes = _lanes(tensors, streams)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(streams)
        child = mp.get_context("spawn").Process(
            target=_receive, args=(server.getsockname()[1], [t.shape for t in tensors], [t.dtype for t in tensors],
                                   lanes))
        child.start()
        conns = [server.accept()[0] for _ in lanes]
        for conn in conns:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER)

        def lane(conn: socket.socket, indices: list[int]) -> None:
            for i in indices:
                conn.sendall(memoryview(tensors[i].numpy()).cast("B"))

        seconds = []
        for _ in range(2):
            t0 = time.perf_counter()
            threads = [threading.Thread(target=lane, args=(c, ix)) for c, ix in zip(conns, lanes)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert conns[0].recv(1) == b"k"
            seconds.append(time.perf_counter() - t0)
        for conn in conns:
            conn.close()
    child.join(timeout=60)
    return {"fresh_s": seconds[0], "warm_s": seconds[1]}


def heal(work: Path, size: str, donors: int) -> dict:
    """`donors` + 1 replicas, replica 1 killed: its replacement is healed by the `donors` survivors, one share each.
    The heal's bytes are its shares' sum; its times, the slowest share's (they run at once)."""
    plan = PLAN[size]
    run = run_elastic(work, size, replicas=donors + 1, steps=plan["steps"], kill_at=plan["kill_at"], min_replicas=1,
                      heal_donors=donors)
    events = read_events(str(Path(run["out"]) / "events.jsonl"))
    death = next(e for e in events if e["event"] == "death")
    gen = next(e for e in events if e["event"] == "heal" and e["ts"] > death["ts"])["gen"]
    shares = [e for e in events if e["event"] == "heal" and e["gen"] == gen]
    if len(shares) != donors:
        raise RuntimeError(f"the heal had {len(shares)} share(s), not {donors}; see {run['out']}")
    return {"donors": donors, "bytes": sum(e["bytes"] for e in shares),
            "seconds": max(e["seconds"] for e in shares), "transfer_s": max(e["transfer_s"] for e in shares),
            "step_s": run["step_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", choices=tuple(PLAN), default=list(PLAN))
    add_out(p)
    p.add_argument("--donors", type=int, nargs="+", choices=(1, 2), default=[1, 2],
                   help="a heal run for each: this many survivors serve the replacement, one share each")
    p.add_argument("--work", type=Path, default=Path("/tmp/monarch_plugin_heal"))
    args = p.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    results = {}
    for size in args.sizes:
        tensors = state_tensors(size)
        row = {"bytes": nbytes(tensors), "tensors": len(tensors), "memcpy": memcpy(tensors),
               "socket": loopback_socket(tensors, 1), "socket2": loopback_socket(tensors, 2)}
        del tensors
        row["heal"] = {str(n): heal(args.work, size, n) for n in args.donors}
        results[size] = row
        print(json.dumps({size: row}), flush=True)
    write_json(args.out, "heal", results)
    print(table(results))


def table(results: dict) -> str:
    def rate(nbytes: int, seconds: float) -> str:
        return f"{seconds * 1000:.0f} ms ({nbytes / seconds / 1e9:.2f} GB/s)"

    rows = ["| | " + " | ".join(f"{s} ({r['bytes'] / 1e6:.0f} MB, {r['tensors']} tensors)"
                                 for s, r in results.items()) + " |", "|---|" + "---|" * len(results)]

    def row(name, fn):
        rows.append(f"| {name} | " + " | ".join(fn(r) for r in results.values()) + " |")

    row("memcpy, warm destination (1 thread)", lambda r: rate(r["bytes"], r["memcpy"]["warm_s"]))
    row("memcpy, fresh destination (1 thread)", lambda r: rate(r["bytes"], r["memcpy"]["fresh_s"]))
    row("loopback TCP socket, fresh destination", lambda r: rate(r["bytes"], r["socket"]["fresh_s"]))
    row("loopback TCP socket, warm destination", lambda r: rate(r["bytes"], r["socket"]["warm_s"]))
    row("2 loopback TCP sockets at once, fresh destination", lambda r: rate(r["bytes"], r["socket2"]["fresh_s"]))
    for n in next(iter(results.values()))["heal"]:
        by = f"{n} donor{'s' if n != '1' else ''}"
        row(f"**heal, {by}: the tensors (gloo broadcasts)**",
            lambda r: rate(r["heal"][n]["bytes"], r["heal"][n]["transfer_s"]))
        row(f"heal, {by}: the whole heal (groups, skeleton, tensors)",
            lambda r: rate(r["heal"][n]["bytes"], r["heal"][n]["seconds"]))
        streams = "socket" if n == "1" else "socket2"  # the socket copy over as many streams, where measured
        row(f"heal, {by} / socket copy over {n} stream(s) (fresh)",
            lambda r: f"{r['heal'][n]['transfer_s'] / r[streams]['fresh_s']:.2f}x")
    row("heal / memcpy (fresh), 1 donor", lambda r: f"{r['heal']['1']['transfer_s'] / r['memcpy']['fresh_s']:.2f}x")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
