"""Agent RPCs hold no thread (controller.backends.agents: coroutines on one asyncio loop): a fan-out
is one round trip however many hosts, a burn-in that never ends holds up no other call, a task
fanning out never waits for a thread of its own pool (controller.live.tasks), and a node seen again
keeps its channel and the calls in flight on it. The agents here are grpc.aio servicers on their own
loop (a double of the agent's API, so the server side never limits the width); the last test drives
the real shell against real gRPC agents."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc import aio

from controller.backends.agents import AgentClients
from controller.live.tasks import TaskPool
from controller.live.translate import Addresses, Translator
from controller.supervisor.machine import Supervisor
from controller.supervisor.policy import RunPlan
from runwarden import __version__
from runwarden.keys import KeySchema
from runwarden.store import EventType, Store, WatchEvent
from runwarden.v1 import agent_pb2, agent_pb2_grpc, common_pb2, events_pb2, store_pb2
from testbed.wait import wait_until
from tests.live.shell import RUN, AgentDouble, is_launch, live_shell, policy, register


class _Agents(agent_pb2_grpc.NodeAgentServicer):
    """One aio server answering for every node: a `burn_in` preflight waits until `release`; a quick
    one, and each status, waits until `width` calls are in at once (a barrier across nodes)."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.arrived = 0
        self.all_in = asyncio.Event()
        self.release = asyncio.Event()
        self.burning = 0

    async def _barrier(self) -> None:
        self.arrived += 1
        if self.arrived >= self.width:
            self.all_in.set()
        await self.all_in.wait()

    async def RunPreflight(self, request: Any, context: Any) -> AsyncIterator[agent_pb2.RunPreflightResponse]:
        if request.mode == "burn_in":
            self.burning += 1
            await self.release.wait()
        else:
            await self._barrier()
        yield agent_pb2.RunPreflightResponse(
            summary=common_pb2.PreflightSummary(mode=request.mode, passed=True)
        )

    async def GetNodeStatus(self, request: Any, context: Any) -> agent_pb2.GetNodeStatusResponse:
        await self._barrier()
        return agent_pb2.GetNodeStatusResponse(node="any")


