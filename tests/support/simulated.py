"""Simulated replicas for the controller: the real protocol over the real store, without a Monarch mesh.

`ElasticController`'s `launch` seam starts these instead of proc meshes: threads in a few worker processes, each
with its own TCPStore client, speaking the protocol a real worker speaks with the same code (`Flags` for the
controller's pushes, carried by a pipe per worker process instead of a Monarch message; `handshake.barrier` to
form each generation; `Key` and `Plan` for the store; `Key.formed` and the `finished` barrier). What they do not do
is everything a real replica does besides the protocol: no torch group, no heal, and a "step" is a wait that a
push ends at once. Each has a real proc for the controller to watch by pidfd and to kill: a `sleep` that does
nothing, whose end takes the protocol thread out with it.

Used by `benchmarks/scale/simulated.py` (1,024 replicas on two cores) and
`tests/unit/controller/test_controller.py`.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import threading
import time

from monarch_plugin.events import EventLog
from monarch_plugin.wire.protocol import Action, Key, Outcome, Plan, Raised

__all__ = ["Fleet", "wait_for"]


# -- the replicas' side: worker processes, a thread per replica -------------------------------------------------

def _replica(rid: int, env: dict, flags, finishing: threading.Event, killed: threading.Event, step_s: float,
             report, ready: bool, raising: list) -> None:
    import torch.distributed as dist

    from monarch_plugin.wire.handshake import GenerationChanged, barrier
    from monarch_plugin.wire.signing import SECRET_ENV, SignedStore

    timeout_s = float(env.get("MONARCH_PLUGIN_JOIN_TIMEOUT_S", "120"))
    store = SignedStore(dist.TCPStore(env["MONARCH_PLUGIN_STORE_HOST"], int(env["MONARCH_PLUGIN_STORE_PORT"]),
                                      is_master=False, wait_for_workers=False,
                                      timeout=datetime.timedelta(seconds=timeout_s)), bytes.fromhex(env[SECRET_ENV]))
    events = EventLog(env["MONARCH_PLUGIN_EVENTS"], source=f"replica{rid}.0")
    t0 = time.time()
    if ready:  # else it is stuck before its training loop: it waits for plans that never name it
        store.set(Key.ready(rid, 0), b"1")
    gen, seen = -1, -1

    def raise_now():  # the training code raised, as a real worker's `ReplicaActor.run` reports it
        raised = Raised(replica=rid, lane=0, gen=gen, **raising[0])
        events.emit("raised", replica=rid, step=raised.step, gen=gen, error=raised.error)
        store.append(Key.RAISED, raised.line())
        store.add(Key.RAISED_COUNT, 1)
        return report(rid, Outcome("error", time.time() - t0, raised=raised))

    while True:
        # The worker's wait for its next generation (`ReplicaSession._next_plan`): the push, or the store each second.
        while flags.latest <= seen and not flags.stop and not raising:
            if not flags.wait_for_plan(seen, 1.0):
                flags.plan(int(store.get(Key.LATEST)))
        if raising:
            return raise_now()
        if flags.stop:
            return report(rid, "died" if killed.is_set() else Outcome("stopped", time.time() - t0))
        plan = Plan.loads(store.get(Key.plan(flags.latest)))
        seen = plan.gen
        if rid not in plan.members:
            if gen >= 0:
                return report(rid, Outcome("stopped", time.time() - t0))
            continue
        if plan.action == Action.WAIT:
            continue  # training nothing until the plan that brings replacements
        try:
            barrier(store, Key.group(plan.gen, 0), plan.members.index(rid), len(plan.members), timeout_s,
                    lambda: flags.stop or flags.latest > plan.gen)
        except GenerationChanged:
            continue
        gen = plan.gen
        store.set(Key.formed(gen, rid, 0), b"1")
        events.emit("join", replica=rid, gen=gen, world=len(plan.members))
        if plan.action == Action.CHECKPOINT:  # its rank 0 writes (nothing, here); the others wait for the stop
            if plan.members.index(rid) == 0:
                return report(rid, Outcome("stopped", time.time() - t0))
            continue
        while not (flags.stop or flags.abort_gen > gen or flags.regroup_gen > gen):  # training
            if raising:
                return raise_now()
            if finishing.is_set():
                try:
                    barrier(store, Key.finished(gen, 0), plan.members.index(rid), len(plan.members), timeout_s,
                            lambda: flags.abort_gen > gen or flags.stop)
                except GenerationChanged:
                    break
                return report(rid, Outcome("ok", time.time() - t0, value=rid, gen=gen))
            flags.wait_for_plan(gen, step_s)  # a step; a push ends it, as an abort ends a real step's reduction


def _serve(commands, outcomes, step_s: float) -> None:
    """One worker process: start, tell, take out and finish the replicas the controller's side sends it."""
    from monarch_plugin.worker.context import Flags

    replicas: dict[int, tuple[Flags, threading.Event, list]] = {}
    finishing = threading.Event()

    def report(rid, outcome):
        outcomes.put((rid, outcome))

    while True:
        kind, rid, arg = commands.get()
        if kind == "start":
            flags, killed, raising = Flags(), threading.Event(), []
            replicas[rid] = (flags, killed, raising)
            env, ready = arg
            threading.Thread(target=_replica, args=(rid, env, flags, finishing, killed, step_s, report, ready, raising),
                             daemon=True).start()
        elif kind == "raise":
            replicas[rid][2].append(arg)
            replicas[rid][0].plan(-1)  # ends the step in flight, which raises
        elif kind in ("plan", "abort", "regroup"):
            getattr(replicas[rid][0], kind)(arg)
        elif kind == "shutdown":
            replicas[rid][0].request_stop()
        elif kind == "kill":
            replicas[rid][1].set()
            replicas[rid][0].request_stop()
        elif kind == "finish":
            finishing.set()
            for flags, _, _ in replicas.values():
                flags.plan(-1)  # wakes every waiting step, so each sees the finish at once
        elif kind == "exit":
            return


