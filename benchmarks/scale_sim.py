"""The generation protocol at 64 to 1,024 replicas: the real controller and store, simulated replicas.

A machine of 2 cores holds 16 real replicas at most. Here `ElasticController` runs unchanged, with its real store,
but its `launch` seam starts light replicas instead of Monarch proc meshes: threads in a few worker processes
(`--procs`), each with its own TCPStore client, speaking the protocol a real worker speaks with the same code:
`Flags` for the controller's pushes (`plan` / `abort` / `regroup` / `shutdown`, carried here by a pipe per worker
process instead of a Monarch message), `collectives.barrier` to form each generation, `Key` and `Plan` for the
store, `Key.formed` and the `finished` barrier. What they do not do is everything a real replica does besides
the protocol: no torch group is built (gloo over a thousand ranks on one machine is not a thing to time), no heal,
and a "step" is a wait of `--step-ms` that a push ends at once.

Each simulated replica has a real proc for the controller to watch by pidfd and to kill: a `sleep` that does
nothing, whose end the mesh's `stop` carries to the protocol thread (which then ends, closing its store connection).
For each count N: start N replicas, let them train, SIGKILL replica 1's proc, and let the controller's replacement
grow the run back. From the events file:

  detected        kill -> the controller's death event (the pidfd)
  shrink plan     kill -> the generation without it published
  all survivors   kill -> the last survivor through that generation's barrier (in its new group)
  grow            the generation admitting the replacement published -> the last member through its barrier

    python benchmarks/scale_sim.py --replicas 64 128 256 512 1024 --out benchmarks/results

Writes <out>/scale_sim.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

from monarch_plugin.config import ElasticConfig
from monarch_plugin.controller import ElasticController
from monarch_plugin.events import EventLog, read_events
from monarch_plugin.protocol import Action, Key, Outcome, Plan
from monarch_plugin.target import Target

HERE = Path(__file__).resolve().parent


# -- the replicas' side: worker processes, a thread per replica -------------------------------------------------

def _replica(rid: int, env: dict, flags, finishing: threading.Event, killed: threading.Event, step_s: float,
             report) -> None:
    import torch.distributed as dist

    from monarch_plugin.handshake import GenerationChanged, barrier

    timeout_s = float(env.get("MONARCH_PLUGIN_JOIN_TIMEOUT_S", "120"))
    store = dist.TCPStore(env["MONARCH_PLUGIN_STORE_HOST"], int(env["MONARCH_PLUGIN_STORE_PORT"]), is_master=False,
                          wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s))
    events = EventLog(env["MONARCH_PLUGIN_EVENTS"], source=f"replica{rid}.0")
    t0 = time.time()
    store.add(Key.ready(rid), 1)
    gen, seen = -1, -1
    while True:
        # The worker's wait for its next generation (`ReplicaSession._next_plan`): the push, or the store each second.
        while flags.latest <= seen and not flags.stop:
            if not flags.wait_for_plan(seen, 1.0):
                flags.plan(int(store.get(Key.LATEST)))
        if flags.stop:
            return report(rid, "died" if killed.is_set() else Outcome("stopped", time.time() - t0))
        plan = Plan.loads(store.get(Key.plan(flags.latest)))
        seen = plan.gen
        if rid not in plan.members:
            if gen >= 0:
                return report(rid, Outcome("stopped", time.time() - t0))
            continue
        try:
            barrier(store, Key.group(plan.gen, 0), len(plan.members), timeout_s,
                    lambda: flags.stop or flags.latest > plan.gen)
        except GenerationChanged:
            continue
        gen = plan.gen
        store.add(Key.formed(gen), 1)
        events.emit("join", replica=rid, gen=gen, world=len(plan.members))
        if plan.action == Action.CHECKPOINT:
            return report(rid, Outcome("stopped", time.time() - t0))
        while not (flags.stop or flags.abort_gen > gen or flags.regroup_gen > gen):  # training
            if finishing.is_set():
                try:
                    barrier(store, Key.finished(gen, 0), len(plan.members), timeout_s,
                            lambda: flags.abort_gen > gen or flags.stop)
                except GenerationChanged:
                    break
                return report(rid, Outcome("ok", time.time() - t0, value=rid, gen=gen))
            flags.wait_for_plan(gen, step_s)  # a step; a push ends it, as an abort ends a real step's reduction


def _serve(commands, outcomes, step_s: float) -> None:
    """One worker process: start, tell, take out and finish the replicas the controller's side sends it."""
    from monarch_plugin.worker.context import Flags

    replicas: dict[int, tuple[Flags, threading.Event]] = {}
    finishing = threading.Event()

    def report(rid, outcome):
        outcomes.put((rid, outcome))

    while True:
        kind, rid, arg = commands.get()
        if kind == "start":
            flags, killed = Flags(), threading.Event()
            replicas[rid] = (flags, killed)
            threading.Thread(target=_replica, args=(rid, arg, flags, finishing, killed, step_s, report),
                             daemon=True).start()
        elif kind in ("plan", "abort", "regroup"):
            getattr(replicas[rid][0], kind)(arg)
        elif kind == "shutdown":
            replicas[rid][0].request_stop()
        elif kind == "kill":
            replicas[rid][1].set()
            replicas[rid][0].request_stop()
        elif kind == "finish":
            finishing.set()
            for flags, _ in replicas.values():
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

    def __init__(self, procs: int, step_s: float):
        ctx = mp.get_context("spawn")
        self.outcomes = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(procs)]
        self.procs = [ctx.Process(target=_serve, args=(q, self.outcomes, step_s), daemon=True) for q in self.commands]
        for p in self.procs:
            p.start()
        self.runs: dict[int, _Run] = {}
        self.placeholders: dict[int, subprocess.Popen] = {}
        threading.Thread(target=self._collect, daemon=True).start()

    def launch(self, rid: int, procs: int, env: dict) -> tuple:
        """(proc mesh, control, replica actor) of one simulated replica. Its proc, the pid the controller watches
        by pidfd and kills, is a real one that does nothing (`sleep`); its protocol runs as a thread of a worker
        process, which the proc's end (the mesh's `stop`) takes out with it."""
        proc = subprocess.Popen(["sleep", "infinity"])
        self.placeholders[rid] = proc

        def stop():
            self.send(rid, "kill")
            proc.kill()
            proc.wait()
            return _Got(None)

        tell = {kind: (lambda arg=None, kind=kind: self.send(rid, kind, arg)) for kind in
                ("plan", "abort", "regroup", "shutdown")}
        control = _Handle(info=lambda: _Got({0: {"pid": proc.pid, "host": socket.gethostname()}}), **tell)
        return _Handle(stop=stop), control, _Handle(run=lambda target: self.start(rid, env))

    def kill(self, rid: int) -> None:
        """SIGKILL the replica's proc from outside, as a failure would."""
        os.kill(self.placeholders[rid].pid, signal.SIGKILL)

    def start(self, rid: int, env: dict) -> _Run:
        self.runs[rid] = _Run()
        self.send(rid, "start", env)
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


