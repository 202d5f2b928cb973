"""A failure that Monarch reports after a controller's run: real proc meshes, each with a call in flight when
its proc is SIGKILLed. One is named as the controller names a replica's, so its report (and its logger's) is
stale news to drop; the other is the user's own, so its report goes to the hook that was there before.
Prints what reached that hook, one mesh name a line, and exits 0 only if the process was not taken down."""

import os
import signal
import time

import monarch.actor
from monarch.actor import Actor, endpoint, this_host

from monarch_plugin.controller.faults import FaultRouter
from monarch_plugin.wire.protocol import mesh_names


class Sleeper(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def sleep(self) -> None:
        time.sleep(60)


outer: list[str] = []
monarch.actor.unhandled_fault_hook = lambda failure: outer.append(failure.mesh_name.split("-")[0])
FaultRouter.installed()  # as a controller's run leaves it: no controller active


def kill_in_flight(proc_mesh_name: str, actor_name: str) -> None:
    procs = this_host().spawn_procs(per_host={"procs": 1}, name=proc_mesh_name)
    actor = procs.spawn(actor_name, Sleeper)
    pid = next(iter(actor.pid.call().get(timeout=30).values()))
    pending = actor.sleep.call()
    os.kill(pid, signal.SIGKILL)
    try:
        pending.get(timeout=30)
    except Exception:  # noqa: BLE001 - the call fails with the proc; the hook's report follows
        pass


proc_mesh, control, _ = mesh_names(7)
kill_in_flight(proc_mesh, control)
kill_in_flight("user_procs", "user_actor")
deadline = time.monotonic() + 20
while "user_actor" not in outer and time.monotonic() < deadline:
    time.sleep(0.1)
print("\n".join(outer), flush=True)
