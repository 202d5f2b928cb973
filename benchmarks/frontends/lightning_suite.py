"""Lightning's own tests under the plugin: its tests that train with `ddp_spawn` or `ddp` on CPU, the strategy swapped.

    python -m benchmarks.frontends.lightning_suite PATH [--runs 3] [--out runs/lightning_suite.json]

PATH is a checkout of Lightning's repository at the installed version's tag (PyPI's packages carry no tests, and
CI cannot reach code hosts, so this is not part of the suite), with its test requirements installed
(`requirements/pytorch/test.txt`: pytest-rerunfailures, jsonargparse, scikit-learn, onnx, tensorboard, ...). Each
run is one pytest session over the test files that mention those strategies, with this file loaded as a pytest
plugin (`-p benchmarks.frontends.lightning_suite`): every `Trainer(strategy="ddp_spawn" | "ddp" | "ddp_*")` becomes
`strategy="monarch"` and `"fsdp"` becomes `"monarch_fsdp"`, and only the tests that name such a strategy are kept.
Lightning's own fixtures and markers stay in force (its autouse checks that no thread, environment variable or
process group outlives a test; its `flaky` reruns). The tests that swapped a strategy fall in two kinds, counted
apart: those that ran a stage (fit, validate, test or predict) on the plugin, and those that only built a Trainer
(most of these assert which strategy class or sampler Lightning picked). Prints each kind's outcomes per run and
every test that did not pass in all of them, with its error; writes them to `--out` as JSON. docs/lightning.md
lists what still fails and why.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest

from benchmarks.harness import REPO

_SWAPPED = "LIGHTNING_SUITE_SWAPPED"
"""Where the plugin writes, per test, whether it swapped a strategy and the outcome of each phase."""


def _swap(strategy: object) -> object:
    if isinstance(strategy, str) and (strategy == "ddp" or strategy.startswith(("ddp_", "ddp_spawn"))):
        return "monarch"
    if strategy == "fsdp":
        return "monarch_fsdp"
    return strategy


# -- the pytest plugin (`-p benchmarks.frontends.lightning_suite`) ------------------------------------------------

_records: dict[str, dict] = {}
_current: list[str] = []


def pytest_configure(config) -> None:
    if not os.environ.get(_SWAPPED):
        return  # imported, not loaded as the plugin
    import monarch_plugin.integrations.lightning  # noqa: F401 - registers "monarch", as a user's import does
    from lightning.pytorch import Trainer

    original = Trainer.__init__

    @functools.wraps(original)
    def init(self, *args, **kwargs):
        swapped = _swap(kwargs.get("strategy"))
        if swapped != kwargs.get("strategy"):
            kwargs["strategy"] = swapped
            if _current:
                _records.setdefault(_current[0], {})["swapped"] = True
        original(self, *args, **kwargs)

    Trainer.__init__ = init
    from monarch_plugin.integrations.lightning.launcher import _MonarchLauncher

    launch = _MonarchLauncher.launch

    @functools.wraps(launch)
    def launched(self, *args, **kwargs):
        if _current:
            _records.setdefault(_current[0], {})["ran"] = True
        return launch(self, *args, **kwargs)

    _MonarchLauncher.launch = launched


def pytest_collection_modifyitems(config, items) -> None:
    if not os.environ.get(_SWAPPED):
        return
    named = re.compile(r"""["'](ddp|ddp_spawn|ddp_[a-z_]+|fsdp)["']""")

    def names_a_strategy(item) -> bool:
        try:
            source = inspect.getsource(item.function)
        except (OSError, TypeError, AttributeError):
            source = ""
        return bool(named.search(source) or re.search(r"[\[-](ddp|fsdp)", item.nodeid))

    items[:] = [item for item in items if names_a_strategy(item)]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    _current[:] = [item.nodeid]


def pytest_runtest_logreport(report) -> None:
    if not os.environ.get(_SWAPPED):
        return
    record = _records.setdefault(report.nodeid, {})
    if report.failed:
        record["outcome"] = "failed" if report.when == "call" else f"error in {report.when}"
        crash = getattr(report.longrepr, "reprcrash", None)
        record["why"] = (crash.message if crash else str(report.longrepr)).strip().splitlines()[0][:300]
    elif report.skipped and "outcome" not in record:
        record["outcome"] = "skipped"
    elif report.when == "call" and report.passed and "outcome" not in record:
        record["outcome"] = "passed"


def pytest_sessionfinish(session) -> None:
    path = os.environ.get(_SWAPPED)
    if path:
        Path(path).write_text(json.dumps(_records))


# -- the driver ---------------------------------------------------------------------------------------------

def _version(checkout: Path) -> str | None:
    info = checkout / "src" / "version.info"
    return info.read_text().strip() if info.exists() else None


def _one_run(checkout: Path, files: list[str], timeout_s: int) -> tuple[dict, float]:
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "records.json"
        env = {**os.environ, _SWAPPED: str(out),
               "PYTHONPATH": os.pathsep.join([str(REPO), str(checkout / "tests"), os.environ.get("PYTHONPATH", "")])}
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-m", "pytest", "-p", __spec__.name, "-q", "-p", "no:cacheprovider",
                        f"--timeout={timeout_s}", "--continue-on-collection-errors", *files], cwd=checkout, env=env,
                       check=False)
        seconds = time.monotonic() - t0
        return (json.loads(out.read_text()) if out.exists() else {}), seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkout", type=Path, help="a checkout of Lightning's repository at the installed version's tag")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--timeout", type=int, default=300, help="seconds per test (pytest-timeout)")
    p.add_argument("--out", type=Path, default=Path("runs/lightning_suite.json"))
    args = p.parse_args()
    import lightning

    tests = args.checkout / "tests" / "tests_pytorch"
    if not tests.is_dir():
        sys.exit(f"{tests} not found: give the root of a checkout of github.com/Lightning-AI/pytorch-lightning")
    found = _version(args.checkout)
    if found != lightning.__version__:
        print(f"note: the checkout is Lightning {found}, the installed one {lightning.__version__}", flush=True)
    files = sorted(str(f.relative_to(args.checkout)) for f in tests.rglob("test_*.py")
                   if re.search(r"""["'](ddp|ddp_spawn|ddp_[a-z_]+|fsdp)["']""", f.read_text()))
    runs = []
    for i in range(args.runs):
        records, seconds = _one_run(args.checkout, files, args.timeout)
        swapped = {k: v for k, v in records.items() if v.get("swapped") and "outcome" in v}
        runs.append({"seconds": round(seconds, 1), "tests": swapped})
        for kind, ran in (("ran", True), ("built", False)):
            runs[-1][kind] = dict(Counter(v["outcome"].split(" in ")[0] for v in swapped.values()
                                          if v.get("ran", False) == ran))
        print(f"run {i + 1} ({seconds:.0f} s): ran a stage on the plugin {runs[-1]['ran']}; "
              f"only built a Trainer {runs[-1]['built']}", flush=True)
    print(f"\nLightning {found} tests, installed Lightning {lightning.__version__}")
    for kind, ran in (("ran a stage (fit, validate, test or predict) on the plugin", True),
                      ("only built a Trainer with the swapped strategy (they check what it is)", False)):
        names = sorted({name for run in runs for name, v in run["tests"].items() if v.get("ran", False) == ran})
        print(f"\n{len(names)} tests {kind}; those that did not pass in every run:")
        for name in names:
            outcomes = [run["tests"].get(name, {}).get("outcome", "-") for run in runs]
            if set(outcomes) != {"passed"}:
                why = next((run["tests"][name].get("why", "") for run in runs if name in run["tests"]
                            and run["tests"][name]["outcome"] != "passed"), "")
                print(f"  {name}: {', '.join(outcomes)}\n      {why}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"lightning_checkout": found, "lightning_installed": lightning.__version__,
                                    "files": files, "runs": runs}, indent=1))
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
