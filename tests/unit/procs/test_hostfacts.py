"""`hostfacts.findings` and `ifname_allows`: each rule of the host check alone, on reports as hosts send them."""

from __future__ import annotations

import pytest

from monarch_plugin.procs.hostfacts import Finding, HostCheck, findings, format_table, ifname_allows, mixed_kinds

STORE = "10.0.0.1:40000"


def _report(**changes) -> dict:
    report = {"hostname": "n1", "python": "3.11.7", "missing": [], "store_error": None, "kind": "cpu", "devices": 0,
              "nccl": False, "gpus": [], "source": "10.0.0.2", "interface": "eth0", "ifnames": {},
              "packages": {"torch": "2.13.0", "torchmonarch": "0.7.0", "monarch-plugin": "0.1.0", "lightning": "2.6.6",
                           "transformers": None, "torchtitan": None}}
    for key, value in changes.items():
        if key == "packages":
            report["packages"] = {**report["packages"], **value}
        else:
            report[key] = value
    return report


def test_a_host_like_this_one_has_nothing_to_say():
    assert findings(_report(), _report(), 0.05, STORE) == []


def test_each_problem_is_an_error_or_a_warning_naming_its_fix():
    local = _report()
    cases = {
        "missing": (_report(missing=["/shared/train.py"]), "error", "/shared/train.py not found there"),
        "python": (_report(python="3.12.1"), "error", "install the same Python minor version"),
        "version": (_report(packages={"torch": "2.12.0"}), "error", "install torch==2.13.0 there"),
        "core": (_report(packages={"torchmonarch": None}), "error", "torchmonarch missing there, 0.7.0 here"),
        "framework": (_report(packages={"lightning": "2.5.0"}), "error", "install lightning==2.6.6 there"),
        "absent": (_report(packages={"lightning": None}), "warning",
                   "lightning missing there, 2.6.6 here: install lightning==2.6.6 there if the training code imports"),
        "old": ({"missing": [], "kind": "cpu"}, "error", "another monarch-plugin there, 0.1.0 here"),
        "store": (_report(store_error="ConnectionRefusedError"), "error", "open this machine's TCP ports"),
        "nccl": (_report(kind="cuda", nccl=False), "error", "install a CUDA or ROCm build of torch"),
        "busy": (_report(kind="cuda", nccl=True, gpus=[{"name": "H100", "total_gib": 80.0, "used_gib": 40.0}]),
                 "warning", "GPU 0 (40.0 of 80.0 GiB)"),
        "ifname": (_report(ifnames={"NCCL_SOCKET_IFNAME": "ib0"}), "warning", "set NCCL_SOCKET_IFNAME=eth0"),
    }
    for name, (remote, severity, words) in cases.items():
        found = [f for f in findings(local, remote, 0.0, STORE) if f.severity == severity and words in f.message]
        assert found, (name, findings(local, remote, 0.0, STORE))
    assert findings(local, _report(python="3.11.9"), 0.0, STORE) == []  # a patch release is the same Python
    # A CPU controller may launch on GPU hosts: the same torch, another build; what it lacks, it does not need.
    gpu_host = _report(kind="cuda", nccl=True, devices=8, packages={"torch": "2.13.0+cu130", "torchtitan": "0.3.0"})
    assert findings(_report(packages={"torch": "2.13.0+cpu"}), gpu_host, 0.0, STORE) == []
    clock = findings(local, _report(), -2.5, STORE)
    assert clock == [Finding("warning", "its clock is -2.5 s from this machine's: events and logs of different "
                                        "hosts will not line up; run NTP/chrony there")]


@pytest.mark.parametrize("variable, value, interface, allowed", [
    ("NCCL_SOCKET_IFNAME", "eth", "eth0", True), ("NCCL_SOCKET_IFNAME", "eth0,ib", "ib1", True),
    ("NCCL_SOCKET_IFNAME", "ib", "eth0", False), ("NCCL_SOCKET_IFNAME", "=eth", "eth0", False),
    ("NCCL_SOCKET_IFNAME", "=eth0", "eth0", True), ("NCCL_SOCKET_IFNAME", "^docker,lo", "eth0", True),
    ("NCCL_SOCKET_IFNAME", "^eth", "eth0", False), ("NCCL_SOCKET_IFNAME", "^=eth", "eth0", True),
    ("GLOO_SOCKET_IFNAME", "eth", "eth0", False), ("GLOO_SOCKET_IFNAME", "eth0", "eth0", True),
])
def test_socket_ifname_follows_each_librarys_syntax(variable, value, interface, allowed):
    """NCCL takes prefixes, `=` for exact names, `^` to exclude; gloo exact names only."""
    assert ifname_allows(variable, value, interface) is allowed


def test_gpu_and_cpu_hosts_in_one_job_warn_on_the_odd_ones():
    checks = [HostCheck(f"tcp://10.0.0.{i}:26600", _report(kind="cuda", nccl=True, devices=8), 0.0) for i in (2, 3)]
    checks.append(HostCheck("tcp://10.0.0.4:26600", _report(), 0.0))
    checks.append(HostCheck("tcp://10.0.0.5:26600", None))
    mixed_kinds(checks)
    assert [len(c.findings) for c in checks] == [0, 0, 1, 0]
    assert checks[2].findings[0].message.startswith("cpu there, cuda on the other hosts")


def test_the_table_has_a_row_per_host_and_each_finding_below_it():
    sound = HostCheck("tcp://10.0.0.2:26600", _report(), 0.01)
    broken = HostCheck("tcp://10.0.0.3:26600", None, None, [Finding("error", "unreachable (TimeoutError): start it")])
    lines = format_table([sound, broken])
    assert lines[0].split()[:2] == ["host", "status"]
    assert lines[1].split()[:3] == ["tcp://10.0.0.2:26600", "ok", "n1"] and "eth0 (10.0.0.2)" in lines[1]
    assert lines[2].split()[:3] == ["tcp://10.0.0.3:26600", "ERROR", "-"]
    assert lines[3] == "tcp://10.0.0.3:26600: error: unreachable (TimeoutError): start it"
