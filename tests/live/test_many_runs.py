"""Several runs on one fleet (issue 21): two real `LiveController`s with real `Supervisor` cores, each
in its own election, under one etcd root (a real etcd), on one fleet of five node agents.

The agents are the in-process gRPC doubles of tests/live/shell.py (every preflight passes, a launch
starts no workers, a stop writes the node's exit into its progress key as a real agent does): the
claims are between the controllers and etcd, and no agent takes part in them. The same story on
real node agents and real torch jobs, with a standby's takeover, is tests/e2e/test_two_runs.py; this
module is the fast one (both runs in one process, their cores inspected). What is proven, through
the shells' real paths (bids, claim transactions, watches, NodeClaimed events, the attempt record's
compares):

* both runs run, each on nodes only it holds;
* a fatal fault in each run at the same moment, with one spare left: both ask for it at once, the
  higher-priority run gets it, the other waits, never both; the loser's core never preflights or
  launches on it;
* a node one run quarantined is never handed to the other, and when the first run ends and gives
  its nodes back, the second run's core loads the node's record (held, its strike) and keeps it out;
* `controllerctl status` lists both runs with their leaders; `controllerctl nodes` names the run
  holding each node.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from controller.api.access import AccessPolicy
from controller.api.server import build_server
from controller.ctl.main import main as ctl_main
from controller.fleet.claims import read_claim
from controller.live.loop import LiveController, ShellConfig
from controller.live.view import LiveView
from controller.supervisor.machine import RunState, Supervisor
from controller.supervisor.policy import RunPlan
from controller.supervisor.pool import PoolState
from runwarden.eventlog import LogEntry
from runwarden.store import Store, StoreConfig
from runwarden.v1 import agent_pb2, agent_pb2_grpc, common_pb2, events_pb2, store_pb2
from testbed.etcd_server import EtcdServer
from tests.live.shell import AgentDouble, LogWatch, policy, register

NODES = ("n1", "n2", "n3", "n4", "n5")
PRIORITY = {"alpha": 0, "beta": 5}


class StoppingAgent(AgentDouble):
    """The double, plus what a real agent does when its workers are stopped: it writes their exit
    into its progress key (the controller learns exits from that watch). Records who launched."""

    def __init__(self, store: Store, node: str) -> None:
        super().__init__()
        self.store, self.node = store, node
        self.launched_by: list[str] = []
        self.attempt: dict[str, int] = {}  # run -> its last attempt launched here

    def LaunchWorkers(self, request: Any, context: Any) -> agent_pb2.LaunchWorkersResponse:
        self.launched_by.append(request.run)
        self.attempt[request.run] = request.attempt
        return super().LaunchWorkers(request, context)

    def StopWorkers(self, request: Any, context: Any) -> agent_pb2.StopWorkersResponse:
        self._exit(request.run, request.attempt, common_pb2.ExitStatus(signal=15, detail="stopped"))
        return super().StopWorkers(request, context)

    def RequestStop(self, request: Any, context: Any) -> agent_pb2.RequestStopResponse:
        """A planned stop: the ranks save, commit and exit 0 at once (the double has no ranks)."""
        attempt = self.attempt.get(request.run, 0)
        self._exit(request.run, attempt, common_pb2.ExitStatus(exit_code=0, planned_stop=request.reason))
        return agent_pb2.RequestStopResponse(accepted=True)

    def _exit(self, run: str, attempt: int, status: common_pb2.ExitStatus) -> None:
        status.ended_at = time.time()
        prog = store_pb2.NodeProgress(node=self.node, run=run, attempt=attempt, exit=status)
        self.store.put(self.store.keys.progress(run, self.node), prog.SerializeToString())


@dataclass
class Fleet:
    store: Store
    agents: dict[str, StoppingAgent]
    shells: dict[str, LiveController] = field(default_factory=dict)
    logs: dict[str, LogWatch] = field(default_factory=dict)
    api: str = ""

    def dump(self) -> str:
        """The claims, attempt records and both runs' logs, for a failed assertion."""
        lines = [f"claims: { {n: self.holder(n) for n in NODES} }"]
        for run, log in self.logs.items():
            lines.append(f"{run} attempt nodes: {self.attempt_nodes(run)}")
            with log.lock:
                lines += [f"  {run} a{e.attempt} {e.kind}: {e.message}" for _, e in log.entries[-40:]]
        return "\n".join(lines)

    def holder(self, node: str) -> str:
        claim = read_claim(self.store.get(self.store.keys.claim(node)))
        return claim.run if claim is not None else ""

    def attempt_nodes(self, run: str) -> tuple[str, ...]:
        rec = store_pb2.AttemptRecord.FromString(self.store.get(self.store.keys.attempt(run)).value)
        return tuple(rec.nodes)

    def core(self, run: str) -> Supervisor:
        core = self.shells[run].core
        assert isinstance(core, Supervisor)
        return core

    def fault(self, node: str, seq: int) -> None:
        ev = common_pb2.Evidence(
            node=node,
            kind=common_pb2.EVIDENCE_KIND_XID,
            severity=common_pb2.SEVERITY_FATAL,
            xid=79,
            detail="Xid 79: GPU has fallen off the bus",
            observed_at=time.time(),
        )
        self.store.put(
            self.store.keys.evidence(node, seq), store_pb2.EvidenceRecord(evidence=ev).SerializeToString()
        )


