"""The bandwidth gate's measurement in the shell (controller.live.bandwidth, Executor's MeasureBandwidth).

The ring-pair schedule and the per-node figures are checked against a narrow test double of the one
agent RPC (`FakeAllReduceRpc`: each group's figure is its slowest member's speed, with the real RPC's
rank-0-first protocol); then the whole procedure runs through the Executor against three real agents
on 127.0.0.11-13, each running a real gloo rank."""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from controller.backends.agents import AgentClients, RpcOutcome
from controller.live import bandwidth
from controller.live.bandwidth import ring_rounds, run_gate
from controller.live.executor import Executor, RunSettings
from controller.live.tasks import TaskPool
from controller.supervisor.actions import Batch, MeasureBandwidth
from controller.supervisor.events import ActionFailed, BandwidthMeasured
from runwarden.v1 import agent_pb2
from tests.nodeagent.helpers import AgentProc, wait_for


class FakeAllReduceRpc:
    """The agents' MeasureAllReduce, faked: rank 0 names a master, waits for the group's other ranks,
    and answers the slowest member's speed. Refused nodes fail at once (FAILED_PRECONDITION). Records
    every group and whether any node was ever in two groups at once."""

    def __init__(self, speeds: dict[str, float], refuse: frozenset[str] = frozenset()) -> None:
        self.speeds = speeds
        self.refuse = refuse
        self.cv = threading.Condition()
        self.members: dict[str, list[str]] = {}
        self.busy: set[str] = set()
        self.overlaps: list[str] = []
        self.groups: list[tuple[str, ...]] = []

    def measure_all_reduce(self, node, request, timeout_s, on_master=None, cancel=None):
        if node in self.refuse:
            return RpcOutcome(node=node, ok=False, code="FAILED_PRECONDITION", error="refused here"), None
        with self.cv:
            if node in self.busy:
                self.overlaps.append(node)
            self.busy.add(node)
            self.members.setdefault(request.group_id, []).append(node)
            self.cv.notify_all()
        try:
            if request.rank != 0:
                return RpcOutcome(node=node, ok=True), agent_pb2.AllReduceMeasurement()
            assert not request.master_addr and not request.master_port
            on_master(agent_pb2.CollectiveMaster(addr=node, port=1))
            end = time.monotonic() + timeout_s
            with self.cv:
                while len(self.members[request.group_id]) < request.world_size:
                    if (cancel is not None and cancel.is_set()) or time.monotonic() > end:
                        return RpcOutcome(node=node, ok=False, code="CANCELLED", error="cancelled"), None
                    self.cv.wait(0.01)
                group = tuple(self.members[request.group_id])
                self.groups.append(group)
            speed = min(self.speeds[n] for n in group)
            return RpcOutcome(node=node, ok=True), agent_pb2.AllReduceMeasurement(
                world_size=request.world_size, backend="gloo", busbw_gbps=speed, correct=True
            )
        finally:
            with self.cv:
                self.busy.discard(node)


@pytest.mark.parametrize(
    ("n", "rounds"),
    [
        (2, [[(0, 1)]]),
        (3, [[(0, 1)], [(1, 2)], [(2, 0)]]),
        (4, [[(0, 1), (2, 3)], [(1, 2), (3, 0)]]),
        (5, [[(0, 1), (2, 3)], [(1, 2), (3, 4)], [(4, 0)]]),
    ],
)
def test_ring_pair_schedule(n: int, rounds: list[list[tuple[int, int]]]) -> None:
    got = ring_rounds(n)
    assert [list(r) for r in got] == rounds
    for r in got:  # no node twice in one round: the pairs of a round run at once
        members = [i for pair in r for i in pair]
        assert len(members) == len(set(members))
    if n > 2:  # every ring edge once; every node in two pairs
        assert sorted(p for r in got for p in r) == sorted((i, (i + 1) % n) for i in range(n))


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_fake_rpc_a_single_slow_node_has_the_lowest_best_pair_figure(n: int) -> None:
    nodes = tuple(f"n{i}" for i in range(n))
    for slow in nodes:
        rpc = FakeAllReduceRpc({node: 1.0 if node == slow else 10.0 for node in nodes})
        answer = run_gate(rpc, nodes, 30.0)
        assert isinstance(answer, BandwidthMeasured), answer
        figures = dict(answer.per_node_gbps)
        assert answer.nodes == nodes and list(figures) == list(nodes)
        assert answer.set_gbps == 1.0 and answer.detail == "gloo, 4 MiB x 3"
        assert rpc.overlaps == []
        if n == 2:  # the set is the one pair: two nodes cannot say which of them is slow
            assert figures == {node: 1.0 for node in nodes} and rpc.groups == [nodes]
            continue
        assert figures[slow] == 1.0 and min(figures, key=figures.__getitem__) == slow
        assert all(figures[node] == 10.0 for node in nodes if node != slow)
        assert rpc.groups[0] == nodes and len(rpc.groups) == 1 + n  # the set, then the n ring pairs


def test_fake_rpc_a_refusing_node_gets_no_figure_fast_and_the_reason() -> None:
    nodes = ("n0", "n1", "n2", "n3")
    rpc = FakeAllReduceRpc(dict.fromkeys(nodes, 5.0), refuse=frozenset({"n2"}))
    started = time.monotonic()
    answer = run_gate(rpc, nodes, 60.0)
    assert time.monotonic() - started < 5  # the refusal cancels its group: no waiting out a timeout
    assert isinstance(answer, BandwidthMeasured)
    # a refusal (busy, an older agent) says nothing about n2's link: no figure, so never "slow"
    assert dict(answer.per_node_gbps) == {"n0": 5.0, "n1": 5.0, "n3": 5.0}
    assert answer.set_gbps == 0.0
    assert "n0+n1+n2+n3: n2: refused here" in answer.detail and "n2+n3: n2: refused here" in answer.detail


