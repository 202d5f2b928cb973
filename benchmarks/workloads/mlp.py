"""The benchmark workload: one MLP training loop, runnable three ways so they compare like for like.

    monarch-run ... benchmarks/workloads/mlp.py --mode elastic   # ElasticLoop under the Monarch controller
    torchrun ...   benchmarks/workloads/mlp.py --mode ddp       # plain torch DDP, the baseline
    torchrun --max-restarts 1 ... --mode ddp --ckpt-every 10     # checkpoint-restart, the other baseline

Each process appends "<global step> <unix time>" per committed step to <out>/steps-<id>.txt, which is all
the driver (recovery/sigkill.py) reads, besides the elastic run's events file.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn

SIZES = {  # (width, hidden, blocks)
    "tiny": (64, 256, 1), "10m": (1024, 4096, 1), "100m": (2048, 8192, 3), "300m": (2048, 8192, 9),
}


def build(size: str) -> nn.Module:
    width, hidden, blocks = SIZES[size]
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width)]
    return nn.Sequential(*layers)


def batch(indices: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(indices[0] if indices else 0)
    x = torch.randn(len(indices), width, generator=g)
    return x, x.flip(-1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("elastic", "ddp"), required=True)
    p.add_argument("--size", choices=tuple(SIZES), default="10m")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--ckpt-every", type=int, default=0, help="ddp only: checkpoint-restart baseline")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    width = SIZES[args.size][0]
    model = build(args.size)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    dataset_size = args.global_batch * (args.steps + 1)

    if args.mode == "elastic":
        from monarch_plugin import ElasticLoop, worker_context

        ident = worker_context().replica_id
        loop = ElasticLoop(model, optimizer, dataset_size=dataset_size, global_batch_size=args.global_batch,
                           max_steps=args.steps, shuffle=False)
        with open(os.path.join(args.out, f"steps-{ident}.txt"), "a") as log:
            for step in loop:
                x, y = batch(step.indices, width)
                nn.functional.mse_loss(model(x), y).backward()
                if step.commit():
                    log.write(f"{step.number} {time.time()}\n")
                    log.flush()
        return

    # After a torchrun restart the agent's store still holds the last round's gloo addresses: namespace it.
    store, rank, world = next(dist.rendezvous("env://"))
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("gloo", store=dist.PrefixStore(f"round{restart}", store), rank=rank, world_size=world)
    ddp = nn.parallel.DistributedDataParallel(model)
    start = 0
    ckpt = os.path.join(args.out, "ckpt.pt")
    if args.ckpt_every and os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    ident = f"{rank}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    with open(os.path.join(args.out, f"pid-{ident}"), "w") as f:
        f.write(str(os.getpid()))
    local = args.global_batch // world
    with open(os.path.join(args.out, f"steps-{ident}.txt"), "a") as log:
        for step in range(start, args.steps):
            first = step * args.global_batch + rank * local
            x, y = batch(list(range(first, first + local)), width)
            nn.functional.mse_loss(ddp(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            log.write(f"{step} {time.time()}\n")
            log.flush()
            if args.ckpt_every and rank == 0 and (step + 1) % args.ckpt_every == 0:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1},
                           ckpt + ".tmp")
                os.replace(ckpt + ".tmp", ckpt)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
