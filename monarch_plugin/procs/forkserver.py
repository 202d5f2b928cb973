"""Replica processes forked from a warm server instead of started as fresh interpreters.

A fresh process pays its imports on every start: torch is 3 s of CPU here, Lightning 10 s (it imports
torchmetrics, which imports transformers), torchtitan 10 s. A replacement paid them again after each death,
and so did every initial replica at once, on cores the survivors were training on. `ForkServer` pays them
once per run: a process that imports the frameworks the replicas will use, then forks a child for each proc
Monarch starts (multiprocessing's forkserver, for Monarch procs).

Monarch starts a proc by running its bootstrap command as a child of the host agent and supervises that
child. The bootstrap command becomes `python -m monarch_plugin.procs.forkserver SOCKET` (`client_main`), which
imports nothing heavy (~30 ms): it sends its environment (Monarch's per-proc bootstrap settings in it), working
directory and inherited descriptors (stdout and stderr are Monarch's log pipes) over a Unix socket, and the
server forks a child that takes them over and runs Monarch's bootstrap (`monarch._src.actor.bootstrap_main`),
so the child is the proc. The client stays as its stand-in: it forwards SIGTERM, SIGUSR1 and SIGINT to the child
(which drains on the first two, `notice`) and ends
with the child's exit status or signal, which is what Monarch's supervision sees.

Rules it keeps:
- The server never imports Monarch: its runtime threads would not survive a fork (Monarch's WF-2). It stays
  single-threaded, so a fork copies no lock held by another thread.
- Lifetimes: the server ends with the process that started it (a pidfd in its loop; it SIGKILLs its children
  as it goes), and a child is SIGKILLed when its client goes (a pidfd watched by a thread). The server is its
  children's subreaper: what a dead proc leaves (e.g. a process the training code started from multiprocessing's
  forkserver, which watches only that forkserver) becomes the server's, which ends it. No process outlives its
  replica or the controller's process.
- The server is a helper, not a replica's life: killed alone (the OOM killer's pick, a stray `kill`), it takes no
  proc with it. Each client then waits on its child's pidfd instead, and stands in for it as before; replicas
  started after that start as fresh interpreters (`ForkServer.bootstrap_command`). A client watches the process
  that started it (the controller's) and SIGKILLs its child when that goes, so no proc outlives the controller
  even once the server that would have ended them is gone.
- A child gets what a fresh interpreter would have: the client's environment, directory, `PYTHONPATH` entries
  and process group, fresh random seeds; only the imported modules are shared (copy-on-write).
- CUDA is never touched in the server; on a GPU build it is off by default all the same (`ElasticConfig
  .forkserver`), since a library that initialises the driver at import would make every child's CUDA unusable.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import logging
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from monarch_plugin.procs import notice
from monarch_plugin.wire.protocol import ORPHAN_ENV

__all__ = ["ALWAYS", "ForkServer", "PRELOADABLE", "client_main", "for_run", "preload_for", "stop_shared"]

log = logging.getLogger(__name__)

ALWAYS = ("torch", "torch._dynamo")
"""Loaded for every run: torch, and what its first optimizer loads (`torch.optim.Optimizer()` imports dynamo, and
with it DTensor and FSDP: 2 s of CPU here, which every replica paid at its first step)."""

PRELOADABLE = ("numpy", "lightning", "pytorch_lightning", "transformers", "accelerate", "datasets",
               "torchtitan.train")
"""Frameworks the server may import as well, if the training code does: slow to import, and starting neither
threads that hold locks nor any device. User code is never imported there (its import may do anything)."""

READY_TIMEOUT_S = 120.0
"""Bound on the server's imports; past it (or if it dies) replicas are started the usual way."""

