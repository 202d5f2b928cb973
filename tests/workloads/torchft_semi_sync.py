"""One replica group of a torchft 0.2.0 DiLoCo or LocalSGD run, the reference our own semi-sync training is checked
against: the toy problem (`_toy.py`), each group training its share (`share`) of the ElasticSampler's global batch
with its own Adam, synced every --sync-every inner steps by torchft's own `DiLoCo` (one fragment, no sync delay; the
outer optimizer SGD(lr 0.7, momentum 0.9, nesterov) as torchtitan's torchft integration builds it) or `LocalSGD`.

    torchft_lighthouse --min_replicas 2 --bind 127.0.0.1:<port> ...   # once, then for R in 0 1:
    python tests/workloads/torchft_semi_sync.py --method diloco --sync-every 4 --syncs 3 --group R \
        --lighthouse http://127.0.0.1:<port> --out DIR

After sync k (from 1) it writes DIR/params-<group>-<k>.pt ({name: tensor}, the parameters every group then holds),
and DIR/done-<group> at the end. `support/torchft_ref.py` runs the two groups and the lighthouse.

The group is one process (group rank 0 of 1) serving its own group's TCPStore, on loopback only (torch's store binds
every interface unless handed a socket: `stores.serve`); the manager server is patched onto loopback as in
benchmarks/workloads/mlp.py, and gloo pinned to `lo`. `init_sync=False`: both groups build the same weights (seeded),
and with the default the first quorum, which these wrappers ask for only at the first sync (after H local steps),
makes group 1 heal from group 0 there: its H steps and Adam state are replaced by group 0's before the average. The
quorum is synchronous for both methods (DiLoCo requires it; for LocalSGD, with no failure, it changes nothing). The
manager's step counts syncs: after K syncs it is K unless a sync's should_commit failed, which the run asserts.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torchft
import torchft.manager
from _toy import toy_problem
from torch import nn
from torchft.checkpointing.pg_transport import PGTransport
from torchft.local_sgd import DiLoCo, LocalSGD

from monarch_plugin.data.sampler import ElasticSampler, share
from monarch_plugin.procs.stores import serve

p = argparse.ArgumentParser()
p.add_argument("--method", choices=("diloco", "local_sgd"), required=True)
p.add_argument("--sync-every", type=int, required=True)
p.add_argument("--syncs", type=int, required=True)
p.add_argument("--samples", type=int, default=96)
p.add_argument("--batch", type=int, default=16, help="the global batch of an inner step, over all groups")
p.add_argument("--group", type=int, required=True)
p.add_argument("--groups", type=int, default=2)
p.add_argument("--lighthouse", required=True)
p.add_argument("--out", required=True)
args = p.parse_args()

_server = torchft.manager.ManagerServer


def _loopback_server(**kwargs: object) -> object:
    """torchft binds its manager server to [::]:<port> with no option to change it."""
    return _server(**{**kwargs, "bind": "127.0.0.1:" + str(kwargs["bind"]).rsplit(":", 1)[1]})


torchft.manager.ManagerServer = _loopback_server

torch.set_num_threads(1)
x, y, model = toy_problem(args.samples)
inner = torch.optim.Adam(model.parameters(), lr=1e-2)
os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo otherwise binds whatever address the hostname resolves to
store = serve("127.0.0.1", 0, timeout_s=60)
pg = torchft.ProcessGroupGloo(timeout=timedelta(seconds=30))
manager = torchft.Manager(
    pg=pg, min_replica_size=args.groups, use_async_quorum=False, init_sync=False,
    # No heal happens without a failure; these are there for one all the same.
    state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
    load_state_dict=lambda s: (model.load_state_dict(s["model"]), inner.load_state_dict(s["inner"])),
    rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=args.lighthouse,
    replica_id=f"semi_sync_{args.group}", hostname="127.0.0.1", timeout=timedelta(seconds=30),
    quorum_timeout=timedelta(seconds=60),
    checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=30), device=torch.device("cpu")),  # no HTTP server
)
if args.method == "diloco":
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    wrapper = DiLoCo(manager, [model], inner, outer, sync_every=args.sync_every,
                     backup_device=torch.device("cpu"), pin_memory=False)
else:
    wrapper = LocalSGD(manager, model, inner, sync_every=args.sync_every)

sampler = ElasticSampler(args.samples, shuffle=True, seed=0)
try:
    with wrapper:
        for step in range(1, args.sync_every * args.syncs + 1):
            idx = share(sampler.window(args.batch)[0], args.group, args.groups)
            nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
            inner.step()  # its post-step hook syncs every sync_every steps
            inner.zero_grad()
            sampler.advance(args.batch)
            if step % args.sync_every == 0:
                torch.save({name: q.detach().clone() for name, q in model.named_parameters()},
                           os.path.join(args.out, f"params-{args.group}-{step // args.sync_every}.pt"))
    # A sync whose should_commit failed is skipped silently: a reference run must have none.
    assert manager.current_step() == args.syncs, f"{manager.current_step()} of {args.syncs} syncs committed"
finally:
    manager.shutdown(wait=False)
open(os.path.join(args.out, f"done-{args.group}"), "w").close()
