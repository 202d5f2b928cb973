"""Side by side with torchft 0.2.0, the system this project's users would pick instead: the same model, data, global
batch and failure schedule, in one invocation, interleaved.

    python -m benchmarks.vs_torchft goodput --every 15 --repeats 3 --out benchmarks/results/vs_torchft
    python -m benchmarks.vs_torchft steady --sizes 10m 100m --out benchmarks/results/vs_torchft

Every variant trains `workloads/mlp.py` on 4 replicas of one process (global batch 32, Adam, gloo):

  ddp             torchrun DDP, no failure: the unit
  monarch-free    monarch-run + ElasticLoop, no failure
  monarch         the same, a cold replacement (forked from the forkserver) for each death
  monarch-spare   the same with --spares 1
  torchft-free    torchft as its train_ddp.py runs it: one `torchft_lighthouse` (127.0.0.1, --min_replicas 2), and
                  each replica group under its own `torchrun --nproc-per-node 1 --max-restarts`, with
                  torchft.Manager, its DistributedDataParallel and OptimizerWrapper on ProcessGroupGloo; no failure
  torchft         the same; torchrun restarts the killed group's worker, which heals from a live peer

`goodput`: the tiny MLP with `--device-ms-per-sample` of idle sleep per sample of a replica's share standing in for
device time (between forward and backward: a kill mid-step finds the victim's gradients unsent, as a kill during a
GPU's forward or backward would), so a step is mostly time the CPU is idle, as on a GPU, and 4 replicas on 2 cores
neither contend for the CPU nor gain from a death. From the first step on, one replica's worker is SIGKILLed from
outside by pid every `--every` seconds (seeded: 0.5-1.5 x apart, a random victim among the replicas training; none
while only `MIN_REPLICAS` are). Per variant: goodput (committed samples per second over DDP's, and over the
system's own failure-free rate), kill -> the survivors' next committed step, kill -> the replacement's first
committed step, steps lost per kill (dropped / discarded attempts), and where each lost second of the monarch runs
went (`account`). `steady`: the 10M and 100M MLPs with no stand-in, each system's steady step against DDP's and the
bytes a heal moved (one kill at `--kill-at`). Writes <out>/vs_torchft-<leg>.json and a plot of committed steps
over time (goodput), and prints the markdown tables docs/benchmarks.md quotes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import time
from pathlib import Path

from benchmarks.harness import (BIN, WORKLOADS, add_out, events, first_commits, grouped, intervals, kill, median,
                                median_range, mlp_workers, plot_steps, reap, spawned, step_log, wait_for, write_json)
from benchmarks.soak.kill_storm import members
from monarch_plugin.tools.report import recoveries

WORKLOAD = WORKLOADS / "mlp.py"
REPLICAS, MIN_REPLICAS, GLOBAL_BATCH = 4, 2, 32
LIGHTHOUSE_TIMEOUTS = {"--heartbeat_timeout_ms": "1000", "--join_timeout_ms": "1000", "--quorum_tick_ms": "10"}
"""The lighthouse's, set for the fastest recovery torchft allows here (its defaults: 5 s, 60 s, 100 ms): a dead
group is dropped once its heartbeats (every 100 ms) have stopped for 1 s; a quorum waits up to 1 s for a group
still heartbeating but not yet asking, which is a survivor stuck in an allreduce with another survivor until gloo's
timeout ends it; and quorums are checked every 10 ms."""
GLOO_TIMEOUT_S = {"goodput": "1", "steady": "5"}
"""torchft's gloo timeout (train_ddp.py's 5 s on CPU): it bounds a survivor's allreduce stuck waiting on another
survivor that errored out. 1 s with the tiny model's sub-second steps; 5 s for the 10M and 100M MLPs, whose
replicas drift further apart on 2 cores."""


DISCARD_WINDOW_S = 6.0
"""torchft's discards of one attempt, by its participants: the longest gloo timeout used here (5 s) and a second."""
EXIT_GRACE_S = 10.0
"""How long a run that committed its last step may take to exit before it is stopped (and counted as finished)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Run:
    """One variant's processes: started, their victims, their pids to reap."""

    def __init__(self, variant: str, out: Path, args: list[str]):
        self.variant, self.out = variant, out
        self.log = open(out / "run.log", "w")
        self.procs: list[subprocess.Popen] = []
        work = [str(WORKLOAD), *args, "--out", str(out)]
        if variant.startswith("monarch"):
            spares = "1" if variant == "monarch-spare" else "0"
            self._start([str(BIN / "monarch-run"), "--replicas", str(REPLICAS), "--min-replicas", str(MIN_REPLICAS),
                         "--spares", spares, "--max-restarts", "1000", "--crash-loop-limit", "1000",
                         "--events", str(self.events), *work, "--mode", "elastic"])
        elif variant.startswith("torchft"):
            port = _free_port()
            self._start([str(BIN / "torchft_lighthouse"), "--min_replicas", str(MIN_REPLICAS),
                         "--bind", f"127.0.0.1:{port}", *(x for kv in LIGHTHOUSE_TIMEOUTS.items() for x in kv)])
            for group in range(REPLICAS):
                env = {**os.environ, "REPLICA_GROUP_ID": str(group), "NUM_REPLICA_GROUPS": str(REPLICAS),
                       "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}"}
                self._start([str(BIN / "torchrun"), "--nproc-per-node", "1", "--max-restarts", "1000",
                             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
                             *work, "--mode", "torchft"], env)
        else:
            self._start([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(REPLICAS), *work,
                         "--mode", "ddp"])

    @property
    def events(self) -> Path:
        return self.out / "events.jsonl"

    def _start(self, cmd: list[str], env: dict | None = None) -> None:
        self.procs.append(subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=self.out, env=env))

    @property
    def trainers(self) -> list[subprocess.Popen]:
        """The processes whose end is the run's end (not torchft's lighthouse)."""
        return self.procs[1:] if self.variant.startswith("torchft") else self.procs

    def running(self) -> bool:
        return any(p.poll() is None for p in self.trainers)

    def failed(self) -> bool:
        return any(p.poll() not in (None, 0) for p in self.trainers)

    def victims(self) -> list[tuple[str, int]]:
        """(name, pid) of each replica's worker that trains now, if more than MIN_REPLICAS do."""
        if self.variant.startswith("monarch"):
            started = spawned(self.events)
            live = [(str(m), started[m][0]) for m in members(events(self.events)) if m in started]
        else:
            newest: dict[str, tuple[int, Path]] = {}
            for path in self.out.glob("pid-torchft*-*"):
                group, restart = path.name.removeprefix("pid-").rsplit("-", 1)
                if int(restart) >= newest.get(group, (-1, path))[0]:
                    newest[group] = (int(restart), path)
            live = [(f"{group}-{restart}", int(path.read_text())) for group, (restart, path) in newest.items()
                    if path.read_text().strip() and step_log(self.out / f"steps-{group}-{restart}.txt")]
        return live if len(live) > MIN_REPLICAS else []

    def reap(self) -> None:
        for proc in self.procs[1:]:
            reap(proc)
        reap(self.procs[0], mlp_workers(self.out))
        self.log.close()


