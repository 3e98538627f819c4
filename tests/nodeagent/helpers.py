"""Test helpers: a real node agent as a subprocess, and small /proc and RPC utilities."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from runwarden.v1 import agent_pb2, agent_pb2_grpc
from testbed.wait import wait_until

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable


wait_for = wait_until  # the nodeagent tests' name for testbed's wait


class AgentProc:
    """`nodeagent` in its own process, talking on a unix socket in tmp (and TCP on loopback)."""

    def __init__(
        self,
        tmp: Path,
        *,
        node: str = "n1",
        etcd: str | None = None,
        etcd_root: str | None = None,
        flags: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.tmp = tmp
        self.node = node
        self.socket = str(tmp / f"{node}.sock")
        self.log_path = tmp / f"{node}.log"
        argv = [
            PYTHON,
            "-m",
            "nodeagent.daemon.cli",
            "--node",
            node,
            "--listen",
            "127.0.0.1:0",
            "--unix-socket",
            self.socket,
            "--run-dir",
            str(tmp / "run"),
            "--metrics-listen",
            "",
            "--nvml-interval",
            "0",
            "--kernel-log",
            "none",
            "--log-level",
            "info",
        ]
        # cold unless a test asks for warm workers (its flags come later and win): the shipped default
        # parks torch-importing processes beside every agent, which the other tests do not exercise
        argv += ["--warm-workers", "false"]
        if etcd:
            argv += ["--etcd", etcd] + (["--etcd-root", etcd_root] if etcd_root else [])
        argv += flags or []
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=full_env, stdout=self._log, stderr=subprocess.STDOUT)
        self.channel = grpc.insecure_channel(f"unix:{self.socket}")
        self.stub = agent_pb2_grpc.NodeAgentStub(self.channel)
        self.wait_serving()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_serving(self, timeout_s: float = 30.0) -> None:
        health = health_pb2_grpc.HealthStub(self.channel)

        def serving() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"agent exited with {self.proc.returncode}:\n{self.log()}")
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
            except grpc.RpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING

        wait_for(serving, timeout_s, "the agent to serve")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def terminate(self, timeout_s: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout_s)

    def close(self) -> None:
        # SIGINT, not SIGTERM: SIGTERM drains and waits for a planned stop of running workers
        # (drain_handoff_s, drain_timeout_s); a teardown stops them now (TERM, KILL after the grace).
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()
        self.channel.close()
        self._log.close()


class AgentSocket:
    """A stand-in for the agent's progress socket (the real datagram server): every request a
    ProgressReporter sends to `path` is kept in `got`, and `seen` is set on each."""

    def __init__(self, tmp: Path) -> None:
        import threading

        from nodeagent.daemon.progress_socket import ProgressDatagramServer
        from nodeagent.wire import progress_socket_path

        self.path = str(tmp / "agent.sock")
        self.got: list[agent_pb2.ReportProgressRequest] = []
        self.seen = threading.Event()
        self._server = ProgressDatagramServer(
            progress_socket_path(self.path), self._handle, lambda code, s: None
        )
        self._server.start()

    def _handle(self, req: agent_pb2.ReportProgressRequest) -> agent_pb2.ReportProgressResponse:
        self.got.append(req)
        self.seen.set()
        return agent_pb2.ReportProgressResponse()

    def stop(self) -> None:
        self._server.stop()


def run_gloo_ranks(
    script: Path, world: int, *args: str, run: str, warm: bool = False, timeout_s: float = 180
) -> None:
    """`script` as `world` plain gloo rank processes on loopback (testbed.gloo_ranks), every one
    waited for; AssertionError with their output if any failed."""
    from testbed.etcd_server import free_port
    from testbed.gloo_ranks import gloo_rank_env

    port = free_port()
    procs = [
        subprocess.Popen(
            [PYTHON, str(script), *args],
            env=gloo_rank_env(rank, world, port, run=run, root=ROOT, warm=warm),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=timeout_s)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
