"""The durable checkpoints' format: torch.distributed.checkpoint (DCP), read without running code from the files.

Importing DCP costs over half a second (it imports DTensor, `worker.dtensors`), so this module is imported only
when a checkpoint is written or read, never at a replica's start.

DCP pickles two things: its metadata (`.metadata`, an index of dataclasses) and every non-tensor item (the loop's
counters, the optimizer's hyperparameters, the random generators). Both are read here through allow-lists: the
metadata may name only DCP's own classes and a few torch types (`_METADATA_GLOBALS`), the items are loaded with
torch's `weights_only` unpickler (containers, numbers, strings, tensors).
"""

from __future__ import annotations

import contextlib
import pickle
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint import metadata as _dcp_md
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from monarch_plugin.storage.checkpoint import is_url, write_digests
from monarch_plugin.storage.filemodes import make_dirs

__all__ = ["CheckpointException", "describe", "load", "read_metadata", "save"]
"""`CheckpointException`: DCP's error on every proc when one failed to write or read (a BaseException)."""


def save(state: dict, path: str, group: dist.ProcessGroup | None, share: bool = False) -> None:
    """Write `state` as the checkpoint `path`, together with the other procs of `group` (None: this proc alone).
    Complete only once DCP's coordinator (the group's rank 0) wrote the metadata, after every proc's files. A local
    `path`, and each directory missing above it, is made readable by this user only unless `share` (`filemodes`)."""
    if is_url(path):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter  # needs fsspec: imported here

        writer = type("_DigestedFsspecWriter", (_Digested, FsspecWriter), {})(path)
    else:
        make_dirs(path, share)
        writer = _DigestedWriter(path)
    writer.digests_for, writer.share = path, share
    with _alone(group):
        dcp.save(state, storage_writer=writer, process_group=group, no_dist=group is None)


class _Digested:
    """A DCP writer whose coordinator records the size and SHA-256 of every file the procs wrote (`write_digests`) just
    before the metadata that makes the checkpoint complete: a complete checkpoint can be checked (`checkpoint.damage`)."""

    digests_for: str
    share: bool

    def finish(self, metadata, results) -> None:
        write_digests(self.digests_for, [w.storage_data.relative_path for ws in results for w in ws], self.share)
        super().finish(metadata, results)


class _DigestedWriter(_Digested, dcp.FileSystemWriter):
    pass


def load(template: dict, path: str, group: dist.ProcessGroup | None) -> dict:
    """Read the checkpoint `path` into `template` (the state as this proc holds it, of its shapes and shards: DCP
    reads what each proc needs, so the procs that wrote it may have been more or fewer) and return it."""
    with _alone(group):
        dcp.load(template, storage_reader=_reader(path), planner=_SafeLoadPlanner(), process_group=group,
                 no_dist=group is None)
    return template


@contextlib.contextmanager
def _alone(group: dist.ProcessGroup | None):
    """DCP warns that it assumes a single process when there is no group: here that is what was meant."""
    with warnings.catch_warnings():
        if group is None:
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def read_metadata(path: str) -> _dcp_md.Metadata:
    """DCP's index of the checkpoint at `path`: what it holds, by name."""
    return _reader(path).read_metadata()


_METADATA_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("collections", "OrderedDict"),
}
"""What DCP's metadata may name: its own dataclasses and a few torch types. Nothing else is looked up, so no
other code runs while it is read. (torch's `weights_only` unpickler would be the natural choice; it does not
read the protocol-4 framing DCP writes its metadata with, so this is the same allow-list idea at `find_class`.)"""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                      torch.dtype)):
            return super().find_class(module, name)
        raise ValueError(f"a checkpoint's metadata names {module}.{name}, which DCP's metadata never holds: it is "
                         "not loaded (it would run code); resume from a checkpoint a run of this runtime wrote")


class _SafeMetadata:
    """A DCP reader's `read_metadata`, through `_MetadataUnpickler` instead of `pickle.load`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> _dcp_md.Metadata:
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = _dcp_md.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeReader(_SafeMetadata, dcp.FileSystemReader):
    pass


def _reader(path: str) -> dcp.FileSystemReader:
    """DCP's reader for `path` (a local path, or an fsspec URL), reading its metadata through the allow-list."""
    if is_url(path):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader  # needs fsspec: imported here

        return type("_SafeFsspecReader", (_SafeMetadata, FsspecReader), {})(path)
    return _SafeReader(path)


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, loading the non-tensor items (the loop's counters, the optimizer's hyperparameters, the random
    generators) with torch's `weights_only` unpickler: containers, numbers, strings and tensors only."""

    def load_bytes(self, read_item, value) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def describe(error: BaseException) -> str:
    """One line for a failed write or read: for DCP's error, which lane failed and how (not its tracebacks)."""
    if isinstance(error, CheckpointException):
        return "; ".join(f"lane {rank}: {type(e).__name__}: {e}" for rank, (e, _) in sorted(error.failures.items()))
    return " ".join(f"{type(error).__name__}: {error}".split())
