"""Agent RPC outcomes: temporary vs permanent gRPC codes, and retries within the call's deadline.

The retry loop is tested with a fake clock; the client against a real in-process gRPC server whose
servicer fails the first calls (the real agent is in tests/live/test_loop_failures.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import pytest

from controller.backends.agents import AgentClients, RpcOutcome, is_temporary, with_retries
from runwarden.v1 import agent_pb2, agent_pb2_grpc, common_pb2


@pytest.mark.parametrize(
    ("code", "error", "temporary"),
    [
        ("UNAVAILABLE", "", True),
        ("DEADLINE_EXCEEDED", "", True),
        ("RESOURCE_EXHAUSTED", "RESOURCE_EXHAUSTED: concurrent RPC limit exceeded", True),
        (
            "RESOURCE_EXHAUSTED",
            "RESOURCE_EXHAUSTED: Received message larger than max (70000000 vs. 67108864)",
            False,
        ),
        ("PERMISSION_DENIED", "", False),
        ("FAILED_PRECONDITION", "", False),
        ("INVALID_ARGUMENT", "", False),
        ("UNKNOWN", "", False),
    ],
)
def test_grpc_codes_are_temporary_or_permanent(code: str, error: str, temporary: bool) -> None:
    assert is_temporary(code, error) is temporary
    assert RpcOutcome(node="n1", ok=False, code=code, error=error).temporary is temporary


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def scripted(codes: list[str], t: FakeTime, cost_s: float = 0.0):
    timeouts: list[float] = []

    async def call(timeout: float) -> tuple[RpcOutcome, str | None]:
        timeouts.append(timeout)
        t.now += cost_s
        code = codes.pop(0) if codes else "OK"
        return (
            (RpcOutcome(node="n1", ok=True), "answer")
            if code == "OK"
            else (RpcOutcome(node="n1", ok=False, code=code, error=f"{code}: x"), None)
        )

    return call, timeouts


def test_temporary_failures_are_retried_with_doubling_waits_until_an_answer() -> None:
    t = FakeTime()
    call, timeouts = scripted(["UNAVAILABLE", "DEADLINE_EXCEEDED", "UNAVAILABLE"], t)
    out, resp = asyncio.run(with_retries(call, deadline_s=10.0, sleep=t.sleep, clock=t.clock))
    assert out.ok and resp == "answer" and out.tries == 4
    assert t.sleeps == [0.1, 0.2, 0.4]
    assert timeouts[0] == 10.0 and timeouts[-1] == pytest.approx(10.0 - 0.7)  # each try gets what is left


def test_a_permanent_failure_is_not_retried() -> None:
    t = FakeTime()
    call, timeouts = scripted(["PERMISSION_DENIED"], t)
    out, resp = asyncio.run(with_retries(call, deadline_s=10.0, sleep=t.sleep, clock=t.clock))
    assert not out.ok and not out.temporary and resp is None and len(timeouts) == 1 and t.sleeps == []


def test_still_temporary_when_the_deadline_runs_out() -> None:
    t = FakeTime()
    call, timeouts = scripted(["UNAVAILABLE"] * 100, t, cost_s=0.5)
    out, _ = asyncio.run(with_retries(call, deadline_s=5.0, sleep=t.sleep, clock=t.clock))
    assert not out.ok and out.temporary and out.tries == len(timeouts) > 1
    assert t.now <= 5.0 + 0.5  # never waits past the deadline (the last try may take its own time)


def test_no_retry_once_stopped_and_closed_clients_retry_nothing() -> None:
    t = FakeTime()
    call, _ = scripted(["UNAVAILABLE"] * 100, t)
    stops = iter([False, False, True])
    out, _ = asyncio.run(
        with_retries(call, deadline_s=300.0, sleep=t.sleep, clock=t.clock, stopped=lambda: next(stops))
    )
    assert not out.ok and out.tries == 3 and t.sleeps == [0.1, 0.2]
    # an exiting controller closes its clients: a call to an agent with no address returns at once
    clients = AgentClients()
    clients.close()
    started = time.monotonic()
    status, _ = clients.status("gone", timeout_s=120.0)
    assert not status.ok and status.tries <= 1 and time.monotonic() - started < 1.0


class FlakyAgent(agent_pb2_grpc.NodeAgentServicer):
    """A servicer whose first `fail` calls of each method abort with `code` (a test double of the agent)."""

    def __init__(self, fail: int, code: grpc.StatusCode) -> None:
        self.fail, self.code = fail, code
        self.calls: dict[str, int] = {}

    def _maybe_fail(self, name: str, context: grpc.ServicerContext) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        if self.calls[name] <= self.fail:
            context.abort(self.code, f"{name} refused by the test")

    def RunPreflight(self, request, context):
        self._maybe_fail("RunPreflight", context)
        yield agent_pb2.RunPreflightResponse(
            result=common_pb2.CheckResult(name="x", status=common_pb2.CHECK_STATUS_PASS)
        )
        yield agent_pb2.RunPreflightResponse(
            summary=common_pb2.PreflightSummary(mode=request.mode, passed=True)
        )

    def StopWorkers(self, request, context):
        self._maybe_fail("StopWorkers", context)
        return agent_pb2.StopWorkersResponse()


@pytest.fixture
def flaky() -> Iterator[tuple[AgentClients, Callable[[int, grpc.StatusCode], FlakyAgent]]]:
    servers: list[grpc.Server] = []
    agents = AgentClients()
    made: list[FlakyAgent] = []

    def start(fail: int, code: grpc.StatusCode) -> FlakyAgent:
        servicer = FlakyAgent(fail, code)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        agent_pb2_grpc.add_NodeAgentServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        agents.set_address(f"n{len(made) + 1}", f"127.0.0.1:{port}")
        made.append(servicer)
        return servicer

    yield agents, start
    agents.close()
    for s in servers:
        s.stop(grace=None)


def test_preflight_unavailable_once_is_retried_and_passes(flaky) -> None:
    agents, start = flaky
    servicer = start(1, grpc.StatusCode.UNAVAILABLE)
    out = agents.run_preflight("n1", agent_pb2.RunPreflightRequest(mode="quick"), timeout_s=10.0)
    assert out.ok and out.summary.passed and out.rpc.tries == 2 and servicer.calls["RunPreflight"] == 2


def test_preflight_permission_denied_is_permanent_after_one_try(flaky) -> None:
    agents, start = flaky
    servicer = start(100, grpc.StatusCode.PERMISSION_DENIED)
    out = agents.run_preflight("n1", agent_pb2.RunPreflightRequest(mode="quick"), timeout_s=10.0)
    assert not out.ok and not out.rpc.temporary and servicer.calls["RunPreflight"] == 1


def test_preflight_still_unavailable_at_its_deadline_is_temporary(flaky) -> None:
    agents, start = flaky
    start(10_000, grpc.StatusCode.UNAVAILABLE)
    out = agents.run_preflight("n1", agent_pb2.RunPreflightRequest(mode="quick"), timeout_s=1.0)
    assert not out.ok and out.rpc.temporary and out.rpc.tries > 2


def test_stop_of_a_node_with_nothing_running_is_a_success(flaky) -> None:
    agents, start = flaky
    start(1, grpc.StatusCode.NOT_FOUND)
    assert agents.stop("n1", agent_pb2.StopWorkersRequest(run="r", attempt=1, grace_s=1.0), timeout_s=5.0).ok


def test_a_node_without_an_address_is_unavailable() -> None:
    out = AgentClients().run_preflight("nowhere", agent_pb2.RunPreflightRequest(mode="quick"), timeout_s=0.3)
    assert not out.ok and out.rpc.temporary and "no address" in out.rpc.error