_BOOTSTRAP = "monarch._src.actor.bootstrap_main"
_GPU_BUILD = 3  # the server's exit status when it finds a GPU build of torch and was started `--cpu-only`
_PR_SET_CHILD_SUBREAPER = 36
_ORPHAN_CAP_S = 600.0
"""How long the server waits for its procs once the process that started it is gone: each ends within its run's
`controller_loss_save_s`, or its client ends it; past this, the server ends what is left regardless."""
_STOP_WAIT_S = 5.0
"""How long `stop` gives the server to end its procs and what they left before it SIGKILLs it."""
_MAX_MESSAGE = 1 << 20


def preload_for(imports: set[str]) -> list[str]:
    """What the server imports: `ALWAYS`, and each `PRELOADABLE` framework whose top-level package is among
    `imports` (those of the training code's source file, `Target.imports`)."""
    return [*ALWAYS, *(m for m in PRELOADABLE if m.split(".")[0] in imports)]


def for_run(config, imports: list[str]) -> "ForkServer | None":
    """The shared server a run on this machine starts its procs from (started now if needed), or None: off in
    `config`, or a multi-host run. Called as early as a run's settings are known, so that its imports run beside
    the controller's own."""
    if config.forkserver is False or config.multi_host:
        return None
    return ForkServer.shared(preload_for(set(imports)), cpu_only=config.forkserver is None)


_SHARED: dict[tuple[str, ...], "ForkServer"] = {}
_SHARED_LOCK = threading.Lock()