def run(work: Path, variant: str, args: list[str], steps: int, every: float | None, seed: int, cap_s: float,
        kill_at: int | None = None) -> dict:
    """One variant to `steps` steps (or `cap_s` seconds from its first), killed every `every` s, or once at step
    `kill_at`; what it measured."""
    out = work / f"{variant}-every{every or 0:.0f}"
    out.mkdir(parents=True)
    r = Run(variant, out, [*args, "--steps", str(steps)])
    rng = random.Random(seed)
    kills: list[dict] = []
    capped = False
    try:
        wait_for(f"{variant}'s first step (see {out / 'run.log'})", lambda: first_commits(out), r.procs[-1],
                 timeout=600, poll_s=0.05)
        first = time.time()
        due = first + every * rng.uniform(0.5, 1.5) if every else None
        trained_at, checked = None, 0.0
        while r.running() and not r.failed():
            time.sleep(0.02)
            now = time.time()
            if now - checked > 0.5:  # a run that trained every step but hangs on its way out is done
                checked = now
                commits = first_commits(out)
                trained_at = trained_at or (now if steps - 1 in commits else None)
                if trained_at and now - trained_at > EXIT_GRACE_S:
                    break
                if kill_at is not None and not kills and max(commits, default=-1) >= kill_at:
                    due = now
            if now - first > cap_s and not trained_at:
                capped = True
                break
            if due is None or now < due or trained_at:
                continue
            victims = r.victims()
            if not victims:
                continue  # still due: it fires once there is someone to hit
            name, pid = rng.choice(victims)
            fields = {"replica": int(name)} if variant.startswith("monarch") else {}
            if not kill(pid, r.events if variant.startswith("monarch") else None, **fields):
                continue
            kills.append({"ts": time.time(), "victim": name})
            due = due + every * rng.uniform(0.5, 1.5) if every else None
    finally:
        failed = r.failed()
        r.reap()
    if failed and not capped and not trained_at:  # once it trained every step, a straggler's exit is not the run's
        raise RuntimeError(f"{variant} failed; see {out / 'run.log'}")
    return measure(out, variant, steps, kills, capped, first + cap_s if capped else None)


