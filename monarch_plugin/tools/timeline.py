"""A run's events drawn over time, for `monarch-plugin timeline EVENTS.jsonl -o run.png [--html run.html]`.

One picture, seconds since the run started along it: how many replicas trained (from `quorum` events), committed
steps per second (from `progress` events; a file from before they existed says so instead), every event that
changed the run (deaths, hangs, dropped steps, heals, hot spares admitted, hosts lost and up, grows, a give-up),
each recovery's phases, each replica's life and, on a multi-host run, each host's. The page (`--html`) is the same
picture as inline SVG with hover tooltips, above the `monarch-plugin summary` text: one file that fetches nothing.
Recoveries, commits and the summary come from `report`, so the picture and the table never disagree.
"""

from __future__ import annotations

import html
import io
import json
import re
from dataclasses import dataclass, field

from monarch_plugin.errors import MissingExtraError
from monarch_plugin.tools.report import (
    Recovery,
    commits,
    format_summary,
    goodput,
    host_name,
    recoveries,
    started_at,
)

__all__ = ["Mark", "Lane", "Picture", "picture", "write_png", "write_html", "MARKS", "PHASES"]

MARKS = {
    "death": ("death", "tab:red", "X"),
    "hang": ("hang", "tab:orange", "s"),
    "dropped_step": ("dropped step", "tab:purple", "v"),
    "heal": ("heal", "tab:green", "P"),
    "spare": ("spare admitted", "tab:cyan", "*"),
    "host_lost": ("host lost", "black", "x"),
    "host_up": ("host up", "tab:gray", "^"),
    "grow": ("grow", "tab:blue", "D"),
    "give_up": ("give up", "darkred", "o"),
}
"""The events marked on the picture, each kind in its own row: kind -> (label, colour, marker)."""

PHASES = {
    "killed": ("black", "x"),
    "noticed": ("tab:red", "o"),
    "shrunk": ("tab:orange", "s"),
    "spawn began": ("tab:gray", ">"),
    "spawned": ("tab:blue", "^"),
    "healed": ("tab:green", "P"),
    "training": ("tab:olive", "*"),
}
"""A recovery's phases in order, each with its colour and marker: the death killed (when a fault or a kill was
recorded), noticed, the survivors' next committed step, the replacement's spawn, heal and first committed step."""

_SPANS = {"spawning": "#c7c7c7", "starting": "#9ecae1", "training": "#3182bd", "attaching": "#c7c7c7",
          "attached": "#74c476"}


@dataclass
class Mark:
    t: float  # seconds since the run started
    kind: str  # a key of MARKS
    text: str


@dataclass
class Lane:
    """One row of bars: a replica's life, or a host's time attached."""

    label: str
    spans: list[tuple[float, float, str, str]] = field(default_factory=list)  # (from, to, what, tooltip)


@dataclass
class Picture:
    """Everything the timeline shows, in seconds since the run started."""

    name: str
    title: str
    seconds: float
    size: list[tuple[float, int]]  # the replicas in each generation, from when it was published
    rate: list[tuple[float, float, float]]  # (from, to, committed steps/s) between consecutive recorded commits
    has_progress: bool
    marks: list[Mark]
    recoveries: list[tuple[str, list[tuple[str, float, str]]]]  # a title, and each phase's (name, t, tooltip)
    replicas: list[Lane]
    hosts: list[Lane]  # empty on one machine


