"""The TCPStores the runtime serves, each listening on one address only.

torch's TCPStore server binds every interface whatever host name it is given, so each store here is handed a socket
already bound where it should listen: the run's own store on `store_host` (loopback on one machine), and a replica's
own store, which its training code's `init_process_group` rendezvous on, on its host's loopback.
"""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist

__all__ = ["AGENT_STORE_ENV", "serve"]

AGENT_STORE_ENV = {"TORCHELASTIC_USE_AGENT_STORE": "True"}
"""What a replica's procs are spawned with so that `init_process_group`'s env:// rendezvous makes every rank a client
of the store on `MASTER_ADDR:MASTER_PORT` (as under torchrun's agent), which the replica's first proc serves on
loopback (`serve`), instead of its rank 0 listening on every interface."""


def serve(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A store served on `host:port` (port 0: any free one) and nowhere else. The store owns the socket from then on
    and closes it when it goes: a second close by us could close whatever file took the same number meanwhile."""
    listener = socket.create_server((host, port), backlog=128)
    try:
        store = dist.TCPStore(host, listener.getsockname()[1], is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s), master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()
    return store