def measure(out: Path, variant: str, steps: int, kills: list[dict], capped: bool, stopped_at: float | None) -> dict:
    commits = first_commits(out)  # step -> its first commit, by whoever logged it first
    done = max(commits) + 1
    start = min(commits.values())
    end = stopped_at if capped else commits[steps - 1]
    ordered = [commits[s] for s in sorted(commits)]
    result = {"variant": variant, "steps_done": done, "seconds": end - start, "capped": capped, "kills": len(kills),
              "kill_times": [k["ts"] - start for k in kills],
              "series": [(round(t - start, 3), s) for s, t in sorted(commits.items())],
              "step_s": _steady([t for t in ordered if not kills or t < kills[0]["ts"]])}
    logs = {p.stem.removeprefix("steps-"): step_log(p) for p in out.glob("steps-*.txt")}
    per_kill = []
    if variant.startswith("monarch"):
        run_events = events(out / "events.jsonl")
        recs = recoveries(run_events)
        result["steps_lost"] = len({(e["gen"], e["step"]) for e in run_events if e["event"] == "dropped_step"})
        for rec in recs:
            if rec.killed_at is None:
                continue
            survivors = [ts for name, log in logs.items() if name != str(rec.replica) for _, ts in log]
            per_kill.append({"next_commit_s": min((t for t in survivors if t > rec.killed_at), default=None),
                             "replacement_s": rec.participating_at, "kill": rec.killed_at})
        result["heal_bytes"] = [rec.heal_bytes for rec in recs if rec.heal_bytes]
    elif variant.startswith("torchft"):
        # Every participant logs the attempt it discarded, one stuck on another survivor up to gloo's timeout
        # later: one attempt is the same step within DISCARD_WINDOW_S.
        attempts = sorted((t, n) for p in out.glob("discarded-*.txt") for n, t in step_log(p))
        result["steps_lost"] = sum(1 for i, (t, n) in enumerate(attempts)
                                   if not any(m == n and t - u < DISCARD_WINDOW_S for u, m in attempts[:i]))
        heals = [json.loads(line) for p in out.glob("heals-*.jsonl") for line in p.read_text().splitlines() if line]
        result["heal_bytes"] = [h["bytes"] for h in heals]
        for k in kills:
            group, restart = k["victim"].rsplit("-", 1)
            survivors = [ts for name, log in logs.items() if not name.startswith(f"{group}-") for _, ts in log]
            later = [log[0][1] for name, log in logs.items() if log and name.startswith(f"{group}-")
                     and int(name.rsplit("-", 1)[1]) > int(restart)]
            per_kill.append({"next_commit_s": min((t for t in survivors if t > k["ts"]), default=None),
                             "replacement_s": min(later, default=None), "kill": k["ts"]})
    for k in per_kill:
        k["next_commit_s"] = None if k["next_commit_s"] is None else k["next_commit_s"] - k["kill"]
        k["replacement_s"] = None if k["replacement_s"] is None else k["replacement_s"] - k["kill"]
    result["per_kill"] = per_kill
    if kills:
        marks = monarch_marks(run_events, recs, commits) if variant.startswith("monarch") \
            else torchft_marks(per_kill, commits)
        result["marks"] = [[round(m - start, 3) for m in kill_marks] for kill_marks in marks]
    print(json.dumps({k: v for k, v in result.items() if k not in ("series", "kill_times", "marks")}), flush=True)
    return result


PHASES = {
    "monarch": ("attempt in flight at the kill", "kill -> death noticed", "survivors' attempt runs out, dropped",
                "regroup (and a spare's heal), redo", "shrunk: fewer replicas", "grow: join, heal, first step"),
    "torchft": ("attempt in flight at the kill", "kill -> survivors' next commit", "3 groups until the replacement"),
}
"""Where each system's lost time went, kill by kill (`account`): monarch's phases from its events file, torchft's
from the step logs (it records no events)."""