class ForkServer:
    """A handle on one server on this machine: start it, wait for its imports, stop it.

    `ForkServer.shared` keeps one per list of imports for the life of the process that runs controllers, as
    multiprocessing keeps its forkserver: `monarch-run`'s, or the child a run from Python is supervised from
    (`procs.apart`), so each of those starts its own. It is stopped when that process exits, and ends by itself
    (removing its socket) when that process ends without stopping it.
    """

    @classmethod
    def shared(cls, preload: list[str], cpu_only: bool) -> "ForkServer":
        """This process's server for `preload`, started now if there is none (or it died, other than by finding a
        GPU build it was not to serve on)."""
        key = (*preload, cpu_only)
        with _SHARED_LOCK:
            server = _SHARED.get(key)
            if server is None or server._proc.poll() not in (None, _GPU_BUILD):
                if not _SHARED:
                    atexit.register(stop_shared)
                server = _SHARED[key] = cls(preload, cpu_only)
                server.start()
            return server

    def __init__(self, preload: list[str], cpu_only: bool = False):
        self.preload = preload
        self.cpu_only = cpu_only
        """Exit on a CUDA or ROCm build of torch (the default, `forkserver=None`), found once torch is imported."""
        self.unused: str | None = None
        """Why procs start the usual way instead, once that is known."""
        self._dir = tempfile.mkdtemp(prefix="monarch-plugin-forkserver-")  # 0700: only this user connects
        self.socket_path = os.path.join(self._dir, "socket")
        self._proc: subprocess.Popen | None = None
        self._ready: bool | None = None
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Start the imports; `bootstrap_command` waits for them."""
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "monarch_plugin.procs.forkserver", "--serve", self.socket_path,
             *(["--cpu-only"] if self.cpu_only else []), *self.preload], stdin=subprocess.DEVNULL)

    def bootstrap_command(self):
        """The `BootstrapCommand` that starts a proc through this server, or None (the usual way) if the server
        did not get ready within `READY_TIMEOUT_S`, or has exited since: said once, in the log. A client of a dead
        server could not start its proc, and every replacement would die at spawn."""
        if not self._wait_ready():
            return None
        if self._proc.poll() is not None:
            with self._lock:
                if self._ready:
                    self._ready = False
                    code = self._proc.returncode
                    self.unused = (f"the forkserver was killed by {signal.Signals(-code).name} during the run"
                                   if code < 0 else f"the forkserver exited with {code} during the run")
                    log.warning("%s: replicas start as fresh processes from now on", self.unused)
            return None
        from monarch.actor import default_bootstrap_cmd

        command = default_bootstrap_cmd()
        command.args = ["-m", "monarch_plugin.procs.forkserver", self.socket_path]
        return command

    def _wait_ready(self) -> bool:
        with self._lock:  # the first spawner waits; the others find the answer
            if self._ready is None:
                deadline = time.monotonic() + READY_TIMEOUT_S
                while not os.path.exists(self.socket_path) and self._proc.poll() is None \
                        and time.monotonic() < deadline:
                    time.sleep(0.02)
                self._ready = os.path.exists(self.socket_path) and self._proc.poll() is None
                if self._proc.poll() == _GPU_BUILD:
                    self.unused = "a GPU build of torch (`forkserver` None: only CPU runs fork by default)"
                elif not self._ready:
                    self.unused = (f"the forkserver exited with {self._proc.returncode}" if self._proc.poll()
                                   is not None else f"the forkserver was not ready in {READY_TIMEOUT_S:.0f} s")
                    log.warning("%s (importing %s): replicas start as fresh processes instead", self.unused,
                                ", ".join(self.preload))
            return self._ready

    def stop(self) -> None:
        """Stop the server: SIGHUP, on which it ends its procs and whatever they left behind, then itself (it
        ignores SIGTERM and SIGUSR1, which a scheduler sends the whole job); SIGKILL if it has not within
        `_STOP_WAIT_S` (its procs still die with it)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGHUP)
            try:
                self._proc.wait(timeout=_STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        for path in (self.socket_path, self._dir):
            try:
                os.rmdir(path) if path == self._dir else os.unlink(path)
            except OSError:
                pass


def stop_shared() -> None:
    """Stop this process's shared servers and their procs (at exit, or before an exit that skips handlers)."""
    with _SHARED_LOCK:
        for server in _SHARED.values():
            server.stop()
        _SHARED.clear()


# -- the server ---------------------------------------------------------------------------------------------

def _serve(path: str, preload: list[str], cpu_only: bool) -> None:
    # The process that started it, watched as a process: PR_SET_PDEATHSIG would fire when the *thread* that
    # started it ends, and a controller runs in whichever thread called it.
    try:
        parent = os.pidfd_open(os.getppid())
    except ProcessLookupError:
        return
    # What a proc leaves behind when it dies (a child of multiprocessing's forkserver watches only that forkserver,
    # never the proc) becomes the server's: ended in `_reap`, never left running.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    for module in preload:
        __import__(module)
        if select.select([parent], [], [], 0)[0]:  # it died meanwhile
            return
        if module == "torch" and cpu_only and (sys.modules["torch"].version.cuda or sys.modules["torch"].version.hip):
            os._exit(_GPU_BUILD)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # a message each: no framing to get wrong
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # it appears when it can be used
    wake_r, wake_w = socket.socketpair()
    wake_w.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno())
    signal.signal(signal.SIGCHLD, lambda *_: None)
    for sig in notice.NOTICE_SIGNALS:  # a scheduler signals the whole job: the procs drain, and must not die with the server
        signal.signal(sig, lambda *_: None)
    signal.signal(signal.SIGHUP, _stop_serving)  # `ForkServer.stop`
    children: dict[int, socket.socket] = {}  # pid -> its client's connection
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    selector.register(parent, selectors.EVENT_READ)
    orphaned = None  # when the process that started it ended: the procs may outlive it by their bound
    try:
        while orphaned is None or (children and time.monotonic() - orphaned < _ORPHAN_CAP_S):
            for key, _ in selector.select(1.0):
                if key.fileobj == parent:
                    # Each proc saves the run and ends within `controller_loss_save_s`, or its client ends it then.
                    orphaned = time.monotonic()
                    selector.unregister(parent)
                    selector.unregister(listener)
                    continue
                if key.fileobj is listener:
                    conn, _ = listener.accept()
                    pid = _fork_one(conn, [listener, wake_r, wake_w, *children.values()], parent, selector)
                    if pid is not None:
                        children[pid] = conn
                else:
                    wake_r.recv(4096)
                    _reap(children)
    finally:
        # Every proc, then what each left: a stopped child ignores SIGTERM; SIGKILL is what PR_SET_PDEATHSIG sends
        # anyway. Reaped until none is left, so the orphans of each reach the server (bounded: it ends regardless).
        deadline = time.monotonic() + _STOP_WAIT_S - 1
        while time.monotonic() < deadline:
            _kill(_adopted(()))
            try:
                while os.waitpid(-1, os.WNOHANG)[0]:
                    pass
            except ChildProcessError:
                break
            time.sleep(0.01)
        for remove, name in ((os.unlink, path), (os.rmdir, os.path.dirname(path))):  # what `stop` removes
            try:
                remove(name)
            except OSError:
                pass


