"""`monarch-run`'s flags, generated from the settings, and its bad-input paths, which fail before spawning."""

from __future__ import annotations

import subprocess
import sys

import pytest

from monarch_plugin import ElasticConfig
from monarch_plugin.config import cli_flag, field_docs

pytestmark = pytest.mark.timeout(60)


def test_monarch_run_refuses_a_nan_timeout_naming_its_flag(capsys):
    from monarch_plugin.tools.cli import main

    assert main(["--collective-timeout", "nan", "x.py"]) == 2
    assert "--collective-timeout must be a finite number, got nan" in capsys.readouterr().err


def test_monarch_run_takes_every_setting_with_its_docstring_and_default():
    from monarch_plugin.tools.cli import build_parser, config_from_args

    parser = build_parser()
    assert config_from_args(parser.parse_args(["x.py"])) == ElasticConfig()
    text = " ".join(parser.format_help().split())
    for name, doc in field_docs().items():
        if name != "env":  # the workers' environment is the caller's own, as under torchrun
            assert cli_flag(name) in text and " ".join(doc.split()[:4]) in text, name
    ns = parser.parse_args(["--join-timeout", "12", "--backend", "gloo", "--batch-policy", "constant_local",
                            "--scale-lr-with-replicas", "train.py", "--lr", "3"])
    config = config_from_args(ns)
    assert (config.join_timeout_s, config.backend, config.scale_lr_with_replicas) == (12.0, "gloo", True)
    assert (ns.target, ns.args) == ("train.py", ["--lr", "3"])
    # A setting on unless told otherwise is turned off by --no-<flag>; one with an automatic choice by either.
    assert config_from_args(parser.parse_args(["--no-requeue", "x.py"])).requeue is False
    assert config_from_args(parser.parse_args(["--no-slurm", "x.py"])).slurm is False


@pytest.mark.parametrize(
    "args, message",
    [
        (["--replicas", "2", "--min-replicas", "3", "x.py"], "lower --min-replicas or raise --max-replicas"),
        (["--replicas", "0", "x.py"], "--replicas must be a positive integer"),
        (["--replicas", "2", "does_not_exist.py"], "training script 'does_not_exist.py' not found"),
        (["--replicas", "2", "-m", "no_such_module_here"], "module 'no_such_module_here' not found"),
        (["--replicas", "2", "--fault", "boom:step=1", "x.py"], "unknown fault mode"),
        (["--backend", "mpi", "x.py"], "invalid choice: 'mpi'"),
    ],
)
def test_cli_rejects_bad_input_before_spawning(tmp_path, monkeypatch, capsys, args, message):
    from monarch_plugin.tools.cli import main

    (tmp_path / "x.py").write_text("print('never runs')\n")
    monkeypatch.chdir(tmp_path)
    try:
        code = main(["--events", "ev.jsonl", *args])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "ev.jsonl").exists()  # nothing was spawned, not even the store


def test_monarch_run_command_exits_2_naming_the_fix(tmp_path):
    """The installed entry point, as a user's shell runs it (the cases above call its `main` in this process)."""
    result = subprocess.run([sys.executable, "-m", "monarch_plugin.tools.cli", "--replicas", "2", "missing.py"],
                            capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 2 and "training script 'missing.py' not found" in result.stderr
