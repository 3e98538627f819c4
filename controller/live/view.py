"""The Controller API's view of a live controller.

Nodes, evidence and reputation are read from etcd exactly as any tool would (`StoreBackedView`);
the run's phase comes from the core itself (the shell publishes a `RunStatus` after every batch);
operator quarantine and release go *through the core* like every other event, so the pool, the
event log and the next placement agree. A stop request is written to the run's stop key, the same
path a Slurm USR1 trap or `controllerctl stop` takes, and the watch delivers it to the core. A
policy change is written to the run's policy key (controller/api/policy.py) and reaches the core
the same way, through the watch; on the leader the answer waits until the core decides with it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING

from controller.api.store_view import StoreBackedView
from controller.api.view import ViewNotFound, ViewRefused, ViewUnavailable
from controller.supervisor.events import OperatorQuarantine, OperatorRelease
from controller.supervisor.reconfigure import from_value, values_of
from runwarden.v1 import agent_pb2, common_pb2, controller_pb2

if TYPE_CHECKING:
    from controller.live.loop import LiveController

OPERATOR_TIMEOUT_S = 10.0
APPLIED_POLL_S = 0.02


class LiveView(StoreBackedView):
    def __init__(self, shell: LiveController) -> None:
        super().__init__(shell.store, shell.cfg.event_log_path)
        self._shell = shell

    def run_statuses(self) -> Sequence[controller_pb2.RunStatus]:
        """This run as its core has it (while this controller leads), every other run under the
        root as the store has it (several runs share one fleet: each has its own controllers)."""
        stored = list(super().run_statuses())
        status = self._shell.status
        if status is None or not self._shell.is_leader.is_set():
            return stored
        mine = controller_pb2.RunStatus()
        mine.CopyFrom(status)
        mine.claimed_nodes = len(self._shell.claims.held())
        return sorted([mine, *(r for r in stored if r.run != mine.run)], key=lambda r: r.run)

    def leader(self) -> tuple[str, int]:
        if self._shell.is_leader.is_set() and self._shell.leadership is not None:
            return self._shell.cfg.identity, int(self._shell.leadership.fence)
        return self.run_leader(self._shell.cfg.run)  # this controller's run's leader (a standby asks)

    def _operator(self, event: OperatorQuarantine | OperatorRelease) -> common_pb2.PoolState.ValueType:
        if not self._shell.is_leader.is_set():
            raise ViewUnavailable("this controller is not the leader; ask the leader")
        holder = self._shell.translator.holder(event.node)
        if holder and holder != self._shell.cfg.run:
            raise ViewRefused(f"node {event.node!r} is held by run {holder!r}: ask that run's controller")
        fut = self._shell.submit_and_wait(event)
        from controller.live.loop import CoreRebuilding

        try:
            state = fut.result(timeout=OPERATOR_TIMEOUT_S)
        except FutureTimeout:
            raise ViewUnavailable("the controller did not act on the request in time") from None
        except CoreRebuilding as exc:
            raise ViewUnavailable(str(exc)) from None
        if state is None:
            raise ViewNotFound(f"no node named {event.node!r}")
        return state

    def quarantine(self, node: str, reason: str, actor: str) -> common_pb2.PoolState.ValueType:
        return self._operator(OperatorQuarantine(node=node, reason=f"operator {actor}: {reason}"))

    def release(self, node: str, reason: str, actor: str) -> common_pb2.PoolState.ValueType:
        before = self._shell.pool_state(node)
        if before in (common_pb2.POOL_STATE_SPARE, common_pb2.POOL_STATE_ASSIGNED):
            raise ViewRefused(f"node {node!r} is not quarantined or held; nothing to release")
        return self._operator(OperatorRelease(node=node, reason=f"released by operator {actor}: {reason}"))

    def drain(self, node: str, reason: str, actor: str, *, undo: bool = False) -> bool:
        """Through the node's agent: its record then says DRAINING (or not) and the core follows it,
        the same path as a SIGTERM to that agent."""
        if node not in self._shell.translator.known_nodes:
            raise ViewNotFound(f"no node named {node!r} is registered")
        why = "" if undo else f"operator {actor}: {reason}"
        out, resp = self._shell.agents.drain(node, agent_pb2.DrainRequest(reason=why, undo=undo))
        if not out.ok or resp is None:
            raise ViewUnavailable(f"node {node!r}: its agent did not answer the drain ({out.error})")
        return bool(resp.draining)

    def policy(self, run: str) -> controller_pb2.GetPolicyResponse:
        return super().policy(run or self._shell.cfg.run)

    def set_policy(
        self,
        run: str,
        values: Mapping[str, common_pb2.PolicyValue],
        *,
        replace: bool,
        actor: str,
        reason: str,
    ) -> controller_pb2.SetPolicyResponse:
        run = run or self._shell.cfg.run
        resp = super().set_policy(run, values, replace=replace, actor=actor, reason=reason)
        if run == self._shell.cfg.run:
            resp.applied = self._applied(resp, time.monotonic() + OPERATOR_TIMEOUT_S)
        return resp

    def _applied(self, resp: controller_pb2.SetPolicyResponse, deadline: float) -> bool:
        """Whether this leader's core decides with the written values (False on a standby)."""
        want = {c.key: from_value(c.new) for c in resp.changes}
        while self._shell.is_leader.is_set():
            core = self._shell.core  # read once: a rebuild may replace it
            if core is not None and all(values_of(core.cfg)[k] == v for k, v in want.items()):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(APPLIED_POLL_S)
        return False
