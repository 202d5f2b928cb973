"""`monarch-plugin`: this machine's host agent for multi-host runs, and a finished run's events read back.

    monarch-plugin host --address tcp://10.0.0.2:26600 [--hosts-file /shared/run1/hosts]
    monarch-plugin summary monarch_events.jsonl
    monarch-plugin timeline monarch_events.jsonl -o run.png [--html run.html]

`host` runs the Monarch host agent. Start one on each machine (under SLURM: `srun --ntasks-per-node=1 monarch-plugin
host --address tcp://$(hostname -i):26600 ...`), then point the controller at them: `monarch-run --hosts
tcp://10.0.0.2:26600,...` or `--hosts-file`. The agent listens on the one address given, never on a wildcard: Monarch
0.7.0's agents take no TLS keys, so anyone who reaches that address can run code as this user. Keep it on the job's
private network. When the controller goes away the agent kills the work it started and waits for the next controller.

`summary` prints each failure of a run as a table, with the run's totals and goodput (`report.format_summary`);
`timeline` draws the run over time (`timeline`; matplotlib, the `viz` extra). Both read only the events file and
import neither torch nor Monarch (docs/observing.md).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

from monarch_plugin.config import parse_host
from monarch_plugin.errors import ConfigError, MissingExtraError

__all__ = ["main"]


def _check_local(ip: str) -> None:
    """The agent must listen on an address of this machine (a typo would otherwise hang every attach)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, 0))
        except OSError as e:
            raise ConfigError(f"{ip} is not an address of this machine ({e.strerror}): give --address this "
                              "machine's own IP on the network the controller reaches it through") from e


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
    from monarch_plugin.report import format_summary

    events = _events("summary", ns.events)
    if events is None:
        return 2
    print(f"events: {ns.events}")
    print("\n".join(format_summary(events)))
    return 0


def _timeline(ns: argparse.Namespace) -> int:
    from monarch_plugin.timeline import write_html, write_png

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="monarch-plugin", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    host = commands.add_parser("host", help="run this machine's Monarch host agent for multi-host runs")
    host.add_argument("--address", required=True, metavar="tcp://IP:PORT",
                      help="where the agent listens: this machine's IP on the job's network, and a free port")
    host.add_argument("--hosts-file", metavar="PATH",
                      help="append the address to this file (on a filesystem the controller reads) once listening, "
                           "so a run started with `--hosts-file PATH` finds this host, also mid-run")
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
    try:
        ip, _ = parse_host(ns.address)
        _check_local(ip)
    except ConfigError as e:
        print(f"monarch-plugin host: error: {str(e).replace('`hosts`', '--address')}", file=sys.stderr)
        return 2
    from monarch.actor import start_worker_loop_forever

    serving = start_worker_loop_forever(ca="trust_all_connections", address=ns.address)
    print(f"monarch-plugin host: agent listening on {ns.address} (no TLS: keep this address on a private network)",
          flush=True)
    if ns.hosts_file:
        with open(ns.hosts_file, "a") as f:
            f.write(ns.address + "\n")
    serving.get()
    return 0


if __name__ == "__main__":
    sys.exit(main())
