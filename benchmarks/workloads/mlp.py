"""The benchmark workload: one MLP training loop, runnable three ways so they compare like for like.

    monarch-run ... benchmarks/workloads/mlp.py --mode elastic   # ElasticLoop under the Monarch controller
    torchrun ...   benchmarks/workloads/mlp.py --mode ddp       # plain torch DDP, the baseline
    torchrun --max-restarts 1 ... --mode ddp --ckpt-every 10     # checkpoint-restart, the other baseline
    torchft_lighthouse --min_replicas 2 --bind 127.0.0.1:<port> ...  # once, then per replica group i:
    REPLICA_GROUP_ID=i NUM_REPLICA_GROUPS=n TORCHFT_LIGHTHOUSE=http://127.0.0.1:<port> \
        torchrun --nproc-per-node 1 --max-restarts 1000 ... --mode torchft   # torchft's DDP fault tolerance

Each process appends "<global step> <unix time>" per committed step to <out>/steps-<id>.txt, which is all
the driver (recovery/sigkill.py) reads, besides the elastic run's events file and torchft's heals-<id>.jsonl.
--device-ms-per-sample sleeps between each forward and backward, an idle stand-in for accelerator time in every
mode: a replica killed during it has sent none of its gradients, as one killed during a GPU's forward or backward
(most of a step) would not have; sleeping after the backward instead would let every kill land after the victim's
reduction, and no system would ever drop a step. torchft's discarded attempts (should_commit False) are logged to
<out>/discarded-<id>.txt.

Elastic mode under `monarch-run --sync-every H` (semi-synchronous) commits every step locally: its step-log lines
are then a replica's local (inner) steps, and what the run learned moves at the syncs. --log-loss writes each
committed step's local loss, "<step> <loss> <samples> <extra>", to <out>/loss-<id>.txt (extra 1: a lost replica's
samples, trained before a sync) and each sync, "<committed steps> <unix time>", to <out>/syncs-<id>.txt.
MLP_TIME_COLLECTIVES=1 in the environment (elastic mode; benchmarks/semi_sync.py) times the blocking part of the
cross-replica reductions and writes it, with the bytes this process wrote (/proc/self/io), to
<out>/collectives-<id>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

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


def backward(loss: torch.Tensor, ms_per_sample: float, local_batch: int) -> None:
    """The step's device time, then its backward (which reduces the gradients). The CPU idles through the first as
    it would while a GPU runs the step: other replicas' processes get the cores."""
    if ms_per_sample:
        time.sleep(ms_per_sample * local_batch / 1000)
    loss.backward()


def tensor_bytes(tree: object) -> int:
    from torch.utils._pytree import tree_leaves

    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


# As torchft's train_ddp.py sets them on CPU: the checkpoint transfer 10 s (per tensor), the manager's RPCs
# (should_commit, checkpoint metadata) and its allreduce callbacks 30 s; gloo's 5 s is --torchft-gloo-timeout.
# After a SIGKILL the survivors that talk to the dead peer error at once (connection reset), but one waiting
# on another survivor sits out the gloo timeout; the next quorum also waits for the lighthouse to drop the
# dead replica (--heartbeat_timeout_ms). The stall is the larger of the two, or the heartbeat alone when the
# kill lands outside an allreduce.
TRANSPORT_TIMEOUT = timedelta(seconds=10)
MANAGER_TIMEOUT = timedelta(seconds=30)


class CollectiveTimer:
    """MLP_TIME_COLLECTIVES=1: the seconds this process spent blocked in the step transaction's reductions, timed by
    wrapping (in this process only) `GradientReducer._complete` (launch the buckets not yet launched, wait for every
    bucket's allreduce, write the sums back: inside backward's final callback when the reduction overlaps backward,
    at a sync's commit otherwise) and `StepTransaction.reduce` (the commit, which holds the former when it was not
    done in backward); `blocked_s` counts time inside either once. With `wchar` of /proc/self/io: the bytes this
    process wrote through write(2)-family calls (gloo's transport writes with writev), from the first step on."""

    def __init__(self) -> None:
        from monarch_plugin.worker.reducer import GradientReducer
        from monarch_plugin.worker.transaction import StepTransaction

        self.depth, self.entered = 0, 0.0
        self.totals = {"blocked_s": 0.0, "complete_s": 0.0, "complete_calls": 0, "reduce_calls": 0}
        self.wchar0: int | None = None
        self._wrap(GradientReducer, "_complete", "complete")
        self._wrap(StepTransaction, "reduce", "reduce")

    def _wrap(self, cls: type, name: str, key: str) -> None:
        inner, timer = getattr(cls, name), self

        def timed(*a: object, **kw: object) -> object:
            t = time.monotonic()
            timer.depth += 1
            try:
                return inner(*a, **kw)
            finally:
                timer.depth -= 1
                spent = time.monotonic() - t
                timer.totals[f"{key}_calls"] += 1
                if key == "complete":
                    timer.totals["complete_s"] += spent
                if timer.depth == 0:
                    timer.totals["blocked_s"] += spent

        setattr(cls, name, timed)

    @staticmethod
    def wchar() -> int:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))

    def start(self) -> None:
        if self.wchar0 is None:
            self.wchar0 = self.wchar()
            self.totals = {k: 0 * v for k, v in self.totals.items()}  # from the first step on, as wchar

    def write(self, path: str, **fields: object) -> None:
        with open(path, "w") as f:
            json.dump({**self.totals, "wchar": self.wchar() - (self.wchar0 or 0), **fields}, f)


