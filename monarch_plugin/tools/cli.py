"""`monarch-run`: torchrun's job, elastic, on Monarch; and `monarch-plugin`: a host agent, and a run read back.

    monarch-run --replicas 4 --min-replicas 2 [--procs-per-replica k] train.py --lr 3e-4
    monarch-run --replicas 4 -m my_pkg.train --lr 3e-4
    monarch-run --hosts tcp://10.0.0.2:26600,tcp://10.0.0.3:26600 --replicas 4 train.py

The calling process becomes the single controller; each replica's procs get the usual torch.distributed
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) scoped to their own replica group, and
reach the elastic runtime through `monarch_plugin.ElasticLoop`.

    monarch-plugin token /shared/run1/token
    monarch-plugin host --address tcp://10.0.0.2:26600 [--hosts-file /shared/run1/hosts --token-file /shared/run1/token]
    monarch-plugin host --hosts-file RUN/hosts --token-file RUN/token     # in a SLURM job: on the node's NodeAddr
    monarch-plugin summary monarch_events.jsonl
    monarch-plugin timeline monarch_events.jsonl -o run.png [--html run.html]

`token` makes a multi-host job's token once (`admission`), `host` runs this machine's Monarch host agent
(`procs.agent`). `summary` prints each failure of a run as a table,
with the run's totals and goodput (`report.format_summary`); `timeline` draws the run over time (`timeline`;
matplotlib, the `viz` extra). Both read only the events file and import neither torch nor Monarch
(docs/observing.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys

from monarch_plugin.config import (BACKENDS, BATCH_POLICIES, ElasticConfig, cli_flag, field_default, field_docs,
                                   spell_fields)
from monarch_plugin.errors import ConfigError, ElasticRunAborted, MissingExtraError, RunStopped

__all__ = ["main", "run", "build_parser", "plugin"]

_CHOICES = {"backend": BACKENDS, "batch_policy": BATCH_POLICIES}
_TYPES = {"int": int, "int | None": int, "float": float, "str": str, "str | None": str,
          "list[str]": lambda text: [item.strip() for item in text.split(",") if item.strip()]}
_NOT_FLAGS = {"env"}  # the worker environment is the caller's own (export it, as under torchrun)


def build_parser() -> argparse.ArgumentParser:
    """One flag per `ElasticConfig` field, its help the field's docstring and its default the field's."""
    p = argparse.ArgumentParser(
        prog="monarch-run",
        description="Run a training script on elastic replica groups supervised by a Monarch controller.",
    )
    for f in dataclasses.fields(ElasticConfig):
        if f.name in _NOT_FLAGS:
            continue
        flag = cli_flag(f.name)
        # The docstrings name other fields in ``double backticks``: here they are flags too.
        doc = spell_fields(field_docs()[f.name].replace("``", "`"), cli_flag)
        if f.type == "bool":  # --flag; a setting that is on unless told otherwise: --flag / --no-flag
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction if f.default else "store_true",
                           default=f.default, help=doc)
            continue
        if f.type == "bool | None":  # --flag / --no-flag, and neither leaves the field's automatic choice
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=doc)
            continue
        default = field_default(f)
        p.add_argument(flag, dest=f.name, type=_TYPES[f.type], default=default, choices=_CHOICES.get(f.name),
                       metavar=None if f.name in _CHOICES else flag[2:].upper().replace("-", "_"),
                       help=doc if default in (None, []) else f"{doc} (default: %(default)s)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="what the run logs: INFO (default) the run's start and end and one line for each failure "
                        "(what happened, what the run did); DEBUG every event; WARNING only failures and give-ups")
    p.add_argument("--quiet", dest="log_level", action="store_const", const="WARNING", help="--log-level WARNING")
    p.add_argument("-m", dest="module", action="store_true", help="run the target as a module (python -m)")
    p.add_argument("target", help="training script (or module with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the training script")
    return p


def config_from_args(ns: argparse.Namespace) -> ElasticConfig:
    return ElasticConfig(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(ElasticConfig)
                            if f.name not in _NOT_FLAGS})


def _spelled(error: Exception) -> str:
    return spell_fields(str(error), cli_flag)


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from monarch_plugin.target import Target

    try:
        config = config_from_args(ns)
        target = Target.module(ns.target, ns.args) if ns.module else Target.script(ns.target, ns.args)
    except ConfigError as e:
        print(f"monarch-run: error: {_spelled(e)}", file=sys.stderr)
        return 2
    from monarch_plugin.procs.slurm import await_earlier_agents
    from monarch_plugin.storage.runlock import hold

    # Relaunched in a SLURM allocation whose last `monarch-run` was killed: its agent steps are saving its last
    # committed step, which they can only while no run holds the files; they end by themselves.
    await_earlier_agents(config)
    try:
        held = hold(config)  # a second run on this run's files is refused before anything is spawned
    except ConfigError as e:
        print(f"monarch-run: error: {_spelled(e)}", file=sys.stderr)
        return 2
    try:
        return _run(config, target, held)
    finally:
        for lock in held:
            lock.release()


def _run(config: ElasticConfig, target, held: list) -> int:
    """The run itself, on files `held` for it."""
    from monarch_plugin.procs import forkserver

    forkserver.for_run(config, target.imports)  # its imports run beside the controller's, which follow
    from monarch_plugin.controller import ElasticController

    try:
        result = ElasticController(config, target, held=held, in_place=True).run()
    except ConfigError as e:
        print(f"monarch-run: error: {_spelled(e)}", file=sys.stderr)
        return 2
    except RunStopped as e:  # told to stop: the controller logged where its checkpoint is
        return e.status
    except ElasticRunAborted as e:  # a give-up, or the training code's own bug (`ReplicaCodeError`)
        print(f"monarch-run: {_spelled(e)}", file=sys.stderr)
        return 1
    from monarch_plugin.tools.report import run_summary

    for line in run_summary(result):
        print(f"monarch-run: {line}")
    return 0


def _events(command: str, path: str) -> list[dict] | None:
    """The events in `path`, or None after saying on stderr why there are none to read."""
    from monarch_plugin.events import read_events

    if not os.path.isfile(path):
        print(f"monarch-plugin {command}: error: no events file at {path}: give the path a run wrote its events "
              "to (`--events`; by default ./monarch_events.jsonl, or $MONARCH_PLUGIN_EVENTS)", file=sys.stderr)
        return None
    try:
        return read_events(path)
    except json.JSONDecodeError as e:
        print(f"monarch-plugin {command}: error: {path} is not a run's events file (one JSON object a line): {e}",
              file=sys.stderr)
        return None


def _summary(ns: argparse.Namespace) -> int:
    from monarch_plugin.tools.report import format_summary

    events = _events("summary", ns.events)
    if events is None:
        return 2
    print(f"events: {ns.events}")
    print("\n".join(format_summary(events)))
    return 0


def _timeline(ns: argparse.Namespace) -> int:
    from monarch_plugin.tools.timeline import write_html, write_png

    events = _events("timeline", ns.events)
    if events is None:
        return 2
    if not events:
        print(f"monarch-plugin timeline: error: {ns.events} is empty: the run wrote no events to draw",
              file=sys.stderr)
        return 2
    name = os.path.basename(ns.events)
    png = ns.output or (None if ns.html else os.path.splitext(ns.events)[0] + ".png")
    try:
        for path, write in ((png, write_png), (ns.html, write_html)):
            if path:
                write(events, name, path)
                print(f"monarch-plugin timeline: wrote {path}")
    except MissingExtraError as e:
        print(f"monarch-plugin timeline: error: {e}", file=sys.stderr)
        return 2
    return 0


def plugin(argv: list[str] | None = None) -> int:
    """`monarch-plugin`."""
    parser = argparse.ArgumentParser(
        prog="monarch-plugin",
        description="A Monarch host agent for multi-host runs, its hosts checked before a run, and a finished "
                    "run's events read back.")
    commands = parser.add_subparsers(dest="command", required=True)
    host = commands.add_parser("host", help="run this machine's Monarch host agent for multi-host runs")
    host.add_argument("--address", metavar="tcp://IP:PORT",
                      help="where the agent listens: this machine's IP on the job's network, and a free port (in a "
                           "SLURM job, by default: the node's NodeAddr, port 26600)")
    host.add_argument("--hosts-file", metavar="PATH",
                      help="append the address to this file (on a filesystem the controller reads) once listening, "
                           "so a run started with `--hosts-file PATH` finds this host, also mid-run")
    host.add_argument("--token-file", metavar="PATH",
                      help="the job's token (`monarch-plugin token PATH`): the line appended to --hosts-file carries "
                           "an HMAC of the address under it, and a run started with `--token-file PATH` attaches "
                           "only lines that carry one")
    host.add_argument("--run-store", metavar="tcp://IP:PORT",
                      help="serve this one run only (how `monarch-run` starts each node's agent under SLURM): once "
                           "the run's store, in its controller's process, has refused connections for the run's "
                           "lease, wait for this host's procs to save the run and end, then exit. Without it the "
                           "agent stays for the next run")
    host.add_argument("--host-timeout", type=float, default=_default_of("host_timeout_s"), metavar="SECONDS",
                      help="with --run-store: the run's --host-timeout, which its lease is made from "
                           "(default: %(default)s)")
    host.add_argument("--controller-loss-save", type=float, default=_default_of("controller_loss_save_s"),
                      metavar="SECONDS", help="with --run-store: the run's --controller-loss-save, how long its "
                                              "procs may take to save once its controller is gone "
                                              "(default: %(default)s)")
    token = commands.add_parser(
        "token", help="make a multi-host job's token once, before its agents and its run start",
        description="Write a new random token to PATH, readable by this user only (0600); an existing token file is "
                    "kept as it is. `-`: print one instead (to store as a Kubernetes secret).")
    token.add_argument("path", metavar="PATH", help="the token file (`-`: print a token on stdout)")
    doctor = commands.add_parser(
        "doctor", help="check a multi-host job's hosts before a run: one row per host, each problem with its fix",
        description="Attach to each host's agent and compare its machine with this one: reachable, Python and "
                    "package versions, the paths a run needs, clock, the store's port, backend and GPUs, the "
                    "interface. Exit status 1 on any error.")
    doctor.add_argument("--hosts", metavar="tcp://IP:PORT,...", help="the agents' addresses, as `monarch-run --hosts`")
    doctor.add_argument("--hosts-file", metavar="PATH", help="the agents' hosts file, as `monarch-run --hosts-file`")
    doctor.add_argument("--token-file", metavar="PATH", help="the job's token, as `monarch-run --token-file`")
    doctor.add_argument("--store-host", metavar="IP",
                        help="this machine's address on the hosts' network (default: the one routing to the first)")
    doctor.add_argument("--script", metavar="PATH", help="the training script: every host must see it at this path")
    doctor.add_argument("--dir", metavar="DIR", action="append",
                        help="a directory every host must see (working, events, checkpoint directory); repeatable. "
                             "Default, without --script: the working directory")
    doctor.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS", help="per host (default 30)")
    summary = commands.add_parser("summary", help="print a run's failures as a table, with its totals and goodput")
    summary.add_argument("events", metavar="EVENTS.jsonl", help="the run's events file")
    timeline = commands.add_parser("timeline", help="draw a run over time: replicas, steps/s, failures, recoveries")
    timeline.add_argument("events", metavar="EVENTS.jsonl", help="the run's events file")
    timeline.add_argument("-o", "--output", metavar="RUN.png",
                          help="write the picture as a PNG here (default, without --html: EVENTS.png)")
    timeline.add_argument("--html", metavar="RUN.html",
                          help="write a self-contained page here: the picture with hover tooltips, and the summary")
    ns = parser.parse_args(argv)
    if ns.command == "summary":
        return _summary(ns)
    if ns.command == "timeline":
        return _timeline(ns)
    if ns.command == "token":
        return _token(ns.path)
    if ns.command == "doctor":
        from monarch_plugin.tools.doctor import main as doctor

        return doctor(ns)
    from monarch_plugin.procs.agent import serve

    return serve(ns.address, ns.hosts_file, ns.token_file, ns.run_store, ns.host_timeout,
                 ns.controller_loss_save)


def _default_of(name: str):
    """The default of `ElasticConfig`'s field `name`."""
    return field_default(next(f for f in dataclasses.fields(ElasticConfig) if f.name == name))


