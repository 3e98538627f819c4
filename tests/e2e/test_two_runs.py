"""Issue 21 on the real parts: two runs on one fleet of node agents under one etcd root.

One deployment for the module: a private etcd, five real node agents (`nodeagent --config`, one rank
each, real gRPC, chaos on), and two runs, `alpha` (priority 0) and `beta` (priority 5), each supervised
by its own real controller process (`controller run --config`, its own election, its own event log)
training examples/train.py under torchrun with gloo on CPU, 2 nodes each; the fifth node is the shared
spare. The steps share the deployment and run in order (each starts where the last one left it):

1. both runs run, each on nodes only it holds (claims/<node> in etcd); `controllerctl status` lists
   both runs with their leaders, `controllerctl nodes` names the run holding each node;
2. a standby controller for beta starts; beta's leader is stopped (SIGTERM, the upgrade path): the
   standby leads, adopts beta's claims (the same keys, untouched) and its running attempt (no
   relaunch: attempt 1 keeps training), and alpha is unaffected (no launch, still attempt 1);
3. a fatal Xid on one node of each run at the same instant (the agents' InjectFault): both runs
   quarantine their node (held for repair) and both ask for the one spare: exactly one run holds
   it and launches on it; the other never launches there and waits, told who holds it. When the two
   asks fall in one bid window (so far every run here: the faults are one instant) beta's priority
   wins; else the first to ask does, and the test takes either. Neither run logs the other's Xid
   as a detection of its own (its goodput counts one failure);
4. the winner ends (`controllerctl stop`): its nodes are given back, its quarantined node with its
   record; the waiting run takes a healthy node, never the quarantined one, and its core holds that
   node as held for repair with the winner's strike on it (the reputation key follows the node).

The claim race itself (both ask in one bid window) is proven at the store level (tests/store/
test_claims.py); here the two asks come from live controllers after real faults, as they happen.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path

import grpc
import pytest

from controller.ctl.main import main as ctl_main
from controller.fleet.claims import read_claim
from controller.goodput.report import compute_goodput
from examples.cluster import ClusterSpec, LocalCluster, leftover_processes
from runwarden.eventlog import LogEntry, read_events
from runwarden.store import KeyValue, Store, StoreConfig
from runwarden.v1 import (
    agent_pb2,
    agent_pb2_grpc,
    common_pb2,
    controller_pb2,
    controller_pb2_grpc,
    events_pb2,
    store_pb2,
)
from testbed.etcd_server import free_port
from testbed.fleet_cluster import controller_settings, start_controller, write_toml

E = events_pb2
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
PRIORITY = {"alpha": 0, "beta": 5}
XID_LINE = "NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus."
WAIT_S = 90.0


class TwoRuns(LocalCluster):
    """LocalCluster's etcd and agents (node1..node5), and instead of its one controller, a controller
    per run (each its own config file, run directory, API port and priority) plus a standby for beta.
    Every controller process is kept in `standbys` (by identity), which `LocalCluster.stop` stops."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, ClusterSpec(warm_workers=False, active=2, spares=3, ckpt_every=5))
        self.api: dict[str, str] = {}  # identity -> its Controller API address
        self.store: Store | None = None
        # what the spare race left, for the step after it
        self.winner, self.loser, self.spare = "", "", ""
        self.victims: dict[str, str] = {}

    def run_root(self, run: str) -> Path:
        return self.root / run

    def events_of(self, run: str) -> list[LogEntry]:
        return read_events(self.run_root(run) / "events.jsonl").entries

    def _start_controller(self) -> None:  # LocalCluster.start: after etcd and the agents
        assert self.etcd is not None
        for run, priority in PRIORITY.items():
            d = self.run_root(run)
            for sub in ("checkpoints", "losses"):
                (d / sub).mkdir(parents=True, exist_ok=True)
            identity = f"{run}-a"
            self.api[identity] = f"127.0.0.1:{free_port()}"
            settings = controller_settings(
                replace(self.spec, run=run),
                store={"endpoints": [self.etcd.endpoint]},
                run_dir=d,
                ckpt_dir=d / "checkpoints",
                loss_dir=d / "losses",
                api_address=self.api[identity],
                metrics_address="",
            )
            settings["controller"].update(priority=priority, identity=identity)
            write_toml(d / "controller.toml", settings)
            self.standbys[identity] = start_controller(d / "controller.toml", d / f"{identity}.log")
        self.store = Store.connect(StoreConfig(endpoints=(self.etcd.endpoint,), timeout_s=5.0))

    def start_standby(self, identity: str) -> int:
        """A second controller for beta, on beta's config (its own identity and API port)."""
        port = free_port()
        self.api[identity] = f"127.0.0.1:{port}"
        d = self.run_root("beta")
        self.standbys[identity] = start_controller(
            d / "controller.toml",
            d / f"{identity}.log",
            *("--identity", identity, "--api", self.api[identity], "--metrics", ""),
        )
        return port

    def stop(self) -> None:
        if self.store is not None:
            self.store.close()
        super().stop()

    # -- reading the fleet ---------------------------------------------------------------------

    @property
    def kv(self) -> Store:
        assert self.store is not None
        return self.store

    def claim(self, node: str) -> KeyValue | None:
        return self.kv.get(self.kv.keys.claim(node))

    def holder(self, node: str) -> str:
        claim = read_claim(self.claim(node))
        return claim.run if claim is not None else ""

    def reputation(self, node: str) -> store_pb2.Reputation:
        kv = self.kv.get(self.kv.keys.reputation(node))
        return store_pb2.Reputation.FromString(kv.value) if kv is not None else store_pb2.Reputation()

    def runs_seen_by(self, identity: str) -> dict[str, controller_pb2.RunStatus]:
        with grpc.insecure_channel(self.api[identity]) as ch:
            resp = controller_pb2_grpc.ControllerStub(ch).GetStatus(
                controller_pb2.GetStatusRequest(), timeout=5
            )
        return {r.run: r for r in resp.runs}

    def nodes_seen_by(self, identity: str) -> dict[str, controller_pb2.NodeInfo]:
        with grpc.insecure_channel(self.api[identity]) as ch:
            resp = controller_pb2_grpc.ControllerStub(ch).ListNodes(
                controller_pb2.ListNodesRequest(), timeout=5
            )
        return {n.node: n for n in resp.nodes}

    def inject_xid(self, nodes: list[str]) -> None:
        """A fatal Xid fed to each node's agent monitor (its InjectFault RPC), one right after another."""
        stubs = []
        for node in nodes:
            kv = self.kv.get(self.kv.keys.node(node))
            assert kv is not None, f"{node} is not registered"
            address = store_pb2.NodeRecord.FromString(kv.value).address
            stubs.append((grpc.insecure_channel(address), node))
        req = agent_pb2.InjectFaultRequest(kind=agent_pb2.FAULT_KIND_XID, line=XID_LINE)
        try:
            for ch, _ in stubs:
                agent_pb2_grpc.NodeAgentStub(ch).InjectFault(req, timeout=5)
        finally:
            for ch, _ in stubs:
                ch.close()

    def losses(self, run: str) -> list[dict[str, float]]:
        path = self.run_root(run) / "losses" / "loss-rank0.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]

    def tail(self, run: str) -> str:
        out = []
        for log in sorted(self.run_root(run).glob("*-?.log")):
            out.append(f"--- {log.name}\n{log.read_text(errors='replace')[-2500:]}")
        events = self.events_of(run)
        out.append(
            "--- events\n"
            + "\n".join(f"{e.seq} a{e.attempt} {E.EventKind.Name(e.kind)}: {e.message}" for e in events[-30:])
        )
        out.append(f"--- claims {[(n, self.holder(n)) for n in self.nodes]}")
        return "\n".join(out)


