"""`signing`: the run's store as its processes see it, on a real TCPStore, with a second client that writes without
the secret as any process reaching the store could; and the controller's and a lease's reading of forged values."""

from __future__ import annotations

import datetime
import json
import queue
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from monarch_plugin.wire.handshake import barrier, passed
from monarch_plugin.wire.signing import Forged, SignedStore, forged_reporter

pytestmark = pytest.mark.timeout(60)


class _Events:
    def __init__(self):
        self.emitted = []

    def emit(self, kind, **fields):
        self.emitted.append((kind, fields))


class _Stranger:
    """A plain client of the run's store. TCPStore answers no `set` or `append`: a read on the same connection after
    each makes the write land before the test's next call, which goes over another connection (without it, a check
    that a forged key is refused once raced the forged write and found the key not there yet)."""

    def __init__(self, inner):
        self._inner = inner

    def set(self, key, value):
        self._inner.set(key, value)
        self._inner.check([key])

    def append(self, key, value):
        self._inner.append(key, value)
        self._inner.check([key])

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.fixture
def stores():
    """(the run's store, signing; a plain client of the same store: a stranger's)."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    stranger = dist.TCPStore("127.0.0.1", master.port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=10))
    events = _Events()
    return SignedStore(master, b"the run's secret", forged_reporter(events)), _Stranger(stranger), events


def test_a_value_reads_back_only_as_the_run_wrote_it_under_its_own_key(stores):
    store, stranger, events = stores
    store.set("plan/1", '{"gen": 1}')
    assert store.get("plan/1") == b'{"gen": 1}' and store.peek("plan/1") == b'{"gen": 1}'
    assert store.peek("plan/2") is None
    stranger.set("plan/2", stranger.get("plan/1"))  # a signed value moved to another key does not verify there
    stranger.set("latest", "7")
    for key in ("plan/2", "latest"):
        with pytest.raises(Forged, match=f"'{key}'.*does not carry the run's signature"):
            store.get(key)
    assert [kind for kind, _ in events.emitted] == ["forged_value"] * 2
    assert [f["key"] for _, f in events.emitted] == ["plan/2", "latest"]
    with pytest.raises(Forged):
        store.get("plan/2")
    assert len(events.emitted) == 2  # the same forged value, read again, is reported once
    assert stranger.get("plan/1").startswith(b'{"gen": 1}')  # signed, not hidden: anyone reaching the store reads it
    with pytest.raises(Forged):  # and only the secret verifies it
        SignedStore(stranger, b"a guess").get("plan/1")


def test_a_decision_taken_first_by_a_stranger_is_never_taken_for_the_runs(stores):
    store, stranger, _ = stores
    assert store.compare_set("a/decision", "", b"go") == b"go"
    assert store.compare_set("a/decision", "", b"superseded") == b"go"  # decided once
    stranger.set("b/decision", "go")
    with pytest.raises(Forged):
        store.compare_set("b/decision", "", b"superseded")


def test_appended_reports_come_back_in_order_each_once_and_a_strangers_lines_are_left_out(stores):
    store, stranger, events = stores
    assert store.lines("raised") == []
    store.append("raised", '{"replica": 1}\n')
    stranger.append("raised", '{"replica": 0}\n')
    stranger.append("raised", "unterminated fragment")  # does not swallow the next real line
    store.append("raised", '{"replica": 2}\n')
    store.append("raised", '{"replica": 2}\n')
    assert store.lines("raised") == ['{"replica": 1}', '{"replica": 2}']
    assert [f["key"] for _, f in events.emitted] == ["raised", "raised"]


def test_every_procs_key_must_verify_before_the_controller_counts_it(stores):
    store, stranger, _ = stores
    store.set("ready/0/0", b"1")
    assert not store.verified(["ready/0/0", "ready/0/1"])  # one proc has not said so yet
    stranger.set("ready/0/1", "1")
    with pytest.raises(Forged):
        store.verified(["ready/0/0", "ready/0/1"])
    store.set("ready/0/1", b"1")
    assert store.verified(["ready/0/0", "ready/0/1"])


def test_a_read_never_waits_for_a_key_a_stranger_deletes_nor_creates_it(stores):
    """A check then a get would wait the store's whole timeout (10 s here) for a key deleted between the two: every
    read is one request instead, answering None for a missing key and leaving it missing."""
    store, stranger, _ = stores
    store.set("ready/0/0", b"1")
    store.append("raised", '{"replica": 1}\n')
    store.set("fin/3/0/decision", b"go")
    for key in ("ready/0/0", "raised", "fin/3/0/decision"):
        stranger.delete_key(key)
    started = time.monotonic()
    assert store.peek("ready/0/0") is None and not store.verified(["ready/0/0"])
    assert store.lines("raised") == []
    assert not passed(store, "fin/3/0")
    assert time.monotonic() - started < 1.0
    assert not stranger.check(["ready/0/0", "raised", "fin/3/0/decision"])


def test_a_barrier_woken_without_its_decision_waits_on(stores):
    """A read of a missing key wakes the store's waiters on it: the member waiting at a barrier must not take that
    for the end of its wait (it decided "timed out" at once, and failed a run's end)."""
    store, _, _ = stores
    member = store.like(dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False,
                                      timeout=datetime.timedelta(seconds=10)))
    outcome = queue.Queue()

    def wait() -> None:
        try:
            barrier(member, "fin/0/0", 0, 2, 10.0, lambda: False)
            outcome.put("go")
        except Exception as e:  # noqa: BLE001 - the test reads what it was
            outcome.put(type(e).__name__)

    threading.Thread(target=wait, daemon=True).start()
    time.sleep(0.3)
    for _ in range(3):  # each wakes the waiter
        assert not passed(store, "fin/0/0")
        time.sleep(0.1)
    assert outcome.empty()
    barrier(store, "fin/0/0", 1, 2, 10.0, lambda: False)  # the last member arrives
    assert outcome.get(timeout=5) == "go" and passed(store, "fin/0/0")


