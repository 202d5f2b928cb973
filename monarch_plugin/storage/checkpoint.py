"""Durable checkpoints of an `ElasticLoop` run: what survives the loss of the controller itself.

Deaths of replicas cost only the step in flight, but the controller is one process: if it (or its machine) is
lost, the replicas end with it, and a relaunch has only what was written to disk. So one replica (the
generation's rank 0) writes a checkpoint of a committed step every `checkpoint_steps` steps and/or every
`checkpoint_interval_s` seconds, off the critical path: it copies its state in memory at the step boundary and a
thread writes the copy while training goes on. A relaunch with `resume="auto"` starts from the newest complete
one, on any number of replicas of any number of procs.

A checkpoint of committed step N is the directory `step{N:08d}` in `checkpoint_dir`, written with
torch.distributed.checkpoint (DCP) by every proc of the writing replica on a group of their own: the model's and
optimizer's tensors by name (an FSDP shard per proc, resharded on load to however many procs load it), the loop's
own state (sampler, step, scheduler, extra) once, and each proc's random generators as `lane{k}`. DCP's
coordinator writes `.metadata` once every proc's files are in place: a checkpoint without it is incomplete, and
no reader takes it. This module is where checkpoints lie and which are complete, for the controller and the
workers; writing them is `worker.checkpoint_writer`'s, in the format of `worker.dcp_io`, which reads unpickling
only what an allow-list admits.

The run holds its checkpoint directory and its events file for itself (`runlock`): a second run pointed at them
is refused, naming the first. Pruning keeps the newest `checkpoint_keep` complete checkpoints and never the
newest complete one; what a crashed run left half-written is removed when the next run takes the directory.

DCP has no checksum of its own: a file cut short fails its load, a bit flipped loads without a word. So the coordinator
writes the size and SHA-256 of every file of the checkpoint (`digests.json`, `write_digests`) before `.metadata`, and a
complete checkpoint carries them: one whose files no longer match (`damage`) is never resumed, and `resume="auto"`
takes the newest intact one (`newest`).
Holding it, the run makes it readable by its user only (0700, `filemodes`; `share_files` widens it), so whatever
DCP writes inside is out of others' reach; a file written whole here (`save_file`) is created 0600 as well.

`checkpoint_dir` may be an fsspec URL (``s3://bucket/run``; needs fsspec and that filesystem's package): written
and read the same way, but not locked (object stores have no locks) nor cleaned at start (without a lock, a write
there may be another run's).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil

import torch

from monarch_plugin.errors import ConfigError
from monarch_plugin.storage.filemodes import file_mode

__all__ = ["DIGESTS", "checkpoints", "clean_stale", "complete", "damage", "is_url", "newest", "newest_written", "prune",
           "save_file", "step_of", "step_path", "write_digests"]

_NAME = re.compile(r"step(?P<step>\d{8})")
_METADATA = ".metadata"
DIGESTS = "digests.json"
"""In a checkpoint's directory: the size and SHA-256 of each of its files, written before `.metadata`."""


def is_url(path: str) -> bool:
    """Whether `path` names another filesystem through fsspec (``s3://bucket/ckpt``, ``memory://...``)."""
    return "://" in path


def _fs(path: str):
    """The fsspec filesystem of the URL `path`."""
    try:
        from fsspec.core import url_to_fs
    except ImportError:
        raise ConfigError(f"`checkpoint_dir` {path} is an fsspec URL: pip install fsspec and the package of its "
                          "filesystem (s3fs, gcsfs, ...), or give a local path", "checkpoint_dir") from None
    return url_to_fs(path)[0]


def _join(directory: str, name: str) -> str:
    return f"{directory.rstrip('/')}/{name}" if is_url(directory) else os.path.join(os.path.abspath(directory), name)


def _names(directory: str) -> list[str]:
    """What `directory` holds, by name; nothing if it does not exist."""
    if is_url(directory):
        fs = _fs(directory)
        if not fs.exists(directory):
            return []
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(directory, detail=False)]
    try:
        return os.listdir(directory)
    except FileNotFoundError:
        return []


def _is_dir(path: str) -> bool:
    return _fs(path).isdir(path) if is_url(path) else os.path.isdir(path)


def _remove(path: str) -> None:
    if is_url(path):
        _fs(path).rm(path, recursive=True)
    elif os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        os.remove(path)


def step_path(directory: str, step: int) -> str:
    """The checkpoint of committed step `step` in `directory` (a local path, or an fsspec URL)."""
    return _join(directory, f"step{step:08d}")


def step_of(path: str) -> int:
    """The committed steps held by the checkpoint at `path`, read from its name."""
    match = _NAME.fullmatch(path.rstrip("/").rsplit("/", 1)[-1])
    if match is None:
        raise ConfigError(f"`resume`: {path} is not a checkpoint of this runtime (a step<N> directory): give one "
                          "of those, or 'auto' for the newest in `checkpoint_dir`", "resume")
    return int(match["step"])


def complete(path: str) -> bool:
    """Whether every proc's part of the checkpoint at `path` is in place: DCP wrote its metadata last."""
    metadata = _join(path, _METADATA)
    return _fs(path).isfile(metadata) if is_url(path) else os.path.isfile(metadata)


