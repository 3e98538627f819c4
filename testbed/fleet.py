"""Many hosts on one machine (`Fleet`): one network namespace per host, joined by a bridge, for tests
and drills. Processes run "on" a host through ``ip netns exec`` and share the filesystem, /proc and
PIDs with this machine; only their network is the host's. Faults (`kill`, `sigstop`, `crash`,
`partition`, `slow`, ...) are plain functions a drill can call too. Leaving the context kills every
process in the fleet's namespaces and deletes them; `sweep_orphans()` removes what a killed run left.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "HOST_NETWORK",
    "Fleet",
    "FleetError",
    "Host",
    "available",
    "crash",
    "default_prefix",
    "heal",
    "kill",
    "namespaces",
    "netns_pids",
    "partition",
    "sigcont",
    "sigstop",
    "slow",
    "sweep",
    "sweep_orphans",
    "unslow",
]

HOST_NETWORK = ipaddress.ip_network("198.18.0.0/24")  # inside 198.18.0.0/15 (RFC 2544 benchmarking)
IFNAME = "eth0"
BRIDGE = "br0"
FABRIC = "fabric"
NETNS_DIR = Path("/run/netns")
_CLONE_NEWNET = 0x40000000
_PREFIX = re.compile(r"^[a-z][a-z0-9]{0,11}$")
_HOST = re.compile(r"^[a-z][a-z0-9]{0,14}$")
_T = TypeVar("_T")


class FleetError(RuntimeError):
    """A namespace, link or qdisc could not be made or changed; the message has the command's stderr."""


def default_prefix() -> str:
    """``rw<pid>``: unique among the runs alive on this machine, short enough for every name limit."""
    return f"rw{os.getpid()}"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise FleetError(f"ip {' '.join(args)}: {out.stderr.strip() or f'exit {out.returncode}'}")
    return out


def _tc(netns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        ["ip", "netns", "exec", netns, "tc", *args], capture_output=True, text=True, timeout=30
    )
    if check and out.returncode != 0:
        raise FleetError(f"tc {' '.join(args)} in {netns}: {out.stderr.strip() or f'exit {out.returncode}'}")
    return out


_available: tuple[bool, str] | None = None


def available() -> tuple[bool, str]:
    """Whether network namespaces can be made here, and if not, why (root, `ip`, `tc`, a trial one)."""
    global _available
    if _available is None:
        _available = _probe()
    return _available


def _probe() -> tuple[bool, str]:
    if os.geteuid() != 0:
        return False, "not root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"no `{tool}` binary (iproute2)"
    trial = f"{default_prefix()}-trial"
    out = _ip("netns", "add", trial, check=False)
    if out.returncode != 0:
        return False, f"ip netns add failed: {out.stderr.strip()}"
    try:
        veth = _ip("-n", trial, "link", "add", "t0", "type", "veth", "peer", "name", "t1", check=False)
        if veth.returncode != 0:
            return False, f"no veth pairs: {veth.stderr.strip()}"
    finally:
        _ip("netns", "del", trial, check=False)
    return True, "network namespaces, veth pairs and tc available"


def namespaces(prefix: str) -> list[str]:
    """The namespaces of this machine whose name is ``<prefix>-...`` (this prefix only)."""
    return sorted(n for n in _all_namespaces() if n.startswith(f"{prefix}-"))


def _all_namespaces() -> list[str]:
    out = _ip("netns", "list", check=False)  # lines like "rw1-a (id: 3)"
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def netns_pids(netns: str) -> list[int]:
    """The processes whose network namespace is `netns` (``ip netns pids``)."""
    out = _ip("netns", "pids", netns, check=False)
    return [int(p) for p in out.stdout.split() if p.isdigit()]