def _token(path: str) -> int:
    """`monarch-plugin token PATH`: the job's token, made once."""
    from monarch_plugin.procs.admission import make_token, new_token

    if path == "-":
        print(new_token())
        return 0
    try:
        made = make_token(path)
    except (ConfigError, OSError) as e:
        message = str(e).replace("`token_file`", "the token file") if isinstance(e, ConfigError) else str(e)
        print(f"monarch-plugin token: error: {message}", file=sys.stderr)
        return 2
    print(f"monarch-plugin token: {'wrote a new token to' if made else 'kept the token already in'} {path} "
          "(readable by this user only): give it to `monarch-run --token-file` and to every "
          "`monarch-plugin host --token-file`")
    return 0


def run() -> None:
    """`monarch-run`: `main`, then `leave`."""
    leave(main())


def plugin_command() -> None:
    """`monarch-plugin`: `plugin`, then `leave` (the doctor and the host agent are Monarch clients too)."""
    leave(plugin())


def leave(code: int) -> None:
    """End the process with `code` without finalizing the interpreter.

    A Monarch client can leave daemon threads blocked in native calls (towards a host that was lost, or one whose
    way back is closed). Finalization ends such a thread inside its call with a forced unwind, which a C++ frame on
    its stack turns into an abort: "FATAL: exception not rethrown" and exit status 134 after a run that had
    succeeded (seen under SLURM, after a lost node), which fails the job. What the exit handlers would do is done
    here first: the shared fork servers stopped, Monarch's runtime ended, logs and output flushed."""
    from monarch_plugin.procs import apart, forkserver

    forkserver.stop_shared()
    apart.end_monarch()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
