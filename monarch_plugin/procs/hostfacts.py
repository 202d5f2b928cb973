"""What a host says of itself and what is wrong with it: the facts behind `monarch-plugin doctor` and a run's
check of each host it attaches (`hosts.preflight`).

`report` runs on the host (in its watcher or the doctor's probe, `watcher.Probe`): versions, paths it cannot see,
whether the controller's store answers, its backend and GPUs, the interface it reaches the controller by.
`findings` compares one report with this machine's, pure, each finding an error (a run would fail, or train
wrongly) or a warning, naming its fix; `format_table` draws the hosts' rows. Nothing here attaches to a host or
starts anything.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import time
from dataclasses import dataclass, field

from monarch_plugin.net import parse_host

__all__ = ["Finding", "HostCheck", "clock_offset", "findings", "format_table", "ifname_allows", "mixed_kinds",
           "report", "unreached"]

CORE = ("torch", "torchmonarch", "monarch-plugin")
"""What every host needs, at this machine's version (its public part: a `+cpu` controller may run `+cu130` hosts)."""
FRAMEWORKS = ("lightning", "transformers", "torchtitan")
"""Needed where the training code imports them, at this machine's version: a host that lacks one is a warning."""
PACKAGES = CORE + FRAMEWORKS

CLOCK_WARN_S = 1.0
"""A host's clock this far from the controller's: the run works (it times nothing across machines), but the
events' and logs' timestamps of different hosts no longer line up."""

IFNAME_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


@dataclass(frozen=True)
class Finding:
    severity: str
    """`error`: a run would fail or train wrongly on this host; `warning`: it would run, with what is said."""
    message: str
    """What is wrong, and the fix."""


