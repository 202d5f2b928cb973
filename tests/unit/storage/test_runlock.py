"""A run's hold on its files: a second run refused naming the first, a dead run's hold taken over at once. The
e2e half (two `monarch-run`s on one checkpoint directory) is in tests/e2e/test_checkpoints.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from monarch_plugin import ConfigError, ElasticConfig
from monarch_plugin.storage.runlock import RunLock, hold

pytestmark = pytest.mark.timeout(60)


def test_a_second_run_is_refused_naming_the_first_and_a_dead_runs_lock_is_taken_over(tmp_path):
    path = str(tmp_path / ".lock")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                               "from monarch_plugin.storage.runlock import RunLock\n"
                               f"RunLock({path!r}, 'x', 'checkpoint_dir'); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=rf"the checkpoint directory d is in use by another run \(pid "
                                              rf"{holder.pid} on .*give this run its own `checkpoint_dir`"):
            RunLock(path, "the checkpoint directory d", "checkpoint_dir")
    finally:
        holder.kill()
        holder.wait()
    lock = RunLock(path, "the checkpoint directory d", "checkpoint_dir")  # its holder died: the lock died with it
    lock.release()
    RunLock(path, "d", "checkpoint_dir").release()  # and released, it is free again


def test_a_run_holds_its_checkpoint_directory_only_if_it_writes_or_resumes_checkpoints(tmp_path):
    events = str(tmp_path / "events.jsonl")
    plain = hold(ElasticConfig(events_path=events, checkpoint_dir=str(tmp_path / "a")))
    assert [lock.path for lock in plain] == [f"{events}.lock"] and not (tmp_path / "a").exists()
    with pytest.raises(ConfigError, match=r"the events file .*events.jsonl is in use by another run \(pid \d+"):
        hold(ElasticConfig(events_path=events, checkpoint_steps=5, checkpoint_dir=str(tmp_path / "b")))
    assert not (tmp_path / "b" / ".lock").exists()  # refused first: the directory's lock was never taken
    for lock in plain:
        lock.release()
    writing = hold(ElasticConfig(events_path=events, checkpoint_steps=5, checkpoint_dir=str(tmp_path / "b")))
    assert [lock.path for lock in writing] == [f"{events}.lock", str(tmp_path / "b" / ".lock")]
    for lock in writing:
        lock.release()


def test_an_fsspec_url_checkpoint_directory_is_not_held(tmp_path):
    locks = hold(ElasticConfig(events_path=str(tmp_path / "e.jsonl"), checkpoint_steps=5,
                               checkpoint_dir="memory://bucket/run"))
    assert [lock.path for lock in locks] == [str(tmp_path / "e.jsonl.lock")]  # object stores have no locks
    for lock in locks:
        lock.release()


def test_a_full_disk_is_one_line_naming_the_directory_and_the_fix_before_anything_is_written(tmp_path, small_disk):
    small_disk.fill()
    for settings, what, option in (
            ({"events_path": str(small_disk.path / "events.jsonl")}, "the events file", "events_path"),
            ({"events_path": str(tmp_path / "events.jsonl"), "checkpoint_steps": 5,
              "checkpoint_dir": str(small_disk.path / "ckpt")}, "the checkpoint directory", "checkpoint_dir")):
        with pytest.raises(ConfigError) as refused:
            hold(ElasticConfig(**settings))
        message = str(refused.value)
        assert message.startswith(f"{what} ") and f"the filesystem of {small_disk.path}" in message, message
        assert "is full (No space left on device; 0 B free of 1 MiB): free space there, or give this run a " \
               f"`{option}` on another filesystem" in message and "\n" not in message
        assert refused.value.field == option
    small_disk.free()
    for lock in hold(ElasticConfig(events_path=str(small_disk.path / "events.jsonl"))):
        lock.release()


def test_events_on_a_full_disk_are_lost_with_one_warning_and_the_run_goes_on(small_disk, caplog):
    from monarch_plugin.events import EventLog, read_events

    log = EventLog(str(small_disk.path / "events.jsonl"), source="controller")
    log.emit("run_start")
    small_disk.fill()
    with caplog.at_level("WARNING", logger="monarch_plugin"):
        for step in range(200):  # the first few fill what was left of the file's last page
            log.emit("progress", step=step)
    assert [r.getMessage() for r in caplog.records].count(
        f"the events file {small_disk.path}/events.jsonl cannot be written (No space left on device): events are lost "
        "until it can be (free space on its filesystem)") == 1
    small_disk.free()
    log.emit("run_end")
    written = [e["event"] for e in read_events(log.path)]  # a line the disk cut short is left out
    assert written[0] == "run_start" and written[-1] == "run_end" and 2 < len(written) < 200, written
