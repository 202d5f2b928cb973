"""Who may read what a run writes: its user alone, unless `share_files` says otherwise.

The events file names the run's store port and its processes; checkpoints hold the model and the data's order. So
the runtime creates them, and the directories it makes for them, readable by the run's user only: files 0600,
directories 0700. With `share_files` they are created as the umask allows (0644 / 0755 under the usual 022). Only
what the runtime creates is set: an existing directory keeps its mode. Files written inside a private directory
by another library (DCP's, in a checkpoint's `step<N>` directory) are out of others' reach through it.

Imports nothing heavy: `EventLog` uses it in every process.
"""

from __future__ import annotations

import os

__all__ = ["dir_mode", "file_mode", "make_dirs"]


def file_mode(share: bool = False) -> int:
    """The mode a runtime file is created with (the umask applies on top)."""
    return 0o644 if share else 0o600


def dir_mode(share: bool = False) -> int:
    """The mode a directory the runtime makes is created with (the umask applies on top)."""
    return 0o777 if share else 0o700


def make_dirs(path: str, share: bool = False) -> None:
    """`path` and each missing directory above it, every new one made with `dir_mode(share)` (`os.makedirs` gives
    only the last one its mode); the existing ones are left as they are."""
    path = os.path.abspath(path)
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, dir_mode(share))
        except FileExistsError:  # made meanwhile by another process of the run
            if not os.path.isdir(directory):
                raise