def wait_until(
    what: str, cond: Callable[[], object], timeout_s: float, show: Callable[[], str] = str
) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{show()}")
        time.sleep(0.2)


def launches(fleet: TwoRuns, run: str) -> list[LogEntry]:
    return [e for e in fleet.events_of(run) if e.kind == E.EVENT_KIND_LAUNCH]


def started(fleet: TwoRuns, run: str) -> list[LogEntry]:
    """The LAUNCH entries whose workers started. A LAUNCH is logged before it is carried out (the
    log is written ahead); one on a shared spare another run claimed first is followed by "attempt N
    was not launched" instead (a pre-validated spare is claimed at the launch, not by a preflight)."""
    events = fleet.events_of(run)
    ran = {e.attempt for e in events if e.kind == E.EVENT_KIND_WORKERS_STARTED}
    return [e for e in events if e.kind == E.EVENT_KIND_LAUNCH and e.attempt in ran]


def first_step(fleet: TwoRuns, run: str, attempt: int) -> bool:
    return any(e.kind == E.EVENT_KIND_FIRST_STEP and e.attempt == attempt for e in fleet.events_of(run))


def trained(fleet: TwoRuns, run: str, attempt: int, after_ts: float) -> bool:
    """rank 0 of `run` logged a step of `attempt` after `after_ts`."""
    return any(int(x["attempt"]) == attempt and float(x["ts"]) > after_ts for x in fleet.losses(run))


