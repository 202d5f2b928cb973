"""What the benchmarks share: start a run, wait for it to reach a point, kill a worker from outside as a failure
would, record the kill in the run's events (so its recoveries are read against it), and leave nothing behind;
run variants interleaved, read step logs, take medians and deciles, and write the results JSON under `--out`.

    proc = subprocess.Popen(cmd, ...)
    try:
        wait_for("three replicas training", lambda: ..., proc, timeout=180)
        victim = spawned(events)[1]
        kill(victim[0], events, replica=1)
        finished(proc, 300, "the elastic run", out)
    finally:
        reap(proc, spawned(events))

Interleaving (A, B, A, B, ...) lets a slow spell of this shared machine hit every variant alike, so the ratios
of one invocation share one machine state:

    runs = interleave({"ddp": lambda i: ..., "elastic": lambda i: ...}, repeats=3)
    write_json(args.out, "name", runs)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, TypeVar

from monarch_plugin.events import EventLog, read_events

__all__ = ["BIN", "REPO", "RESULTS", "WORKLOADS", "add_out", "alternate", "alternate_table", "decile", "events",
           "finished", "first_commits", "grouped", "interleave", "intervals", "kill", "launch", "median", "median_range",
           "mlp_workers", "plot_steps", "progress", "reap", "spawned", "step_log", "wait_for", "write_json"]

T = TypeVar("T")

REPO = Path(__file__).resolve().parent.parent
"""The checkout: the benchmarks run from its root, `python -m benchmarks.<area>.<name>`."""
RESULTS = REPO / "benchmarks" / "results"
"""Where the results docs/benchmarks.md quotes are kept: every `--out`'s default."""
WORKLOADS = REPO / "benchmarks" / "workloads"
"""The training scripts the benchmarks launch by path (`monarch-run`, `torchrun`)."""
BIN = Path(sys.executable).parent
"""This interpreter's scripts: `monarch-run` and `torchrun` of the same environment."""


# -- launch and wait ----------------------------------------------------------------------------------------------

def events(path: Path | str) -> list[dict]:
    """The run's events so far; none before the controller wrote its first."""
    return read_events(str(path)) if Path(path).exists() else []


def spawned(path: Path | str) -> dict[int, list[int]]:
    """Each replica's worker pids, from its (newest) spawn event."""
    return {e["replica"]: e["pids"] for e in events(path) if e["event"] == "spawn"}


def wait_for(what: str, predicate: Callable[[], T], proc: subprocess.Popen, timeout: float,
             poll_s: float = 0.02) -> T:
    """What `predicate()` returns once it is true; RuntimeError naming `what` if the run ends or `timeout` passes
    first."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended (rc {proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(poll_s)


def kill(pid: int, events_path: Path | str | None = None, **fields) -> bool:
    """SIGKILL `pid` from outside, as a failure would; False if it had already gone. With `events_path`, the kill
    is recorded there (`fields`: which replica), so the run's report measures its recovery from this moment."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    if events_path is not None:
        EventLog(str(events_path), source="benchmark").emit("kill", pid=pid, **fields)
    return True


def finished(proc: subprocess.Popen, timeout: float, what: str, where: Path | str) -> None:
    """Wait for the run to end; RuntimeError, pointing at `where`, unless it ended well."""
    if proc.wait(timeout=timeout) != 0:
        raise RuntimeError(f"{what} failed (rc {proc.returncode}); see {where}")


