"""`watcher.loopback_port`: a replica's rendezvous port, below the kernel's ephemeral range, where no outgoing
connection takes it between the pick and the replica's bind, and never the same one twice in a row."""

from __future__ import annotations

import socket

from monarch_plugin.procs.watcher import _ephemeral_low, loopback_port


def test_ports_are_below_the_ephemeral_range_free_and_distinct():
    low = _ephemeral_low()
    ports = [loopback_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(max(1024, low - 16384) <= p < low for p in ports), (low, ports)
    with socket.create_server(("127.0.0.1", ports[0])):  # the replica's rank 0 binds it as `procs.stores` does
        pass


def test_the_range_is_read_from_the_kernel_or_defaults(tmp_path):
    path = tmp_path / "range"
    path.write_text("40000\t60999\n")
    assert _ephemeral_low(str(path)) == 40000
    assert _ephemeral_low(str(tmp_path / "missing")) == 32768