def ctl(address: str, *args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = ctl_main(["--controller", address, *args])
    assert rc == 0, out.getvalue()
    return out.getvalue()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoRuns]:
    f = TwoRuns(tmp_path_factory.mktemp("tworuns") / "fleet")
    try:
        f.start()
        for run in PRIORITY:
            wait_until(f"{run}'s first step", partial(first_step, f, run, 1), 150, partial(f.tail, run))
        yield f
    finally:
        f.stop()
    assert not leftover_processes(f.root, wait_s=10), "the deployment left processes behind"


def test_both_runs_train_each_on_nodes_only_it_holds(fleet: TwoRuns) -> None:
    alpha, beta = (set(launches(fleet, run)[-1].launch.nodes) for run in PRIORITY)
    assert len(alpha) == len(beta) == 2 and not alpha & beta
    for run, nodes in (("alpha", alpha), ("beta", beta)):
        assert all(fleet.holder(n) == run for n in nodes), fleet.tail(run)
    (spare,) = set(fleet.nodes) - alpha - beta
    # a run claims the shared spare only while its background preflight of it runs (spare_checks.py)
    wait_until(
        "the shared spare to be free", lambda: fleet.holder(spare) == "", 60, partial(fleet.tail, "beta")
    )
    # every controller answers for every run under the root: each run with its own leader
    status = fleet.runs_seen_by("alpha-a")
    assert status["alpha"].leader == "alpha-a" and status["beta"].leader == "beta-a"
    assert status["alpha"].claimed_nodes == status["beta"].claimed_nodes == 2
    rows = {line.split()[0]: line for line in ctl(fleet.api["beta-a"], "status").splitlines()[1:] if line}
    assert "alpha-a" in rows["alpha"] and "beta-a" in rows["beta"]
    # a spare's claim moves while the table is read (beta's background spare check claims it for its
    # preflight): the holder shown is the one etcd had just before or just after (CI run of a37af09)
    before = {node: fleet.holder(node) or "-" for node in fleet.nodes}
    held = {
        line.split()[0]: line.split() for line in ctl(fleet.api["alpha-a"], "nodes").splitlines()[1:] if line
    }
    after = {node: fleet.holder(node) or "-" for node in fleet.nodes}
    for node in fleet.nodes:
        assert before[node] in held[node] or after[node] in held[node], (
            held[node],
            before[node],
            after[node],
        )


