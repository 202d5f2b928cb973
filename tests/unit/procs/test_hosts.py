"""The hosts' bookkeeping and judgements without a host: a run's slots on this machine, how many replicas a host's
report makes room for, and when its silence loses it or only replaces its watcher."""

from __future__ import annotations

import os
import queue

import pytest

from monarch_plugin import ElasticConfig
from monarch_plugin.controller import policies
from monarch_plugin.events import EventLog
from monarch_plugin.procs.hosts import _REWATCH_S, Host, Hosts, heard, slots, watcher_stuck

CPU = {"kind": "cpu", "devices": 0, "environ": {}}


def _local(tmp_path, **settings) -> Hosts:
    config = ElasticConfig(events_path=str(tmp_path / "events.jsonl"), **settings)
    return Hosts(config, EventLog(config.events_path, "controller"), queue.Queue(), [str(tmp_path)], [])


def test_a_run_on_this_machine_has_a_slot_for_each_replica_and_spare_taken_and_given_back(tmp_path):
    hosts = _local(tmp_path, replicas=3, spares=1)
    assert hosts.rooms() == {0: (4, set())}
    for replica in range(4):
        host, slot = policies.place(hosts.rooms())
        hosts.take(replica, host, slot)
    assert hosts.rooms() == {0: (4, {0, 1, 2, 3})} and policies.place(hosts.rooms()) is None
    # No watcher: no lease, no GPUs on CPU; the controller's pid, whose end is its loss (`worker.orphan`).
    assert hosts.env_for(2) == {"MONARCH_PLUGIN_BIND_ADDR": "127.0.0.1", "MONARCH_PLUGIN_CONTROLLER_PID": str(os.getpid())}
    hosts.release(2)
    assert hosts.rooms() == {0: (4, {0, 1, 3})} and policies.place(hosts.rooms()) == (0, 2)


def test_a_host_told_to_go_or_lost_has_no_room(tmp_path):
    hosts = _local(tmp_path, replicas=2)
    hosts.hosts.append(Host(1, "tcp://10.0.0.2:26600", 2))
    hosts.hosts.append(Host(2, "tcp://10.0.0.3:26600", 2, live=False))
    hosts.hosts[0].leaving = True
    assert hosts.rooms() == {1: (2, set())}
    assert hosts.hosts[1].ip == "10.0.0.2" and hosts.hosts[0].name == "this machine"


@pytest.mark.parametrize("machine, settings, room", [
    (CPU, {"replicas": 2, "max_replicas": 4, "spares": 1}, 5),  # a CPU host holds the whole run
    (CPU, {"replicas": 2, "replicas_per_host": 1}, 1),
    ({"kind": "cuda", "devices": 8, "environ": {}}, {"replicas": 2, "procs_per_replica": 2}, 4),
    ({"kind": "cuda", "devices": 8, "environ": {}}, {"replicas": 2, "procs_per_replica": 2, "replicas_per_host": 3}, 3),
    ({"kind": "rocm", "devices": 1, "environ": {}}, {"replicas": 2, "procs_per_replica": 2}, 0),  # fits none
])
def test_a_hosts_room_is_what_its_devices_fit_at_most_replicas_per_host(machine, settings, room):
    found, gpus = slots(machine, ElasticConfig(**settings))
    assert found == room
    if machine["kind"] == "cpu" or not room:
        assert gpus is None
    else:  # each slot its own procs_per_replica GPUs
        k = settings["procs_per_replica"]
        assert [gpus.env_for_slot(s)["CUDA_VISIBLE_DEVICES"] for s in range(room)] == \
            [",".join(str(d) for d in range(s * k, s * k + k)) for s in range(room)]


def test_a_host_silent_for_host_timeout_is_lost_and_any_beat_hears_it_again():
    host = Host(1, "tcp://10.0.0.2:26600", 2)
    assert heard(host, 1, now=100.0, timeout_s=5.0) is None and host.heard_at == 100.0
    assert heard(host, 1, now=104.9, timeout_s=5.0) is None
    assert heard(host, 2, now=104.9, timeout_s=5.0) is None and host.heard_at == 104.9
    assert heard(host, 2, now=110.0, timeout_s=5.0) == "no beat for 5.1 s"


def test_a_watcher_silent_while_its_host_beats_on_is_replaced_once():
    host = Host(1, "tcp://10.0.0.2:26600", 2)
    heard(host, 1, now=0.0, timeout_s=5.0)
    assert not watcher_stuck(host, 7, now=0.0)
    late = _REWATCH_S + 0.1
    heard(host, 2, now=late, timeout_s=5.0)  # the workers' leases beat the host on
    assert watcher_stuck(host, 7, now=late)
    host.rewatching = True  # a replacement under way: not another
    assert not watcher_stuck(host, 7, now=late)
    host.rewatching = False
    assert not watcher_stuck(host, 8, now=late)  # it beat: heard again
    assert not watcher_stuck(host, 8, now=late + _REWATCH_S + 0.1)  # and the host fell silent too: the host's matter
