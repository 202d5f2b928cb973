"""A process without the run's secret that reaches the run's store, as `tests/e2e/test_attacks.py` runs it: as another,
unprivileged user of this machine (the system's Python, with the project's packages on `PYTHONPATH`), connected to
the store's port like any local process can. It writes under the runtime's own keys with a plain TCPStore client,
and prints a line for each thing it did, which the test reads back.

    python tests/support/attacker.py --port P steer     # forged reports, plans and a stall, then the next
                                                        # formation's addresses
    python tests/support/attacker.py --port P preempt   # the next formation's decision taken before its members
                                                        # decide it
    python tests/support/attacker.py --host IP --port P hosts   # a host's deaths and another's loss, from the job
                                                                # network
"""

from __future__ import annotations

import argparse
import datetime
import json
import threading
import time

import torch.distributed as dist

_TAG = 64  # what the runtime's signature adds to a value (`signing`): the attacker can read values, not sign them


HOST = "127.0.0.1"


def client(port: int) -> dist.TCPStore:
    return dist.TCPStore(HOST, port, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))


def generation(store: dist.TCPStore) -> int:
    """The newest generation, read off the controller's signed `latest` (readable by anyone, like every value)."""
    return int(store.get("latest")[:-_TAG])


_SAYING = threading.Lock()  # the overwriting threads say what they did at once: a line each, never run together


def say(what: str, **fields) -> None:
    with _SAYING:
        print(json.dumps({"did": what, **fields}), flush=True)


def overwrite_addresses(port: int, prefix: str, world: int, seconds: float) -> None:
    """Each rank's gloo address in the formation `prefix`, overwritten the moment it is published, and again and again
    for `seconds`: the members that read it after get the attacker's value."""

    def one(rank: int) -> None:
        store = client(port)
        key = f"{prefix}/0/{rank}"
        try:
            store.wait([key], datetime.timedelta(seconds=30))
        except dist.DistStoreError:
            return
        until = time.monotonic() + seconds
        count = 0
        while time.monotonic() < until:
            store.set(key, b"\x02\x00attacker's address")
            count += 1
        say("overwrote", key=key, times=count)

    threads = [threading.Thread(target=one, args=(rank,)) for rank in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def steer(port: int, replicas: int) -> None:
    """What would stop, shrink or misdirect the run if it were believed."""
    store = client(port)
    g = generation(store)
    say("read", gen=g)
    # The next formation (the test brings one about): its members' addresses, overwritten.
    rendezvous = threading.Thread(target=overwrite_addresses, args=(port, f"pg/{g + 1}/0", replicas, 1.0))
    rendezvous.start()
    plan = json.dumps({"gen": g + 5, "members": [0], "action": "checkpoint", "reason": "forged", "target": 1,
                       "holders": [0], "checkpoint": None})
    store.set(f"plan/{g + 5}", plan)
    store.set("latest", str(g + 5))
    say("forged", keys=[f"plan/{g + 5}", "latest"])
    raised = {"replica": 0, "lane": 0, "error": "RuntimeError: forged", "kind": "builtins.RuntimeError",
              "traceback": "forged", "stage": "run", "step": 3, "gen": g, "finished": False, "phase": "compute",
              "runtime": "", "oom": False, "held": None}
    store.append("raised", json.dumps(raised) + "\n")
    store.add("raised/count", 1)
    store.append("drains", json.dumps({"replica": 1, "lane": 0, "signal": "SIGTERM", "pid": 1, "host": -1}) + "\n")
    store.add("drains/count", 1)
    store.append(f"stalled/{g + 1}/unfit", json.dumps({"replica": 0, "why": "forged"}) + "\n")  # read on its stall
    say("forged", keys=["raised", "drains", f"stalled/{g + 1}/unfit"])
    store.add(f"stalled/{g}", 1)  # counters carry no signature: this one makes the controller look, no more
    store.set(f"stalled/{g}/0/0", b"1")  # and the key it looks for, unsigned
    say("stalled", gen=g)
    rendezvous.join()


def preempt(port: int) -> None:
    """The next formation's outcome decided before its members decide it (the test brings that formation about)."""
    store = client(port)
    g = generation(store)
    store.set(f"pg/{g + 1}/0/decision", b"go")
    say("forged", keys=[f"pg/{g + 1}/0/decision"])


def hosts(port: int) -> None:
    """A multi-host run's watch, from a machine on the job network: three deaths on host 0, with their records and
    their count, and host 1 declared lost."""
    store = client(port)
    for n in (1, 2, 3):
        store.set(f"host/0/death/{n}", json.dumps({"replica": 0, "pid": 1}))
    store.set("host/0/deaths", "3")
    store.set("host/1/lost", "1")
    say("forged", keys=["host/0/death/1", "host/0/death/2", "host/0/death/3", "host/0/deaths", "host/1/lost"])


def main() -> None:
    global HOST
    p = argparse.ArgumentParser()
    p.add_argument("--host", default=HOST, help="the store's address")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("attack", choices=["steer", "preempt", "hosts"])
    args = p.parse_args()
    HOST = args.host
    if args.attack == "steer":
        steer(args.port, args.replicas)
    else:
        preempt(args.port) if args.attack == "preempt" else hosts(args.port)


if __name__ == "__main__":
    main()