def _marks(events: list[dict], t0: float, found: list[Recovery]) -> list[Mark]:
    marks, seen = [], set()
    for e in events:
        kind, t = e["event"], e["ts"] - t0
        if kind == "death":
            marks.append(Mark(t, kind, f"replica {e['replica']} died on {host_name(e.get('host'))}: noticed by "
                                       f"{e['detected_by']}"))
        elif kind == "hang":
            marks.append(Mark(t, kind, f"replica {e['replica']} hung: {e['detected_by']}"))
        elif kind == "dropped_step" and (kind, e["gen"], e["step"]) not in seen:
            seen.add((kind, e["gen"], e["step"]))
            marks.append(Mark(t, kind, f"step {e['step']} dropped in generation {e['gen']} ({e.get('reason')} "
                                       f"on replica {e.get('replica')})"))
        elif kind == "heal" and (kind, e["gen"], tuple(e["recipients"])) not in seen:
            seen.add((kind, e["gen"], tuple(e["recipients"])))
            donors = e.get("donors") or [e.get("donor")]
            marks.append(Mark(t, kind, f"replica(s) {e['recipients']} healed from replica(s) "
                                       f"{', '.join(map(str, donors))} at step {e['step']}"))
        elif kind == "host_lost":
            marks.append(Mark(t, kind, f"host {host_name(e['host'])} lost, with replica(s) {e.get('replicas')}: "
                                       f"{e.get('reason')}"))
        elif kind == "host_up":
            again = " (a machine seen before)" if e.get("returning") else ""
            marks.append(Mark(t, kind, f"host {host_name(e.get('address'))} up{again}: {e.get('slots')} slot(s), "
                                       f"attached in {e.get('seconds', 0):.1f} s"))
        elif kind == "grow":
            marks.append(Mark(t, kind, f"grow to {e['replicas']} replicas (was {e.get('was')}): host "
                                       f"{host_name(e.get('host'))} joined"))
        elif kind == "give_up":
            marks.append(Mark(t, kind, f"the controller gave up: {e.get('reason')}"))
    quorums = [e for e in events if e["event"] == "quorum"]
    for rec in found:
        if rec.hot_spare and rec.replacement_joined:
            admit = next(q for q in quorums if q["ts"] >= rec.detected_at and rec.replacement in q["members"])
            marks.append(Mark(admit["ts"] - t0, "spare", f"hot spare replica {rec.replacement} admitted for replica "
                                                         f"{rec.replica} (generation {admit['gen']})"))
    return sorted(marks, key=lambda m: m.t)


def _phases(rec: Recovery, t0: float) -> tuple[str, list[tuple[str, float, str]]]:
    p = rec.phases()
    since = "the kill" if rec.killed_at is not None else "the detection"
    new = f"replica {rec.replacement}"
    cold = not rec.hot_spare
    phases = [
        ("killed", rec.killed_at, f"replica {rec.replica} killed (a recorded fault or kill)"),
        ("noticed", rec.detected_at, f"replica {rec.replica}'s death noticed by {rec.detected_by}"),
        ("shrunk", rec.resumed_at, f"survivors {rec.survivors} committed their next step, "
                                   f"{(p['kill_to_next_commit'] or 0):.3f} s after {since}"),
        ("spawn began", rec.spawn_started_at if cold else None, f"{new}'s spawn began"),
        ("spawned", rec.spawned_at if cold else None, f"{new} spawned in {(p['spawn'] or 0):.1f} s"),
        ("healed", rec.healed_at, f"{new} healed from a live peer in {(rec.heal_seconds or 0) * 1000:.0f} ms"),
        ("training", rec.participating_at, f"{new} committed its first step ({rec.participating_step}), "
                                           f"{(p['replace_to_participating'] or 0):.1f} s after "
                                           f"{'spawn began' if cold else 'the death was noticed'}"),
    ]
    title = f"replica {rec.replica} died" + ("" if rec.host in (None, "this machine") else f" ({host_name(rec.host)})")
    return title, [(name, t - t0, f"{name} at t={t - t0:.2f} s: {text}") for name, t, text in phases if t is not None]


def _replica_lanes(events: list[dict], t0: float, end: float, multihost: bool) -> list[Lane]:
    lanes = []
    for spawn in sorted((e for e in events if e["event"] == "spawn"), key=lambda e: e["replica"]):
        rid, began, spawned = spawn["replica"], spawn["ts"] - spawn["seconds"], spawn["ts"]
        first = next((e for e in events if e["event"] == "first_commit" and e["replica"] == rid), None)
        stop = next((e for e in events if e["event"] in ("death", "finished") and e.get("replica") == rid), None)
        until = stop["ts"] if stop else end
        how = ("until it died" if stop["event"] == "death" else "until it finished") if stop else "until the run ended"
        where = host_name(spawn.get("host"))
        lane = Lane(f"replica {rid}" + (f" @ {where}" if multihost else ""))
        lane.spans.append((began - t0, spawned - t0, "spawning", f"replica {rid} spawning on {where}: "
                                                                  f"{spawned - began:.1f} s"))
        starting_until = first["ts"] if first else until
        lane.spans.append((spawned - t0, starting_until - t0, "starting",
                           f"replica {rid} starting (ready, joining, healing or waiting as a spare): "
                           f"{starting_until - spawned:.1f} s" + ("" if first else f", never trained, {how}")))
        if first:
            lane.spans.append((first["ts"] - t0, until - t0, "training",
                               f"replica {rid} training from step {first['step']}, {how}: {until - first['ts']:.1f} s"))
        lanes.append(lane)
    return lanes