def test_fake_rpc_nothing_measured_is_a_temporary_action_failed() -> None:
    nodes = ("n0", "n1", "n2")
    rpc = FakeAllReduceRpc(dict.fromkeys(nodes, 5.0), refuse=frozenset(nodes))
    answer = run_gate(rpc, nodes, 30.0)
    assert isinstance(answer, str) and answer.startswith("no all-reduce could run")
    posted: queue.Queue = queue.Queue()
    ex = _executor(rpc, posted)
    action = MeasureBandwidth(nodes=nodes, timeout_s=30.0)
    assert ex.execute(Batch(actions=(action,))) == []  # off the loop: the answer comes on the queue
    failed = posted.get(timeout=10)
    assert isinstance(failed, ActionFailed) and failed.action == action and failed.temporary
    assert "refused here" in failed.reason
    ex.tasks.shutdown()


def test_fake_rpc_the_gate_ends_within_its_budget_when_the_others_never_join() -> None:
    class NoMaster(FakeAllReduceRpc):  # rank 0's agent never names a master
        def measure_all_reduce(self, node, request, timeout_s, on_master=None, cancel=None):
            end = time.monotonic() + timeout_s
            while time.monotonic() < end and not (cancel is not None and cancel.is_set()):
                time.sleep(0.01)
            return RpcOutcome(node=node, ok=False, code="CANCELLED", error="cancelled"), None

    started = time.monotonic()
    answer = run_gate(NoMaster({}), ("n0", "n1", "n2"), 8.0)
    assert time.monotonic() - started < 8.0
    assert isinstance(answer, str) and "named no master" in answer


def _executor(agents, posted: queue.Queue) -> Executor:
    """An Executor with only what MeasureBandwidth uses (the agents, the pool, the queue)."""
    return Executor(
        RunSettings(run="live", command=("true",), env=(), procs_per_node=1, rpc_timeout_s=5.0),
        store=SimpleNamespace(keys=None),
        leadership=None,
        eventlog=None,
        timers=None,
        backend=None,
        agents=agents,
        pager=None,
        translator=None,
        tasks=TaskPool(),
        post=posted.put,
        relist=lambda: None,
        listeners=[],
    )


HOSTS = ("127.0.0.11", "127.0.0.12", "127.0.0.13")


@pytest.fixture
def three_agents(tmp_path: Path):
    agents = []
    try:
        for i, host in enumerate(HOSTS):
            agents.append(
                AgentProc(tmp_path / f"agent{i}", node=f"n{i + 1}", flags=["--listen", f"{host}:0"])
            )
        yield agents
    finally:
        for a in agents:
            a.close()


def _address(agent: AgentProc) -> str:
    import re

    m = wait_for(
        lambda: re.search(r"serving: tcp ([\d.]+):\d+ \(port (\d+)\)", agent.log()), 10, "the serving line"
    )
    return f"{m.group(1)}:{m.group(2)}"


@pytest.mark.slow
def test_a_burn_in_soak_through_the_executor_against_three_real_agents(three_agents) -> None:
    """The burn-in soak is the gate's measurement with its own iteration count (the gate's default
    count is what the fake-RPC tests see)."""
    clients = AgentClients()
    for a in three_agents:
        clients.set_address(a.node, _address(a))
    posted: queue.Queue = queue.Queue()
    ex = _executor(clients, posted)
    nodes = tuple(a.node for a in three_agents)
    action = MeasureBandwidth(nodes=nodes, timeout_s=60.0, purpose="burn_in", iterations=5)
    started = time.monotonic()
    ex.execute(Batch(actions=(action,)))
    answer = posted.get(timeout=70)
    cost = time.monotonic() - started
    assert isinstance(answer, BandwidthMeasured), answer
    assert answer.nodes == nodes and [n for n, _ in answer.per_node_gbps] == list(nodes)
    assert answer.set_gbps > 0 and all(g > 0 for _, g in answer.per_node_gbps), answer
    assert answer.detail == f"gloo, {bandwidth.SIZE_BYTES >> 20} MiB x 5"
    assert answer.duration_s <= cost < 60
    shown = ", ".join(f"{n} {g:.3f}" for n, g in answer.per_node_gbps)
    print(f"burn-in soak on 3 real agents: {cost:.2f}s; set {answer.set_gbps:.3f} GB/s; best pair: {shown}")
    ex.tasks.shutdown()
    clients.close()


@pytest.mark.slow
def test_a_dead_agent_gets_zero_and_the_others_their_pair_figure(three_agents) -> None:
    clients = AgentClients()
    for a in three_agents:
        clients.set_address(a.node, _address(a))
    three_agents[2].kill()  # n3's agent is gone: its pairs cannot run
    started = time.monotonic()
    answer = run_gate(clients, ("n1", "n2", "n3"), 60.0)
    assert isinstance(answer, BandwidthMeasured), answer
    figures = dict(answer.per_node_gbps)
    assert figures["n3"] == 0.0 and figures["n1"] > 0 and figures["n2"] > 0
    assert answer.set_gbps == 0.0 and "n3: UNAVAILABLE" in answer.detail
    assert time.monotonic() - started < 30  # a failure cancels its group: no timeout waited out
    clients.close()
