"""Nothing readable wider than needed: the events file, the lock files and the checkpoints a run creates are its user's
alone (0600 files, 0700 directories) unless `share_files`; a wildcard `store_host` is refused."""

from __future__ import annotations

import os
import stat

import pytest

from monarch_plugin import ConfigError, ElasticConfig
from monarch_plugin.events import EventLog
from monarch_plugin.storage.filemodes import make_dirs
from monarch_plugin.storage.runlock import hold

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def usual_umask():
    """The umask most users have (022): what would otherwise leave the files readable by everyone."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_events_file_and_the_directories_made_for_it_are_the_users_alone_unless_shared(tmp_path):
    path = tmp_path / "a" / "b" / "events.jsonl"
    log = EventLog(str(path), "controller")
    assert not (tmp_path / "a").exists()  # made on the first event, not before
    log.emit("run_start")
    assert (_mode(tmp_path / "a"), _mode(tmp_path / "a" / "b"), _mode(path)) == (0o700, 0o700, 0o600)
    EventLog(str(path), "replica0.0").emit("spawn")  # a worker appends: the mode stays
    assert _mode(path) == 0o600 and len(path.read_text().splitlines()) == 2
    shared = tmp_path / "c" / "events.jsonl"
    EventLog(str(shared), "controller", share=True).emit("run_start")
    assert (_mode(tmp_path / "c"), _mode(shared)) == (0o755, 0o644)


def test_a_run_creates_its_events_file_lock_files_and_checkpoint_directory_for_its_user_only(tmp_path):
    events = tmp_path / "logs" / "events.jsonl"
    checkpoints = tmp_path / "ckpt" / "run1"
    locks = hold(ElasticConfig(events_path=str(events), checkpoint_steps=5, checkpoint_dir=str(checkpoints)))
    try:
        assert _mode(events) == _mode(f"{events}.lock") == _mode(checkpoints / ".lock") == 0o600
        assert _mode(tmp_path / "logs") == _mode(tmp_path / "ckpt") == _mode(checkpoints) == 0o700
    finally:
        for lock in locks:
            lock.release()


def test_an_events_file_an_earlier_run_left_readable_is_narrowed_and_share_files_keeps_the_umasks_modes(tmp_path):
    events = tmp_path / "events.jsonl"
    events.write_text('{"event": "old"}\n')
    events.chmod(0o644)
    for lock in hold(ElasticConfig(events_path=str(events))):
        lock.release()
    assert _mode(events) == 0o600
    shared_events, shared_checkpoints = tmp_path / "s" / "events.jsonl", tmp_path / "s" / "ckpt"
    for lock in hold(ElasticConfig(events_path=str(shared_events), checkpoint_steps=5,
                                   checkpoint_dir=str(shared_checkpoints), share_files=True)):
        lock.release()
    assert _mode(shared_events) == _mode(shared_checkpoints / ".lock") == 0o644
    assert _mode(tmp_path / "s") == _mode(shared_checkpoints) == 0o755


def test_make_dirs_makes_each_missing_directory_private_and_leaves_existing_ones(tmp_path):
    (tmp_path / "x").mkdir(mode=0o755)
    make_dirs(str(tmp_path / "x" / "y" / "z"))
    assert (_mode(tmp_path / "x"), _mode(tmp_path / "x" / "y"), _mode(tmp_path / "x" / "y" / "z")) == (
        0o755, 0o700, 0o700)
    make_dirs(str(tmp_path / "x" / "y" / "z"))  # there already: nothing to do


def test_a_checkpoint_file_written_whole_is_the_users_alone_unless_shared(tmp_path):
    from monarch_plugin.storage.checkpoint import save_file

    save_file({"step": 3}, str(tmp_path / "a.ckpt"))
    save_file({"step": 3}, str(tmp_path / "b.ckpt"), share=True)
    assert (_mode(tmp_path / "a.ckpt"), _mode(tmp_path / "b.ckpt")) == (0o600, 0o644)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ckpt", "b.ckpt"]  # no temporary file left


@pytest.mark.parametrize("address", ["0.0.0.0", "::", "[::]", "", "*", "0", "::ffff:0.0.0.0"])
def test_a_wildcard_store_host_is_refused_naming_the_fix(address):
    with pytest.raises(ConfigError, match=r"`store_host` .* is a wildcard address: .*give this machine's own IP") as e:
        ElasticConfig(store_host=address)
    assert e.value.field == "store_host"


def test_a_specific_store_host_is_taken():
    for address in ("127.0.0.1", "10.0.0.1", "::1", "controller.example"):
        assert ElasticConfig(store_host=address).store_host == address
