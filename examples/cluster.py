"""A whole runwarden deployment on one machine: a private etcd, N node agents, a controller.

Used by the demo (`examples/demo.py`) and by the end-to-end tests. Every part is the real
program with its real CLI and config file, started as a process exactly as systemd would start it
(`nodeagent --config`, `controller run --config`); nothing here reaches into their internals.
Each "node" is an agent on its own loopback port with its own state directory and unix socket.
Preflight runs either the shipped defaults with only what the deployment must say (`shipped_preflight`:
the demo, a user's first run) or the test clusters' cut-down settings (the tests' default).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from testbed.etcd_server import EtcdServer, free_port
from testbed.fleet_cluster import (
    REPO,
    ClusterBase,
    ClusterSpec,
    agent_settings,
    controller_settings,
    controllerctl,
    preflight_settings,
    program,
    write_toml,
)

__all__ = [
    "REPO",
    "ClusterSpec",
    "LocalCluster",
    "deployment_preflight_settings",
    "kill_strays",
    "leftover_processes",
    "write_toml",
]


class LocalCluster(ClusterBase):
    """Start with `start()`, stop with `stop()` (or use as a context manager). Leaves no process."""

    def __init__(
        self, root: Path, spec: ClusterSpec | None = None, *, shipped_preflight: bool = False
    ) -> None:
        self.root = root.resolve()
        self.spec = spec or ClusterSpec()
        self.shipped_preflight = shipped_preflight
        self.etcd: EtcdServer | None = None
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.controller: subprocess.Popen[bytes] | None = None
        self.standbys: dict[str, subprocess.Popen[bytes]] = {}
        self.api_port = 0
        self.metrics_port = 0
        self.nodes = [f"node{i + 1}" for i in range(self.spec.active + self.spec.spares)]

    # -- paths --------------------------------------------------------------------------------

    @property
    def controller_address(self) -> str:
        return f"127.0.0.1:{self.api_port}"

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> LocalCluster:
        if self.root.exists():
            shutil.rmtree(self.root)
        for d in (self.root, self.run_dir, self.ckpt_dir, self.loss_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.etcd = EtcdServer(self.root / "etcd", fast=True).start()
        self._write_preflight_config()
        for node in self.nodes:
            self.start_agent(node)
        self._start_controller()
        return self

    def _write_preflight_config(self) -> None:
        settings = (
            deployment_preflight_settings(self.ckpt_dir)
            if self.shipped_preflight
            else preflight_settings(self.ckpt_dir)
        )
        write_toml(self.root / "preflight.toml", settings)

    def agent_config(self, node: str) -> Path:
        assert self.etcd is not None
        state = self.root / "nodes" / node
        state.mkdir(parents=True, exist_ok=True)
        path = state / "nodeagent.toml"
        # port 0: the agent binds a port of the kernel's choosing and advertises it in its node
        # record (a port picked here could be taken by the time a slow-starting agent binds it)
        settings = agent_settings(
            node,
            self.spec,
            listen="127.0.0.1:0",
            state_dir=state,
            etcd_endpoints=[self.etcd.endpoint],
            preflight_config=self.root / "preflight.toml",
        )
        write_toml(path, {"": settings})
        return path

    def start_agent(self, node: str) -> None:
        cfg = self.agent_config(node)
        log = (self.root / "nodes" / node / "agent.log").open("ab")
        self.agents[node] = subprocess.Popen(
            [*program("nodeagent"), "--config", str(cfg)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            start_new_session=True,
        )

    def _start_controller(self) -> None:
        self.api_port = free_port()
        cfg = self._controller_config()
        log = (self.run_dir / "controller.log").open("ab")
        self.controller = subprocess.Popen(
            [*program("controller"), "run", "--config", str(cfg)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            start_new_session=True,
        )

    def start_standby(self, identity: str) -> int:
        """A second controller replica on the same config (its own API port); returns the port."""
        port = free_port()
        log = (self.run_dir / f"{identity}.log").open("ab")
        self.standbys[identity] = subprocess.Popen(
            [
                *program("controller"),
                "run",
                "--config",
                str(self.run_dir / "controller.toml"),
                "--identity",
                identity,
                "--api",
                f"127.0.0.1:{port}",
                "--metrics",
                "",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            start_new_session=True,
        )
        return port

    def controller_settings(self) -> dict[str, dict[str, object]]:
        """The controller's config, section -> key -> value (a subclass changes the job here)."""
        assert self.etcd is not None
        self.metrics_port = self.metrics_port or free_port()
        return controller_settings(
            self.spec,
            store={"endpoints": [self.etcd.endpoint]},
            run_dir=self.run_dir,
            ckpt_dir=self.ckpt_dir,
            loss_dir=self.loss_dir,
            api_address=self.controller_address,
            metrics_address=f"127.0.0.1:{self.metrics_port}",
        )

    def _controller_config(self) -> Path:
        cfg = self.run_dir / "controller.toml"
        write_toml(cfg, self.controller_settings())
        return cfg

    def stop(self) -> None:
        procs: list[subprocess.Popen[bytes]] = []
        if self.controller is not None:
            procs.append(self.controller)
        procs.extend(self.standbys.values())
        procs.extend(self.agents.values())
        agents = {id(p) for p in self.agents.values()}
        for p in procs:
            if p.poll() is None:
                # SIGINT: an agent stops its workers now (SIGTERM would drain and hand over first)
                _signal_group(p, signal.SIGINT if id(p) in agents else signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait(timeout=5)
        # Workers live in their own process groups under the agents; an agent stops them on SIGINT,
        # and anything still running from this cluster's directory is killed here.
        kill_strays(self.root, keep={self.etcd.pid} if self.etcd is not None and self.etcd.pid else set())
        if self.etcd is not None:
            # the event log and every log stay; etcd's data (two preallocated 64 MB WAL files) goes
            self.etcd.stop()
            self.etcd.discard()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- operating it -------------------------------------------------------------------------

    def ctl(self, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        return controllerctl(self.controller_address, *args, timeout=timeout)


def deployment_preflight_settings(ckpt_dir: Path) -> dict[str, dict[str, object]]:
    """preflight.toml as a deployment writes it: the shipped defaults (preflight/defaults.toml) plus
    what only the deployment knows, the checkpoint path the storage check probes. No tuning."""
    return {"storage": {"checkpoint_path": str(ckpt_dir)}}


def _signal_group(p: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, sig)


def _processes_under(root: Path) -> Iterator[int]:
    """Processes whose command line mentions `root`; never this one or its ancestors (a shell or
    `timeout` that started it with `--dir ROOT` is no stray)."""
    needle = str(root).encode()
    mine = _ancestors()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in mine:
            continue
        try:
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if needle in cmd:
            yield int(entry.name)


def _ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state: the parent's pid
    return pids


def kill_strays(root: Path, keep: set[int] | None = None) -> list[int]:
    """SIGKILL every process whose command line mentions `root` (workers of this cluster only)."""
    killed = []
    for pid in _processes_under(root):
        if keep and pid in keep:
            continue
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass
    return killed


def leftover_processes(root: Path, wait_s: float = 0.0) -> Sequence[int]:
    """Processes whose command line mentions `root`, after waiting up to `wait_s` for them to go (a
    process killed by stop() may take a moment to be gone)."""
    deadline = time.monotonic() + wait_s
    while (left := list(_processes_under(root))) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left
