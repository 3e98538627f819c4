"""The core's side of a shared fleet (issue 21): a node another run holds is no spare, is never
burned in or quarantined here, and comes back with its record (strikes and holds follow it)."""

from __future__ import annotations

from controller.supervisor.actions import AllocateFromQueue, Launch, RunPreflight
from controller.supervisor.events import (
    ActionFailed,
    EvidenceObserved,
    NodeClaimed,
    NodeJoined,
    StoreListed,
)
from controller.supervisor.machine import RunState
from controller.supervisor.pool import NodeRecordView, PoolState
from runwarden.v1 import common_pb2
from runwarden.v1 import events_pb2 as E

from .harness import Driver, fast


def test_a_node_claimed_by_another_run_is_never_picked_and_a_failed_claim_picks_the_next() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.send(NodeClaimed(node="n1", run="other"))
    d.add_nodes(3)  # n1 (held by run other), n2, n3
    (pre,) = [a for a in d.actions if isinstance(a, RunPreflight)]
    assert set(pre.nodes) == {"n2", "n3"} and d.sup.holds() == {"n2", "n3"}
    # the shell could not claim n3 (another run out-bid us): no spare left, so the queue; then n4 joins
    out = d.send(
        ActionFailed(action=pre, temporary=True, node="n3", reason="not claimed: claimed by run other")
    )
    assert any(isinstance(a, AllocateFromQueue) for a in out)
    d.send(NodeClaimed(node="n3", run="other"))
    assert "n3" not in d.sup.preparing.slots and "n3" not in d.sup.holds()
    assert d.sup.pool.get("n3").elsewhere == "other"
    d.send(NodeJoined(node="n4"))
    d.answer_preflight()
    (launch,) = [a for a in d.actions if isinstance(a, Launch)]
    assert {nr.node for nr in launch.nodes} == {"n2", "n4"}


def test_given_back_with_its_record_a_held_node_stays_out_and_its_strike_follows() -> None:
    d = Driver(cfg=fast(), nodes=1)
    d.send(NodeClaimed(node="n1", run="other"))
    xid = common_pb2.Evidence(
        node="n1", kind=common_pb2.EVIDENCE_KIND_XID, severity=common_pb2.SEVERITY_FATAL, xid=79
    )
    out = d.send(EvidenceObserved(evidence=xid))  # the holder's business: not quarantined here
    assert d.sup.pool.get("n1").state is PoolState.SPARE and not d.sup.pool.get("n1").failure_times
    assert not d.events(E.EVENT_KIND_DETECTION, out)  # nor a fault of this run (its goodput)
    held = NodeRecordView(
        node="n1", pool_state=common_pb2.POOL_STATE_HELD, reason="fatal Xid 79", failure_times=(900.0,)
    )
    d.send(NodeClaimed(node="n1", record=held))  # given back by the run that quarantined it
    node = d.sup.pool.get("n1")
    assert node.state is PoolState.HELD and node.failure_times == [900.0] and not node.elsewhere
    d.add_nodes(1)
    assert d.sup.state is RunState.WAITING_NODES and not any(isinstance(a, RunPreflight) for a in d.actions)
    assert d.sup.holds() == {"n1"}  # this run answers for it now (an operator's release goes here)


def test_a_snapshot_marks_the_nodes_other_runs_hold() -> None:
    d = Driver(cfg=fast(), nodes=1)
    d.send(StoreListed(alive={"n1": 1, "n2": 1}, claimed_elsewhere={"n1": "other"}))
    (pre,) = [a for a in d.actions if isinstance(a, RunPreflight)]
    assert pre.nodes == ("n2",)
    d.send(StoreListed(alive={"n1": 1, "n2": 1}))  # the claim is gone: free again
    assert not d.sup.pool.get("n1").elsewhere


def test_a_relist_tells_a_claim_change_the_watch_missed() -> None:
    """A watched core learns from a relist that another run took a spare (its claim landed while the
    watch restarted) or gave it back: logged as the watch would have, not only set."""
    d = Driver(cfg=fast(), nodes=1)
    d.start(nodes=2)  # n1 trains, n2 is a spare
    spare = next(n for n in ("n1", "n2") if n not in d.running_nodes())
    out = d.send(StoreListed(alive={"n1": 1, "n2": 1}, claimed_elsewhere={spare: "other"}))
    (claimed,) = d.events(E.EVENT_KIND_NODE_CLAIMED, out)
    assert claimed.message.startswith(f"node {spare} is claimed by run other")
    assert d.sup.pool.get(spare).elsewhere == "other"
    out = d.send(StoreListed(alive={"n1": 1, "n2": 1}, claimed_elsewhere={spare: "other"}))
    assert not d.events(E.EVENT_KIND_NODE_CLAIMED, out)  # nothing new: nothing told
    out = d.send(StoreListed(alive={"n1": 1, "n2": 1}))
    (back,) = d.events(E.EVENT_KIND_NODE_CLAIMED, out)
    assert f"node {spare} is back in the shared pool from run other" in back.message
    assert not d.sup.pool.get(spare).elsewhere