def _fork_one(conn: socket.socket, own: list[socket.socket], parent: int, selector) -> int | None:
    conn.settimeout(10)
    try:
        message, fds, _, _ = socket.recv_fds(conn, _MAX_MESSAGE, 64)
        request = json.loads(message)
    except (OSError, ValueError):
        conn.close()
        return None
    pid = os.fork()
    if pid == 0:
        try:
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGCHLD, *notice.NOTICE_SIGNALS):
                signal.signal(sig, signal.SIG_DFL)
            selector.close()
            os.close(parent)
            for s in own:
                s.close()
            code = _become_proc(request, fds, conn)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # noqa: BLE001 - the child must end here, never back in the server's loop
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001
                    pass
        os._exit(code)
    for fd in fds:
        os.close(fd)
    try:
        conn.send(json.dumps({"pid": pid}).encode())
    except OSError:
        pass  # its client is gone: the child sees that through its pidfd and ends
    return pid


def _stop_serving(*_) -> None:
    raise SystemExit(0)


def _adopted(children) -> list[int]:
    """The server's children that are not `children` (its procs): what a dead proc left, adopted by the server as
    their subreaper."""
    me, found = str(os.getpid()), []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) not in children:
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = f.read().rsplit(")", 1)[1].split()[1]
            except (OSError, IndexError):
                continue
            if ppid == me:
                found.append(int(name))
    return found


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _reap(children: dict[int, socket.socket]) -> None:
    """Report each proc's end to its client; SIGKILL what the dead left behind (those reparent to the server, and
    die in turn, so each round of deaths brings this back until nothing is left)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            _kill(_adopted(children))
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        end = ({"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status)
               else {"code": os.waitstatus_to_exitcode(status)})
        try:
            conn.send(json.dumps(end).encode())
        except OSError:
            pass
        conn.close()


def _become_proc(request: dict, fds: list[int], conn: socket.socket) -> int:
    """In the child: take over the client's descriptors, environment and directory, then run Monarch's bootstrap."""
    targets = request["fds"]
    top = max(targets + [conn.fileno()]) + 1
    moved = [_dup_above(fd, top) for fd in fds]  # out of the targets' way first
    for fd in fds:
        os.close(fd)
    for fd, target in zip(moved, targets):
        os.dup2(fd, target)
        os.close(fd)
    conn.close()
    client = request["client_pid"]
    try:
        os.setpgid(0, os.getpgid(client))  # in its client's group, which Monarch may signal as a whole
    except OSError:
        pass
    _watch_client(client)
    os.environ.clear()
    os.environ.update(request["env"])
    # Monarch's bootstrap has a proc die with its parent: here the server, a helper whose loss must take no proc
    # (the client above stands in for it, and its death is this proc's).
    os.environ["HYPERACTOR_MESH_BOOTSTRAP_ENABLE_PDEATHSIG"] = "false"
    os.chdir(request["cwd"])
    sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.argv = [request["argv0"]]
    import random

    random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    import runpy

    notice.install()  # on this, the proc's main thread, before Monarch's bootstrap takes it
    runpy.run_module(_BOOTSTRAP, run_name="__main__", alter_sys=True)
    return 0


def _dup_above(fd: int, floor: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, floor)


def _watch_client(pid: int) -> None:
    """SIGKILL this process when its client ends: Monarch stopping or killing a proc reaches the client."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)
        return

    def wait() -> None:
        watch = selectors.DefaultSelector()
        watch.register(pidfd, selectors.EVENT_READ)
        watch.select()
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait, name="forkserver-client-watch", daemon=True).start()