@contextmanager
def _served(width: int) -> Iterator[tuple[_Agents, str, asyncio.AbstractEventLoop]]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> tuple[_Agents, aio.Server, int]:
        agents = _Agents(width)
        server = aio.server()
        agent_pb2_grpc.add_NodeAgentServicer_to_server(agents, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return agents, server, port

    agents, server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield agents, f"127.0.0.1:{port}", loop
    finally:
        loop.call_soon_threadsafe(agents.release.set)
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def _clients(address: str, n: int) -> AgentClients:
    clients = AgentClients()
    for i in range(n):
        clients.set_address(f"n{i:04d}", address, registration=1)
    return clients


@pytest.mark.timeout(120)
def test_a_fan_out_of_512_calls_is_one_round_trip_on_no_thread_of_its_own() -> None:
    """512 status calls that each answer only once all 512 have arrived: only a fan-out that sends
    every call at once ends, and it starts no thread per call."""
    n = 512
    with _served(n) as (_, address, _):
        clients = _clients(address, n)
        try:
            threads_before = threading.active_count()
            answers = clients.gather(clients.status_async(f"n{i:04d}", timeout_s=60.0) for i in range(n))
            assert all(out.ok for out, _ in answers), [o.error for o, _ in answers if not o.ok][:3]
            assert threading.active_count() - threads_before < 8
        finally:
            clients.close()


@pytest.mark.timeout(120)
def test_burn_ins_that_never_end_hold_up_no_other_call() -> None:
    """200 burn-ins in flight (each an endless preflight): a fan-out of quick preflights to the same
    nodes, and a launch's status checks, answer as if none ran."""
    n = 200
    with _served(n) as (agents, address, loop):
        clients = _clients(address, n)
        try:
            burn_in = agent_pb2.RunPreflightRequest(mode="burn_in")
            burning = [
                clients.submit(clients.run_preflight_async(f"n{i:04d}", burn_in, 3600.0)) for i in range(n)
            ]
            wait_until(lambda: agents.burning == n, 30, "every burn-in in flight")
            t0 = time.monotonic()
            quick = agent_pb2.RunPreflightRequest(mode="quick")
            answers = clients.gather(clients.run_preflight_async(f"n{i:04d}", quick, 60.0) for i in range(n))
            took = time.monotonic() - t0
            assert all(out.ok and out.summary.passed for out in answers)
            assert not any(f.done() for f in burning)
            print(f"{n} quick preflights beside {n} burn-ins: {took:.2f} s")
            loop.call_soon_threadsafe(agents.release.set)
            assert all(f.result(30).ok for f in burning)
        finally:
            clients.close()


@pytest.mark.timeout(120)
def test_tasks_that_fan_out_while_their_pool_is_full_never_deadlock() -> None:
    n = 64
    with _served(n) as (_, address, _):
        clients = _clients(address, n * 6)
        tasks = TaskPool(2)
        answers: list[int] = []
        lock = threading.Lock()
        done = threading.Semaphore(0)

        def task(k: int) -> None:  # six tasks on two threads, each fanning out 64 calls due together
            got = clients.gather(clients.status_async(f"n{k * n + i:04d}", timeout_s=60.0) for i in range(n))
            with lock:
                answers.append(sum(out.ok for out, _ in got))
            done.release()

        try:
            for k in range(6):
                tasks.submit(task, k)
            assert all(done.acquire(timeout=60.0) for _ in range(6))
            assert answers == [n] * 6
        finally:
            tasks.shutdown()
            clients.close()


@pytest.mark.timeout(60)
def test_a_node_seen_again_keeps_its_calls_and_a_new_registration_ends_them() -> None:
    """A new leader relists and sees every node again (same address, same lease): the burn-ins in
    flight go on. A node that re-registers (a new lease) gets a new channel: its old calls end
    CANCELLED at once, never a hang; a forgotten node's too."""
    with _served(1) as (agents, address, loop):
        clients = _clients(address, 3)
        try:
            burn_in = agent_pb2.RunPreflightRequest(mode="burn_in")
            calls = [
                clients.submit(clients.run_preflight_async(f"n{i:04d}", burn_in, 3600.0)) for i in range(3)
            ]
            wait_until(lambda: agents.burning == 3, 30, "three burn-ins in flight")
            for i in range(3):
                clients.set_address(f"n{i:04d}", address, registration=1)  # seen again
            clients.set_address("n0001", address, registration=2)  # re-registered
            clients.forget("n0002")
            ended = [calls[1].result(10), calls[2].result(10)]
            assert [o.rpc.code for o in ended] == ["CANCELLED", "CANCELLED"], ended
            assert not calls[0].done()
            loop.call_soon_threadsafe(agents.release.set)
            assert calls[0].result(10).ok
        finally:
            clients.close()


def test_a_new_leaders_translator_keeps_each_nodes_channel_until_its_registration_changes() -> None:
    """A step-down and a new term build a new Translator, which meets every node as new: it asks for
    the node's address and registration, never for its channel to be dropped (that cancelled every
    preflight in flight at 2,048 hosts); a deleted record does drop it."""
    keys = KeySchema()

    def put(lease: int) -> WatchEvent:
        rec = store_pb2.NodeRecord(
            node="n1", address="10.0.0.1:50051", lease_id=lease, agent_version=__version__
        )
        return WatchEvent(
            type=EventType.PUT,
            key=keys.node("n1"),
            value=rec.SerializeToString(),
            mod_revision=2,
            create_revision=1,
        )

    first, again = Translator(keys, RUN), Translator(keys, RUN)  # two terms of leadership
    assert first.watch_event(put(7))[1] == Addresses(set={"n1": ("10.0.0.1:50051", 7)})
    assert again.watch_event(put(7))[1] == Addresses(set={"n1": ("10.0.0.1:50051", 7)})
    assert again.watch_event(put(8))[1] == Addresses(set={"n1": ("10.0.0.1:50051", 8)})
    gone = WatchEvent(
        type=EventType.DELETE, key=keys.node("n1"), value=b"", mod_revision=3, create_revision=1
    )
    assert again.watch_event(gone)[1] == Addresses(forget=("n1",))


def test_closed_clients_answer_every_call_at_once() -> None:
    clients = AgentClients()
    clients.set_address("n1", "127.0.0.1:9", registration=1)
    clients.close()
    t0 = time.monotonic()
    out, _ = clients.status("n1", timeout_s=60.0)
    assert not out.ok and out.error == "no address known" and time.monotonic() - t0 < 1.0
    assert (
        clients.gather([clients.stop_async("n1", agent_pb2.StopWorkersRequest(), 60.0)])[0].code
        == "UNAVAILABLE"
    )


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
    """40 agents whose preflights each answer only once all 40 have arrived: the attempt launches,
    every node preflighted once per preflight plan (one, unless the leader stepped down: a process
    starved of the CPU for long enough stops leading, and its successor preflights the attempt anew)."""
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
        # 40 servers' threads in this process: a long lease, so that the leader is not starved out of it
        with live_shell(store, tmp_path, nodes=n, core_factory=factory, election_ttl_s=10.0) as (_, watch):
            watch.wait(is_launch(1), 60)
            wait_until(lambda: all(d.launches for d in doubles), 30, "every node's launch")
            plans = sum(e.kind == events_pb2.EVENT_KIND_PREFLIGHT_PLAN for _, e in watch.entries)
        print(f"{n} nodes preflighted and launched in {time.monotonic() - t0:.2f} s ({plans} plans)")
        assert not barrier.broken
        assert plans >= 1
        assert [d.calls.count("RunPreflight") for d in doubles] == [plans] * n
        assert [len(d.launches) for d in doubles] == [1] * n
    finally:
        for server in servers:
            server.stop(grace=None)