def run_torchft(args: argparse.Namespace, model: nn.Module, optimizer: torch.optim.Optimizer, width: int) -> None:
    # Gloo otherwise binds whatever address the hostname resolves to.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torchft
    import torchft.manager
    from torchft.checkpointing.pg_transport import PGTransport

    # torchft 0.2.0 binds its manager server to [::]:<port> with no option to change it; keep it on loopback
    # (the address it advertises is hostname=, below).
    server = torchft.manager.ManagerServer

    def loopback_server(**kwargs: object) -> object:
        return server(**{**kwargs, "bind": "127.0.0.1:" + str(kwargs["bind"]).rsplit(":", 1)[1]})

    torchft.manager.ManagerServer = loopback_server

    class DDP(torchft.DistributedDataParallel):
        @staticmethod
        def _comm_hook(manager, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations
            # torchft 0.2.0's hook asserts on a failed allreduce (a peer SIGKILLed mid-step: gloo's "connection
            # reset"), which kills the survivors too, and on an errored manager's dummy work. The manager has
            # the error already and its should_commit says no, so hand DDP the unreduced bucket instead.
            work = manager.allreduce(bucket.buffer())
            reduced = getattr(work.get_future(), "_fut", None) if work.wait() else None
            if reduced is not None:
                return reduced
            done: torch.futures.Future = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done

    class TimedTransport(PGTransport):
        recv_s: float | None = None

        def recv_checkpoint(self, *a: object, **kw: object) -> object:
            t = time.monotonic()
            state = super().recv_checkpoint(*a, **kw)
            self.recv_s = time.monotonic() - t
            return state

    group = os.environ["REPLICA_GROUP_ID"]
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    ident = f"torchft{group}-{restart}"
    with open(os.path.join(args.out, f"pid-{ident}"), "w") as f:
        f.write(str(os.getpid()))
    heals = open(os.path.join(args.out, f"heals-{ident}.jsonl"), "a")
    quorum_started = 0.0

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(state: dict) -> None:
        # torchft calls this only to heal, from the main thread in should_commit, with a peer's state.
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        now = time.time()
        heals.write(json.dumps({"ts": now, "step": manager.current_step(), "bytes": tensor_bytes(state),
                                "quorum_to_load_s": now - quorum_started, "recv_s": transport.recv_s}) + "\n")
        heals.flush()

    # PGTransport, as train_ddp.py: the checkpoint goes over the quorum's gloo PG, no HTTP server.
    pg = torchft.ProcessGroupGloo(timeout=timedelta(seconds=args.torchft_gloo_timeout))
    transport = TimedTransport(pg, timeout=TRANSPORT_TIMEOUT, device=torch.device("cpu"))
    manager = torchft.Manager(
        pg=pg, min_replica_size=2, load_state_dict=load_state_dict, state_dict=state_dict,
        replica_id=f"mlp_{group}", timeout=MANAGER_TIMEOUT, checkpoint_transport=transport,
        hostname="127.0.0.1",
        # Every replica builds the same weights (manual_seed), so step 0 needs no sync (torchft's advice);
        # heals then mean a replica that came back.
        init_sync=False,
    )
    ddp = DDP(manager, model)
    opt = torchft.Optimizer(manager, optimizer)
    if restart == "0":
        # The lighthouse forms a quorum from the replicas heartbeating (min_replicas of them), so the ones
        # still importing torch would join a few steps in by healing; at launch, wait (a bounded time) until
        # every group's manager is up, so they all start at step 0 as in the other modes.
        open(os.path.join(args.out, f"ready-torchft{group}"), "w").close()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(
                os.path.exists(os.path.join(args.out, f"ready-torchft{i}"))
                for i in range(int(os.environ.get("NUM_REPLICA_GROUPS", "1")))):
            time.sleep(0.05)
    with open(os.path.join(args.out, f"steps-{ident}.txt"), "a") as log, \
            open(os.path.join(args.out, f"discarded-{ident}.txt"), "a") as discarded:
        while manager.current_step() < args.steps:
            quorum_started = time.time()
            opt.zero_grad(set_to_none=True)  # starts the step's quorum; the share below waits for it
            n, rank, step = manager.num_participants(), manager.participating_rank(), manager.current_step()
            # A healing replica (rank None) is not counted in n and torchft zeroes its gradients in the
            # allreduce; as in train_ddp.py it still runs a batch, a participant's share in size.
            share = rank if rank is not None else 0
            first = step * args.global_batch + share * args.global_batch // n
            last = step * args.global_batch + (share + 1) * args.global_batch // n
            x, y = batch(list(range(first, last)), width)
            backward(nn.functional.mse_loss(ddp(x), y), args.device_ms_per_sample, last - first)
            opt.step()  # steps Adam only if every replica's should_commit agreed; then current_step advances
            if manager.current_step() > step:
                log.write(f"{step} {time.time()}\n")
                log.flush()
            else:
                discarded.write(f"{step} {time.time()}\n")
                discarded.flush()
    manager.shutdown(wait=False)
    heals.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("elastic", "ddp", "torchft"), required=True)
    p.add_argument("--size", choices=tuple(SIZES), default="10m")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--ckpt-every", type=int, default=0, help="ddp only: checkpoint-restart baseline")
    p.add_argument("--device-ms-per-sample", type=float, default=0.0, help="idle sleep per local sample per step")
    p.add_argument("--torchft-gloo-timeout", type=float, default=5.0, help="s, bounds a stuck allreduce")
    p.add_argument("--log-loss", action="store_true",
                   help="elastic only: each step's local loss to loss-<id>.txt and each sync to syncs-<id>.txt")
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
        timer = CollectiveTimer() if os.environ.get("MLP_TIME_COLLECTIVES") == "1" else None
        loop = ElasticLoop(model, optimizer, dataset_size=dataset_size, global_batch_size=args.global_batch,
                           max_steps=args.steps, shuffle=False)
        losses = open(os.path.join(args.out, f"loss-{ident}.txt"), "a") if args.log_loss else None
        syncs_log = open(os.path.join(args.out, f"syncs-{ident}.txt"), "a") if args.log_loss else None
        syncs = 0

        def synced() -> None:  # a sync commits between two steps: seen at the top of the next, or after the loop
            nonlocal syncs
            if syncs_log is not None and loop.syncs != syncs:
                syncs = loop.syncs
                syncs_log.write(f"{loop.step} {time.time()}\n")
                syncs_log.flush()

        with open(os.path.join(args.out, f"steps-{ident}.txt"), "a") as log:
            for step in loop:
                synced()
                if timer is not None:
                    timer.start()
                x, y = batch(step.indices, width)
                loss = nn.functional.mse_loss(model(x), y)
                backward(loss, args.device_ms_per_sample, len(step.indices))
                if step.commit():
                    log.write(f"{step.number} {time.time()}\n")
                    log.flush()
                    if losses is not None:
                        losses.write(f"{step.number} {loss.item():.6g} {len(step.indices)} {int(step.extra)}\n")
                        losses.flush()
        synced()
        if timer is not None:
            timer.write(os.path.join(args.out, f"collectives-{ident}.json"), steps=loop.step, syncs=loop.syncs,
                        params=sum(p.numel() for p in model.parameters()))
        return
    if args.mode == "torchft":
        run_torchft(args, model, optimizer, width)
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
            backward(nn.functional.mse_loss(ddp(x), y), args.device_ms_per_sample, local)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            log.write(f"{step} {time.time()}\n")
            log.flush()
            if args.ckpt_every and rank == 0 and (step + 1) % args.ckpt_every == 0:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1},
                           ckpt + ".tmp")
                os.replace(ckpt + ".tmp", ckpt)
    dist.destroy_process_group()
    # Freeing DDP's reducer as main() returns can deadlock in torch 2.13 (~ProcessGroupGloo waits for its worker
    # thread, which waits for the GIL the freeing thread holds to drop its last work): nothing is left to do.
    os._exit(0)


if __name__ == "__main__":
    main()
