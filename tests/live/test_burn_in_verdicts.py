"""Issue 26 through the live shell, against a real etcd: a burn-in that could not tell is no strike,
and a failed burn-in waits for a repair durably, so a new leader does not burn the node in again.

The node is an in-process gRPC agent double whose RunPreflight answers as the real agent's bridge
does: a FAIL result for the quick preflight (so the node is quarantined and burned in), then its
burn-in's verdict (FAIL, or INCONCLUSIVE with no FAIL)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from controller.supervisor.machine import Supervisor
from controller.supervisor.policy import RunPlan
from controller.supervisor.pool import PoolState
from runwarden.store import Store
from runwarden.v1 import agent_pb2, agent_pb2_grpc, common_pb2, events_pb2, store_pb2
from tests.live.shell import RUN, AgentDouble, live_shell, policy, register, says

pytestmark = pytest.mark.timeout(120)
S = common_pb2


class BurnInDouble(AgentDouble):
    """Fails its quick preflight; its burn-in answers `burn_in` (FAIL or INCONCLUSIVE)."""

    def __init__(self, burn_in: common_pb2.CheckStatus.ValueType) -> None:
        super().__init__()
        self.burn_in = burn_in
        self.modes: list[str] = []

    def RunPreflight(self, request: Any, context: Any) -> Iterator[agent_pb2.RunPreflightResponse]:
        self.modes.append(request.mode)
        status = self.burn_in if request.mode == "burn_in" else S.CHECK_STATUS_FAIL
        name = "burn_in.allreduce" if request.mode == "burn_in" else "compute.matmul"
        yield agent_pb2.RunPreflightResponse(
            result=common_pb2.CheckResult(name=name, status=status, message="the double's verdict")
        )
        failed = status == S.CHECK_STATUS_FAIL
        yield agent_pb2.RunPreflightResponse(
            summary=common_pb2.PreflightSummary(
                mode=request.mode,
                passed=False,
                fail_count=int(failed),
                failed_checks=[name] if failed else [],
                inconclusive_count=int(not failed),
                inconclusive_checks=[] if failed else [name],
            )
        )


@contextmanager
def serve(store: Store, servicer: AgentDouble, node: str = "n2") -> Iterator[None]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    agent_pb2_grpc.add_NodeAgentServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    register(store, node, port)
    try:
        yield
    finally:
        server.stop(grace=None)


def pool_entry(store: Store, node: str = "n2") -> store_pb2.PoolEntry:
    kv = store.get(store.keys.pool(node))
    assert kv is not None, f"no pool entry for {node}"
    return store_pb2.PoolEntry.FromString(kv.value)


def test_a_failed_burn_in_waits_for_a_repair_in_etcd_and_the_next_leader_does_not_burn_it_in(
    store: Store, tmp_path: Path
) -> None:
    cores: list[Supervisor] = []

    def factory() -> Supervisor:
        cores.append(Supervisor(policy(), RunPlan(run=RUN, nodes=1)))
        return cores[-1]

    double = BurnInDouble(S.CHECK_STATUS_FAIL)
    with serve(store, double), live_shell(store, tmp_path / "a", core_factory=factory) as (_shell, log):
        log.wait(says("burn-in of n2: failed"), 20)
        _, failed = log.wait(says("it waits for a repair"), 5)
        assert "failed burn_in.allreduce" in failed.message
    entry = pool_entry(store)
    assert entry.state == S.POOL_STATE_QUARANTINED and entry.awaiting_repair_since > 0
    assert double.modes == ["quick", "burn_in"]
    with serve(store, double), live_shell(store, tmp_path / "b", core_factory=factory) as (_shell, log):
        log.wait(says("reconciled from the store"), 20)
        # The next leader's core works on (it asks the queue for a node, a second later): by then a
        # burn-in it wrongly started would have reached the agent.
        log.wait(lambda e: e.kind == events_pb2.EVENT_KIND_ALLOCATE, 20)
        assert cores[-1].pool.get("n2").state is PoolState.QUARANTINED
    assert double.modes == ["quick", "burn_in"], "the new leader burned in a node that waits for a repair"


def test_an_inconclusive_burn_in_is_no_strike_and_no_wait_for_repair(store: Store, tmp_path: Path) -> None:
    double = BurnInDouble(S.CHECK_STATUS_INCONCLUSIVE)
    with serve(store, double), live_shell(store, tmp_path / "run") as (_shell, log):
        _, seen = log.wait(says("burn-in of n2: inconclusive"), 20)
        assert (
            "burn_in.allreduce could not tell" in seen.message and "no strike; again in 60s" in seen.message
        )
        assert log.find(says("burn-in of n2: failed")) is None
        entry = pool_entry(store)  # written when its burn-in started; the inconclusive changes nothing
        assert entry.state == S.POOL_STATE_BURN_IN and entry.awaiting_repair_since == 0.0
        assert double.modes == ["quick", "burn_in"]  # not again at once: after its backoff