def _host_lanes(events: list[dict], t0: float, end: float) -> list[Lane]:
    lanes = []
    for up in (e for e in events if e["event"] == "host_up"):
        address = up.get("address")
        lost = next((e for e in events if e["event"] == "host_lost" and e["host"] == address and e["ts"] >= up["ts"]),
                    None)
        until = lost["ts"] if lost else end
        lane = Lane(f"host {host_name(address)}")
        lane.spans.append((up["ts"] - up.get("seconds", 0) - t0, up["ts"] - t0, "attaching",
                           f"host {host_name(address)} attaching: {up.get('seconds', 0):.1f} s"))
        lane.spans.append((up["ts"] - t0, until - t0, "attached", f"host {host_name(address)} attached, "
                           + (f"until it was lost: {lost.get('reason')}" if lost else "until the run ended")))
        lanes.append(lane)
    return lanes


def picture(events: list[dict], name: str) -> Picture:
    """What the timeline of these events shows; `name` (the events file's) titles it."""
    t0 = started_at(events)
    end = next((e["ts"] for e in reversed(events) if e["event"] == "run_end"), events[-1]["ts"] if events else t0)
    multihost = any(e["event"] == "host_up" for e in events)
    found = recoveries(events)
    has_progress = any(e["event"] == "progress" for e in events)
    points = commits(events)
    g = goodput(events)
    title = (f"{name}: {len(found)} failure(s), goodput "
             + (f"{g.value:.0%}" if g.value is not None else "not measurable (see the summary)"))
    return Picture(
        name=name, title=title, seconds=max(end - t0, 1e-3),
        size=[(0.0, 0)] + [(e["ts"] - t0, len(e["members"])) for e in events if e["event"] == "quorum"],
        rate=[(a.ts - t0, b.ts - t0, (b.step - a.step) / (b.ts - a.ts)) for a, b in zip(points, points[1:])
              if b.ts > a.ts] if has_progress else [],
        has_progress=has_progress,
        marks=_marks(events, t0, found),
        recoveries=[_phases(rec, t0) for rec in found],
        replicas=_replica_lanes(events, t0, end, multihost),
        hosts=_host_lanes(events, t0, end) if multihost else [],
    )


def _matplotlib():
    """matplotlib's `Figure` and `rc_context` (no pyplot: no global backend is chosen; PNGs are drawn by Agg)."""
    try:
        from matplotlib import rc_context
        from matplotlib.figure import Figure
    except ImportError as e:
        raise MissingExtraError("the timeline is drawn with matplotlib, which is not installed here: "
                                "pip install 'monarch-plugin[viz]'") from e
    return Figure, rc_context


def _labels(ax, phases: list[tuple[str, float, str]], y: float, seconds: float) -> None:
    """Each phase's name by its marker, at the first height where it clears the names already there (the one
    they clear most when none is free); a name is about 0.8% of the axis wide per character."""
    per_char = seconds * 0.008
    ends = {tier: float("-inf") for tier in (0.25, -0.27, 0.43, -0.45)}  # the right edge of the last name at each
    for name, t, _ in phases:
        half = len(name) * per_char / 2
        tier = next((tier for tier, end in ends.items() if t - half > end), min(ends, key=ends.get))
        ends[tier] = t + half
        ax.text(t, y + tier, name, fontsize=7, ha="center", va="center", color=PHASES[name][0])


