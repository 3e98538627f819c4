"""The launcher peers: torchrun (TorchElastic) and NVRx's ft_launcher, one launcher process per "node".

Each node is a launcher on this machine (`--nnodes=4 --nproc-per-node=1`, c10d rendezvous on
127.0.0.1). Node 0 is started first and the others only once its port listens, so node 0's launcher
hosts the rendezvous store (c10d: the first to bind the endpoint serves it, the rest connect).
Neither tool has spare nodes: all four nodes train. The job is bench/peers/train_adapter.py
(examples/train.py's main, plus the peer's adapter).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.peers.observe import TRIAL_ENV, Line, Tail, kill_all, processes_mentioning, rank_pid, workers
from runwarden.net import free_port as _free_port

REPO = Path(__file__).resolve().parents[2]
ADAPTER = REPO / "bench" / "peers" / "train_adapter.py"
PEER_VENV = REPO / "bench" / ".peer-venv"
NODES = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class LauncherPeer:
    """How one launcher tool is run: its command up to the script, and what its own reaction looks like."""

    name: str
    python: Path
    launcher: tuple[str, ...]  # argv after the interpreter, before the script
    train_args: tuple[str, ...] = ()  # extra arguments of examples/train.py
    env: dict[str, str] = field(default_factory=dict)
    # a line of the tool's own logging after the fault = its first reaction (its detection)
    reaction: str = r"^[EWI]\d{4} .*torch/distributed/elastic/"  # the elastic agent's glog lines

    def config(self) -> dict[str, object]:
        return {
            "python": str(self.python),
            "launcher": list(self.launcher),
            "train_args": list(self.train_args),
            "env": self.env,
        }


def torchrun(collective_timeout_s: float | None = None) -> LauncherPeer:
    """torchrun at its defaults (plus the issue's --max-restarts=3), or with a short process-group timeout."""
    name = "torchrun" if collective_timeout_s is None else f"torchrun-{collective_timeout_s:g}s"
    train_args = () if collective_timeout_s is None else ("--collective-timeout", f"{collective_timeout_s:g}")
    return LauncherPeer(
        name=name,
        python=Path(sys.executable),  # the project's own torch: no extra install
        launcher=("-m", "torch.distributed.run", "--max-restarts=3"),
        train_args=train_args,
    )


def nvrx() -> LauncherPeer:
    """NVRx ft_launcher with its rank monitor and heartbeats, set up for fast hang detection as its docs
    advise: a 10 s rank heartbeat timeout, a sub-second workload check, a short worker-stop timeout."""
    return LauncherPeer(
        name="nvrx",
        python=PEER_VENV / "bin" / "python",
        launcher=(
            str(PEER_VENV / "bin" / "ft_launcher"),
            "--max-restarts=3",
            "--ft-initial-rank-heartbeat-timeout=60",
            "--ft-rank-heartbeat-timeout=10",
            "--ft-workload-check-interval=0.5",
            "--ft-rank-termination-signal=SIGKILL",
            "--workers-stop-timeout=2",
            "--ft-enable-nic-monitor=false",
        ),
        env={"BENCH_NVRX_HEARTBEAT": "1"},
        # its rank monitor's and launcher's own reactions (not the health-check notices of every rendezvous)
        reaction=r"Did not get (?:initial|subsequent) heartbeat|FT timeout elapsed|failed \(exitcode|"
        r"Worker group FAILED|Stopping workers|attempts to join the next round|[Rr]endezvous.*(?:closed|timed out)",
    )


def nvrx_version() -> str:
    try:
        out = subprocess.run(
            [
                str(PEER_VENV / "bin" / "python"),
                "-c",
                "import importlib.metadata as m; print(m.version('nvidia-resiliency-ext'))",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        return out.stdout.strip() or "not installed"
    except (OSError, subprocess.TimeoutExpired):
        return "not installed"


def _wait_listening(port: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
        time.sleep(0.1)
    return False


class LauncherDeployment:
    """One run of a launcher peer under `root`: node i is launcher process i, its log nodes/node<i>.log."""

    store_node = 0  # the launcher that hosts the c10d rendezvous store

    def __init__(self, peer: LauncherPeer, root: Path, job_args: list[str], tail: Tail) -> None:
        self.peer = peer
        self.root = root
        self.job_args = job_args
        self.tail = tail
        self.port = _free_port()
        self.launchers: dict[int, subprocess.Popen[bytes]] = {}
        self.loss_dir = root / "losses"
        (root / "nodes").mkdir(parents=True, exist_ok=True)
        tail.watch(root / "nodes", "*.log")

    def command(self, node: int) -> list[str]:
        return [
            str(self.peer.python), *self.peer.launcher,
            f"--nnodes={NODES}", "--nproc-per-node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{self.port}", "--rdzv-id=bench",
            str(ADAPTER), *self.job_args, *self.peer.train_args,
        ]  # fmt: skip

    def start_launcher(self, node: int) -> None:
        env = {
            **os.environ,
            **self.peer.env,
            "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1",
            "BENCH_NODE": f"node{node}",
            TRIAL_ENV: str(self.root),
            "BENCH_SLOW_FILE": str(self.root / f"slow-node{node}"),
        }
        log = (self.root / "nodes" / f"node{node}.log").open("ab")
        self.launchers[node] = subprocess.Popen(
            self.command(node),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=env,
            start_new_session=True,
        )

    def start(self) -> None:
        self.start_launcher(self.store_node)
        if not _wait_listening(self.port, 60):
            raise RuntimeError(f"{self.peer.name}: node 0's rendezvous store did not listen")
        for node in range(NODES):
            if node != self.store_node:
                self.start_launcher(node)

    # -- faults (node r = launcher r; a rank's own node is read from its environment) ----------

    def node_of_rank(self, rank: int) -> str:
        return f"node{rank}"

    def rank_pid(self, rank: int) -> int | None:
        return rank_pid(str(self.root), rank)

    def kill_launcher(self, node: int) -> None:
        """SIGKILL the launcher process alone: no cleanup, its workers are not signalled."""
        os.kill(self.launchers[node].pid, signal.SIGKILL)
        self.launchers[node].wait()

    def restart_launcher(self, node: int) -> None:
        """What systemd's Restart=always (or a pod restart) does for the dead launcher."""
        if self.launchers[node].poll() is not None:
            self.start_launcher(node)

    def slow_rank(self, rank: int, seconds: float) -> None:
        (self.root / f"slow-node{rank}").write_text(f"{seconds}")

    # -- reading what the tool did -------------------------------------------------------------

    def _reactions(self, after: float, dead_node: str) -> list[Line]:
        """The tool's lines after `after`, but not a killed launcher's (its restart's start-up is no
        reaction of the surviving launchers)."""
        pattern = re.compile(self.peer.reaction)
        return [
            line
            for line in self.tail.snapshot()
            if line.t > after and line.path.parent.name == "nodes" and line.path.stem != dead_node
            and pattern.search(line.text)
        ]  # fmt: skip

    def first_reaction(self, after: float, dead_node: str = "") -> float | None:
        lines = self._reactions(after, dead_node)
        return lines[0].t if lines else None

    def reaction_lines(self, after: float, dead_node: str = "", limit: int = 6) -> list[str]:
        return [f"{line.path.stem} +{line.t - after:.1f}s: {line.text[:240]}"
                for line in self._reactions(after, dead_node)[:limit]]  # fmt: skip

    def nodes_training(self) -> set[str]:
        return {p.env.get("BENCH_NODE", "?") for p in workers(str(self.root))}

    def alive(self) -> bool:
        return any(p.poll() is None for p in self.launchers.values())

    def stop(self, grace_s: float = 40.0) -> list[str]:
        """Stop as an operator would (SIGTERM each live launcher, which stops its workers), then count
        what is still running from this run (the processes left behind) and kill it."""
        for p in self.launchers.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in self.launchers.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        time.sleep(0.5)
        left = [f"{p.pid} {' '.join(p.cmdline)[:160]}" for p in processes_mentioning(str(self.root))]
        kill_all(str(self.root))
        for p in self.launchers.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
        return left
