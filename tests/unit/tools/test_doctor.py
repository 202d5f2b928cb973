"""`monarch-plugin doctor` refuses what it cannot check before it attaches to anything."""

from __future__ import annotations


def test_a_wildcard_store_host_is_refused_before_anything_listens():
    from monarch_plugin.tools.cli import plugin

    assert plugin(["doctor", "--hosts", "tcp://127.0.0.1:1", "--store-host", "0.0.0.0"]) == 2
