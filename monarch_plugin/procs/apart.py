"""A run supervised from a child process, so that the process that asked for it is left as it was.

Monarch's runtime, once a process starts it (its first mesh), stays in that process: the actor threads
(`monarch-actor-event-loop`, `monarch-actor-driver`), its sockets and `HYPERACTOR_EXECUTION_ID` in the
environment; torchmonarch 0.7.0's `shutdown_context` ends it for good ("the client cannot be restarted in the
same process"). A Lightning script that fits, then tests, or a notebook that fits twice, would keep all of it
and the controller's own threads after `fit` returned. So `in_child` forks the caller, runs the controller in the
child, and hands back what it returned or raised: the caller keeps its threads, signal handlers, environment and
open files, as ddp_spawn's launching process does. A fork, not a fresh interpreter: the run's target, settings
and imports are already in memory, and nothing in the caller has started Monarch to be copied half-alive.

While it waits, the caller passes the signals that end a run (SIGTERM, SIGUSR1: stop with a checkpoint;
SIGINT: stop) on to the child, which stops the run as it would have in place; a signal sent to the whole process
group (a terminal's Ctrl-C, SLURM's) reaches the child twice, and twice is the same as once. If the caller dies,
the child is killed (PR_SET_PDEATHSIG), as the controller would have died with it.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import struct
import sys
import threading
import traceback
from typing import Callable, TypeVar

from monarch_plugin.errors import ElasticRunAborted
from monarch_plugin.procs.notice import NOTICE_SIGNALS

__all__ = ["end_monarch", "in_child"]

T = TypeVar("T")

_PASSED_ON = (*NOTICE_SIGNALS, signal.SIGINT)
_PR_SET_PDEATHSIG = 1
_SHUTDOWN_S = 1.0
"""How long the child waits for Monarch's runtime to end (its procs stopped, transports flushed), as Monarch's own
exit handler does; the run's meshes were stopped before."""


def in_child(run: Callable[[], T]) -> T:
    """`run()` in a forked child of this process: its return value, or its exception raised here."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # or the child would write this process's buffered output again
    read_end, write_end = os.pipe()
    child: list[int] = []
    early: list[int] = []  # a signal between the handlers' installation and the fork: passed on after it

    def pass_on(signum: int, frame) -> None:
        if child:
            _pass_on(child[0], signum)
        else:
            early.append(signum)

    passed_on = {}
    if threading.current_thread() is threading.main_thread():  # Python sets handlers only there
        passed_on = {sig: signal.signal(sig, pass_on) for sig in _PASSED_ON}  # before the fork: none is missed
    pid = os.fork()
    if pid == 0:  # the child: never returns
        for sig, handler in passed_on.items():
            signal.signal(sig, handler)
        os.close(read_end)
        _child(run, write_end)
    child.append(pid)
    os.close(write_end)
    try:
        for signum in early:
            _pass_on(pid, signum)
        message = _read_all(read_end)
        _, status = os.waitpid(pid, 0)
    finally:
        for sig, handler in passed_on.items():
            signal.signal(sig, handler)
        os.close(read_end)
    if not message:
        how = (f"signal {signal.Signals(os.WTERMSIG(status)).name}" if os.WIFSIGNALED(status)
               else f"exit status {os.waitstatus_to_exitcode(status)}")
        raise ElasticRunAborted(f"the run's controller process (pid {pid}) ended by {how} before it reported: its "
                                "replicas were stopped with it; the events file says how far the run got")
    outcome, value = pickle.loads(message)
    if outcome == "raised":
        raise value
    return value


def _pass_on(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:  # it has ended: the run's outcome is on its way
        pass


def _child(run: Callable[[], object], write_end: int) -> None:
    """Run, report, end Monarch's runtime, and exit without running the caller's exit handlers."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() == 1:  # the caller died before the line above
            os._exit(1)
        signal.signal(signal.SIGINT, _interrupt_once)
        try:
            message = _dumps(("returned", run()))
        except BaseException as e:  # noqa: BLE001 - whatever it was, the caller raises it
            message = _dumps(("raised", e))
        os.write(write_end, struct.pack("!Q", len(message)))
        view = memoryview(message)
        while view:
            view = view[os.write(write_end, view):]
        os.close(write_end)
        end_monarch()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - exiting regardless
                pass
        os._exit(0)


def _dumps(outcome: tuple[str, object]) -> bytes:
    """The outcome, pickled for the caller; an exception that cannot be pickled goes as its text."""
    import cloudpickle  # results may hold what only cloudpickle pickles, as the replicas' return values do

    kind, value = outcome
    if kind == "raised" and type(value).__module__ != "monarch_plugin.errors" and isinstance(value, Exception):
        text = "".join(traceback.format_exception(value))
        try:
            value.add_note(f"raised in the run's controller process (pid {os.getpid()}):\n{text}")
        except AttributeError:
            pass
    try:
        return cloudpickle.dumps((kind, value))
    except Exception as e:  # noqa: BLE001 - any pickling failure: send what can be said
        text = "".join(traceback.format_exception(value)) if kind == "raised" else repr(value)
        return pickle.dumps(("raised", RuntimeError(
            f"the run's controller could not send its {'error' if kind == 'raised' else 'result'} back "
            f"({type(e).__name__}: {e}):\n{text}")))


def _read_all(fd: int) -> bytes:
    """The child's length-prefixed message, or b'' if it ended without sending one."""
    header = _read(fd, 8)
    if len(header) < 8:
        return b""
    (size,) = struct.unpack("!Q", header)
    message = _read(fd, size)
    return message if len(message) == size else b""


def _read(fd: int, size: int) -> bytes:
    chunks, got = [], 0
    while got < size:
        chunk = os.read(fd, min(size - got, 1 << 20))  # retried after a signal's handler ran (PEP 475)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _interrupt_once(signum: int, frame) -> None:
    """SIGINT in the child: one KeyboardInterrupt stops the run; a second (the terminal's Ctrl-C reaches both
    processes, and the caller passes its own on) must not cut the run's shutdown short."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def end_monarch() -> None:
    """Stop Monarch's runtime if the run started it (its exit handler would, but `os._exit` skips handlers)."""
    if "monarch.actor" not in sys.modules:
        return
    from monarch.actor import shutdown_context

    try:
        shutdown_context(host_timeout=0.3).get(timeout=_SHUTDOWN_S)
    except Exception:  # noqa: BLE001 - best effort: the process ends next either way
        pass
