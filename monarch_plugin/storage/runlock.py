"""A run's hold on the files it writes: its events file and its checkpoint directory, one run each.

Two runs pointed at one checkpoint directory would prune each other's checkpoints and could resume one assembled
from both; two on one events file would truncate and interleave each other's records. So a run holds both for
itself from before anything is spawned until it ends, and a second run is refused, naming the first.

Holding them, the run also creates them readable by its user only (`filemodes`; `share_files` widens it): the
events file 0600 before its first event (one left wider by an earlier run is narrowed: the run empties it anyway),
the lock files 0600, and the directories made for them, the checkpoint directory among them, 0700.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import sys
import time

from monarch_plugin.config import ElasticConfig
from monarch_plugin.errors import ConfigError
from monarch_plugin.storage.filemodes import file_mode, make_dirs

__all__ = ["RunLock", "hold", "holds_checkpoints", "unwritable"]

LOCK_NAME = ".lock"
"""The lock file in a checkpoint directory; an events file's is beside it, `<events>.lock`."""


def holds_checkpoints(config: ElasticConfig) -> bool:
    """Whether the run holds its checkpoint directory: it writes or resumes `ElasticLoop` checkpoints (a framework
    front end writes its own), in a local directory (an fsspec URL's store has no locks)."""
    return bool(config.checkpoint_steps or config.checkpoint_interval_s or config.resume) and \
        "://" not in config.checkpoint_dir


def hold(config: ElasticConfig) -> list["RunLock"]:
    """The run's events file and, if it writes or resumes `ElasticLoop` checkpoints in a local directory, that
    directory, held until each lock is released; ConfigError naming the run that holds one. The events file is
    created (or narrowed) with the mode `share_files` asks for, once both are held."""
    locks: list[RunLock] = []
    try:
        if config.events_path:
            locks.append(RunLock(f"{config.events_path}.lock", f"the events file {config.events_path}",
                                 "events_path", share=config.share_files))
        if holds_checkpoints(config):
            locks.append(RunLock(os.path.join(config.checkpoint_dir, LOCK_NAME),
                                 f"the checkpoint directory {config.checkpoint_dir}", "checkpoint_dir",
                                 share=config.share_files))
    except ConfigError:
        for lock in locks:
            lock.release()
        raise
    if config.events_path:
        try:
            _create(config.events_path, config.share_files)
        except OSError as e:
            for lock in locks:
                lock.release()
            raise unwritable(f"the events file {config.events_path}", "events_path", config.events_path, e) from None
    return locks


def unwritable(what: str, option: str, path: str, error: OSError) -> ConfigError:
    """The one line for `what` (the file `path` in it, set by `option`) that this run cannot write: on a full
    filesystem, which directory, how full, and the fix."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        where = os.path.dirname(os.path.abspath(path))
        while not os.path.exists(where):
            where = os.path.dirname(where)
        fs = os.statvfs(where)
        return ConfigError(f"{what} cannot be written: the filesystem of {where} is full ({error.strerror}; "
                           f"{_size(fs.f_bavail * fs.f_frsize)} free of {_size(fs.f_blocks * fs.f_frsize)}): free "
                           f"space there, or give this run a `{option}` on another filesystem", option)
    return ConfigError(f"{what} cannot be written ({error.strerror}): give this run a `{option}` it can write", option)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _create(path: str, share: bool) -> None:
    """The events file at `path`, created with `file_mode(share)` before anyone writes it; an existing one of this
    user's that others may read is narrowed to 0600 unless `share` (the run empties it anyway)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, file_mode(share))
    try:
        st = os.fstat(fd)
        if not share and stat.S_ISREG(st.st_mode) and st.st_mode & 0o077 and st.st_uid == os.geteuid():
            os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


class RunLock:
    """A run's hold on a file or directory it writes (its checkpoint directory, its events file): an exclusive
    `flock` on a lock file, taken without waiting, held until `release` or the process's end. The kernel releases
    it when the holder dies however it dies, so a crashed run's successor takes it over at once.

    On a local filesystem this is exact. On NFS, Linux emulates `flock` with the server's byte-range locks (NFSv4,
    or NLM for v3 with lockd running): it excludes runs on other clients too, and a crashed client's lock is freed
    when its lease expires (90 s by default), so a successor on another machine is refused until then. Filesystems
    without locks (some FUSE mounts, object-store mounts) either refuse the lock, which is reported, or grant it to
    everyone, which excludes nothing: give such runs their own directories."""

    def __init__(self, path: str, what: str, option: str, share: bool = False):
        """`path`: the lock file. `what` names what it guards and `option` the setting to change, in messages.
        `share`: the lock file, and the directories made for it, readable by others too (`filemodes`)."""
        self.path, self._fd = path, None
        try:
            make_dirs(os.path.dirname(os.path.abspath(path)), share)
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, file_mode(share))
            full = os.fstatvfs(self._fd).f_bavail == 0  # what the run will write there could not be
        except OSError as e:
            self.release()
            raise unwritable(what, option, path, e) from None
        if full:
            self.release()
            raise unwritable(what, option, path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(os.pread(self._fd, 4096, 0))
            os.close(self._fd)
            raise ConfigError(f"{what} is in use by another run ({holder}): give this run its own `{option}`, or stop "
                              "that run first", option) from None
        except OSError as e:
            os.close(self._fd)
            raise ConfigError(f"{what} cannot be locked for this run ({e}): its filesystem has no locks; give this run "
                              f"a `{option}` on one that has", option) from None
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                             "command": " ".join(sys.argv)[:300]}).encode()
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, record, 0)
        except OSError as e:
            self.release()
            raise unwritable(what, option, path, e) from None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor of the open file releases its lock
            self._fd = None


def _describe(record: bytes) -> str:
    try:
        holder = json.loads(record)
        return (f"pid {holder['pid']} on {holder['host']}, `{holder['command']}`, since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder['since']))}")
    except (ValueError, KeyError, TypeError):
        return "its process is still running"