def test_a_standby_takes_over_one_run_adopting_its_claims_and_attempt_the_other_run_unaffected(
    fleet: TwoRuns,
) -> None:
    fleet.start_standby("beta-b")
    wait_until("beta's standby to answer", lambda: _answers(fleet, "beta-b"), 30, lambda: fleet.tail("beta"))
    nodes = list(launches(fleet, "beta")[-1].launch.nodes)
    claims_before = {n: fleet.claim(n) for n in nodes}
    launched = {run: len(launches(fleet, run)) for run in PRIORITY}
    leader = fleet.standbys["beta-a"]
    # Read before the signal: the leader resigns at once and the standby may have adopted (and logged
    # it) before this process runs again, on a loaded machine.
    stopped_at = time.time()
    os.killpg(leader.pid, signal.SIGTERM)  # the upgrade path: the leader resigns on its way out
    assert leader.wait(timeout=20) == 0
    wait_until(
        "beta-b to lead beta",
        lambda: fleet.runs_seen_by("beta-b")["beta"].leader == "beta-b",
        20,
        lambda: fleet.tail("beta"),
    )
    took_over = time.time()
    # the running attempt goes on, adopted, in both runs: rank 0 logs new steps of attempt 1
    for run in PRIORITY:
        wait_until(
            f"{run} to train on",
            partial(trained, fleet, run, 1, took_over + 1.0),
            30,
            partial(fleet.tail, run),
        )
    assert {run: len(launches(fleet, run)) for run in PRIORITY} == launched, "a run was relaunched"
    beta = fleet.runs_seen_by("beta-b")["beta"]
    assert beta.attempt == 1 and set(beta.nodes) == set(nodes) and beta.claimed_nodes == 2
    assert beta.phase == controller_pb2.RUN_PHASE_RUNNING
    for node in nodes:  # the same claim keys, not given back and taken again
        now = fleet.claim(node)
        before = claims_before[node]
        assert now is not None and before is not None
        assert (now.create_revision, now.mod_revision) == (before.create_revision, before.mod_revision)
    after = [e for e in fleet.events_of("beta") if e.ts > stopped_at]
    assert not [e for e in after if e.kind in (E.EVENT_KIND_DETECTION, E.EVENT_KIND_STOP_REQUEST)], [
        e.message for e in after
    ]
    adopted = [e for e in after if e.kind == E.EVENT_KIND_CONTROL_PLANE and "adopted" in e.message]
    assert adopted and adopted[0].attempt == 1, [e.message for e in after]
    assert fleet.runs_seen_by("alpha-a")["alpha"].leader == "alpha-a"


def _answers(fleet: TwoRuns, identity: str) -> bool:
    try:
        return fleet.runs_seen_by(identity)["beta"].leader == "beta-a"
    except (grpc.RpcError, KeyError):
        return False


def test_faults_in_both_runs_at_once_the_spare_goes_to_one_run_only(fleet: TwoRuns) -> None:
    nodes = {run: list(launches(fleet, run)[-1].launch.nodes) for run in PRIORITY}
    (spare,) = set(fleet.nodes) - set(nodes["alpha"]) - set(nodes["beta"])
    victims = {run: nodes[run][0] for run in PRIORITY}
    marks = {run: fleet.events_of(run)[-1].seq for run in PRIORITY}
    fleet.inject_xid([victims["alpha"], victims["beta"]])
    wait_until(
        "one run to relaunch on the spare",
        lambda: any(len(started(fleet, run)) == 2 for run in PRIORITY),
        WAIT_S,
        lambda: fleet.tail("alpha") + fleet.tail("beta"),
    )
    winner = next(run for run in PRIORITY if len(started(fleet, run)) == 2)
    (loser,) = set(PRIORITY) - {winner}
    relaunch = started(fleet, winner)[-1]
    assert spare in relaunch.launch.nodes and victims[winner] not in relaunch.launch.nodes
    wait_until(
        f"{winner}'s first step",
        lambda: first_step(fleet, winner, relaunch.attempt),
        WAIT_S,
        lambda: fleet.tail(winner),
    )
    assert fleet.holder(spare) == winner
    # the loser never launched there: it waits for a node, told which run holds the spare
    wait_until(
        f"{loser} to hear who holds {spare}",
        lambda: any(
            e.seq > marks[loser]
            and e.kind == E.EVENT_KIND_NODE_CLAIMED
            and spare in e.message
            and winner in e.message
            for e in fleet.events_of(loser)
        ),
        10,
        lambda: fleet.tail(loser),
    )
    assert len(started(fleet, loser)) == 1, fleet.tail(loser)
    for e in launches(fleet, loser)[1:]:  # a launch on the spare the winner claimed first, not carried out
        assert any(
            f"attempt {e.attempt} was not launched" in x.message and f"not claimed: {spare}" in x.message
            for x in fleet.events_of(loser)
        ), fleet.tail(loser)
    # both asked within one bid window (the usual case here: the faults were one instant): priority decided
    at_once = [
        e for e in fleet.events_of(loser) if e.seq > marks[loser] and "asked for it at once" in e.message
    ]
    assert not at_once or (winner == "beta" and "run beta" in at_once[0].message), at_once[0].message
    lost = fleet.runs_seen_by(fleet_leader(fleet, loser))[loser]
    # still preparing its relaunch (its healthy node in a slot, one slot to fill), not on the spare
    assert lost.phase != controller_pb2.RUN_PHASE_RUNNING, lost
    assert spare not in lost.nodes and victims[loser] not in lost.nodes, lost
    for run, victim in victims.items():  # each run quarantined its own node and answers for it
        quarantined = [
            e for e in fleet.events_of(run) if e.seq > marks[run] and e.kind == E.EVENT_KIND_QUARANTINE
        ]
        assert [e.quarantine.node for e in quarantined] == [victim], fleet.tail(run)
        # the other run's Xid is that run's fault: no detection of it here (this run's goodput)
        detected = [
            e for e in fleet.events_of(run) if e.seq > marks[run] and e.kind == E.EVENT_KIND_DETECTION
        ]
        assert [list(e.detection.nodes) for e in detected] == [[victim]], [e.message for e in detected]
        assert fleet.holder(victim) == run
        assert fleet.reputation(victim).failures == 1
    for run in PRIORITY:  # no node was ever launched on by both runs
        other = ({*PRIORITY} - {run}).pop()
        mine = {n for e in started(fleet, run) for n in e.launch.nodes}
        assert not mine & {n for e in started(fleet, other) for n in e.launch.nodes}
    fleet.winner, fleet.loser, fleet.victims, fleet.spare = winner, loser, victims, spare  # for the next step


