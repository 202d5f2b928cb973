"""Signals with notice in a worker proc: SIGTERM and SIGUSR1 ask its replica to leave; they do not kill the proc.

SIGTERM is what SLURM sends before SIGKILL (`KillWait`, 30 s by default), and Kubernetes and spot instances before
they take a machine; SIGUSR1 is what `sbatch --signal=USR1@N` sends N seconds before the time limit. Either, to any
proc of a replica, makes the controller drain that replica at the next step boundary (or stop the run with a
checkpoint, when every replica got one); a proc that died of it would drop the step in flight instead.

Python runs a signal handler only on a process's main thread, and in a Monarch proc that thread sits in Monarch's
bootstrap (an asyncio loop awaiting Rust) while training runs on an actor's thread: a handler there runs late, or
never. So the proc's first Python code, on its main thread before Monarch's bootstrap, installs a handler that does
nothing, which keeps the signal from ending the process, and a wakeup fd: CPython's C-level handler writes the
signal's number there from whichever thread the kernel picked, and the notice thread, reading it, tells the
controller through the store (`protocol.Drain`) at once. `install` is called by the forkserver's child
(`forkserver._become_proc`) and, where procs start as fresh interpreters (a run without the forkserver, a host of a
multi-host run), by this module run as their bootstrap command (`bootstrap_command`). A host's watcher proc tells
the controller that its whole host is going (`listen`); the host's agent (`monarch-plugin host`) passes the signal
on to every proc it started (`install(act=...)`), so a node told to go drains all its replicas at once.
"""

from __future__ import annotations

import datetime
import os
import runpy
import signal
import sys
import threading
import time
from typing import Callable

__all__ = ["NOTICE_SIGNALS", "bootstrap_command", "install", "listen"]

NOTICE_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

_BOOTSTRAP = "monarch._src.actor.bootstrap_main"
_ENV_WAIT_S = 120.0
"""How long a signal that came before the replica's actor set this proc up waits to be told (the store's address
arrives with the actor)."""


_listener: Callable[[str], None] | None = None


def listen(tell: Callable[[str], None]) -> None:
    """A proc that is no replica's (a host's watcher) tells the controller itself: `tell(signal name)`."""
    global _listener
    _listener = tell


def install(act: Callable[[str], bool] | None = None) -> None:
    """On the process's main thread: catch the notice signals and start the notice thread, which calls `act(signal
    name)` for each (until it returns True); by default, before Monarch's bootstrap, it tells the controller."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    for sig in NOTICE_SIGNALS:
        signal.signal(sig, _ignore)
    if act is None:
        # A proc's process group is orphaned when the controller ends, and then, if any member is stopped, the kernel
        # sends SIGHUP to every member: a proc must outlive its controller long enough to save the run
        # (`worker.orphan`), and no terminal's hangup is a proc's to act on.
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    threading.Thread(target=_relay, args=(read, act or _tell), name="monarch-plugin-notice", daemon=True).start()


def _ignore(signum, frame) -> None:
    """The Python-level handler: the notice thread has acted on the signal already."""


def _relay(read: int, act: Callable[[str], bool]) -> None:
    told = False
    while True:
        try:
            data = os.read(read, 64)
        except InterruptedError:
            continue
        if not data:
            return
        signals = [signal.Signals(n).name for n in data if n in NOTICE_SIGNALS]
        if signals and not told:
            told = act(signals[0])


def _tell(name: str) -> bool:
    """Report the signal to the controller; True once reported (or when this proc is no replica's: nothing to tell)."""
    deadline = time.monotonic() + _ENV_WAIT_S
    while "MONARCH_PLUGIN_STORE_PORT" not in os.environ and _listener is None:  # set as the proc's actor starts
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    if "MONARCH_PLUGIN_REPLICA_ID" not in os.environ:
        if _listener is not None:  # a host's watcher
            _listener(name)
        return True
    import torch.distributed as dist

    from monarch_plugin.wire.protocol import Drain, Key
    from monarch_plugin.wire.signing import SignedStore, secret_from_env

    drain = Drain(replica=int(os.environ["MONARCH_PLUGIN_REPLICA_ID"]), lane=int(os.environ.get("LOCAL_RANK", 0)),
                  signal=name, pid=os.getpid())
    print(f"monarch-plugin: replica {drain.replica} proc {drain.pid} received {name}: the replica leaves at the next "
          "step boundary", file=sys.stderr, flush=True)
    try:
        store = SignedStore(dist.TCPStore(os.environ["MONARCH_PLUGIN_STORE_HOST"],
                                          int(os.environ["MONARCH_PLUGIN_STORE_PORT"]), is_master=False,
                                          wait_for_workers=False, timeout=datetime.timedelta(seconds=30)),
                            secret_from_env())
        store.append(Key.DRAINS, drain.line())
        store.add(Key.DRAIN_COUNT, 1)
    except Exception as e:  # noqa: BLE001 - the controller then sees this proc die when SIGKILL follows
        print(f"monarch-plugin: could not tell the controller of {name}: {e}", file=sys.stderr, flush=True)
        return False
    return True


def bootstrap_command():
    """Monarch's bootstrap command for a proc started as a fresh interpreter, through `main` below."""
    from monarch.actor import default_bootstrap_cmd

    command = default_bootstrap_cmd()
    command.args = ["-m", "monarch_plugin.procs.notice"]
    return command


def main() -> None:
    from monarch_plugin.wire.protocol import ORPHAN_ENV

    bound = float(os.environ.get(ORPHAN_ENV, 0))  # set for the procs on the controller's machine only
    if bound:
        # Monarch has the proc die with the process that started it, the controller: it would lose the state the
        # proc is to save when that goes (`worker.orphan`). A watchdog ends it `bound` seconds later instead.
        os.environ["HYPERACTOR_MESH_BOOTSTRAP_ENABLE_PDEATHSIG"] = "false"
        _watchdog(bound)
    install()
    runpy.run_module(_BOOTSTRAP, run_name="__main__", alter_sys=True)


def _watchdog(bound_s: float) -> None:
    """Fork a process that SIGKILLs this one `bound_s` (and a second) after the controller, its parent, ends, and
    itself ends with this one. Forked before anything starts a thread."""
    import select

    proc = os.getpid()
    controller, me = os.pidfd_open(os.getppid()), os.pidfd_open(proc)
    if os.fork():
        os.close(controller)
        os.close(me)
        return
    try:
        ready, _, _ = select.select([controller, me], [], [])
        if me not in ready:
            select.select([me], [], [], bound_s + 1.0)
            signal.pidfd_send_signal(me, signal.SIGKILL)
    finally:
        os._exit(0)


if __name__ == "__main__":
    from monarch_plugin.procs import notice  # the module itself, not this `__main__` copy: `listen` sets its hook

    notice.main()