# -- one count ----------------------------------------------------------------------------------------------------

def run(work: Path, replicas: int, procs: int, step_ms: float) -> dict:
    here = work / f"sim-{replicas}"
    here.mkdir(parents=True)
    events_path = str(here / "events.jsonl")
    config = ElasticConfig(replicas=replicas, min_replicas=1, forkserver=False, join_timeout_s=120,
                           events_path=events_path, restart_backoff_s=0.5, checkpoint_dir=str(here / "ckpt"))
    config.env.update(MONARCH_PLUGIN_EVENTS=events_path, MONARCH_PLUGIN_JOIN_TIMEOUT_S="120")
    fleet = Fleet(procs, step_ms / 1000)
    controller = ElasticController(config, Target.function(print), launch=fleet.launch)
    log = EventLog(events_path, source="benchmark")
    result: dict = {}

    def drive():
        try:
            def gens_with(predicate):
                return [q for q in read_events(events_path) if q["event"] == "quorum" and predicate(q)]

            def wait(what, predicate, timeout=300):
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    found = predicate()
                    if found:
                        return found
                    time.sleep(0.2)
                raise RuntimeError(f"{replicas} replicas: no {what} in {timeout} s; see {events_path}")

            def joined(gen):
                return [e for e in read_events(events_path) if e["event"] == "join" and e["gen"] == gen]

            start = wait("first generation", lambda: gens_with(lambda q: len(q["members"]) == replicas))[0]
            wait("first generation formed", lambda: len(joined(start["gen"])) == replicas)
            time.sleep(1.0)
            log.emit("kill", replica=1)
            fleet.kill(1)
            wait("regrown generation", lambda: gens_with(lambda q: q["gen"] > start["gen"] and len(q["members"]) == replicas))
            grow = gens_with(lambda q: q["gen"] > start["gen"] and len(q["members"]) == replicas)[0]
            wait("regrown generation formed", lambda: len(joined(grow["gen"])) == replicas)
            result["ok"] = True
        finally:
            fleet.finish()

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    t0 = time.monotonic()
    try:
        controller.run()
    finally:
        fleet.close()
    driver.join(5)
    if not result.get("ok"):
        raise RuntimeError(f"{replicas} replicas: the run ended before it regrew; see {events_path}")
    events = read_events(events_path)
    kill = next(e["ts"] for e in events if e["event"] == "kill")
    death = next(e["ts"] for e in events if e["event"] == "death")
    quorums = [e for e in events if e["event"] == "quorum"]
    shrink = next(q for q in quorums if q["ts"] >= death and 1 not in q["members"])
    grow = next(q for q in quorums if q["gen"] > shrink["gen"] and len(q["members"]) == replicas)
    joins: dict[int, list[float]] = {}
    for e in events:
        if e["event"] == "join":
            joins.setdefault(e["gen"], []).append(e["ts"])
    return {
        "replicas": replicas,
        "procs": procs,
        "run_s": round(time.monotonic() - t0, 1),
        "detected_s": death - kill,
        "shrink_plan_s": shrink["ts"] - kill,
        "all_survivors_s": max(joins[shrink["gen"]]) - kill,
        "grow_s": max(joins[grow["gen"]]) - grow["ts"],
        "shrink_gens": grow["gen"] - shrink["gen"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    p.add_argument("--procs", type=int, default=8, help="worker processes the simulated replicas share")
    p.add_argument("--step-ms", type=float, default=100.0)
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--work", type=Path, default=Path("/tmp/monarch_plugin_scale_sim"))
    args = p.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    results = []
    for n in args.replicas:
        results.append(run(args.work, n, args.procs, args.step_ms))
        print(json.dumps(results[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scale_sim.json").write_text(json.dumps(results, indent=1))
    print("\n| simulated replicas | kill -> shrink plan | kill -> every survivor in the new group | "
          "grow plan -> every member in the grown group |\n|---|---|---|---|")
    for r in results:
        ms = [f"{r[k] * 1000:.0f} ms" for k in ("shrink_plan_s", "all_survivors_s", "grow_s")]
        print(f"| {r['replicas']} | " + " | ".join(ms) + " |")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