def fleet_leader(fleet: TwoRuns, run: str) -> str:
    return "alpha-a" if run == "alpha" else "beta-b"


def test_the_winner_ends_and_its_quarantined_node_is_never_handed_to_the_other_run(fleet: TwoRuns) -> None:
    assert fleet.winner, "runs after test_faults_in_both_runs_at_once_the_spare_goes_to_one_run_only"
    winner, loser, victims = fleet.winner, fleet.loser, fleet.victims
    held = victims[winner]  # quarantined by the winner: held for repair, one strike
    given_back = set(started(fleet, winner)[-1].launch.nodes)
    ctl(fleet.api[fleet_leader(fleet, winner)], "stop", winner, "--reason", "done")
    wait_until(
        f"{winner} to end",
        lambda: any(e.kind == E.EVENT_KIND_RUN_END for e in fleet.events_of(winner)),
        WAIT_S,
        lambda: fleet.tail(winner),
    )
    wait_until(
        f"{loser}'s relaunch",
        lambda: (
            len(started(fleet, loser)) == 2 and first_step(fleet, loser, started(fleet, loser)[-1].attempt)
        ),
        WAIT_S,
        lambda: fleet.tail(loser),
    )
    relaunch = started(fleet, loser)[-1]
    assert held not in relaunch.launch.nodes and victims[loser] not in relaunch.launch.nodes
    kept = set(launches(fleet, loser)[0].launch.nodes) - {victims[loser]}
    assert set(relaunch.launch.nodes) - kept <= given_back - {held}
    wait_until(
        f"{winner}'s claims given back", lambda: all(fleet.holder(n) != winner for n in fleet.nodes), 20
    )
    # the node's record came with it: held for repair, the winner's strike on it, in the loser's view too
    assert fleet.reputation(held).failures == 1
    seen = fleet.nodes_seen_by(fleet_leader(fleet, loser))[held]
    assert seen.failures == 1 and seen.pool_state == common_pb2.POOL_STATE_HELD, seen
    assert not any(held in e.launch.nodes for e in started(fleet, loser))
    for run in PRIORITY:  # one failure each, in each run's own goodput, which adds up
        report = compute_goodput(fleet.events_of(run), run=run).to_proto()
        assert report.failures == 1, (run, report)
        assert report.productive_s + report.lost_s == pytest.approx(report.allocated_s, abs=1e-6)
