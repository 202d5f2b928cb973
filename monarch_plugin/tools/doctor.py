"""`monarch-plugin doctor`: the hosts of a multi-host job checked before a run, one row per host.

    monarch-plugin doctor --hosts tcp://10.0.0.2:26600,tcp://10.0.0.3:26600 [--script train.py] [--dir DIR ...]
    monarch-plugin doctor --hosts-file /shared/run1/hosts [--token-file /shared/run1/token]

A multi-node run otherwise fails late and far from the cause: a host that lacks the script's path, runs another
torch, has its clock far off, cannot reach the controller's store, or has its GPUs held by another job. The doctor
attaches to each host's agent (`monarch-plugin host`) as a run would, spawns one proc there that reports on its
machine (`hostfacts.report`, run there by `procs.watcher.Probe`), and compares each report with this machine's
(`hostfacts.findings`, pure). Each finding is an error (a run would fail, or train wrongly) or a warning, and names its fix;
the exit status is 1 on any error, 0 otherwise. A run does the same as it attaches each host (`preflight`): its
watcher is a `Probe` too. The store check listens on `store_host` (this machine's address on the job's network, as a
run's store does) for the doctor's time only, and each host connects to it.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import threading
import time

from monarch_plugin.procs.hostfacts import Finding, HostCheck, clock_offset, findings, format_table, mixed_kinds, \
    report, unreached

__all__ = ["check_hosts", "main"]


def _probe(index: int, check: HostCheck, paths: list[str], store_host: str, store_port: int, timeout: float,
           local: dict) -> None:
    from monarch.actor import attach_to_workers

    from monarch_plugin.procs.watcher import Probe

    try:
        mesh = attach_to_workers(workers=[check.address], ca="trust_all_connections", name=f"doctor{index}")
        mesh.initialized.get(timeout=timeout)
        procs = mesh.spawn_procs(per_host={"procs": 1}, name=f"doctor{index}_procs")
        probe = procs.spawn(f"doctor{index}", Probe)
        machine = probe.report.call_one(paths, store_host, store_port, True).get(timeout=timeout)
        offset = clock_offset(probe)
    except Exception as e:  # noqa: BLE001 - an agent that cannot be reached is this host's finding
        check.findings.append(Finding("error", unreached(check.address, store_host, e)))
        return
    check.report, check.offset_s = machine, offset
    check.findings.extend(findings(local, machine, offset, f"{store_host}:{store_port}"))
    try:
        procs.stop().get(timeout=timeout)
    except Exception:  # noqa: BLE001 - the agent ends what this controller started when it leaves anyway
        pass


def check_hosts(addresses: list[str], paths: list[str], store_host: str, timeout: float = 30.0) -> list[HostCheck]:
    """Attach to every host at once and check it; a row per address, in their order."""
    from monarch.actor import enable_transport

    enable_transport(f"tcp://{store_host}:0")  # before any other Monarch call, as a run does
    with socket.socket(socket.AF_INET6 if ":" in store_host else socket.AF_INET) as listener:
        listener.bind((store_host, 0))  # where a run's store would listen, for the doctor's time only
        listener.listen(64)
        port = listener.getsockname()[1]
        local = report(paths, store_host, port)
        checks = [HostCheck(a) for a in addresses]
        threads = [threading.Thread(target=_probe, args=(i, c, paths, store_host, port, timeout, local), daemon=True)
                   for i, c in enumerate(checks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout + 45)  # attach, report, three clock calls (10 s each at most)
    for c in checks:
        if c.report is None and not c.findings:
            c.findings.append(Finding("error", "no answer in time (attached, then silent): see its agent's log"))
    mixed_kinds(checks)
    return checks


def _listed(ns) -> list[str]:
    """The addresses given by `--hosts` and `--hosts-file` (admitted as a run admits them)."""
    from monarch_plugin.procs.admission import check_hosts_file, read_hosts_file, read_token

    addresses = [a for a in (ns.hosts or "").split(",") if a]
    if ns.hosts_file:
        check_hosts_file(ns.hosts_file)
        listed, refused = read_hosts_file(ns.hosts_file, read_token(ns.token_file) if ns.token_file else None)
        for line, _, why in refused:
            print(f"monarch-plugin doctor: {ns.hosts_file}: {line!r} not admitted: {why}")
        addresses += listed
    return list(dict.fromkeys(addresses))


def main(ns) -> int:
    """`monarch-plugin doctor`, from its parsed arguments. With no hosts given, in a SLURM batch script of two or
    more nodes: an agent started on each node as a run starts them (`procs.slurm`), checked, then stopped."""
    from monarch_plugin.config import in_slurm_allocation
    from monarch_plugin.net import route_address, wildcard
    from monarch_plugin.errors import ConfigError

    paths = [os.path.abspath(p) for p in [*(ns.dir or []), *([ns.script] if ns.script else [])]] or [os.getcwd()]
    agents = None
    try:
        missing_here = [p for p in paths if not os.path.exists(p)]
        if missing_here:
            raise ConfigError(f"{', '.join(missing_here)} not found on this machine", "script")
        addresses = _listed(ns)
        if not addresses and in_slurm_allocation(os.environ):
            agents, addresses = _slurm_agents(ns.timeout)
        if not addresses:
            raise ConfigError("no hosts to check: give `--hosts tcp://IP:PORT,...` or `--hosts-file PATH`, or run it "
                              "in a SLURM batch script of two or more nodes", "hosts")
        store_host = ns.store_host or route_address(addresses[0])
        if wildcard(store_host):
            raise ConfigError(f"--store-host {store_host} is a wildcard address: give this machine's IP on the "
                              "network the hosts share, or leave it unset", "store_host")
        t0 = time.monotonic()
        checks = check_hosts(addresses, paths, store_host, ns.timeout)
    except (ConfigError, OSError) as e:
        print(f"monarch-plugin doctor: error: {e}", file=sys.stderr)
        return 2
    finally:
        if agents is not None:
            agents.stop()
            shutil.rmtree(agents.dir, ignore_errors=True)
    print("\n".join(format_table(checks)))
    bad = sum(not c.ok for c in checks)
    print(f"monarch-plugin doctor: {len(checks)} host(s) checked in {time.monotonic() - t0:.1f} s from {store_host}: "
          + (f"{bad} with errors" if bad else "no errors"))
    return 1 if bad else 0


def _slurm_agents(timeout: float):
    """An agent on each node of this SLURM allocation (their hosts file and token in a folder of the working
    directory, which the nodes share), and the addresses of those that started."""
    from pathlib import Path

    from monarch_plugin.procs import slurm

    allocation = slurm.Allocation.from_env()
    where = Path(f"monarch-doctor-{allocation.job_id}").absolute()
    agents = slurm.Agents(allocation, str(where / "hosts"), str(where / "token"))
    agents.prepare()
    agents.start()
    try:
        agents.wait_listed(timeout)
    except BaseException:
        agents.stop()
        shutil.rmtree(agents.dir, ignore_errors=True)
        raise
    return agents, [allocation.agent(node) for node in allocation.nodes]