def reap(proc: subprocess.Popen, pids: dict[int, list[int]] | list[int] = ()) -> None:
    """Stop the run if it still runs, and SIGKILL every worker it spawned: nothing a benchmark started outlives it."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pid in (p for ps in pids.values() for p in ps) if isinstance(pids, dict) else pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def mlp_workers(out: Path) -> list[int]:
    """The workers of a `workloads/mlp.py` run in `out` (its events' spawns, its `pid-*` files) that still run the
    benchmark's code: a dead one's pid may have been reused by then."""
    pids = [p for ps in spawned(out / "events.jsonl").values() for p in ps]
    pids += [int(p.read_text()) for p in out.glob("pid-*") if p.read_text().strip()]
    ours = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"mlp.py" in cmdline or b"monarch_plugin.procs.forkserver" in cmdline:
            ours.append(pid)
    return ours


def launch(command: list[str], run: Path, env: dict[str, str] | None = None) -> float:
    """Run `command` to its end in the folder `run` (made here), its output in `run/run.log`; the seconds it took.
    RuntimeError, pointing at the log, unless it ended well. `env` is added to this process's environment."""
    run.mkdir(parents=True)
    t0 = time.monotonic()
    with open(run / "run.log", "w") as log:
        rc = subprocess.call(command, cwd=run, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    if rc != 0:
        raise RuntimeError(f"the run in {run} failed (rc {rc}); see {run / 'run.log'}")
    return time.monotonic() - t0


def interleave(variants: dict[str, Callable[[int], T]], repeats: int,
               shown: Callable[[T], object] | None = lambda result: result) -> dict[str, list[T]]:
    """Each variant's `run(repeat)`, `repeats` times, alternating (A, B, A, B, ...); each result printed as one JSON
    line as it comes (`shown` picks what of it, None: nothing)."""
    runs: dict[str, list[T]] = {name: [] for name in variants}
    for repeat in range(repeats):
        for name, run in variants.items():
            runs[name].append(run(repeat))
            if shown is not None:
                print(json.dumps({name: shown(runs[name][-1])}), flush=True)
    return runs


# -- two launches of one job, compared by their step ---------------------------------------------------------------

def alternate(commands: dict[str, list[str]], repeats: int, steps: int, work: Path,
              env: dict[str, str] | None = None, warmup: int = 10) -> dict[str, dict]:
    """Each side's command run `repeats` times, alternating, each in `work/<side>-<repeat>` (`launch`). Each run
    writes one line per step, "<step> <seconds>", to `steps.txt` in its folder; a run's step time is the median
    interval after `warmup` steps, a side's (`median_step_s`) the median over its runs."""
    def run(side: str, repeat: int) -> dict:
        folder = work / f"{side}-{repeat}"
        wall = launch(commands[side], folder, env)
        times = [t for _, t in step_log(folder / "steps.txt")]
        if len(times) != steps:
            raise RuntimeError(f"{folder / 'steps.txt'} has {len(times)} steps, expected {steps}")
        return {"step_s": statistics.median(intervals(times, warmup)), "wall_s": wall}

    runs = interleave({side: lambda repeat, side=side: run(side, repeat) for side in commands}, repeats)
    return {side: {"step_s": [r["step_s"] for r in rs], "wall_s": [r["wall_s"] for r in rs],
                   "median_step_s": statistics.median(r["step_s"] for r in rs)} for side, rs in runs.items()}


def alternate_table(results: dict, labels: dict[str, str], header: str) -> str:
    """Add the ratio of the second side to the first to `alternate`'s `results`; the markdown table of both.
    `labels` maps each side (baseline first) to its row label; `header` names the job in the first cell."""
    (baseline, _), (elastic, _) = labels.items()
    results["ratio"] = results[elastic]["median_step_s"] / results[baseline]["median_step_s"]

    def row(side: str) -> str:
        each = ", ".join(f"{x * 1000:.0f}" for x in results[side]["step_s"])
        walls = ", ".join(f"{x:.1f}" for x in results[side]["wall_s"])
        return f"| {labels[side]} | {results[side]['median_step_s'] * 1000:.0f} ms | {each} | {walls} |"

    return "\n".join([
        f"| {header} | median step | per run (ms) | whole launch per run (s) |",
        "|---|---|---|---|",
        row(baseline),
        row(elastic),
        f"| ratio {elastic} / {baseline} | {results['ratio']:.2f} | | |",
    ])


# -- step logs and statistics -------------------------------------------------------------------------------------

def step_log(path: Path) -> list[tuple[int, float]]:
    """A worker's step log, one "<step> <unix time>" line per step; empty before it wrote one."""
    if not path.exists():
        return []
    return [(int(a), float(b)) for a, b in (line.split() for line in path.read_text().splitlines() if line)]


def first_commits(folder: Path) -> dict[int, float]:
    """Each step's first commit, by whichever worker's step log (`steps-*.txt` in `folder`) has it first."""
    first: dict[int, float] = {}
    for path in folder.glob("steps-*.txt"):
        for step, ts in step_log(path):
            first[step] = min(ts, first.get(step, ts))
    return first


def progress(folder: Path, ident: object) -> int:
    """The last step a test workload (tests/workloads/) reported in `folder/progress-<ident>`; -1 before any."""
    try:
        return int((folder / f"progress-{ident}").read_text() or -1)
    except (FileNotFoundError, ValueError):
        return -1


def intervals(times: Iterable[float], skip: int = 0) -> list[float]:
    """The gaps between consecutive `times`, the first `skip` times (a warm-up) left out."""
    kept = list(times)[skip:]
    return [b - a for a, b in zip(kept, kept[1:])]


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values that were measured (not None); None if none was."""
    measured = [v for v in values if v is not None]
    return statistics.median(measured) if measured else None


def median_range(values: Iterable[float | None], fmt: str, spread: bool = True) -> str:
    """The median of the measured `values` in `fmt`, with their range in brackets where there are several (and
    `spread`): a table cell over repeats. "-" where nothing was measured."""
    measured = sorted(v for v in values if v is not None)
    if not measured:
        return "-"
    mid = fmt.format(statistics.median(measured))
    return f"{mid} ({fmt.format(measured[0])}-{fmt.format(measured[-1])})" if spread and len(measured) > 1 else mid


def grouped(results: list[dict], *keys: str) -> dict[tuple, list[dict]]:
    """The results by the values of `keys` (a variant and its schedule: its repeats), in first-seen order."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    return groups


def decile(values: list[float]) -> float:
    """The 10th percentile: on a machine shared with other work, the steadier estimate of an unhindered pace."""
    return statistics.quantiles(values, n=10)[0]


# -- results ------------------------------------------------------------------------------------------------------

def add_out(parser: argparse.ArgumentParser, default: Path = RESULTS) -> None:
    """The `--out` folder a benchmark writes its results JSON to: benchmarks/results unless told."""
    parser.add_argument("--out", type=Path, default=default, help="folder for the results JSON")


def write_json(out: Path | str, name: str, results: object) -> Path:
    """`results` as `<out>/<name>.json` (the folder made if need be); its path."""
    path = Path(out) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")
    return path


def plot_steps(runs: list[tuple[str, dict]], path: Path, title: str, ylabel: str = "committed step") -> None:
    """Steps over time under a failure schedule: each (label, run) as a line of the run's `series` ((seconds since
    its first step, step) pairs), its `kill_times` as thin vertical lines of the same colour; a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for label, run in runs:
        t, s = zip(*run["series"])
        (line,) = ax.plot(t, s, label=label, lw=1.2)
        for k in run["kill_times"]:
            ax.axvline(k, color=line.get_color(), alpha=0.3, lw=0.8)
    ax.set_xlabel("seconds since the first step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
