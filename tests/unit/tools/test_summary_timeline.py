"""`monarch-plugin summary` and `timeline` on real runs' events: the numbers are the events', the pictures are made.

data/plain_sigkill.jsonl is a plain-loop run (3 replicas, replica 1 SIGKILLed at step 8, regrown) with `progress`
events; data/hf_multihost_no_progress.jsonl an HF run on two hosts, one of them lost, from before `progress`
existed. Expected values are computed here from the raw events, not through `report`.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from monarch_plugin.tools.cli import plugin as main
from monarch_plugin.events import read_events
from monarch_plugin.tools.report import format_summary, goodput, recoveries
from monarch_plugin.tools.timeline import write_html, write_png

pytestmark = pytest.mark.timeout(60)

DATA = Path(__file__).parent / "events"
PLAIN = DATA / "plain_sigkill.jsonl"
MULTIHOST = DATA / "hf_multihost_no_progress.jsonl"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _of(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["event"] == kind]


def test_the_failure_row_is_the_events_time_to_shrink_regrow_and_dropped_step():
    events = read_events(str(PLAIN))
    start = _of(events, "run_start")[0]["ts"]
    [death] = _of(events, "death")
    shrunk = next(q for q in _of(events, "quorum") if q["ts"] >= death["ts"] and death["replica"] not in q["members"])
    resumed = min(e["ts"] for e in _of(events, "first_commit") if e["gen"] == shrunk["gen"])
    dropped = sorted({e["step"] for e in _of(events, "dropped_step") if e["gen"] == death["gen"]})
    [new] = [e for e in _of(events, "spawn") if not e["initial"]]
    trained = next(e["ts"] for e in _of(events, "first_commit") if e["replica"] == new["replica"])
    regrow = trained - (new["ts"] - new["seconds"])
    assert dropped == [8] and 0.1 < resumed - death["ts"] < 0.2 and 5 < regrow < 6  # the run this file recorded

    lines = format_summary(events)
    row = lines[2]  # under the title and the column names
    assert row.split() == ["1", f"{death['ts'] - start:.1f}", "1", *death["detected_by"].split(),
                           f"{resumed - death['ts']:.3f}", "s", f"{regrow:.3f}", "s", "8"]
    assert "host" not in lines[1]  # one machine: no host column
    assert any(line.startswith("  shrink: death noticed") for line in lines)
    totals = next(line for line in lines if line.startswith("run: "))
    assert f"run: {_of(events, 'run_end')[0]['ts'] - start:.1f} s" in totals
    assert "1 death(s)" in totals and "4 replica(s) spawned (3 at the start)" in totals
    assert "1 step(s) dropped: step 8 in generation 0" in "\n".join(lines)


def test_a_cold_replacements_phases_are_its_events_one_after_the_other():
    events = read_events(str(PLAIN))
    [rec] = recoveries(events)
    [new] = [e for e in _of(events, "spawn") if not e["initial"]]
    [ready] = [e for e in _of(events, "ready") if e["replica"] == new["replica"]]
    p = rec.phases()
    assert p["spawn"] == pytest.approx(new["seconds"]) and p["spawned_to_ready"] == pytest.approx(
        ready["ts"] - new["ts"])
    steps = p["spawn"] + p["spawned_to_ready"] + p["ready_to_healed"] + p["healed_to_participating"]
    assert steps == pytest.approx(p["replace_to_participating"])


def test_goodput_falls_back_to_the_longest_stretch_at_the_starting_size_and_says_which():
    events = read_events(str(PLAIN))
    [death] = _of(events, "death")
    recorded = sorted(_of(events, "first_commit") + _of(events, "progress"), key=lambda e: e["ts"])
    assert {e["step"] for e in recorded if e["ts"] < death["ts"]} == {0}  # too little before the failure to measure
    run = (recorded[-1]["step"] - recorded[0]["step"]) / (recorded[-1]["ts"] - recorded[0]["ts"])
    gen2 = [e for e in recorded if e["gen"] == 2]  # 3 replicas again, the starting size, and nothing failed in it
    assert len(_of(events, "quorum")[0]["members"]) == len(_of(events, "quorum")[2]["members"]) == 3
    baseline = (gen2[-1]["step"] - gen2[0]["step"]) / (gen2[-1]["ts"] - gen2[0]["ts"])

    g = goodput(events)
    assert g.run.rate == pytest.approx(run) and g.baseline.rate == pytest.approx(baseline)
    text = "\n".join(format_summary(events))
    assert "goodput = committed steps per second over the whole run" in text  # the definition is stated
    assert f"goodput: {run / baseline:.0%} = {run:.2f} steps/s over the run" in text
    assert "before the first failure are too few" in text and "used instead: generation 2" in text


def _run(*, fail_at: float | None, regrow: bool = True) -> list[dict]:
    """Two replicas at 10 steps/s for 10 s, then (after a death at `fail_at`) one at 5 steps/s for 9 s."""
    events = [{"ts": 100.0, "event": "run_start"}, {"ts": 101.0, "event": "quorum", "gen": 0, "members": [0, 1]},
              {"ts": 101.0, "event": "first_commit", "replica": 0, "gen": 0, "step": 0}]
    events += [{"ts": 101.0 + i, "event": "progress", "replica": 0, "gen": 0, "step": 10 * i} for i in range(1, 11)
               if fail_at is None or 101.0 + i < fail_at]
    if fail_at is not None:
        last = max(e["step"] for e in events if "step" in e)
        events += [{"ts": fail_at, "event": "death", "replica": 1, "detected_by": "pidfd", "gen": 0},
                   {"ts": fail_at, "event": "quorum", "gen": 1, "members": [0]},
                   {"ts": fail_at + 0.5, "event": "first_commit", "replica": 0, "gen": 1, "step": last + 1}]
        events += [{"ts": fail_at + 0.5 + i, "event": "progress", "replica": 0, "gen": 1, "step": last + 1 + 5 * i}
                   for i in range(1, 10)]
    return events + [{"ts": events[-1]["ts"] + 0.5, "event": "run_end"}]


def test_goodput_is_the_run_rate_over_the_rate_before_the_first_failure():
    g = goodput(_run(fail_at=111.5))
    assert g.baseline.rate == pytest.approx(10.0)  # steps 0-100 in the 10 s before the death
    assert g.run.rate == pytest.approx(146 / 20.0)  # steps 0-146 from t=1 s to t=21 s: first to last recorded
    assert g.baseline_is.startswith("before the first failure")
    assert goodput(_run(fail_at=None)).value == pytest.approx(1.0)


def test_goodput_without_a_long_enough_stretch_at_the_starting_size_is_not_made_up():
    events = _run(fail_at=102.5)  # 1.5 s of 2 replicas, then never 2 again
    assert goodput(events).value is None
    [line] = [line for line in format_summary(events) if line.startswith("goodput:")]
    assert "not measurable" in line and "%" not in line and "starting size (2 replicas)" in line
    old = read_events(str(MULTIHOST))
    assert "goodput: not measurable: this events file has no `progress` events" in "\n".join(format_summary(old))


def test_a_multihost_summary_names_the_dead_replicas_host_and_counts_the_hosts():
    events = read_events(str(MULTIHOST))
    lines = format_summary(events)
    assert lines[1].split()[:5] == ["#", "at", "(s)", "replica", "host"]
    [death] = _of(events, "death")
    assert death["host"].removeprefix("tcp://") in lines[2]
    assert "hosts: 2 up at the start, 1 lost, 1 joined later" in "\n".join(lines)


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("html") / "run.html"
    write_html(read_events(str(PLAIN)), PLAIN.name, str(path))
    return path.read_text()


def test_the_page_is_self_contained(page):
    assert "http://" not in page and "https://" not in page
    assert not re.search(r"<(link|iframe|img|object|embed)\b", page)
    assert not re.search(r"<script[^>]*\bsrc=", page) and not re.search(r"\b(src|href)=\"(?!#)", page)
    assert not re.search(r"url\((?!#)", page) and "@import" not in page
    scripts = re.findall(r"<script>(.*?)</script>", page, re.S)
    assert len(scripts) == 1 and "mousemove" in scripts[0]


def test_the_page_marks_the_death_drop_heal_and_each_phase_of_the_recovery(page):
    tips = re.findall(r'data-tip="([^"]*)"', page)
    for text in ("replica 1 died on this machine: noticed by pidfd", "step 8 dropped in generation 0",
                 "healed from replica(s) 0", "replica 3 training from step 63"):
        assert any(text in tip for tip in tips), text
    for phase in ("noticed", "shrunk", "spawn began", "spawned", "healed", "training"):
        assert any(tip.startswith(f"{phase} at t=") for tip in tips), phase
        assert f">{phase}</text>" in page  # labelled on the picture, not only in tooltips
    assert "goodput = committed steps per second" in page  # the summary sits under the picture


# Put around the page in a copy: the first script records every error the page raises (before the page's own
# script runs), the last one moves the pointer over the plot and over a mark, as a user would, and writes what the
# page showed into the DOM, which `--dump-dom` prints.
_RECORD_ERRORS = """<script>window.pageErrors = [];
window.addEventListener("error", (e) => pageErrors.push(String(e.message)));
window.addEventListener("unhandledrejection", (e) => pageErrors.push(String(e.reason)));</script>"""
_POINT_AND_REPORT = """<script>(() => {  // its own scope: the page's script has top-level consts of these names
const chart = document.querySelector("#chart svg"), box = chart.getScreenCTM();
const inPlot = new DOMPoint((data.x0 + data.x1) / 2, 0).matrixTransform(box);
chart.dispatchEvent(new MouseEvent("mousemove", {bubbles: true, clientX: inPlot.x, clientY: inPlot.y}));
const readout = document.getElementById("readout").textContent;
const mark = [...document.querySelectorAll(".tip")].find((g) => g.dataset.tip.includes("died"));
const r = mark.getBoundingClientRect();
mark.dispatchEvent(new MouseEvent("mousemove",
  {bubbles: true, clientX: r.x + r.width / 2, clientY: r.y + r.height / 2}));
const tip = document.getElementById("tip");
const pre = document.createElement("pre");
pre.id = "harness";
pre.textContent = JSON.stringify({errors: pageErrors, readout, tip: tip.hidden ? null : tip.textContent});
document.body.append(pre);
})();</script>"""


@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="no chromium on PATH (.ci/run installs Debian's: apt-get install chromium)")
def test_the_page_loads_in_a_real_browser_without_errors_and_answers_the_pointer(page, tmp_path):
    harnessed = tmp_path / "harnessed.html"
    harnessed.write_text(page.replace("<head>", "<head>" + _RECORD_ERRORS, 1)
                         .replace("</body>", _POINT_AND_REPORT + "</body>", 1))
    dom = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", "--virtual-time-budget=5000",
         f"--user-data-dir={tmp_path / 'profile'}", "--host-resolver-rules=MAP * ~NOTFOUND",
         harnessed.as_uri()],
        capture_output=True, text=True, timeout=45).stdout
    found = re.search(r'<pre id="harness">(.*?)</pre>', dom, re.S)
    assert found, f"the page's script did not run to its end; the browser printed:\n{dom[-2000:]}"
    shown = json.loads(html.unescape(found[1]))
    assert shown["errors"] == []
    rate = r"([\d.]+ committed steps/s|no commit recorded around here)"
    assert re.fullmatch(rf"t = [\d.]+ s · [1-9] replica\(s\) · {rate}", shown["readout"]), shown["readout"]
    assert shown["tip"] and "replica 1 died on this machine" in shown["tip"]


def test_the_png_is_drawn_without_progress_events_too(tmp_path):
    path = tmp_path / "old.png"
    write_png(read_events(str(MULTIHOST)), MULTIHOST.name, str(path))
    assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 10_000


def test_the_commands_in_process(tmp_path, capsys):
    assert main(["summary", str(PLAIN)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"events: {PLAIN}\n") and "goodput: 101%" in out
    png = tmp_path / "run.png"
    assert main(["timeline", str(PLAIN), "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000
    assert f"wrote {png}" in capsys.readouterr().out
    missing = tmp_path / "nowhere.jsonl"
    for command in (["summary", str(missing)], ["timeline", str(missing), "-o", str(png)]):
        assert main(command) == 2
        assert f"no events file at {missing}" in capsys.readouterr().err


def test_the_timeline_without_matplotlib_names_the_fix(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an environment without it raises: ImportError
    assert main(["timeline", str(PLAIN), "-o", str(tmp_path / "x.png")]) == 2
    assert "pip install 'monarch-plugin[viz]'" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_reading_events_loads_neither_torch_nor_monarch():
    probe = (f"import sys; from monarch_plugin.tools.cli import plugin as main; import monarch_plugin.tools.timeline; "
             f"assert main(['summary', {str(PLAIN)!r}]) == 0; "
             "loaded = [m for m in ('torch', 'monarch', 'matplotlib') if m in sys.modules]; "
             "assert not loaded, loaded")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# A multi-host run with a hot spare, trimmed to the fields read: replica 1 (on host b) is found hung after its
# injected fault, the spare replica 2 takes its place at once, a third machine joins (the run grows), host b goes,
# and the controller gives up.
_SPARE = [
    {"ts": 0.0, "event": "run_start"},
    {"ts": 1.0, "event": "host_up", "host": 0, "address": "tcp://10.0.0.1:26600", "slots": 2, "seconds": 0.9},
    {"ts": 1.0, "event": "host_up", "host": 1, "address": "tcp://10.0.0.2:26600", "slots": 1, "seconds": 0.9},
    {"ts": 3.0, "event": "spawn", "replica": 0, "initial": True, "host": "tcp://10.0.0.1:26600", "seconds": 2.0},
    {"ts": 3.0, "event": "spawn", "replica": 1, "initial": True, "host": "tcp://10.0.0.2:26600", "seconds": 2.0},
    {"ts": 3.5, "event": "spawn", "replica": 2, "initial": False, "host": "tcp://10.0.0.1:26600", "seconds": 2.0},
    {"ts": 4.0, "event": "quorum", "gen": 0, "members": [0, 1]},
    {"ts": 4.5, "event": "first_commit", "replica": 0, "gen": 0, "step": 0},
    *({"ts": 4.5 + i, "event": "progress", "replica": 0, "gen": 0, "step": 5 * i} for i in range(1, 4)),
    {"ts": 7.9, "event": "fault_injected", "replica": 1, "step": 17, "mode": "hang"},
    {"ts": 8.0, "event": "hang", "replica": 1, "gen": 0, "detected_by": "hang"},
    {"ts": 8.01, "event": "death", "replica": 1, "detected_by": "hang", "gen": 0, "was_member": True,
     "host": "tcp://10.0.0.2:26600"},
    {"ts": 8.02, "event": "quorum", "gen": 1, "members": [0, 2]},
    {"ts": 8.05, "event": "dropped_step", "replica": 0, "step": 17, "gen": 0, "reason": "CollectiveTimeout"},
    {"ts": 8.1, "event": "heal", "gen": 1, "donor": 0, "recipients": [2], "step": 17, "bytes": 1000, "seconds": 0.05},
    {"ts": 8.3, "event": "first_commit", "replica": 0, "gen": 1, "step": 17},
    {"ts": 8.31, "event": "first_commit", "replica": 2, "gen": 1, "step": 17},
    {"ts": 9.0, "event": "host_up", "host": 2, "address": "tcp://10.0.0.3:26600", "slots": 1, "seconds": 0.5},
    {"ts": 9.0, "event": "grow", "host": "tcp://10.0.0.3:26600", "replicas": 3, "was": 2},
    {"ts": 10.0, "event": "host_lost", "host": "tcp://10.0.0.2:26600", "replicas": [], "reason": "no beat for 4.0 s"},
    {"ts": 12.0, "event": "give_up", "reason": "a test says so", "checkpoint": "/ckpt/step_40"},
    {"ts": 12.5, "event": "run_end", "gen": 1, "members": [0, 2]},
]


def test_a_hot_spare_hang_grow_host_loss_and_give_up_are_each_shown(tmp_path):
    from monarch_plugin.tools.timeline import picture

    text = "\n".join(format_summary(_SPARE))
    row = text.splitlines()[2].split()
    assert row[:4] == ["1", "8.0", "1", "10.0.0.2:26600"]
    assert row[-5:] == ["0.400", "s", "0.300", "s", "17"]  # shrink from the kill; a spare's regrow from the detection
    assert "the controller gave up: a test says so (checkpoint /ckpt/step_40)" in text
    p = picture(_SPARE, "spare")
    assert {m.kind for m in p.marks} == {"death", "hang", "dropped_step", "heal", "spare", "host_lost", "host_up",
                                         "grow", "give_up"}
    [(title, phases)] = p.recoveries
    assert title == "replica 1 died (10.0.0.2:26600)"
    assert [name for name, _, _ in phases] == ["killed", "noticed", "shrunk", "healed", "training"]  # no spawn: a spare
    assert [lane.label for lane in p.hosts] == ["host 10.0.0.1:26600", "host 10.0.0.2:26600", "host 10.0.0.3:26600"]
    write_png(_SPARE, "spare", str(tmp_path / "spare.png"))
    assert (tmp_path / "spare.png").read_bytes()[:8] == PNG_MAGIC