def test_a_hosts_forged_death_record_is_reported_and_no_death_is(stores, tmp_path):
    """The controller's watch of a host (`Hosts._poll`): a record the host's watcher did not sign is left."""
    from monarch_plugin.config import ElasticConfig
    from monarch_plugin.events import EventLog
    from monarch_plugin.procs.hosts import Host, Hosts
    from monarch_plugin.wire.protocol import Died, Key

    store, stranger, _ = stores
    events = EventLog(str(tmp_path / "events.jsonl"), source="controller")
    reports: queue.Queue = queue.Queue()
    hosts = Hosts(ElasticConfig(forkserver=False), events, reports, [], [])
    watched = store.like(stranger)
    host = Host(0, "tcp://10.0.0.2:26600", slots=1, heard_at=time.monotonic())
    store.set(Key.host_death(0, 1), json.dumps({"replica": 3, "pid": 1}))  # what its watcher writes
    store.set(Key.host_deaths(0), "1")
    hosts._poll(watched, host, time.monotonic())
    assert reports.get_nowait() == Died(3, "watcher on tcp://10.0.0.2:26600 (pid 1 exited)")
    stranger.set(Key.host_death(0, 2), json.dumps({"replica": 1, "pid": 2}))  # a record, and a count for it
    stranger.set(Key.host_deaths(0), "2")
    hosts._poll(watched, host, time.monotonic())
    store.set(Key.host_deaths(0), "2")  # a count of the watcher's own over a forged record
    hosts._poll(watched, host, time.monotonic())
    assert reports.empty() and host.deaths_seen == 2 and host.live
    stranger.set(Key.host_deaths(0), "9")  # a count with no records behind it never has the host waited for
    hosts._poll(watched, host, time.monotonic() + 3600)
    assert host.deaths_seen == 2 and host.unrecorded_since is None


LEASE = """
import sys, time
from monarch_plugin.procs.lease import Lease
Lease("127.0.0.1", int(sys.argv[1]), 0, 5.0, "a test proc", sys.argv[2])
print("leased", flush=True)
time.sleep(30)
"""


def test_a_lease_ends_its_proc_on_the_controllers_word_only(stores):
    """A proc on another host ends itself when the controller declares its host lost; a stranger's `lost` is not
    the controller's word, and the proc goes on."""
    from monarch_plugin.wire.protocol import Key

    store, stranger, _ = stores
    secret = "the run's secret".encode().hex()
    signed = SignedStore(stranger, bytes.fromhex(secret))
    proc = subprocess.Popen([sys.executable, "-c", LEASE, str(stranger.port), secret], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "leased"
        stranger.set(Key.host_lost(0), "1")
        time.sleep(1.5)  # three of its touches
        assert proc.poll() is None
        signed.set(Key.host_lost(0), "1")
        assert proc.wait(timeout=10) == 17
        assert "its host was declared lost" in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
