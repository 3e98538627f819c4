"""A whole runwarden deployment on one machine: a private etcd, N node agents, a controller.

Used by the demo (`examples/demo.py`) and by the end-to-end tests. Every part is the real
program with its real CLI and config file, started as a process exactly as systemd would start it
(`nodeagent --config`, `controller run --config`); nothing here reaches into their internals.
Each "node" is an agent on its own loopback port with its own state directory and unix socket.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from runwarden.eventlog import read_events
from runwarden.testing.etcd_server import EtcdServer, free_port
from runwarden.v1 import events_pb2

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _bin(name: str) -> list[str]:
    exe = BIN / name
    return (
        [str(exe)]
        if exe.exists()
        else [
            sys.executable,
            "-m",
            {
                "nodeagent": "nodeagent.cli",
                "controller": "controller.live.main",
                "controllerctl": "controller.ctl.main",
            }[name],
        ]
    )


def _toml(value: object) -> str:
    return json.dumps(value) if not isinstance(value, bool) else ("true" if value else "false")


def write_toml(path: Path, sections: dict[str, dict[str, object]]) -> None:
    lines: list[str] = []
    for name, table in sections.items():
        if name:
            lines.append(f"[{name}]")
        for key, value in table.items():
            lines.append(f"{key} = {_toml(value)}")
        lines.append("")
    path.write_text("\n".join(lines))


@dataclass(kw_only=True)
class ClusterSpec:
    run: str = "demo"
    active: int = 4
    spares: int = 2
    steps: int = 100_000
    ckpt_every: int = 10
    step_sleep: float = 0.05
    lease_ttl_s: float = 2.0
    seed: int = 1234
    train_args: tuple[str, ...] = ()
    policy: dict[str, object] = field(default_factory=dict)


class LocalCluster:
    """Start with `start()`, stop with `stop()` (or use as a context manager). Leaves no process."""

    def __init__(self, root: Path, spec: ClusterSpec | None = None) -> None:
        self.root = root.resolve()
        self.spec = spec or ClusterSpec()
        self.etcd: EtcdServer | None = None
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.controller: subprocess.Popen[bytes] | None = None
        self.standbys: dict[str, subprocess.Popen[bytes]] = {}
        self.api_port = 0
        self.metrics_port = 0
        self.nodes = [f"node{i + 1}" for i in range(self.spec.active + self.spec.spares)]

    # -- paths --------------------------------------------------------------------------------

    @property
    def run_dir(self) -> Path:
        return self.root / "controller"

    @property
    def event_log(self) -> Path:
        return self.run_dir / "events.jsonl"

    @property
    def ckpt_dir(self) -> Path:
        return self.root / "checkpoints"

    @property
    def loss_dir(self) -> Path:
        return self.root / "losses"

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
        # Before every attempt the quick preflight checks the kernel log, the counters, storage and
        # network; compute and the all-reduce run in the full preflight (burn-in). On a GPU node the
        # quick mode includes the matmul too: here 2 CPU cores would spend seconds on it per node.
        write_toml(
            self.root / "preflight.toml",
            {
                "compute": {"modes": ["full"], "size_cpu": 128, "iterations_cpu": 2},
                "collective": {
                    "modes": ["full"],
                    "size_bytes_cpu": 1 << 20,
                    "iterations": 3,
                    "cpu_processes": 2,
                },
                "storage": {"checkpoint_path": str(self.ckpt_dir), "free_space_floor_gb": 0.1},
            },
        )

    def agent_config(self, node: str) -> Path:
        assert self.etcd is not None
        state = self.root / "nodes" / node
        state.mkdir(parents=True, exist_ok=True)
        path = state / "nodeagent.toml"
        write_toml(
            path,
            {
                "": {
                    "node": node,
                    # port 0: the agent binds a port of the kernel's choosing and advertises it in its node
                    # record (a port picked here could be taken by the time a slow-starting agent binds it)
                    "listen": "127.0.0.1:0",
                    "unix_socket": str(state / "agent.sock"),
                    "etcd_endpoints": [self.etcd.endpoint],
                    "lease_ttl_s": self.spec.lease_ttl_s,
                    "progress_interval_s": 0.5,
                    "kernel_log": "none",
                    "nvml_interval_s": 0.0,
                    "allowed_executables": [sys.executable],
                    "chaos_enabled": True,
                    "metrics_listen": "",
                    "run_dir": str(state / "run"),
                    "local_ranks": 1,
                    "preflight_config": str(self.root / "preflight.toml"),
                    "stop_grace_s": 5.0,
                }
            },
        )
        return path

    def start_agent(self, node: str) -> None:
        cfg = self.agent_config(node)
        log = (self.root / "nodes" / node / "agent.log").open("ab")
        self.agents[node] = subprocess.Popen(
            [*_bin("nodeagent"), "--config", str(cfg)],
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
            [*_bin("controller"), "run", "--config", str(cfg)],
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
                *_bin("controller"),
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

    def _controller_config(self) -> Path:
        assert self.etcd is not None
        self.metrics_port = self.metrics_port or free_port()
        # torchrun runs the script with its own interpreter: the command starts at the script.
        command = [
            str(REPO / "examples" / "train.py"),
            "--steps",
            str(self.spec.steps),
            "--ckpt-dir",
            str(self.ckpt_dir),
            "--ckpt-every",
            str(self.spec.ckpt_every),
            "--out",
            str(self.loss_dir),
            "--seed",
            str(self.spec.seed),
            "--step-sleep",
            str(self.spec.step_sleep),
            *self.spec.train_args,
        ]
        policy: dict[str, object] = {
            "burn_in_passes": 1,
            "backoff_base_s": 0.5,
            "backoff_max_s": 5.0,
            "stop_grace_s": 5.0,
            "dump_timeout_s": 3.0,
            "queue_wait_s": 5.0,
            "startup_timeout_s": 120.0,
        }
        policy.update(self.spec.policy)
        cfg = self.run_dir / "controller.toml"
        write_toml(
            cfg,
            {
                "store": {"endpoints": [self.etcd.endpoint]},
                "controller": {
                    "run": self.spec.run,
                    "nodes": self.spec.active,
                    "command": command,
                    "run_dir": str(self.run_dir),
                    "api_address": self.controller_address,
                    "identity": "controller-a",
                    "election_ttl_s": 3.0,
                    "metrics_address": f"127.0.0.1:{self.metrics_port}",
                },
                "controller.env": {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
                "policy": policy,
            },
        )
        return cfg

    def stop(self) -> None:
        procs: list[subprocess.Popen[bytes]] = []
        if self.controller is not None:
            procs.append(self.controller)
        procs.extend(self.standbys.values())
        procs.extend(self.agents.values())
        for p in procs:
            if p.poll() is None:
                _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait(timeout=5)
        # Workers live in their own process groups under the agents; an agent stops them on SIGTERM,
        # and anything still running from this cluster's directory is killed here.
        kill_strays(self.root, keep={self.etcd.pid} if self.etcd is not None and self.etcd.pid else set())
        if self.etcd is not None:
            self.etcd.stop()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- operating it -------------------------------------------------------------------------

    def ctl(self, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*_bin("controllerctl"), "--controller", self.controller_address, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO,
        )

    def status(self) -> dict[str, object]:
        out = self.ctl("status", "--json")
        if out.returncode != 0:
            return {}
        data = json.loads(out.stdout)
        runs = data.get("runs", []) if isinstance(data, dict) else data
        return runs[0] if runs else {}

    def events(self) -> list[events_pb2.Event]:
        return read_events(self.event_log).events

    def wait_for_event(
        self,
        kind: int,
        after_seq: int,
        timeout_s: float,
        pred: Callable[[events_pb2.Event], bool] | None = None,
    ) -> events_pb2.Event | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for ev in self.events():
                if ev.seq > after_seq and ev.kind == kind and (pred is None or pred(ev)):
                    return ev
            time.sleep(0.2)
        return None

    def restart_agent(self, node: str) -> None:
        """What systemd's Restart=always does for a dead agent."""
        p = self.agents.get(node)
        if p is not None and p.poll() is None:
            return
        self.start_agent(node)

    def kill_agent_process(self, node: str) -> None:
        p = self.agents.get(node)
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()


def _signal_group(p: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, sig)


def _processes_under(root: Path) -> Iterator[int]:
    needle = str(root).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if needle in cmd:
            yield int(entry.name)


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


def leftover_processes(root: Path) -> Sequence[int]:
    return list(_processes_under(root))
