"""Emulated hosts on one machine: one network namespace per host, joined by veth pairs to a
bridge in its own namespace, links rate-limited with tc, and mpirun (or horovodrun --gloo)
driven through an rsh agent (an ssh stand-in) that does ``ip netns exec``.  Needs root
(CAP_NET_ADMIN).

Traffic stays inside the namespaces made here: hosts get addresses in SUBNET on their own
veth, the bridge has no address and no uplink, so nothing can reach any other network.
Everything is torn down on exit, also after an error.

    with EmulatedHosts(3, rate="1gbit") as hosts:
        hosts.mpirun(["python", "worker.py"], ranks_per_host=1, timeout=300)
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

SUBNET = "10.231.7"  # /24, only ever assigned inside namespaces created here
PREFIX = "gq"


ROOT_NEEDED = ("emulated hosts need root (network namespaces and tc): run as root, e.g. with "
               "sudo, or in a container started with --cap-add NET_ADMIN")


def require_root() -> None:
    if os.geteuid() != 0:
        sys.exit(ROOT_NEEDED)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class EmulatedHosts:
    """``n`` hosts ``10.231.7.1 ..`` in namespaces ``gq<id>h0 ..``; ``rate`` like ``1gbit``
    (None: unthrottled), ``delay`` like ``0.1ms`` for added one-way latency."""

    def __init__(self, n: int, rate: str | None = "1gbit", delay: str | None = None,
                 burst: str = "1mb") -> None:
        self.n, self.rate, self.delay, self.burst = n, rate, delay, burst
        self.tag = uuid.uuid4().hex[:6]
        self.bridge_ns = f"{PREFIX}{self.tag}br"
        self.hosts = [f"{PREFIX}{self.tag}h{i}" for i in range(n)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(n)]
        self._tmp = tempfile.TemporaryDirectory(prefix="gq-hosts-")
        self._etc: list[Path] = []  # /etc/netns/<host> folders made by horovodrun()
        self._etc_made: set[Path] = set()  # /etc/netns itself, when horovodrun() made it

    def __enter__(self) -> EmulatedHosts:
        if os.geteuid() != 0:
            raise PermissionError(ROOT_NEEDED)
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self) -> None:
        _ip("netns", "add", self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        for i, (ns, addr) in enumerate(zip(self.hosts, self.addresses)):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "add", f"{PREFIX}{self.tag}{i}a", "netns", ns, "type", "veth",
                "peer", "name", f"{PREFIX}{self.tag}{i}b", "netns", self.bridge_ns)
            _ip("-n", ns, "link", "set", f"{PREFIX}{self.tag}{i}a", "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", self.bridge_ns, "link", "set", f"{PREFIX}{self.tag}{i}b", "master", "br0")
            _ip("-n", self.bridge_ns, "link", "set", f"{PREFIX}{self.tag}{i}b", "up")
            self._shape(ns)

    def _shape(self, ns: str) -> None:
        if self.rate is None and self.delay is None:
            return
        cmd = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root"]
        if self.delay:
            cmd += ["netem", "delay", self.delay]
            if self.rate:
                cmd += ["rate", self.rate]
        else:
            cmd += ["tbf", "rate", self.rate, "burst", self.burst, "latency", "100ms"]
        subprocess.run(cmd, check=True, capture_output=True, text=True)

    def close(self) -> None:
        for ns in [*self.hosts, self.bridge_ns]:
            kill = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in kill.stdout.split():
                subprocess.run(["kill", "-9", pid], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for path in self._etc:  # our /etc/netns/<host> folders, then /etc/netns if ours
            shutil.rmtree(path, ignore_errors=True)
            if path.parent in self._etc_made and not any(path.parent.iterdir()):
                path.parent.rmdir()
        self._tmp.cleanup()

    def agent(self) -> str:
        """An rsh agent for mpirun, and ssh for horovodrun: ``agent [-o opt].. <host-address>
        [-o opt | -p port | -i file].. <command...>`` runs the command in that host's
        namespace (ssh's options, which horovodrun passes, are skipped)."""
        path = Path(self._tmp.name) / "netns-rsh"
        cases = "\n".join(f"  {a}) ns={h} ;;" for a, h in zip(self.addresses, self.hosts))
        path.write_text(
            "#!/bin/sh\n"
            "while [ \"$1\" = -o ]; do shift 2; done\n"
            "host=$1; shift\n"
            "while [ \"$1\" = -o ] || [ \"$1\" = -p ] || [ \"$1\" = -i ]; do shift 2; done\n"
            "case $host in\n"
            f"{cases}\n"
            "  *) echo \"netns-rsh: unknown emulated host $host\" >&2; exit 1 ;;\n"
            "esac\n"
            "exec ip netns exec $ns sh -c \"$*\"\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
        return str(path)

    def horovodrun(self, command: list[str], ranks_per_host: int = 1, timeout: float = 600,
                   env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run ``command`` on every host with ``horovodrun --gloo`` (Horovod's Gloo
        controller, no MPI), started from host 0's namespace over the emulated links only.

        horovodrun reaches remote hosts with ``ssh``: :meth:`agent`, first on PATH as
        ``ssh``, runs the command in the host's namespace instead.  Gloo binds to the address
        the hostname resolves to, 127.0.0.1 in every namespace by default; ``ip netns exec``
        mounts ``/etc/netns/<host>/hosts`` over /etc/hosts, and those files (removed on exit)
        give each host's hostname its own address."""
        shim = Path(self._tmp.name) / "ssh-shim"
        shim.mkdir(exist_ok=True)
        if not (shim / "ssh").exists():
            (shim / "ssh").symlink_to(self.agent())
        for ns, addr in zip(self.hosts, self.addresses):
            etc = Path("/etc/netns") / ns
            if etc not in self._etc:
                if not etc.parent.exists():
                    self._etc_made.add(etc.parent)
                etc.mkdir(parents=True, exist_ok=True)
                self._etc.append(etc)
                (etc / "hosts").write_text(f"127.0.0.1 localhost\n{addr} {socket.gethostname()}\n")
        hosts = ",".join(f"{a}:{ranks_per_host}" for a in self.addresses)
        launcher = ["ip", "netns", "exec", self.hosts[0],
                    str(Path(sys.executable).parent / "horovodrun"), "--gloo",
                    "-np", str(self.n * ranks_per_host), "-H", hosts,
                    "--network-interfaces", "eth0", *command]
        full = {**os.environ, **(env or {})}
        full["PATH"] = f"{shim}:{full.get('PATH', '')}"
        return subprocess.run(launcher, env=full, capture_output=True, text=True,
                              timeout=timeout)

    def mpirun(self, command: list[str], ranks_per_host: int = 1, timeout: float = 600,
               env: dict[str, str] | None = None,
               mca: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run ``command`` on every host with Open MPI over TCP on the emulated links only
        (shared memory is off: the namespaces share one kernel and hostname)."""
        hosts = ",".join(f"{a}:{ranks_per_host}" for a in self.addresses)
        exports = [x for name in (env or {}) for x in ("-x", name)]
        mpi = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
               "-np", str(self.n * ranks_per_host), "-H", hosts,
               "--mca", "plm_rsh_agent", self.agent(),
               "--mca", "btl", "self,tcp",
               "--mca", "btl_tcp_if_include", f"{SUBNET}.0/24",
               "--mca", "oob_tcp_if_include", f"{SUBNET}.0/24",
               # Each host's orted writes its hwloc topology to a shared-memory file; with one
               # kernel and hostname for all hosts they collide, and orted sometimes segfaults
               # in hwloc_shmem_topology_write (seen in `make bench` at 4 hosts).  Not needed
               # with --bind-to none.
               "--mca", "rtc", "^hwloc",
               *[x for k, v in (mca or {}).items() for x in ("--mca", k, v)],
               "-x", "PATH", "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS", *exports, *command]
        launcher = ["ip", "netns", "exec", self.hosts[0], *mpi]
        return subprocess.run(launcher, env={**os.environ, **(env or {})}, capture_output=True,
                              text=True, timeout=timeout)