def _draw(p: Picture):
    """The figure, its axes, and the tooltip of each artist given a `tip-N` gid (N indexes the list)."""
    Figure, _ = _matplotlib()
    kinds = [k for k in MARKS if any(m.kind == k for m in p.marks)]
    panels = [("size", 1.3), ("rate", 1.5)]
    panels += [("marks", 0.3 * len(kinds) + 0.4)] if kinds else []
    panels += [("recoveries", 0.75 * len(p.recoveries) + 0.5)] if p.recoveries else []
    panels += [("replicas", 0.24 * len(p.replicas) + 0.4)] if p.replicas else []
    panels += [("hosts", 0.24 * len(p.hosts) + 0.4)] if p.hosts else []
    # Fixed margins, in inches (a constrained layout would double the drawing time): the left one fits the longest
    # row name (8 pt), the right one the legends.
    labels = [MARKS[k][0] for k in kinds] + [title for title, _ in p.recoveries] + [
        lane.label for lane in p.replicas + p.hosts]
    width, height = 12.0, sum(h for _, h in panels) + 0.25 * len(panels) + 1.0
    left = 0.3 + 0.06 * max(map(len, labels), default=8)
    fig = Figure(figsize=(width, height))
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False, gridspec_kw={
        "height_ratios": [h for _, h in panels], "hspace": 0.25 * len(panels) / sum(h for _, h in panels),
        "left": left / width, "right": 1 - 1.1 / width, "top": 1 - 0.5 / height, "bottom": 0.55 / height})[:, 0]
    ax = dict(zip((name for name, _ in panels), axes))
    tips: list[str] = []

    def tip(artist, text: str) -> None:
        artist.set_gid(f"tip-{len(tips)}")
        tips.append(text)

    fig.suptitle(p.title, fontsize=11)
    for a in axes:
        for m in p.marks:
            if m.kind in ("death", "host_lost", "give_up"):
                a.axvline(m.t, color=MARKS[m.kind][1], alpha=0.25, linewidth=1)
        a.grid(axis="x", alpha=0.3)
    a = ax["size"]
    a.step([t for t, _ in p.size] + [p.seconds], [n for _, n in p.size] + [p.size[-1][1]], where="post",
           color="tab:blue")
    a.set_ylim(0, max(n for _, n in p.size) + 1)
    a.yaxis.get_major_locator().set_params(integer=True)
    a.set_ylabel("replicas")
    a = ax["rate"]
    a.set_ylabel("committed\nsteps/s")
    if p.rate:
        a.step([s for s, _, _ in p.rate] + [p.rate[-1][1]], [r for _, _, r in p.rate] + [p.rate[-1][2]],
               where="post", color="tab:green")
        a.set_ylim(0, max(r for _, _, r in p.rate) * 1.15)
    else:
        why = ("this events file has no `progress` events (it was written before they existed)" if not p.has_progress
               else "fewer than two steps were recorded committed")
        a.text(0.5, 0.5, f"steps/s not drawn: {why}", transform=a.transAxes, ha="center", va="center",
               color="dimgray")
        a.set_yticks([])
    if kinds:
        a = ax["marks"]
        for row, kind in enumerate(kinds):
            _, color, marker = MARKS[kind]
            for m in (m for m in p.marks if m.kind == kind):
                (artist,) = a.plot([m.t], [row], marker=marker, color=color, markersize=8, linestyle="none")
                tip(artist, f"t={m.t:.2f} s: {m.text}")
        a.set_yticks(range(len(kinds)), [MARKS[k][0] for k in kinds], fontsize=8)
        a.set_ylim(len(kinds) - 0.5, -0.5)
    if p.recoveries:
        a = ax["recoveries"]
        for row, (title, phases) in enumerate(p.recoveries):
            times = dict((name, t) for name, t, _ in phases)
            start = times.get("killed", times.get("noticed"))
            if "shrunk" in times:
                a.plot([start, times["shrunk"]], [row, row], color="tab:orange", linewidth=6, alpha=0.35,
                       solid_capstyle="butt")
            regrow_from = times.get("spawn began", times.get("noticed"))
            if "training" in times:
                a.plot([regrow_from, times["training"]], [row, row], color="tab:blue", linewidth=3, alpha=0.3,
                       solid_capstyle="butt")
            for name, t, text in phases:
                color, marker = PHASES[name]
                (artist,) = a.plot([t], [row], marker=marker, color=color, markersize=8, linestyle="none")
                tip(artist, text)
            _labels(a, phases, row, p.seconds)
        a.set_yticks(range(len(p.recoveries)), [title for title, _ in p.recoveries], fontsize=8)
        a.set_ylim(len(p.recoveries) - 0.4, -0.6)
    for panel in ("replicas", "hosts"):
        lanes = getattr(p, panel)
        if not lanes:
            continue
        a = ax[panel]
        for row, lane in enumerate(lanes):
            for start, stop, what, text in lane.spans:
                (bar,) = a.barh([row], [max(stop - start, 0.0)], left=[start], height=0.6, color=_SPANS[what])
                tip(bar, text)
        a.set_yticks(range(len(lanes)), [lane.label for lane in lanes], fontsize=8)
        a.set_ylim(len(lanes) - 0.5, -0.5)
    for panel in ("replicas", "hosts"):
        shown = [what for what in _SPANS if any(span[2] == what for lane in getattr(p, panel) for span in lane.spans)]
        if shown:
            handles = [ax[panel].plot([], [], color=_SPANS[what], linewidth=6)[0] for what in shown]
            ax[panel].legend(handles, shown, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    if p.recoveries:
        shown = [name for name in PHASES if any(phase[0] == name for _, phases in p.recoveries for phase in phases)]
        handles = [ax["recoveries"].plot([], [], marker=PHASES[name][1], color=PHASES[name][0], linestyle="none")[0]
                   for name in shown]
        ax["recoveries"].legend(handles, shown, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7,
                                frameon=False)
    axes[-1].set_xlim(0, p.seconds)
    axes[-1].set_xlabel("seconds since the run started")
    return fig, axes, tips


def write_png(events: list[dict], name: str, path: str) -> None:
    """Draw the timeline of these events into a PNG at `path`."""
    fig, _, _ = _draw(picture(events, name))
    fig.savefig(path, format="png", dpi=100)


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1em 2em; color: #222; }}
#chart svg {{ width: 100%; height: auto; }}
#readout {{ font: 13px ui-monospace, monospace; min-height: 1.3em; color: #444; }}
#tip {{ position: absolute; max-width: 36em; background: #fffff0; border: 1px solid #999; padding: 4px 8px;
  font: 12px ui-monospace, monospace; pointer-events: none; white-space: pre-wrap; }}