def _kill_netns(netns: str, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL every process in `netns` until none is left (a process may fork while we kill).

    A dead child is a zombie until its parent reaps it, but a zombie is no longer in a namespace
    (its /proc/PID/ns/net is gone), so ``ip netns pids`` stops listing it at once."""
    killed: list[int] = []
    deadline = time.monotonic() + timeout_s
    while pids := netns_pids(netns):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)  # a stopped process dies of SIGKILL too; be explicit
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        if time.monotonic() > deadline:
            raise FleetError(f"processes {pids} in {netns} survived SIGKILL for {timeout_s:g} s")
        time.sleep(0.05)
    return killed


def _kill_started(host: Host) -> list[int]:
    """SIGKILL the processes `host.popen` started that still run. ``ip netns pids`` alone would miss
    one that has not entered the namespace yet (still setpriv or ip, e.g. stopped right after start)."""
    killed = []
    for proc in host.processes:
        if proc.poll() is None:
            kill(proc, signal.SIGCONT)
            kill(proc, signal.SIGKILL)
            killed.append(proc.pid)
    return killed


def sweep(prefix: str) -> list[str]:
    """Kill the processes of, and delete, every namespace ``<prefix>-...`` (a crashed run's leftovers).

    Returns the names removed. Namespaces of any other prefix are never touched."""
    removed = []
    for netns in namespaces(prefix):
        _kill_netns(netns)
        _ip("netns", "del", netns, check=False)
        removed.append(netns)
    return removed


def sweep_orphans(family: str = "rw") -> list[str]:
    """`sweep` every prefix ``<family><pid>`` (`default_prefix`, with or without a letter suffix)
    whose process ``pid`` is gone: a crashed run's leftovers. Live runs' namespaces stay."""
    pattern = re.compile(rf"^({re.escape(family)}(\d+)[a-z]*)-")
    removed = []
    for netns in _all_namespaces():
        match = pattern.match(netns)
        if match and not Path(f"/proc/{match[2]}").exists():
            removed += sweep(match[1])
    return removed


def _die_with_parent() -> list[str]:
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []


@dataclass(eq=False, kw_only=True)
class Host:
    """One host of a fleet: a network namespace with ``eth0`` at `address` on the fleet's bridge."""

    fleet: Fleet = field(repr=False)
    name: str
    netns: str
    address: str
    index: int
    ifname: str = IFNAME
    processes: list[subprocess.Popen[Any]] = field(default_factory=list, repr=False)

    @property
    def veth(self) -> str:
        """The bridge-side end of this host's link (in the fabric namespace)."""
        return f"v{self.index}"

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` as run on this host: ``ip netns exec <netns> argv...``."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def popen(self, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start `argv` on this host (keyword arguments go to `subprocess.Popen`); the fleet kills it
        at teardown. The process's PID is argv[0]'s (``ip netns exec`` and setpriv exec in place)."""
        kw.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen([*_die_with_parent(), *self.command(argv)], **kw)
        self.processes.append(proc)
        return proc

    def run(
        self, argv: Sequence[str], *, timeout: float = 60.0, check: bool = False, **kw: Any
    ) -> subprocess.CompletedProcess[str]:
        """Run `argv` on this host to completion; stdout and stderr are captured as text."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.run(self.command(argv), timeout=timeout, check=check, **kw)

    def call(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` in a short-lived thread that entered this host's network namespace: the
        sockets it opens are the host's (a probe from the test process without a process per probe).
        Close them before returning: an open socket keeps a deleted namespace alive."""
        result: list[_T] = []
        error: list[BaseException] = []

        def body() -> None:
            try:
                _enter_netns(self.netns)
                result.append(fn(*args))
            except BaseException as exc:
                error.append(exc)

        thread = threading.Thread(target=body, name=f"netns-{self.netns}", daemon=True)
        thread.start()
        thread.join()
        if error:
            raise error[0]
        return result[0]

    def connects(self, address: str, port: int, timeout_s: float = 1.0) -> bool:
        """Whether a TCP connect from this host to ``address:port`` succeeds within `timeout_s`."""

        def probe() -> bool:
            try:
                with socket.create_connection((address, port), timeout=timeout_s):
                    return True
            except OSError:
                return False

        return self.call(probe)

    def wait_for_port(self, address: str, port: int, timeout_s: float = 30.0) -> None:
        """Until a TCP connect from this host to ``address:port`` succeeds; FleetError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not self.connects(address, port, timeout_s=1.0):
            if time.monotonic() > deadline:
                raise FleetError(f"{address}:{port} not reachable from {self.name} within {timeout_s:g} s")
            time.sleep(0.1)


def _enter_netns(netns: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(NETNS_DIR / netns, os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({netns}): {os.strerror(err)}")
    finally:
        os.close(fd)


class Fleet:
    """Hosts in network namespaces on one bridge. Use as a context manager; leaves nothing behind.

    Under a per-run prefix ``P`` (``rw<pid>`` by default): the fabric namespace ``P-fabric`` holds the
    bridge ``br0`` (no address); per host ``NAME`` a namespace ``P-NAME`` with loopback up and ``eth0``
    at 198.18.0.<index>/24, the peer of the veth ``v<index>`` on ``br0``. Nothing configures an address
    in the root namespace or sends traffic outside these namespaces.

    `partition` / `heal` put the host's veth down / up on the bridge side (its processes keep running);
    `slow` / `unslow` add a `tc tbf` token bucket on both ends of its veth. `netem` is not available on
    these machines, so there is no delay or loss fault. Processes are found by ``ip netns pids`` (a
    worker a host's process started too); top-level ones also get SIGKILL when the thread that started
    them dies (``setpriv --pdeathsig``): start them from a long-lived thread.
    """

    def __init__(self, prefix: str | None = None) -> None:
        self.prefix = prefix or default_prefix()
        if not _PREFIX.match(self.prefix):
            raise FleetError(f"prefix {self.prefix!r}: a lowercase letter, then at most 11 letters or digits")
        self.fabric = f"{self.prefix}-{FABRIC}"
        self.hosts: dict[str, Host] = {}
        self._made: list[str] = []

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> Fleet:
        """Make the fabric namespace and its bridge (idempotent)."""
        if self.fabric in self._made:
            return self
        self._add_netns(self.fabric)
        _ip("-n", self.fabric, "link", "set", "lo", "up")
        _ip("-n", self.fabric, "link", "add", BRIDGE, "type", "bridge")
        _ip("-n", self.fabric, "link", "set", BRIDGE, "up")
        return self

    def _add_netns(self, netns: str) -> None:
        _ip("netns", "add", netns)
        self._made.append(netns)

    def add_host(self, name: str) -> Host:
        """A new host ``name`` (lowercase letters and digits, at most 15) with the next free address."""
        if not _HOST.match(name) or name in (FABRIC, "trial"):
            raise FleetError(f"host name {name!r}: a lowercase letter, then at most 14 letters or digits")
        if name in self.hosts:
            raise FleetError(f"host {name!r} already exists")
        self.start()
        index = len(self.hosts) + 1
        if index >= HOST_NETWORK.num_addresses - 1:
            raise FleetError(f"no address left in {HOST_NETWORK}")
        host = Host(
            fleet=self,
            name=name,
            netns=f"{self.prefix}-{name}",
            address=str(HOST_NETWORK.network_address + index),
            index=index,
        )
        self._add_netns(host.netns)
        _ip("-n", host.netns, "link", "set", "lo", "up")
        _ip(
            "-n",
            self.fabric,
            "link",
            "add",
            host.veth,
            "type",
            "veth",
            "peer",
            "name",
            IFNAME,
            "netns",
            host.netns,
        )
        _ip("-n", self.fabric, "link", "set", host.veth, "master", BRIDGE, "up")
        _ip("-n", host.netns, "addr", "add", f"{host.address}/{HOST_NETWORK.prefixlen}", "dev", IFNAME)
        _ip("-n", host.netns, "link", "set", IFNAME, "up")
        self.hosts[name] = host
        return host

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def namespaces(self) -> list[str]:
        """The namespaces this fleet made and has not deleted yet."""
        return list(self._made)

    def close(self) -> None:
        """Kill every process in the fleet's namespaces, reap the ones started here, delete the
        namespaces. Idempotent; runs every step even when one fails, then raises the first error."""
        errors: list[BaseException] = []
        for host in self.hosts.values():
            _kill_started(host)
        for netns in reversed(self._made):
            try:
                _kill_netns(netns)
            except BaseException as exc:
                errors.append(exc)
        for host in self.hosts.values():
            for proc in host.processes:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
        for netns in reversed(self._made):
            out = _ip("netns", "del", netns, check=False)
            if out.returncode != 0 and (NETNS_DIR / netns).exists():
                errors.append(FleetError(f"ip netns del {netns}: {out.stderr.strip()}"))
        self._made.clear()
        self.hosts.clear()
        if errors:
            raise errors[0]


# -- faults: functions a test or an operator-style drill calls -----------------------------------


def _pid(proc_or_pid: subprocess.Popen[Any] | int) -> int:
    return proc_or_pid if isinstance(proc_or_pid, int) else proc_or_pid.pid


def kill(proc_or_pid: subprocess.Popen[Any] | int, sig: int = signal.SIGKILL) -> None:
    """Send `sig` (SIGKILL by default: a crash) to one process; a process already gone is fine."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(_pid(proc_or_pid), sig)


def sigstop(proc_or_pid: subprocess.Popen[Any] | int) -> None:
    """Freeze a process (a hang: it holds its sockets and leases but answers nothing)."""
    kill(proc_or_pid, signal.SIGSTOP)


def sigcont(proc_or_pid: subprocess.Popen[Any] | int) -> None:
    """Thaw a process `sigstop` froze."""
    kill(proc_or_pid, signal.SIGCONT)


def crash(host: Host) -> list[int]:
    """SIGKILL every process on `host`, workers included (a host that lost power: nothing shuts down
    cleanly). The host stays, ready for new processes. Returns the PIDs killed."""
    killed = _kill_started(host) + _kill_netns(host.netns)
    for proc in host.processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
    host.processes[:] = [p for p in host.processes if p.returncode is None]
    return killed


def partition(host: Host) -> None:
    """Cut `host` off the fabric: its veth goes down on the bridge side. Its processes keep running
    and keep their sockets; nothing reaches them and nothing they send arrives."""
    _ip("-n", host.fleet.fabric, "link", "set", host.veth, "down")


def heal(host: Host) -> None:
    """Undo `partition`: the bridge-side veth goes up again. Returns once both ends report the link
    up (the kernel passes carrier changes on with up to a second's delay; a packet sent before
    that is dropped)."""
    _ip("-n", host.fleet.fabric, "link", "set", host.veth, "up")
    deadline = time.monotonic() + 10.0
    while not all(
        "state UP" in _ip("-n", netns, "-o", "link", "show", "dev", dev).stdout
        for netns, dev in ((host.fleet.fabric, host.veth), (host.netns, host.ifname))
    ):
        if time.monotonic() > deadline:
            raise FleetError(f"{host.name}: link not up 10 s after heal")
        time.sleep(0.02)


def slow(host: Host, rate: str = "10mbit", *, burst: str = "32kbit", latency: str = "400ms") -> None:
    """Shape `host`'s link to `rate` both ways: a `tc tbf` qdisc on the bridge-side veth (traffic to
    the host) and on the host's eth0 (traffic from it). Replaces an earlier `slow`."""
    for netns, dev in ((host.fleet.fabric, host.veth), (host.netns, host.ifname)):
        _tc(
            netns,
            "qdisc",
            "replace",
            "dev",
            dev,
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            burst,
            "latency",
            latency,
        )


def unslow(host: Host) -> None:
    """Remove the shaping `slow` added (a link that was not slowed is fine)."""
    for netns, dev in ((host.fleet.fabric, host.veth), (host.netns, host.ifname)):
        _tc(netns, "qdisc", "del", "dev", dev, "root", check=False)  # fails when there is none
        if " tbf " in _tc(netns, "qdisc", "show", "dev", dev).stdout:
            raise FleetError(f"tc qdisc del dev {dev} root in {netns}: the tbf qdisc is still there")