@dataclass
class HostCheck:
    """One host's row: its address, what it reported (None: unreachable) and what is wrong with it."""

    address: str
    report: dict | None = None
    offset_s: float | None = None
    """The host's clock minus this machine's, halfway through the call that read it."""
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(f.severity == "error" for f in self.findings)


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _source_address(ip: str) -> str | None:
    """This machine's address on the interface that routes to `ip` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def _interface_of(address: str | None) -> str | None:
    """The name of the interface holding `address` (Linux: from the kernel's interface list), or None."""
    if address is None:
        return None
    import fcntl
    import struct

    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    return None


def _gpus() -> list[dict]:
    """Each visible GPU's name, memory and the memory other processes hold on it (`torch.cuda.mem_get_info`, which
    makes a CUDA context on each: only the doctor's short-lived probe asks, never a run's watcher)."""
    import torch

    found = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        found.append({"name": torch.cuda.get_device_name(i), "total_gib": round(total / 2**30, 1),
                      "used_gib": round((total - free) / 2**30, 1)})
    return found


def report(paths: list[str], store_host: str, store_port: int, gpus: bool = False) -> dict:
    """What this machine says of itself for the doctor (run on each host): versions, which of `paths` it does not
    see, whether the controller's store port answers, its backend (and with `gpus`, each GPU's memory in use), and
    the interface it would reach the controller by."""
    import torch

    from monarch_plugin.backend import accelerator_kind

    try:
        with socket.create_connection((store_host, store_port), timeout=3.0):
            store = None
    except OSError as e:
        store = f"{type(e).__name__}: {e}"
    kind = accelerator_kind()
    source = _source_address(store_host)
    return {
        "hostname": socket.gethostname(), "python": platform.python_version(),
        "packages": {name: _version(name) for name in PACKAGES},
        "missing": [p for p in paths if not os.path.exists(p)], "store_error": store,
        "kind": kind, "devices": torch.cuda.device_count(),
        "nccl": kind != "cpu" and torch.distributed.is_nccl_available(),
        "gpus": _gpus() if gpus and kind != "cpu" else [],
        "source": source, "interface": _interface_of(source),
        "ifnames": {name: os.environ[name] for name in IFNAME_VARS if name in os.environ},
    }


def _public(version: str | None) -> str | None:
    return version.split("+")[0] if version else None


def findings(local: dict, remote: dict, offset_s: float, store: str) -> list[Finding]:
    """What is wrong with a host, from its `report` against this machine's (`local`): pure, so each rule is tested
    alone. `store` is the address:port the host was asked to reach."""
    if "packages" not in remote:  # a watcher of an older monarch-plugin, whose report has none of this
        return [Finding("error", f"another monarch-plugin there, {local['packages']['monarch-plugin']} here: "
                                 f"install monarch-plugin=={local['packages']['monarch-plugin']} there")]
    out = []
    for name in remote["missing"]:
        out.append(Finding("error", f"{name} not found there: the script, working directory, events and checkpoint "
                                    "directories must be at the same paths on every host (mount the shared "
                                    "filesystem there)"))
    if remote["python"].rsplit(".", 1)[0] != local["python"].rsplit(".", 1)[0]:
        out.append(Finding("error", f"Python {remote['python']} there, {local['python']} here: the controller "
                                    "sends pickled code and state; install the same Python minor version"))
    for name in PACKAGES:
        mine, theirs = local["packages"].get(name), remote["packages"].get(name)
        if not mine or _public(mine) == _public(theirs):
            continue  # what this machine lacks, its training code does not import here either
        says = f"{name} {theirs or 'missing'} there, {mine} here: install {name}=={_public(mine)} there"
        if theirs or name in CORE:
            out.append(Finding("error", says))
        else:
            out.append(Finding("warning", f"{says} if the training code imports it"))
    if remote["store_error"]:
        out.append(Finding("error", f"the controller's store port ({store}) cannot be reached from there "
                                    f"({remote['store_error']}): open this machine's TCP ports to the host (a "
                                    "run's store takes a free port), or set `store_host` to an address it reaches"))
    if abs(offset_s) > CLOCK_WARN_S:
        out.append(Finding("warning", f"its clock is {offset_s:+.1f} s from this machine's: events and logs of "
                                      "different hosts will not line up; run NTP/chrony there"))
    if remote["kind"] != "cpu" and not remote["nccl"]:
        out.append(Finding("error", "its torch has no NCCL (RCCL on ROCm): install a CUDA or ROCm build of torch"))
    busy = [f"GPU {i} ({g['used_gib']} of {g['total_gib']} GiB)" for i, g in enumerate(remote["gpus"])
            if g["used_gib"] > 0.1 * g["total_gib"]]
    if busy:
        out.append(Finding("warning", f"memory in use by other processes on {', '.join(busy)}: another job may hold "
                                      "these GPUs; narrow the agent's CUDA_VISIBLE_DEVICES/HIP_VISIBLE_DEVICES"))
    for name, value in remote["ifnames"].items():
        if remote["interface"] and not ifname_allows(name, value, remote["interface"]):
            out.append(Finding("warning", f"{name}={value} there, but it reaches this machine by "
                                          f"{remote['interface']}: set {name}={remote['interface']}, or unset it"))
    return out


def mixed_kinds(checks: list[HostCheck]) -> None:
    """GPU and CPU hosts in one job: each worker resolves `backend auto` for itself, so they would not agree. A
    warning on each host of a kind other than the most common one."""
    kinds = [c.report["kind"] for c in checks if c.report]
    common = max(set(kinds), key=kinds.count) if kinds else None
    for c in checks:
        if c.report and c.report["kind"] != common:
            c.findings.append(Finding("warning", f"{c.report['kind']} there, {common} on the other hosts: keep a "
                                                 "run's hosts all GPU or all CPU (`backend auto` is chosen per host)"))


def ifname_allows(variable: str, value: str, interface: str) -> bool:
    """Whether `variable`=`value` lets a process's traffic use `interface`. NCCL_SOCKET_IFNAME: a comma-separated
    list of name prefixes, `=` before it for exact names, `^` to exclude those instead; GLOO_SOCKET_IFNAME: exact
    names."""
    if variable == "GLOO_SOCKET_IFNAME":
        return interface in [v.strip() for v in value.split(",")]
    exclude = value.startswith("^")
    value = value.lstrip("^")
    exact = value.startswith("=")
    names = [v.strip() for v in value.lstrip("=").split(",") if v.strip()]
    hit = any(interface == n if exact else interface.startswith(n) for n in names)
    return hit != exclude


def clock_offset(probe) -> float:
    """The host's clock minus this machine's: the reading of the quickest of three calls, against its midpoint."""
    samples = []
    for _ in range(3):
        t0 = time.time()
        remote = probe.clock.call_one().get(timeout=10)
        t1 = time.time()
        samples.append((t1 - t0, remote - (t0 + t1) / 2))
    return min(samples)[1]


def unreached(address: str, store_host: str, error: Exception) -> str:
    """Why an attach failed, and its fix. Monarch's channels run both ways: the controller connects to the agent, and
    the host's procs connect back to this machine. A host whose agent port answers a plain connect, but whose attach
    still failed, cannot open connections to this machine (a firewall here, or on the way back)."""
    try:
        socket.create_connection(parse_host(address), timeout=3.0).close()
    except OSError:
        return (f"unreachable ({type(error).__name__}): start `monarch-plugin host --address {address}` there, on the "
                "address this machine reaches it by")
    return (f"its agent answers, but the attach failed ({type(error).__name__}): the host cannot open connections "
            f"back to this machine, where Monarch and a run's store listen on free ports of {store_host}: open this "
            "machine's TCP ports to the host (a firewall?), or set `store_host` to an address it reaches")


def format_table(checks: list[HostCheck]) -> list[str]:
    """One row per host (reachable, versions, clock, store, backend, interface), then each finding with its fix."""
    head = ("host", "status", "hostname", "python", "torch", "torchmonarch", "clock", "store", "backend", "interface")
    rows = [head]
    for c in checks:
        r = c.report
        status = "ok" if not c.findings else ("ERROR" if not c.ok else "warning")
        if r is None:
            rows.append((c.address, status, *["-"] * (len(head) - 2)))
            continue
        backend = r["kind"] if r["kind"] == "cpu" else f"{r['kind']} x{r['devices']}"
        rows.append((c.address, status, r["hostname"], r["python"], r["packages"]["torch"] or "missing",
                     r["packages"]["torchmonarch"] or "missing", f"{c.offset_s:+.2f}s",
                     "reached" if not r["store_error"] else "UNREACHABLE", backend,
                     f"{r['interface'] or '?'} ({r['source']})"))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    lines = ["  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
    for c in checks:
        lines += [f"{c.address}: {f.severity}: {f.message}" for f in c.findings]
    return lines