.tip:hover {{ opacity: 0.7; cursor: default; }}
pre {{ font-size: 12px; background: #f6f6f6; padding: 1em; overflow-x: auto; }}
</style></head>
<body>
<div id="readout">move the pointer over the picture: the time, the replicas and the steps/s there; over a mark, what
happened</div>
<div id="chart">{svg}</div>
<div id="tip" hidden></div>
<h2>monarch-plugin summary</h2>
<pre>{summary}</pre>
<script>
const data = {data};
const svg = document.querySelector("#chart svg"), tip = document.getElementById("tip"),
  readout = document.getElementById("readout");
function at(series, t) {{ let v = null; for (const s of series) {{ if (s[0] <= t) v = s; else break; }} return v; }}
svg.addEventListener("mousemove", (ev) => {{
  const p = new DOMPoint(ev.clientX, ev.clientY).matrixTransform(svg.getScreenCTM().inverse());
  const t = (p.x - data.x0) / (data.x1 - data.x0) * data.seconds;
  if (t >= 0 && t <= data.seconds) {{
    const size = at(data.size, t), rate = at(data.rate, t);
    const steps = !data.has_progress ? "steps/s: not recorded in this file"
      : rate && t <= rate[1] ? rate[2].toFixed(2) + " committed steps/s" : "no commit recorded around here";
    readout.textContent = "t = " + t.toFixed(2) + " s \\u00b7 " + (size ? size[1] : 0) + " replica(s) \\u00b7 " + steps;
  }}
  const el = ev.target.closest(".tip");
  if (el) {{
    tip.textContent = el.dataset.tip;
    tip.style.left = (ev.pageX + 14) + "px";
    tip.style.top = (ev.pageY + 14) + "px";
    tip.hidden = false;
  }} else {{
    tip.hidden = true;
  }}
}});
svg.addEventListener("mouseleave", () => {{ tip.hidden = true; }});
</script>
</body></html>
"""


def _inline(svg: str, tips: list[str]) -> str:
    """matplotlib's SVG made fit to sit inside a page: no XML prolog, doctype, metadata or namespace URLs (an
    HTML parser puts inline <svg> in its namespace), and each tooltip on its artist's group."""
    svg = svg[svg.index("<svg"):]
    svg = re.sub(r"<metadata>.*?</metadata>\s*", "", svg, flags=re.S)
    svg = re.sub(r'\s+xmlns(:xlink)?="[^"]*"', "", svg)
    return re.sub(r'<g id="tip-(\d+)">',
                  lambda m: f'<g id="tip-{m[1]}" class="tip" data-tip="{html.escape(tips[int(m[1])])}">', svg)


def write_html(events: list[dict], name: str, path: str) -> None:
    """Write a self-contained page at `path`: the timeline as inline SVG with hover tooltips, and the summary."""
    p = picture(events, name)
    fig, axes, tips = _draw(p)
    _, rc_context = _matplotlib()
    buffer = io.StringIO()
    with rc_context({"svg.fonttype": "none"}):  # text as text: selectable, and in the viewer's font
        fig.savefig(buffer, format="svg")
    box = axes[-1].get_position()
    width = fig.get_figwidth() * 72  # the SVG's user units are points
    data = {"x0": box.x0 * width, "x1": box.x1 * width, "seconds": p.seconds, "has_progress": p.has_progress,
            "size": p.size, "rate": [[round(a, 3), round(b, 3), round(r, 3)] for a, b, r in p.rate]}
    page = _PAGE.format(title=html.escape(p.title), svg=_inline(buffer.getvalue(), tips),
                        summary=html.escape("\n".join(format_summary(events))),
                        data=json.dumps(data).replace("</", "<\\/"))
    with open(path, "w") as f:
        f.write(page)
