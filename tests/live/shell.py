"""Helpers for tests of the live shell in-process: a real etcd (the `store` fixture), the real
`LiveController` and `Supervisor`, and node agents that are either real processes or a small
in-process gRPC servicer (`AgentDouble`, for tests about the controller, not the agent)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from controller.live.loop import LiveController, ShellConfig
from controller.supervisor.machine import Supervisor
from controller.supervisor.policy import RunPlan, SupervisorConfig
from runwarden import __version__
from runwarden.eventlog import LogEntry
from runwarden.store import Store
from runwarden.v1 import agent_pb2, agent_pb2_grpc, common_pb2, events_pb2, store_pb2

RUN = "live"


class AgentDouble(agent_pb2_grpc.NodeAgentServicer):
    """Passes every preflight and accepts every launch (no workers are started); records the calls.

    `before_preflight` runs inside the RunPreflight handler, before the answer: a test's hook to change
    the world "just before the launch"."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.launches: list[agent_pb2.LaunchWorkersRequest] = []
        self.before_preflight: Callable[[], None] | None = None
        self.launch_refusals = 0  # the first this many launches abort with PERMISSION_DENIED
        self.stop_exit: common_pb2.ExitStatus | None = None  # set: StopWorkers answers this exit
        self.stop_gate: threading.Event | None = None  # set: StopWorkers answers once it is set
        self.stopped = threading.Event()  # a StopWorkers has answered

    def RunPreflight(self, request: Any, context: Any) -> Iterator[agent_pb2.RunPreflightResponse]:
        self.calls.append("RunPreflight")
        if self.before_preflight is not None:
            self.before_preflight()
        yield agent_pb2.RunPreflightResponse(
            summary=common_pb2.PreflightSummary(mode=request.mode, passed=True)
        )

    def LaunchWorkers(self, request: Any, context: Any) -> agent_pb2.LaunchWorkersResponse:
        self.calls.append("LaunchWorkers")
        if self.launch_refusals > 0:
            self.launch_refusals -= 1
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "argv[0] is not allowed (the test's refusal)")
        self.launches.append(request)
        return agent_pb2.LaunchWorkersResponse(
            pid=1, launch_path="cold", launch_detail="the double starts no workers"
        )

    def StopWorkers(self, request: Any, context: Any) -> agent_pb2.StopWorkersResponse:
        self.calls.append("StopWorkers")
        if self.stop_gate is not None:
            self.stop_gate.wait(60)
        try:
            if self.stop_exit is None:
                return agent_pb2.StopWorkersResponse()
            ended = agent_pb2.WorkerStatus(
                run=request.run, attempt=request.attempt, pid=1, exit=self.stop_exit
            )
            return agent_pb2.StopWorkersResponse(stopped=[ended])
        finally:
            self.stopped.set()

    def GetNodeStatus(self, request: Any, context: Any) -> agent_pb2.GetNodeStatusResponse:
        return agent_pb2.GetNodeStatusResponse()


def register(store: Store, node: str, port: int) -> None:
    """The node record of an agent double serving on loopback `port` (no lease: the test removes it)."""
    # a real agent reports where it hosts a rendezvous as node rank 0; the double never listens there
    rec = store_pb2.NodeRecord(
        node=node,
        address=f"127.0.0.1:{port}",
        local_ranks=1,
        torch_host="127.0.0.1",
        rdzv_port=29400,
        agent_version=__version__,
    )
    store.put(store.keys.node(node), rec.SerializeToString())


@contextmanager
def agent_double(store: Store, node: str = "n1") -> Iterator[AgentDouble]:
    """Serve an `AgentDouble` on loopback and register `node` at its address in etcd."""
    servicer = AgentDouble()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    agent_pb2_grpc.add_NodeAgentServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    register(store, node, port)
    try:
        yield servicer
    finally:
        server.stop(grace=None)


@dataclass
class LogWatch:
    """Every entry the shell appended, with the monotonic time it was written (a listener's view)."""

    entries: list[tuple[float, LogEntry]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, ev: LogEntry) -> None:
        with self.lock:
            self.entries.append((time.monotonic(), ev))

    def find(self, pred: Callable[[LogEntry], bool], after: float = 0.0) -> tuple[float, LogEntry] | None:
        with self.lock:
            return next(((t, e) for t, e in self.entries if t >= after and pred(e)), None)

    def wait(
        self, pred: Callable[[LogEntry], bool], timeout_s: float, after: float = 0.0
    ) -> tuple[float, LogEntry]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            hit = self.find(pred, after)
            if hit is not None:
                return hit
            time.sleep(0.02)
        with self.lock:
            shown = "\n".join(f"{e.seq} {e.kind} a{e.attempt}: {e.message}" for _, e in self.entries[-30:])
        raise AssertionError(f"timed out after {timeout_s} s; the log so far:\n{shown}")


def policy(**overrides: Any) -> SupervisorConfig:
    values: dict[str, Any] = {
        "burn_in_passes": 1,
        "backoff_base_s": 0.2,
        "backoff_max_s": 1.0,
        "queue_wait_s": 1.0,
        "startup_timeout_s": 300.0,
        "preflight_timeout_s": 20.0,
    }
    values.update(overrides)
    return SupervisorConfig(**values)


@contextmanager
def live_shell(
    store: Store,
    run_dir: Path,
    *,
    nodes: int = 1,
    core_factory: Callable[[], Any] | None = None,
    **kwargs: Any,
) -> Iterator[tuple[LiveController, LogWatch]]:
    """A `LiveController` leading in a thread (tick 0.1 s); stopped and closed on exit."""
    factory = core_factory or (lambda: Supervisor(policy(), RunPlan(run=RUN, nodes=nodes)))
    cfg_kwargs = {
        k: kwargs.pop(k) for k in ("command", "env", "rpc_timeout_s", "election_ttl_s") if k in kwargs
    }
    cfg = ShellConfig(
        run=RUN,
        command=cfg_kwargs.pop("command", ("train.py",)),
        run_dir=run_dir,
        identity="test-controller",
        election_ttl_s=cfg_kwargs.pop("election_ttl_s", 2.0),
        tick_s=0.1,
        **cfg_kwargs,
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    shell = LiveController(cfg, store, factory, **kwargs)
    watch = LogWatch()
    shell.listeners.append(watch)
    thread = threading.Thread(target=shell.run, name="test-shell", daemon=True)
    thread.start()
    try:
        yield shell, watch
    finally:
        shell.stop()
        thread.join(timeout=15)
        shell.close()
        assert not thread.is_alive(), "the shell did not stop"


def is_launch(attempt: int | None = None) -> Callable[[LogEntry], bool]:
    return lambda e: e.kind == events_pb2.EVENT_KIND_LAUNCH and (attempt is None or e.attempt == attempt)


def says(text: str) -> Callable[[LogEntry], bool]:
    return lambda e: text in e.message
