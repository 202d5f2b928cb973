"""The suite's hooks and fixtures; what the tests share is in `support/` (import it from there, never from here).

`elastic_run` makes `monarch-run` runs (`support.runs.ElasticRun`), each killed with everything it spawned after the
test, pass or fail; `small_disk` a 1 MiB tmpfs; `hosts` network-namespace hosts with real agents.
"""

from __future__ import annotations

import collections
import os
import subprocess

import pytest

from support.runs import ElasticRun, SmallDisk, run_factory


def pytest_collection_modifyitems(items):
    """tests/e2e drives the front ends end to end, on real replica meshes (a few check a front end's settings in
    this process); `-m "not slow"` runs the unit tests alone, in seconds."""
    for item in items:
        if "e2e" in item.path.parts:
            item.add_marker(pytest.mark.slow)


def pytest_unconfigure(config):
    """The session's last line names what was skipped and why (the SLURM, browser and firewall tests skip where their
    Debian packages are missing; `.ci/run` installs them), so a green run on a fresh machine says what it left out."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    reasons = collections.Counter(report.longrepr[2].removeprefix("Skipped: ")
                                  for report in reporter.stats.get("skipped", []) if isinstance(report.longrepr, tuple))
    if reasons:
        reporter.write_line(f"skipped {sum(reasons.values())}: " + "; ".join(
            f"{count} because {reason}" for reason, count in reasons.most_common()))


@pytest.fixture
def elastic_run(tmp_path):
    yield from run_factory(tmp_path, ElasticRun)


@pytest.fixture
def small_disk(tmp_path):
    """A filesystem of its own (a 1 MiB tmpfs, which only root may mount), for what a full disk does to a run: `fill`
    takes every byte of it, `free` gives them back. Unmounted after the test, pass or fail."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = SmallDisk(tmp_path / "disk")
    yield disk
    subprocess.run(["umount", "--lazy", str(disk.path)], check=False, timeout=30)


@pytest.fixture
def hosts(tmp_path):
    """Network-namespace hosts (`netns.NetnsHosts`), made by `hosts(count)`; all removed after the test."""
    from support import netns

    made: list = []

    def make(count: int, token: bool = False):
        made.append(netns.NetnsHosts(count, tmp_path / f"hosts{len(made)}", token=token))
        return made[-1]

    yield make
    for net in made:
        net.close()