def wait_for(
    what: str, cond: Callable[[], object], timeout_s: float = 20.0, show: Callable[[], str] = str
) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{show()}")
        time.sleep(0.05)


def launched(attempt: int) -> Callable[[LogEntry], bool]:
    """The attempt's workers started on every node (logged after its record was written and the
    launch RPCs answered; its LAUNCH entry is logged before either)."""
    return lambda e: e.kind == events_pb2.EVENT_KIND_WORKERS_STARTED and e.attempt == attempt


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = Path(tmp_path_factory.mktemp("many-runs"))
    etcd = EtcdServer(root / "etcd", fast=True).start()
    store = Store.connect(StoreConfig(endpoints=(etcd.endpoint,), timeout_s=5.0))
    servers, threads = [], []
    fleet = Fleet(store=store, agents={})
    try:
        for node in NODES:
            agent = StoppingAgent(store, node)
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
            agent_pb2_grpc.add_NodeAgentServicer_to_server(agent, server)
            port = server.add_insecure_port("127.0.0.1:0")
            server.start()
            servers.append(server)
            register(store, node, port)
            fleet.agents[node] = agent
        for run in ("alpha", "beta"):
            cfg = ShellConfig(
                run=run,
                command=("train.py",),
                run_dir=root / run,
                identity=f"{run}-controller",
                election_ttl_s=2.0,
                tick_s=0.1,
                priority=PRIORITY[run],
                claim_bid_window_s=1.0,  # both runs' asks after one fault instant fall inside it
            )
            cfg.run_dir.mkdir()
            shell = LiveController(
                cfg,
                store,
                lambda run=run: Supervisor(policy(stop_grace_s=5.0), RunPlan(run=run, nodes=2)),
            )
            fleet.logs[run] = LogWatch()
            shell.listeners.append(fleet.logs[run])
            fleet.shells[run] = shell
        for shell in fleet.shells.values():  # both at once: they ask for the same two best nodes
            threads.append(threading.Thread(target=shell.run, daemon=True))
            threads[-1].start()
        api, port = build_server(LiveView(fleet.shells["alpha"]), "127.0.0.1:0", policy=AccessPolicy())
        api.start()
        servers.append(api)
        fleet.api = f"127.0.0.1:{port}"
        yield fleet
    finally:
        for shell in fleet.shells.values():
            shell.stop()
        for t in threads:
            t.join(timeout=15)
        for shell in fleet.shells.values():
            shell.close()
        for server in servers:
            server.stop(grace=None)
        store.close()
        etcd.discard()


