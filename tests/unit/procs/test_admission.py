"""Hosts admitted before contact (`admission`, `procs.hosts`): a hosts file that others may write is refused, and with
the job's token a line is admitted only if it carries the HMAC of its address under it. The e2e half (a run on real
host agents that never contacts a refused line's address) is in tests/e2e/test_multihost.py."""

from __future__ import annotations

import os
import queue
import stat
import subprocess
import sys

import pytest

from monarch_plugin import ConfigError, ElasticConfig
from monarch_plugin.procs.admission import (admit, check_hosts_file, host_line, hosts_file_unsafe, make_token, read_token,
                                      sign)
from monarch_plugin.events import read_events

pytestmark = pytest.mark.timeout(60)

A, B = "tcp://10.0.0.2:26600", "tcp://10.0.0.3:26600"
TOKEN, OTHER = b"a" * 64, b"b" * 64


def test_a_line_with_its_addresss_hmac_under_the_token_is_admitted_and_any_other_refused():
    assert admit(host_line(A, TOKEN), TOKEN) == (A, None)
    assert admit(f"  {host_line(B, TOKEN)}  ", TOKEN) == (B, None)
    assert host_line(A, TOKEN) == f"{A} hmac={sign(TOKEN, A)}" and sign(TOKEN, A) != sign(TOKEN, B)
    refused = {
        "no HMAC": (A, TOKEN),
        "another token's": (host_line(A, OTHER), TOKEN),
        "another address's": (f"{A} hmac={sign(TOKEN, B)}", TOKEN),
        "upper-case hex": (f"{A} hmac={sign(TOKEN, A).upper()}", TOKEN),
        "truncated": (host_line(A, TOKEN)[:-2], TOKEN),
    }
    for what, (line, token) in refused.items():
        address, why = admit(line, token)
        assert address == A and why, what
    assert "carries no HMAC" in admit(A, TOKEN)[1] and "does not verify" in admit(host_line(A, OTHER), TOKEN)[1]


def test_without_a_token_every_well_formed_line_is_admitted_and_a_malformed_one_never():
    assert admit(A, None) == (A, None)
    assert admit(host_line(A, TOKEN), None) == (A, None)  # an agent given a token, a run without: trusted as before
    assert admit("10.0.0.2:26600", None)[0] is None and "not a host agent address" in admit("10.0.0.2:26600", None)[1]
    assert "wildcard" in admit("tcp://0.0.0.0:26600", TOKEN)[1]
    for line in (f"{A} extra", f"{A} hmac=00 hmac=11"):
        assert admit(line, None)[0] == A and "unexpected" in admit(line, None)[1]


def test_the_token_is_made_once_readable_by_its_user_only_and_a_wider_one_is_refused(tmp_path):
    path = str(tmp_path / "token")
    with pytest.raises(ConfigError, match=rf"`token_file` {path} does not exist: .*`monarch-plugin token {path}`"):
        read_token(path)
    assert make_token(path) is True
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    token = read_token(path)
    assert len(token) == 64 and int(token, 16)
    assert make_token(path) is False and read_token(path) == token  # made once: kept, not replaced
    os.chmod(path, 0o640)
    with pytest.raises(ConfigError, match=rf"readable by group or others \(mode 640\).*`chmod 600 {path}`") as raised:
        read_token(path)
    assert raised.value.field == "token_file"
    with pytest.raises(ConfigError, match="chmod 600"):
        make_token(path)  # an existing token file is checked, never overwritten
    short = tmp_path / "short"
    short.write_text("secret\n")
    short.chmod(0o600)
    with pytest.raises(ConfigError, match="holds no token"):
        read_token(str(short))


def test_a_hosts_file_others_may_write_or_owned_by_another_user_is_refused_naming_the_fix(tmp_path):
    path = tmp_path / "hosts"
    check_hosts_file(str(path))  # not there yet: the agents make it
    path.write_text(A + "\n")
    path.chmod(0o644)
    check_hosts_file(str(path))
    assert hosts_file_unsafe(os.stat(path), str(path)) is None
    for mode, writers in ((0o664, "group"), (0o646, "others"), (0o666, "group and others")):
        path.chmod(mode)
        with pytest.raises(ConfigError, match=rf"is writable by {writers} \(mode {mode:o}\).*`chmod go-w {path}`"):
            check_hosts_file(str(path))
    path.chmod(0o644)
    why = hosts_file_unsafe(os.stat(path), str(path), uid=os.geteuid() + 4242)
    assert "not by this run's user" in why and "chown" in why
    assert "is not a file" in hosts_file_unsafe(os.stat(tmp_path), str(tmp_path))