def account(marks_per_kill: list[list[float]], commits: dict[int, float], phases: tuple[str, ...],
            steady: float | None = None) -> dict:
    """Cut the run's lost time at each kill's `marks` (a window from the last commit before the kill to the
    replacement's first commit, one mark between each two of `phases`). A phase's loss is its length less the steps
    committed in it times the steady step (`steady`: the same system's failure-free step; else the run's own median
    interval between commits), so a window's phases sum to its loss, and with the loss outside every window
    (`between`) to the run's: its seconds from first to last commit less its steps times the steady step. A phase that ends at a mark other than a commit carries the part
    of a step that straddles the mark (a negative loss where the next phase has the commit)."""
    times = sorted(commits.values())
    steady = steady or statistics.median(intervals(times, 5))
    lost = {name: 0.0 for name in phases}
    covered, last_end = 0.0, times[0]
    for marks in marks_per_kill:
        marks = [max(m, last_end) for m in marks]  # windows that overlap count once
        for i in range(1, len(marks)):
            marks[i] = max(marks[i], marks[i - 1])
        for name, a, b in zip(phases, marks, marks[1:]):
            lost[name] += (b - a) - sum(1 for t in times if a < t <= b) * steady
        covered += marks[-1] - marks[0] - sum(1 for t in times if marks[0] < t <= marks[-1]) * steady
        last_end = marks[-1]
    total = (times[-1] - times[0]) - (len(times) - 1) * steady
    return {"steady_step_s": steady, "phases_s": lost, "between_s": total - covered, "total_s": total}


def monarch_marks(run_events: list[dict], recs: list, commits: dict[int, float]) -> list[list[float]]:
    """Each kill's phase boundaries from the events: the death noticed, the survivors' attempt dropped, then at
    commits (from the step logs, so each commit falls in one phase): the survivors' first after the drop, the last
    before the generation that admits the replacement, the replacement's first."""
    times = sorted(commits.values())
    quorums = [e for e in run_events if e["event"] == "quorum"]
    found = []
    for rec in recs:  # the events' `recoveries`
        if rec.killed_at is None or rec.participating_step not in commits:
            continue
        gen = next((q["gen"] for q in reversed(quorums) if q["ts"] < rec.detected_at), None)
        drop = max((e["ts"] for e in run_events if e["event"] == "dropped_step" and e["gen"] == gen),
                   default=rec.detected_at)
        resumed = next((t for t in times if t > drop), times[-1])
        grow = next((q["ts"] for q in quorums if q["ts"] >= rec.detected_at and rec.replacement in q["members"]),
                    resumed)
        found.append([_before(times, rec.killed_at), rec.killed_at, rec.detected_at, drop, resumed,
                      _before(times, grow), commits[rec.participating_step]])
    return found


def torchft_marks(per_kill: list[dict], commits: dict[int, float]) -> list[list[float]]:
    times = sorted(commits.values())
    return [[_before(times, k["kill"]), k["kill"], k["kill"] + k["next_commit_s"], k["kill"] + k["replacement_s"]]
            for k in per_kill if k["next_commit_s"] is not None and k["replacement_s"] is not None]


def _steady(times: list[float]) -> float | None:
    """The median interval between commits after a 5-step warm-up (None for fewer than 3 such intervals)."""
    gaps = intervals(times, 5)
    return statistics.median(gaps) if len(gaps) >= 3 else None


def _before(times: list[float], ts: float) -> float:
    """The last commit at or before `ts` (the first commit if none)."""
    return max((t for t in times if t <= ts), default=times[0])


def goodput_leg(args) -> list[dict]:
    work = [*("--size", "tiny", "--global-batch", str(GLOBAL_BATCH), "--torchft-gloo-timeout", GLOO_TIMEOUT_S["goodput"]),
            *("--device-ms-per-sample", str(args.device_ms_per_sample))]
    results = []
    for repeat in range(args.repeats):  # interleaved, so each repeat's ratios share one machine state
        here, seed = Path(args.work) / f"repeat{repeat}", args.seed + repeat
        batch = [run(here, "ddp", work, args.steps, None, seed, cap_s=3600)]
        cap = args.cap * batch[0]["seconds"]
        batch += [run(here, v, work, args.steps, None, seed, cap) for v in ("monarch-free", "torchft-free")]
        for every in args.every:
            batch += [run(here, v, work, args.steps, every, seed, cap) for v in ("monarch", "monarch-spare", "torchft")]
        rate = args.steps / batch[0]["seconds"]
        free = {r["variant"].split("-")[0]: r["steps_done"] / r["seconds"] for r in batch if r["variant"].endswith("-free")}
        for r in batch:
            r["repeat"], r["every_s"] = repeat, None
            r["goodput"] = r["steps_done"] / r["seconds"] / rate
            r["own"] = r["steps_done"] / r["seconds"] / free[r["variant"].split("-")[0]] if r["variant"] != "ddp" else 1.0
        for r, every in zip(batch[3:], [e for e in args.every for _ in range(3)]):
            r["every_s"] = every
        settle(batch)
        results += batch
    return results


