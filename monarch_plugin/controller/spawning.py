"""Spawning and placement: where a replica starts, how its procs and actors are launched, and its call to train.

It decides which host a new replica goes to (`policies.place`: the most room) and whether the hosts hold the replicas a
run starts with. It reads the run's config, hosts, store address and secret, and writes only the new replica's record
(its launched meshes and pids too), the run's `replicas`, `restarts` and `spawners`; what became of a spawn
(`Spawned`, `Died`, `Returned`) it puts on the run's queue for the run loop: it never decides a generation, a death
or a give-up.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from typing import Any

from monarch_plugin.controller import policies
from monarch_plugin.controller.faults import first_line
from monarch_plugin.controller.hangs import PROBE_TIMEOUT_S
from monarch_plugin.controller.replica import Replica
from monarch_plugin.errors import ConfigError
from monarch_plugin.procs.hosts import Hosts
from monarch_plugin.procs.stores import AGENT_STORE_ENV
from monarch_plugin.wire.protocol import ORPHAN_ENV, START_METHOD_ENV, Died, Returned, Spawned, mesh_names
from monarch_plugin.wire.signing import SECRET_ENV

__all__ = ["check_room", "launch_on_monarch", "spawn", "stop_mesh"]


def check_room(run) -> None:
    """The hosts must hold the replicas a run starts with (later ones may wait for room)."""
    config, hosts = run.config, run.hosts
    room = sum(slots for slots, _ in hosts.rooms().values())
    wanted = config.replicas + config.spares
    if room < wanted:
        gpus = f"{config.procs_per_replica} GPU(s) each, " if any(h.gpus for h in hosts.hosts) else ""
        failed = "; ".join(f"{address}: {why}" for address, why in hosts.failures)
        refused = f"; not used: {failed}" if failed else ""
        raise ConfigError(
            f"the hosts hold {room} replica(s) at once ({gpus}`replicas_per_host` "
            f"{config.replicas_per_host}{refused}) but the run starts {wanted} (`replicas` + "
            "`spares`): add hosts, raise `replicas_per_host`, or start fewer", "replicas"
        )


def spawn(run, initial: bool, restart: bool = True) -> bool:
    """Start a replica on the host with the most room; False if no host has room (nothing is started).
    `restart`: it replaces a lost one (a spare, or growth onto a new machine, is not a restart)."""
    spot = policies.place(run.hosts.rooms())
    if spot is None:
        return False
    rid = len(run.replicas)
    replica = Replica(rid=rid, initial=initial, host=spot[0], spawned_at=time.time())
    run.replicas[rid] = replica
    run.hosts.take(rid, *spot)
    if not initial and restart:
        run.restarts += 1
    spawner = threading.Thread(target=_start, args=(run, replica), daemon=True, name=f"spawn-{rid}")
    run.spawners[rid] = spawner
    spawner.start()
    return True


def launch_on_monarch(hosts: Hosts, rid: int, procs: int, env: dict[str, str]) -> tuple[Any, Any, Any]:
    """The default `launch`: the replica's procs on its host as a Monarch proc mesh, and its two actors there."""
    from monarch_plugin.worker.actors import ControlActor, ReplicaActor

    mesh_name, control_name, actor_name = mesh_names(rid)
    mesh = hosts.spawn_procs(rid, procs, mesh_name)
    return mesh, mesh.spawn(control_name, ControlActor), mesh.spawn(actor_name, ReplicaActor, env)


def _env(run, replica: Replica) -> dict[str, str]:
    """What the replica's procs find in their environment: the run's settings, its store and secret, their group."""
    k = run.config.procs_per_replica
    return {
        **run.config.env,
        **run.config.to_env(),
        "MONARCH_PLUGIN_REPLICA_ID": str(replica.rid),
        "MONARCH_PLUGIN_INITIAL": "1" if replica.initial else "0",
        "MONARCH_PLUGIN_STORE_HOST": run.config.store_host,
        "MONARCH_PLUGIN_STORE_PORT": str(run.store.port),
        SECRET_ENV: run.secret,
        # The replica's own group stays on its host's loopback, gloo's sockets and its store included (served by
        # its first proc: `ReplicaActor`).
        "MASTER_ADDR": "127.0.0.1",
        **AGENT_STORE_ENV,
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        "WORLD_SIZE": str(k),
        "LOCAL_WORLD_SIZE": str(k),
        # torchrun's default: replicas share the host's cores, and a thread pool per core each thrashes.
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        START_METHOD_ENV: multiprocessing.get_start_method(allow_none=True) or "",
        ORPHAN_ENV: str(run.config.controller_loss_save_s),
        **run.hosts.env_for(replica.rid),
    }


def _start(run, replica: Replica) -> None:
    """The replica's spawn thread: launch it, watch its procs, start its training, then await its return."""
    env = _env(run, replica)
    hosts = run.hosts
    try:
        env["MASTER_PORT"] = str(hosts.free_port(replica.rid))  # free there, not here
        replica.mesh, replica.control, replica.actor = run.launch(replica.rid, run.config.procs_per_replica, env)
        infos = list(replica.control.info.call().get(timeout=run.config.join_timeout_s).values())
        replica.pids = [i["pid"] for i in infos]
        hosts.watch(replica.rid, replica.pids)
        if run.closing.is_set():  # the run ended while this replica started: it must not outlive it
            hosts.kill(replica.rid)
            stop_mesh(hosts, replica)
            return
        future = replica.actor.run.call(run.target)
    except Exception as e:  # noqa: BLE001 - a failed spawn is reported as a death of that replica
        if not hosts.gone(replica.rid):  # else its host's loss takes it, and it is no crash of its own
            run.reports.put(Died(replica.rid, f"spawn failed: {type(e).__name__}: {e}"))
        return
    run.events.emit("spawn", replica=replica.rid, pids=replica.pids, initial=replica.initial,
                    host=hosts.host_of(replica.rid).name, seconds=round(time.time() - replica.spawned_at, 3))
    run.reports.put(Spawned(replica.rid))
    while True:
        try:
            results = list(future.get(timeout=PROBE_TIMEOUT_S).values())
            break
        except TimeoutError:  # training goes on; but a lost host's procs never answer, nor does Monarch for them
            if not hosts.hosts[replica.host].live:  # its loss took the replica (`HostLost`)
                return
        except Exception as e:  # noqa: BLE001 - supervision errors mean the process died
            run.reports.put(Died(replica.rid, f"supervision ({type(e).__name__}: {first_line(e)})"))
            return
    run.reports.put(Returned(replica.rid, results))


def stop_mesh(hosts: Hosts, replica: Replica) -> None:
    """Stop the replica's proc mesh, once (a lost host's meshes cannot be reached)."""
    if replica.mesh is None or replica.mesh_stopped or not hosts.hosts[replica.host].live:
        return
    replica.mesh_stopped = True
    try:
        replica.mesh.stop().get(timeout=10)
    except Exception:  # noqa: BLE001 - a mesh holding a dead proc may refuse; the kill follows
        pass