def _hosts(tmp_path, **settings):
    from monarch_plugin.events import EventLog
    from monarch_plugin.procs.hosts import Hosts

    config = ElasticConfig(hosts_file=str(tmp_path / "hosts"), events_path=str(tmp_path / "events.jsonl"),
                           **settings)
    return Hosts(config, EventLog(config.events_path, "controller"), queue.Queue(), [], [])


def test_the_controller_refuses_an_unsafe_hosts_file_or_token_before_anything_is_spawned(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text(A + "\n")
    hosts.chmod(0o666)
    with pytest.raises(ConfigError, match="chmod go-w") as raised:
        _hosts(tmp_path)
    assert raised.value.field == "hosts_file"
    hosts.chmod(0o644)
    with pytest.raises(ConfigError, match="monarch-plugin token") as raised:
        _hosts(tmp_path, token_file=str(tmp_path / "token"))
    assert raised.value.field == "token_file"
    assert not (tmp_path / "events.jsonl").exists()


def test_the_hosts_file_as_read_mid_run_lists_only_the_admitted_lines_and_reports_each_refusal_once(tmp_path):
    token_file = tmp_path / "token"
    make_token(str(token_file))
    token = read_token(str(token_file))
    hosts = tmp_path / "hosts"
    hosts.write_text("")
    run = _hosts(tmp_path, token_file=str(token_file))
    forged = f"{B} hmac={sign(OTHER, B)}"
    hosts.write_text(f"{host_line(A, token)}\n{B}\n{forged}  # appended by someone without the token\n\n")
    for _ in range(3):  # re-read every second: each refusal reported once
        assert run._listed() == [A]
    refused = [e for e in read_events(str(tmp_path / "events.jsonl")) if e["event"] == "host_refused"]
    assert [(e["address"], e["line"]) for e in refused] == [(B, B), (B, forged)], refused
    assert "carries no HMAC" in refused[0]["reason"] and "does not verify" in refused[1]["reason"]
    hosts.chmod(0o664)  # made writable by group mid-run: refused whole, with an event, not an exception
    assert run._listed() == [] and run._listed() == []
    [whole] = [e for e in read_events(str(tmp_path / "events.jsonl")) if e["event"] == "host_refused"][2:]
    assert whole["line"] is None and "chmod go-w" in whole["reason"]
    hosts.chmod(0o644)
    assert run._listed() == [A]


def _plugin(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "monarch_plugin", *args], capture_output=True, text=True,
                          timeout=60, cwd=cwd)


def test_monarch_plugin_token_makes_the_token_once_and_the_agent_refuses_a_token_it_cannot_trust(tmp_path):
    done = _plugin("token", "token", cwd=tmp_path)
    assert done.returncode == 0 and "wrote a new token to token" in done.stdout, done.stderr
    token = (tmp_path / "token").read_text()
    again = _plugin("token", "token", cwd=tmp_path)
    assert again.returncode == 0 and "kept the token" in again.stdout and (tmp_path / "token").read_text() == token
    printed = _plugin("token", "-", cwd=tmp_path)
    assert printed.returncode == 0 and len(printed.stdout.strip()) == 64
    (tmp_path / "token").chmod(0o644)
    for args, message in (
        (("--hosts-file", "hosts", "--token-file", "token"), "--token-file token is readable by group or others"),
        (("--token-file", "token"), "--token-file signs the line this agent appends to --hosts-file"),
        (("--hosts-file", "hosts", "--token-file", "missing"), "monarch-plugin token missing"),
    ):
        refused = _plugin("host", "--address", "tcp://127.0.0.1:1", *args, cwd=tmp_path)
        assert refused.returncode == 2 and message in refused.stderr, refused.stderr
    assert not (tmp_path / "hosts").exists()


def test_monarch_run_refuses_a_hosts_file_others_may_write_naming_its_flag_and_the_fix(tmp_path, monkeypatch, capsys):
    from monarch_plugin.tools.cli import main

    (tmp_path / "x.py").write_text("print('never runs')\n")
    (tmp_path / "hosts").write_text(A + "\n")
    (tmp_path / "hosts").chmod(0o666)
    monkeypatch.chdir(tmp_path)
    assert main(["--events", "ev.jsonl", "--hosts-file", "hosts", "x.py"]) == 2
    err = capsys.readouterr().err
    assert "error: --hosts-file hosts is writable by group and others (mode 666)" in err and "chmod go-w hosts" in err
    assert (tmp_path / "ev.jsonl").read_text() == ""  # held, and not one event: nothing was spawned