# -- the client: Monarch's bootstrap command ----------------------------------------------------------------

def client_main(path: str) -> int:
    """Have the server fork this proc, stand in for it, and end as it ended."""
    starter = os.pidfd_open(os.getppid())  # the controller's process, whose Monarch started this one
    inherited = [fd for fd in _open_fds() if os.get_inheritable(fd)]  # what Monarch gave this process
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(path)
    request = {"fds": inherited, "env": dict(os.environ), "cwd": os.getcwd(), "client_pid": os.getpid(),
               "argv0": sys.argv[0]}
    socket.send_fds(conn, [json.dumps(request).encode()], inherited)
    first = conn.recv(4096)
    if not first:
        print(f"monarch-plugin forkserver at {path} closed before forking this proc", file=sys.stderr)
        return 1
    child = json.loads(first)["pid"]

    def forward(sig, _frame):
        try:
            os.kill(child, sig)
        except ProcessLookupError:
            pass

    for sig in (*notice.NOTICE_SIGNALS, signal.SIGINT):
        signal.signal(sig, forward)
    watch = selectors.DefaultSelector()
    watch.register(conn, selectors.EVENT_READ)
    watch.register(starter, selectors.EVENT_READ)
    while True:
        for key, _ in watch.select():
            if key.fileobj == starter:  # the controller's process is gone: its proc goes too (a stopped one as well)
                _outlive(child, float(os.environ.get(ORPHAN_ENV, 0)))
                forward(signal.SIGKILL, None)
                return 1
            if key.fileobj is not conn:  # the child ended after the server: how went with the server, its parent
                return 1
            last = conn.recv(4096)
            if last:
                return _end_as(json.loads(last))
            # The server went, a helper: the child goes on, and this stands in for it until it ends.
            watch.unregister(conn)
            try:
                watch.register(os.pidfd_open(child), selectors.EVENT_READ)
            except ProcessLookupError:
                return 1


def _outlive(child: int, bound_s: float) -> None:
    """The controller is gone: give the proc `bound_s` to save the run and end by itself (`worker.orphan`); none when
    `controller_loss_save_s` is 0 (the proc goes with its controller)."""
    if not bound_s:
        return
    try:
        pidfd = os.pidfd_open(child)
    except ProcessLookupError:
        return
    select.select([pidfd], [], [], bound_s + 1.0)  # its own bound first, then this one
    os.close(pidfd)


def _end_as(end: dict) -> int:
    """End as the child did, so that Monarch's supervision reads the same death."""
    if "signal" in end:
        if end["signal"] not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(end["signal"], signal.SIG_DFL)
        os.kill(os.getpid(), end["signal"])
        return 128 + end["signal"]
    return end.get("code", 1)


def _open_fds() -> list[int]:
    fds = []
    for name in os.listdir("/proc/self/fd"):
        try:
            os.fstat(int(name))
            fds.append(int(name))
        except OSError:
            pass  # the directory listing's own descriptor, closed by now
    return fds


def main(argv: list[str]) -> int:
    if argv[:1] == ["--serve"]:
        cpu_only = argv[2:3] == ["--cpu-only"]
        try:
            _serve(argv[1], argv[3:] if cpu_only else argv[2:], cpu_only)
        finally:
            os._exit(0)  # its children are dead by now, and finalizing what it imported only takes time
    return client_main(argv[0])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
