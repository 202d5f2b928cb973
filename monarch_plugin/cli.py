"""`monarch-run`: torchrun's job, elastic, on Monarch.

    monarch-run --replicas 4 --min-replicas 2 [--procs-per-replica k] train.py --lr 3e-4
    monarch-run --replicas 4 -m my_pkg.train --lr 3e-4

The calling process becomes the single controller; each replica's procs get the usual torch.distributed
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) scoped to their own replica group, and
reach the elastic runtime through `monarch_plugin.ElasticLoop`.
"""

from __future__ import annotations

import argparse
import logging
import sys

from monarch_plugin.config import BACKENDS, BATCH_POLICIES, ElasticConfig
from monarch_plugin.errors import ConfigError, ElasticRunAborted, ReplicaCodeError

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="monarch-run",
        description="Run a training script on elastic replica groups supervised by a Monarch controller.",
    )
    p.add_argument("--replicas", type=int, default=2, help="replica groups to start and to regrow to")
    p.add_argument("--min-replicas", type=int, default=1,
                   help="fewest live replicas to keep training on (default: 1); below it the run stops")
    p.add_argument("--max-replicas", type=int, default=None, help="most live replicas (default: --replicas)")
    p.add_argument("--procs-per-replica", type=int, default=1, help="procs in one replica group (FSDP: k)")
    p.add_argument("--backend", choices=BACKENDS, default="auto", help="cross-replica backend")
    p.add_argument("--intra-backend", choices=BACKENDS, default="auto", help="backend inside a replica")
    p.add_argument("--batch-policy", choices=BATCH_POLICIES, default="constant_global")
    p.add_argument("--spares", type=int, default=0, help="hot spare replicas, ready to be healed in the moment one dies")
    p.add_argument("--max-restarts", type=int, default=10)
    p.add_argument("--collective-timeout", type=float, default=60.0, help="seconds before a stalled step is investigated")
    p.add_argument("--join-timeout", type=float, default=300.0, help="seconds a new replica may take to start")
    p.add_argument("--events", default=None, help="JSON-lines events file (default: monarch_events.jsonl)")
    p.add_argument("--checkpoint-dir", default="monarch_checkpoints")
    p.add_argument("--fault", default=None, help="inject a fault, e.g. sigkill:replica=1:step=20")
    p.add_argument("-m", dest="module", action="store_true", help="run the target as a module (python -m)")
    p.add_argument("target", help="training script (or module with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the training script")
    return p


def config_from_args(ns: argparse.Namespace) -> ElasticConfig:
    return ElasticConfig(
        replicas=ns.replicas,
        min_replicas=ns.min_replicas,
        max_replicas=ns.max_replicas,
        procs_per_replica=ns.procs_per_replica,
        cross_backend=ns.backend,
        intra_backend=ns.intra_backend,
        batch_policy=ns.batch_policy,
        spares=ns.spares,
        max_restarts=ns.max_restarts,
        collective_timeout_s=ns.collective_timeout,
        join_timeout_s=ns.join_timeout,
        events_path=ns.events,
        checkpoint_dir=ns.checkpoint_dir,
        fault=ns.fault,
    )


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from monarch_plugin.target import Target

    try:
        config = config_from_args(ns)
        target = Target.module(ns.target, ns.args) if ns.module else Target.script(ns.target, ns.args)
    except ConfigError as e:
        print(f"monarch-run: error: {e}", file=sys.stderr)
        return 2
    from monarch_plugin.controller import ElasticController

    try:
        result = ElasticController(config, target).run()
    except ConfigError as e:
        print(f"monarch-run: error: {e}", file=sys.stderr)
        return 2
    except (ElasticRunAborted, ReplicaCodeError) as e:
        print(f"monarch-run: {e}", file=sys.stderr)
        return 1
    from monarch_plugin.events import read_events
    from monarch_plugin.report import format_recovery, recoveries

    for rec in recoveries(read_events(result.events_path)):
        print("monarch-run: " + format_recovery(rec).replace("\n", "\nmonarch-run: "))
    print(
        f"monarch-run: finished in {result.seconds:.1f}s: {result.generations} generation(s), "
        f"{result.deaths} death(s), {result.replicas_spawned} replica(s) spawned; events in {result.events_path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