# -- the controller's side: what `launch` returns, shaped as Monarch's meshes are to the controller -----------

class _Got:
    def __init__(self, value):
        self.value = value

    def get(self, timeout=None):
        return self.value


class _Endpoint:
    """An endpoint of a simulated replica's actor mesh, as the controller calls it (`broadcast`, `call().get()`)."""

    def __init__(self, fn):
        self.fn = fn

    def broadcast(self, *args) -> None:
        self.fn(*args)

    def call(self, *args):
        return self.fn(*args)


class _Handle:
    def __init__(self, **endpoints):
        for name, fn in endpoints.items():
            setattr(self, name, _Endpoint(fn))


class _Run:
    """The `run` call's future: the replica's outcome, or an error as Monarch's supervision raises for a death."""

    def __init__(self):
        self.done = threading.Event()
        self.outcome = None

    def get(self, timeout=None):
        self.done.wait()
        if self.outcome == "died":
            raise RuntimeError("simulated replica taken out")
        return {0: self.outcome}


class Fleet:
    """The worker processes, and the `launch` the controller calls."""

    def __init__(self, procs: int, step_s: float, never_ready: tuple[int, ...] = ()):
        """`procs` worker processes; a step takes `step_s`; the replicas `never_ready` never count themselves
        ready (stuck before their training loop)."""
        self.never_ready = never_ready
        ctx = mp.get_context("spawn")
        self.outcomes = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(procs)]
        self.procs = [ctx.Process(target=_serve, args=(q, self.outcomes, step_s), daemon=True) for q in self.commands]
        for p in self.procs:
            p.start()
        self.runs: dict[int, _Run] = {}
        self.placeholders: dict[int, subprocess.Popen] = {}
        self.envs: dict[int, dict] = {}  # what each replica was spawned with (the run's secret among it)
        threading.Thread(target=self._collect, daemon=True).start()

    def launch(self, rid: int, procs: int, env: dict) -> tuple:
        """(proc mesh, control, replica actor) of one simulated replica. Its proc, the pid the controller watches
        by pidfd and kills, is a real one that does nothing (`sleep`); its protocol runs as a thread of a worker
        process, which the proc's end (the mesh's `stop`) takes out with it."""
        proc = subprocess.Popen(["sleep", "infinity"])
        self.placeholders[rid] = proc
        self.envs[rid] = env

        def stop():
            self.send(rid, "kill")
            proc.kill()
            proc.wait()
            return _Got(None)

        tell = {kind: (lambda arg=None, kind=kind: self.send(rid, kind, arg)) for kind in
                ("plan", "abort", "regroup", "shutdown")}
        control = _Handle(info=lambda: _Got({0: {"pid": proc.pid, "host": socket.gethostname()}}),
                          checkpoint_held=lambda: _Got({0: None}), newest_checkpoint=lambda: _Got({0: None}), **tell)
        return _Handle(stop=stop), control, _Handle(run=lambda target: self.start(rid, env))

    def kill(self, rid: int) -> None:
        """SIGKILL the replica's proc from outside, as a failure would."""
        os.kill(self.placeholders[rid].pid, signal.SIGKILL)

    def raise_in(self, rid: int, step: int, kind: str = "builtins.RuntimeError", oom: bool = False,
                 runtime: str = "") -> None:
        """The replica's training code raises `kind` at `step` (its proc lives on, as a real one does); `runtime`: the
        runtime's own part of the worker failed there instead (`errors.ProtocolError`)."""
        name = kind.rsplit(".")[-1]
        self.send(rid, "raise", {"step": step, "kind": kind, "error": f"{name}: simulated", "oom": oom,
                                 "runtime": runtime, "traceback": f"Traceback (simulated)\n{name}: simulated in {rid}"})

    def start(self, rid: int, env: dict) -> _Run:
        self.runs[rid] = _Run()
        self.send(rid, "start", (env, rid not in self.never_ready))
        return self.runs[rid]

    def send(self, rid: int, kind: str, arg=None) -> None:
        self.commands[rid % len(self.commands)].put((kind, rid, arg))

    def finish(self) -> None:
        for q in self.commands:
            q.put(("finish", -1, None))

    def close(self) -> None:
        for proc in self.placeholders.values():
            proc.kill()
            proc.wait()
        for q in self.commands:
            q.put(("exit", -1, None))
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()

    def _collect(self) -> None:
        while True:
            rid, outcome = self.outcomes.get()
            run = self.runs[rid]
            run.outcome = outcome
            run.done.set()


def wait_for(what: str, predicate, timeout: float, where: str):
    """What `predicate()` returns once it is true, polled every 0.1 s; RuntimeError naming `what` and `where` (the
    events file to look in) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.1)
    raise RuntimeError(f"no {what} in {timeout} s; see {where}")