def settle(batch: list[dict]) -> None:
    """Each killed run's `account` against the step of its own system's failure-free run in the same repeat, so
    that it sums to the loss against that run's rate: what a death cost, the rate after it included."""
    free = {r["variant"].split("-")[0]: r["seconds"] / (r["steps_done"] - 1) for r in batch
            if r["variant"].endswith("-free")}
    for r in batch:
        if r.get("marks"):
            system = r["variant"].split("-")[0]
            r["account"] = account(r["marks"], {s: t for t, s in r["series"]}, PHASES[system], free[system])


def goodput_table(results: list[dict], steps: int) -> str:
    def mid(rows, fn, fmt, spread=False):
        return median_range(map(fn, rows), fmt, spread)

    def kills(rows, key):
        values = sorted(k[key] for r in rows for k in r["per_kill"] if k[key] is not None)
        return f"{median(values) * 1000:.0f} ({values[0] * 1000:.0f}-{values[-1] * 1000:.0f})" if values else "-"

    groups = grouped(results, "variant", "every_s")
    repeats = max(r["repeat"] for r in results) + 1
    lines = [f"Medians of {repeats} repeat(s), range in brackets; per-kill times over every kill of every repeat.", "",
             f"| variant | kill every | kills | seconds for {steps} steps | goodput (of DDP) | of its own failure-free "
             "rate | kill → survivors' next commit, ms | kill → replacement's first commit, ms | steps lost per kill | "
             "steady step, ms | heals per kill | bytes per heal |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (variant, every), rows in groups.items():
        killed = [r for r in rows if r["kills"]]
        lost = mid(killed, lambda r: r["steps_lost"] / r["kills"], "{:.2f}") if killed else "-"
        lines.append(" | ".join([
            f"| {variant}", "-" if every is None else f"{every:.0f} s", mid(rows, lambda r: r["kills"], "{:.0f}"),
            mid(rows, lambda r: r["seconds"], "{:.1f}") + (" (stopped)" if any(r["capped"] for r in rows) else ""),
            mid(rows, lambda r: r["goodput"], "{:.3f}", True), mid(rows, lambda r: r["own"] * 100, "{:.1f} %", True),
            kills(rows, "next_commit_s"), kills(rows, "replacement_s"), lost,
            mid(rows, lambda r: r["step_s"] and r["step_s"] * 1000, "{:.0f}"),
            mid(killed, lambda r: len(r["heal_bytes"]) / r["kills"], "{:.2f}") if killed else "-",
            mid(killed, lambda r: median(r["heal_bytes"]), "{:,.0f}") if killed else "-"]) + " |")
    return "\n".join(lines)


def account_table(results: list[dict], system: str) -> str:
    """Where the system's lost time went under kills: ms per kill and the share of the run's time, phase by phase
    (`account`), means over the repeats, so that the rows sum to the last one (the measured loss) as in each run."""
    groups = list(dict.fromkeys((r["variant"], r["every_s"]) for r in results
                                if r["variant"].startswith(system) and r.get("account")))
    lines = [f"| {system}: where the time went, ms per kill (% of the run) | "
             + " | ".join(f"{v}, a kill every ~{e:.0f} s" for v, e in groups) + " |", "|---|" + "---|" * len(groups)]
    for name in (*PHASES[system], "between recoveries", "total lost: run time - steps x steady step"):
        cells = []
        for variant, every in groups:
            runs = [r for r in results if r["variant"] == variant and r["every_s"] == every and r.get("account")]

            def part(r, name=name):
                a = r["account"]
                return a["phases_s"][name] if name in a["phases_s"] else a["between_s"] if name.startswith("between") \
                    else a["total_s"]
            cells.append(f"{statistics.mean(part(r) / r['kills'] * 1000 for r in runs):.0f} "
                         f"({statistics.mean(part(r) / r['seconds'] * 100 for r in runs):.1f} %)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def steady_leg(args) -> list[dict]:
    results = []
    for repeat in range(args.repeats):
        for size in args.sizes:
            here = Path(args.work) / f"repeat{repeat}-{size}"
            work = ["--size", size, "--global-batch", str(GLOBAL_BATCH), "--torchft-gloo-timeout", GLOO_TIMEOUT_S["steady"]]
            for variant in ("ddp", "monarch", "torchft"):
                kill_at = None if variant == "ddp" else args.kill_at
                r = run(here, variant, work, args.steps, None, args.seed, cap_s=3600, kill_at=kill_at)
                r["size"], r["repeat"] = size, repeat
                results.append(r)
    return results


def steady_table(results: list[dict]) -> str:
    """Each system's steady step against DDP's (medians over repeats), and what its one kill cost: the survivors'
    next commit, the replacement's first, the bytes its heal moved."""
    def cell(rows, fn, fmt):
        value = median(v for r in rows for v in fn(r))
        return "-" if value is None else fmt.format(value)

    lines = ["| model | system | steady step | vs DDP | kill → survivors' next commit | kill → replacement's first "
             "commit | heals | heal moved, each |", "|---|---|---|---|---|---|---|---|"]
    for size in dict.fromkeys(r["size"] for r in results):
        rows = {v: [r for r in results if r["size"] == size and r["variant"] == v] for v in ("ddp", "monarch", "torchft")}
        ddp = median(r["step_s"] for r in rows["ddp"])
        for variant, runs in rows.items():
            step = median(r["step_s"] for r in runs)
            lines.append(" | ".join([
                f"| {size}", variant, f"{step * 1000:.0f} ms", f"{step / ddp:.3f}",
                cell(runs, lambda r: [k["next_commit_s"] for k in r["per_kill"] if k["next_commit_s"]], "{:.2f} s"),
                cell(runs, lambda r: [k["replacement_s"] for k in r["per_kill"] if k["replacement_s"]], "{:.2f} s"),
                cell(runs, lambda r: [len(r.get("heal_bytes", []))], "{:.0f}") if variant != "ddp" else "-",
                cell(runs, lambda r: r.get("heal_bytes", []), "{:,.0f} B")]) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("leg", choices=("goodput", "steady", "tables"),
                   help="tables: print the tables again from the results JSON in --out")
    p.add_argument("--steps", type=int, default=None, help="per variant (goodput: 300; steady: 40)")
    p.add_argument("--every", type=float, nargs="+", default=[15.0], help="goodput: seconds between kills")
    p.add_argument("--device-ms-per-sample", type=float, default=20.0,
                   help="goodput: idle sleep per sample of a replica's share, standing in for device time")
    p.add_argument("--sizes", nargs="+", default=["10m", "100m"], help="steady: the MLPs")
    p.add_argument("--kill-at", type=int, default=None,
                   help="steady: the step at which one worker is killed (default: half way); its step time is the "
                        "median before it")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cap", type=float, default=3.0, help="stop a variant after this many times DDP's time")
    add_out(p, Path("benchmarks/results/vs_torchft"))
    p.add_argument("--work", default="/tmp/monarch_plugin_vs_torchft")
    args = p.parse_args()
    if args.leg == "tables":
        for path in sorted(args.out.glob("vs_torchft-*.json")):
            results = json.loads(path.read_text())
            print(f"\n{path}\n")
            if "goodput" in path.name:
                print(goodput_table(results, max(r["steps_done"] for r in results)))
                for system in PHASES:
                    print()
                    print(account_table(results, system))
            else:
                print(steady_table(results))
        return
    shutil.rmtree(args.work, ignore_errors=True)
    if args.leg == "goodput":
        args.steps = args.steps or 300
        results = goodput_leg(args)
        write_json(args.out, "vs_torchft-goodput", results)
        plot_steps([(f"{r['variant']} ({r['goodput']:.3f} of DDP)", r) for r in results
                    if r["repeat"] == 0 and r["variant"] in ("ddp", "monarch", "monarch-spare", "torchft")
                    and r["every_s"] in (None, args.every[0])], args.out / "vs_torchft-goodput.png",
                   "monarch-plugin and torchft under the same SIGKILLs (thin lines), 4 replicas, CPU + idle stand-in")
        print(goodput_table(results, args.steps))
        print()
        for system in PHASES:
            print()
            print(account_table(results, system))
    else:
        args.steps = args.steps or 40
        args.kill_at = args.kill_at or args.steps // 2
        results = steady_leg(args)
        write_json(args.out, "vs_torchft-steady-" + "-".join(args.sizes), results)
        print(steady_table(results))


if __name__ == "__main__":
    main()
