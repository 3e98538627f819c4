"""The shell's slow work runs in pools by kind (controller.live.rpc_pools): burn-ins never hold up an
attempt's calls, a fan-out is one round trip however many hosts, and a task fanning out never waits
for a thread of its own pool. The last test drives the real shell against real gRPC agents."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from controller.live.rpc_pools import RpcKind, RpcPools
from controller.supervisor.machine import Supervisor
from controller.supervisor.policy import RunPlan
from runwarden.store import Store
from runwarden.v1 import agent_pb2, agent_pb2_grpc, common_pb2
from testbed.wait import wait_until
from tests.live.shell import RUN, AgentDouble, is_launch, live_shell, policy, register


def test_burn_ins_past_their_bound_never_hold_up_the_other_kinds() -> None:
    pools = RpcPools({RpcKind.BURN_IN: 4})
    release = threading.Event()
    try:
        for _ in range(12):  # three times the bound: eight wait in the queue
            pools.submit(RpcKind.BURN_IN, release.wait, 30.0)
        ran = {kind: threading.Event() for kind in (RpcKind.PREFLIGHT, RpcKind.TASK, RpcKind.CALL)}
        for kind, done in ran.items():
            pools.submit(kind, done.set)
        assert all(done.wait(5.0) for done in ran.values()), {k.value: d.is_set() for k, d in ran.items()}
        assert pools.map(lambda x: x * 2, range(100)) == [x * 2 for x in range(100)]
    finally:
        release.set()
        pools.shutdown()


def test_a_fan_out_runs_every_call_at_once_not_sixteen_at_a_time() -> None:
    """512 calls that each wait for all 512 to have started: only a fan-out as wide as the fleet ends."""
    pools = RpcPools()
    barrier = threading.Barrier(512, timeout=30.0)
    try:
        assert pools.map(lambda i: (barrier.wait(), i)[1], range(512)) == list(range(512))
    finally:
        pools.shutdown()


def test_tasks_that_fan_out_while_their_pool_is_full_never_deadlock() -> None:
    pools = RpcPools({RpcKind.TASK: 2})
    answers: list[list[int]] = []
    lock = threading.Lock()
    done = threading.Semaphore(0)

    def task(n: int) -> None:
        got = pools.map(lambda i: i + n, range(64))
        with lock:
            answers.append(got)
        done.release()

    try:
        for n in range(6):
            pools.submit(RpcKind.TASK, task, n)
        assert all(done.acquire(timeout=10.0) for _ in range(6))
        assert sorted(a[0] for a in answers) == list(range(6))
    finally:
        pools.shutdown()


class _Barrier(AgentDouble):
    """Answers its preflight only once every node's preflight has arrived (a barrier across agents)."""

    def __init__(self, barrier: threading.Barrier) -> None:
        super().__init__()
        self.barrier = barrier

    def RunPreflight(self, request: Any, context: Any) -> Iterator[agent_pb2.RunPreflightResponse]:
        self.calls.append("RunPreflight")
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the preflights did not all arrive together")
        yield agent_pb2.RunPreflightResponse(
            summary=common_pb2.PreflightSummary(mode=request.mode, passed=True)
        )


@pytest.mark.timeout(120)
def test_the_shell_preflights_every_node_of_an_attempt_at_once(store: Store, tmp_path: Path) -> None:
    """40 agents (more than the old single pool's 16 threads) whose preflights each answer only once
    all 40 have arrived: the attempt launches, every node preflighted once."""
    n = 40
    barrier = threading.Barrier(n, timeout=20.0)
    servers, doubles = [], []
    try:
        for i in range(n):
            double = _Barrier(barrier)
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
            agent_pb2_grpc.add_NodeAgentServicer_to_server(double, server)
            port = server.add_insecure_port("127.0.0.1:0")
            server.start()
            register(store, f"n{i:02d}", port)
            servers.append(server)
            doubles.append(double)
        t0 = time.monotonic()
        factory = lambda: Supervisor(policy(preflight_timeout_s=60.0), RunPlan(run=RUN, nodes=n))  # noqa: E731
        with live_shell(store, tmp_path, nodes=n, core_factory=factory) as (_, watch):
            watch.wait(is_launch(1), 60)
            wait_until(lambda: all(d.launches for d in doubles), 30, "every node's launch")
        print(f"{n} nodes preflighted and launched in {time.monotonic() - t0:.2f} s")
        assert not barrier.broken
        assert [d.calls.count("RunPreflight") for d in doubles] == [1] * n
        assert [len(d.launches) for d in doubles] == [1] * n
    finally:
        for server in servers:
            server.stop(grace=None)
