"""Lightning checkpoints written whole or not at all, so a relaunch never resumes from a torn file.

Lightning's `TorchCheckpointIO` writes a checkpoint by opening its final name and writing into it. A replica
killed mid-write (its controller lost, its machine gone) leaves a truncated `.ckpt` under that name, the newest
one, which `fit(ckpt_path=...)` then fails to load, or `ModelCheckpoint` counts as saved. `MonarchStrategy` uses
this IO unless `Trainer(plugins=[...])` names another: local files go to a temporary name, are fsynced and renamed
(the runtime's own `checkpoint.save_file`), readable by the run's user only unless `share_files`; a remote URL
(`s3://...`) keeps Lightning's way.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from monarch_plugin.storage.checkpoint import save_file

__all__ = ["AtomicCheckpointIO"]


class AtomicCheckpointIO(TorchCheckpointIO):
    def __init__(self, share: bool = False) -> None:
        super().__init__()
        self.share = share
        """Whether the files are created readable by others too (`share_files`); else 0600."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None or "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        get_filesystem(path).makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        save_file(checkpoint, str(path), share=getattr(self, "share", False))
