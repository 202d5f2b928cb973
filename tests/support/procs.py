"""Processes and listeners, seen from outside as the tests check them: by pid, from /proc and `ss`."""

from __future__ import annotations

import subprocess

WILDCARDS = ("0.0.0.0", "*", "[::]", "::", "[::ffff:0.0.0.0]")
"""How `ss` writes a listener bound to every interface."""


def listeners(pids: set[int] | None = None, ns: str | None = None) -> list[tuple[str, str]]:
    """(local address, process) of every TCP listener of `pids` (in the root namespace), or of namespace `ns`."""
    cmd = ["ss", "-ltnpH"] if ns is None else ["ip", "netns", "exec", ns, "ss", "-ltnpH"]
    found = []
    for line in subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=30).stdout.splitlines():
        fields = line.split()
        local, process = fields[3], " ".join(fields[5:])
        owners = {int(part.split("=")[1].rstrip(",)")) for part in process.split(",") if part.startswith("pid=")}
        if pids is None or owners & pids:
            found.append((local.rsplit(":", 1)[0], process))
    return found


def descendants(pid: int) -> set[int]:
    """`pid` and every process below it."""
    children: dict[int, list[int]] = {}
    for stat in subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout.splitlines():
        child, parent = map(int, stat.split())
        children.setdefault(parent, []).append(child)
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        found.add(p)
        todo += children.get(p, [])
    return found


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name: state, parent pid, ..."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    """True if pid runs and is not a zombie."""
    try:
        return _stat(pid)[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def stopped(pid: int) -> bool:
    """True if pid is stopped (SIGSTOP: state T)."""
    try:
        return _stat(pid)[0] == "T"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def parent(pid: int) -> int:
    return int(_stat(pid)[1])