def test_two_runs_share_a_fleet_a_spare_goes_to_one_and_a_quarantine_follows_the_node(
    fleet: Fleet, capsys: pytest.CaptureFixture[str]
) -> None:
    # 1. each runs, on nodes only it holds; the higher priority got the two best nodes they both asked for
    for run in ("alpha", "beta"):
        fleet.logs[run].wait(launched(1), 20)
    alpha, beta = fleet.attempt_nodes("alpha"), fleet.attempt_nodes("beta")
    assert not set(alpha) & set(beta)
    assert set(beta) == {"n1", "n2"}  # both picked n1, n2 (best by name); beta's priority won them
    assert all(fleet.holder(n) == "alpha" for n in alpha) and all(fleet.holder(n) == "beta" for n in beta)
    (spare,) = set(NODES) - set(alpha) - set(beta)
    assert fleet.holder(spare) == ""

    # controllerctl: every run under the root with its leader; the run holding each node
    assert ctl_main(["--controller", fleet.api, "status"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert {"alpha", "beta"} <= set(rows)
    assert "alpha-controller" in rows["alpha"] and "beta-controller" in rows["beta"]
    assert ctl_main(["--controller", fleet.api, "nodes"]) == 0
    held = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    for node in NODES:
        assert (fleet.holder(node) or "-") in held[node], held[node]

    # 2. a fatal fault in each run at the same instant, one spare left: beta (priority 5) gets it
    victim_a, victim_b = alpha[0], beta[0]
    fleet.fault(victim_a, 1)
    fleet.fault(victim_b, 1)
    fleet.logs["beta"].wait(launched(2), 20)
    assert spare in fleet.attempt_nodes("beta"), fleet.dump()
    lost = fleet.logs["alpha"].wait(lambda e: spare in e.message and "run beta" in e.message, 10)[1]
    assert "not claimed" in lost.message or "claimed by run beta" in lost.message, lost.message
    core_a = fleet.core("alpha")
    assert (
        core_a.state in (RunState.PREFLIGHT, RunState.WAITING_NODES) and spare not in core_a.preparing.slots
    )
    assert not fleet.logs["alpha"].find(lambda e: e.kind == events_pb2.EVENT_KIND_LAUNCH and e.attempt == 2)
    assert fleet.holder(spare) == "beta" and spare in fleet.attempt_nodes("beta"), fleet.dump()
    assert "beta" in fleet.agents[spare].launched_by and "alpha" not in fleet.agents[spare].launched_by
    assert fleet.logs["alpha"].find(
        lambda e: e.kind == events_pb2.EVENT_KIND_NODE_CLAIMED and spare in e.message
    )
    assert fleet.core("alpha").pool.get(spare).elsewhere == "beta"
    for run, victim in (("alpha", victim_a), ("beta", victim_b)):
        assert fleet.holder(victim) == run  # each answers for the node it quarantined
        assert fleet.core(run).pool.get(victim).state is PoolState.HELD  # needs repair: fatal Xid
    assert (
        "alpha" not in fleet.agents[victim_b].launched_by and "beta" not in fleet.agents[victim_a].launched_by
    )

    # 3. beta ends and gives its nodes back; its quarantined node comes with its record to alpha
    stop = store_pb2.StopRequest(run="beta", reason="done", requested_at=time.time(), relaunch=False)
    fleet.store.put(fleet.store.keys.stop("beta"), stop.SerializeToString())
    wait_for("alpha's relaunch", lambda: fleet.logs["alpha"].find(launched(2)), 30, fleet.dump)
    wait_for("beta's claims given back", lambda: all(fleet.holder(n) != "beta" for n in NODES))
    again = fleet.attempt_nodes("alpha")
    assert victim_b not in again and victim_a not in again  # held nodes stay out, whoever held them
    quarantined = fleet.core("alpha").pool.get(victim_b)
    assert quarantined.state is PoolState.HELD and len(quarantined.failure_times) == 1  # beta's strike
    rep = store_pb2.Reputation.FromString(fleet.store.get(fleet.store.keys.reputation(victim_b)).value)
    assert rep.failures == 1
    wait_for("alpha to answer for the held node", lambda: fleet.holder(victim_b) == "alpha")
    assert fleet.agents[victim_b].launched_by == ["beta"]  # beta's attempt 1 only: never handed to alpha