def checkpoints(directory: str, name: re.Pattern = _NAME) -> list[tuple[int, str]]:
    """(step, path) of every checkpoint directory in `directory`, complete or not, oldest first: those named as
    `name` matches, with the step as its group `step` (this runtime's `step<N>`, or a framework's own)."""
    found = [(int(m["step"]), _join(directory, m[0])) for m in map(name.fullmatch, _names(directory)) if m]
    return sorted(p for p in found if _is_dir(p[1]))


def newest(directory: str, skipped=None, name: re.Pattern = _NAME) -> str | None:
    """The newest complete checkpoint in `directory` (named as `name` matches: `checkpoints`) whose files are as they
    were written (`damage`); None if there is none. Each newer one passed over for its damage is told to
    `skipped(path, why)`."""
    return _newest_intact([path for _, path in checkpoints(directory, name)], skipped)


def _open(path: str, mode: str):
    return _fs(path).open(path, mode) if is_url(path) else open(path, mode)


def _size(path: str) -> int:
    return _fs(path).size(path) if is_url(path) else os.path.getsize(path)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with _open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_digests(path: str, files: list[str], share: bool = False) -> None:
    """Record the size and SHA-256 of each of `files` (names in the checkpoint at `path`), before its `.metadata` is
    written: on the writing thread, off the step's path (1.57 GB/s of SHA-256 on one core here, from the page cache).
    Created readable by this user only unless `share`."""
    record = {"algorithm": "sha256",
              "files": {name: {"bytes": _size(_join(path, name)), "sha256": _sha256(_join(path, name))}
                        for name in sorted(set(files))}}
    text = json.dumps(record, indent=1) + "\n"
    target = _join(path, DIGESTS)
    if is_url(path):
        with _open(target, "w") as f:
            f.write(text)
        return
    tmp = f"{target}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, file_mode(share))
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)


def damage(path: str, hashed: bool = True) -> str | None:
    """What is wrong with the complete checkpoint at `path`, naming its file (cut short, changed since it was written,
    missing, unreadable), or None: its files are as they were written (or it was written without digests: nothing to
    check them by). Reads every file once; with `hashed` False only their sizes are compared (a checkpoint this run
    wrote minutes ago, chosen mid-run, where reading hundreds of GB would hold up the run's decisions)."""
    try:
        with _open(_join(path, DIGESTS), "r") as f:
            files = json.load(f)["files"]
        written = {name: (int(entry["bytes"]), str(entry["sha256"])) for name, entry in files.items()}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"its {DIGESTS} cannot be read ({type(e).__name__}: {e})"
    for name, (size_written, sha256) in written.items():
        file = _join(path, name)
        try:
            size = _size(file)
            if size < size_written:
                return f"{name} is cut short: {size} of the {size_written} bytes written"
            if size != size_written or (hashed and _sha256(file) != sha256):
                return (f"{name} changed since it was written (its SHA-256 is not the one written with it: a bit "
                        "flipped on the disk or on its way there, or a write over it)")
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as e:  # a bad sector, a permission: what a damaged disk also does
            return f"{name} cannot be read ({type(e).__name__}: {e})"
    return None


def newest_written(paths: list[str], skipped=None, hashed: bool = True) -> str | None:
    """The newest of `paths` (what a run recorded writing) still complete and intact on disk (`damage`, `hashed`);
    None if there is none. Each newer one passed over for its damage is told to `skipped(path, why)`."""
    return _newest_intact(sorted(set(paths), key=step_of), skipped, hashed)


def _newest_intact(paths: list[str], skipped, hashed: bool = True) -> str | None:
    """The last of `paths` (oldest first) that is complete and intact."""
    for path in reversed(paths):
        if not complete(path):
            continue
        why = damage(path, hashed)
        if why is None:
            return path
        if skipped is not None:
            skipped(path, why)
    return None


def prune(directory: str, keep: int) -> list[str]:
    """Remove all but the newest `keep` complete checkpoints, and what is left of any write older than the newest
    complete one (a write that failed, or whose writer died). The newest complete checkpoint is never removed, and
    neither is a write newer than it, which may still be going. Returns what was removed."""
    found = checkpoints(directory)
    done = [path for _, path in found if complete(path)]
    if not done:
        return []
    kept = set(done[-max(keep, 1):])
    newest_step = step_of(done[-1])
    removed = [path for step, path in found if path not in kept and step <= newest_step]
    for path in removed:
        _remove(path)
    return removed


def clean_stale(directory: str) -> list[str]:
    """At the start of a run that holds `directory`: remove the incomplete checkpoints and temporary files an earlier
    run left when it was killed mid-write (nothing else writes here while the lock is held). Returns what was removed."""
    stale = [path for _, path in checkpoints(directory) if not complete(path)]
    stale += [_join(directory, n) for n in _names(directory) if ".tmp" in n]
    for path in stale:
        _remove(path)
    return stale


def save_file(state: dict, path: str, share: bool = False) -> None:
    """Write `state` to the one file `path` atomically: all of it, or (after a crash) nothing under that name (what
    Lightning's checkpoints go through, `AtomicCheckpointIO`); readable by this user only unless `share`."""
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, file_mode(share))
    with os.fdopen(fd, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a power loss
    finally:
        os.close(fd)


