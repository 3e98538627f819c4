"""The resume point of a relaunch when the ranks hold in-memory snapshots between commits
(controller/supervisor/snapshots.py): the newest snapshot every rank reported complete, when every
rank's state (its own node, or its buddy's: the same local rank on the next node) is among the new
attempt's nodes, else the newest commit; the LAUNCH event says which and why. A snapshot the ranks
refused at the load, or whose state gave a non-finite loss, is dropped for the commit."""

from __future__ import annotations

import math

from controller.supervisor.actions import Launch
from controller.supervisor.blame import FlightRecorderVerdict
from controller.supervisor.events import (
    AttemptExited,
    CheckpointCommitted,
    CheckpointInvalid,
    DumpsCollected,
    NodeLost,
    StoreListed,
)
from controller.supervisor.machine import RunState
from runwarden.v1 import events_pb2 as E
from tests.supervisor.harness import Driver, fast


def _driver(nodes: int = 2, spares: int = 1, **cfg: object) -> Driver:
    d = Driver(cfg=fast(**cfg), nodes=nodes, ranks_per_node=2)
    d.start(nodes + spares)
    return d


def _end_attempt(d: Driver, *, lost: tuple[str, ...] = (), crashed: str = "") -> None:
    attempt = d.sup.attempt
    for n in lost:
        d.send(NodeLost(node=n))
    if crashed:
        d.send(AttemptExited(node=crashed, attempt=attempt, exit_code=1, ended_at=d.now))
    if d.sup.state is RunState.COLLECTING:
        d.send(DumpsCollected(attempt=attempt, verdict=FlightRecorderVerdict()))
    for n in d.running_nodes():
        if d.sup.pool.get(n).alive and n not in d.sup.cur.exited:
            d.send(AttemptExited(node=n, attempt=attempt, exit_code=-15))
    d.advance(d.cfg.backoff_max_s + 1)
    d.answer_preflight()
    assert d.sup.state is RunState.RUNNING and d.sup.attempt == attempt + 1


def _commit_10_then_snapshot_15(d: Driver) -> None:
    d.steps(1, 10)
    d.send(CheckpointCommitted(step=10))
    d.steps(11, 15, snapshots=(15,))


def _launch_event(d: Driver) -> E.Event:
    return d.events(E.EVENT_KIND_LAUNCH)[-1]


def test_a_crash_resumes_from_the_newest_snapshot_every_ranks_state_survives_in() -> None:
    d = _driver()
    _commit_10_then_snapshot_15(d)
    d.steps(16, 20, snapshots=(15, 20))
    # n2's ranks report 25, n1's have not yet: n2 holds n1's ranks' state at 25 (it is their buddy)
    d.steps(21, 25, snapshots={"n1": (15, 20), "n2": (20, 25)})
    _end_attempt(d, crashed="n1")
    launch: Launch = d.launches[-1]
    assert (launch.resume_step, launch.resume_snapshot) == (25, 1)
    ev = _launch_event(d)
    assert ev.launch.resume_step == 25 and ev.launch.resume_snapshot_attempt == 1
    assert "in-memory snapshot of step 25" in ev.message and "newest commit 10" in ev.message
    assert launch.snapshot_interval_s == d.cfg.snapshot_interval_s > 0  # the ranks' interval, at every launch
    # a script that reports the step it loaded as committed said it of the snapshot: not a resume point
    out = d.send(CheckpointCommitted(step=25, attempt=2))
    assert (
        d.sup.committed == {10}
        and "in-memory snapshot attempt 2 resumed from" in d.events(actions=out)[0].message
    )


def test_snapshots_reported_while_the_attempt_ends_are_resume_points() -> None:
    """A lost host's peers train on, snapshotting, until its lease expires and the stop reaches them."""
    d = _driver()
    _commit_10_then_snapshot_15(d)
    d.send(NodeLost(node="n1"))
    assert d.sup.state is RunState.COLLECTING or d.sup.state is RunState.STOPPING
    d.progress(20, nodes=["n2"], snapshots=(15, 20))  # n1's ranks' state at 20 is on n2, their buddy
    _end_attempt(d)
    assert (d.launches[-1].resume_step, d.launches[-1].resume_snapshot) == (20, 1)


def test_a_lost_node_that_alone_held_the_newest_snapshot_leaves_the_one_before() -> None:
    d = _driver()
    d.steps(1, 10)
    d.send(CheckpointCommitted(step=10))
    d.steps(11, 20, snapshots=(15, 20))
    d.steps(21, 25, snapshots={"n1": (15, 20), "n2": (20, 25)})
    _end_attempt(d, lost=("n2",))  # rank 0's state at 25 was on n1 (not reported) or n2 (lost)
    assert [nr.node for nr in d.launches[-1].nodes] == ["n1", "n3"]
    assert (d.launches[-1].resume_step, d.launches[-1].resume_snapshot) == (20, 1)


def test_a_lost_node_replaced_by_a_spare_still_resumes_from_the_snapshot_its_buddy_holds() -> None:
    d = _driver()
    _commit_10_then_snapshot_15(d)
    _end_attempt(d, lost=("n1",))
    assert [nr.node for nr in d.launches[-1].nodes] == ["n3", "n2"]
    assert (d.launches[-1].resume_step, d.launches[-1].resume_snapshot) == (15, 1)


def test_a_snapshot_whose_rank_and_buddy_are_both_gone_is_passed_over_for_the_commit() -> None:
    d = _driver(nodes=3, spares=2)
    _commit_10_then_snapshot_15(d)
    # ranks 0-1 live on n1, their buddies (ranks 2-3) on n2: both hosts lost
    _end_attempt(d, lost=("n1", "n2"))
    assert (d.launches[-1].resume_step, d.launches[-1].resume_snapshot) == (10, 0)
    ev = _launch_event(d)
    assert "neither on n1 (not in this attempt) nor on its buddy n2 (not in this attempt)" in ev.message
    assert "snapshot of step 15 passed over: rank 0's state is neither on n1" in ev.message
    assert ev.launch.snapshot_reason.startswith("the in-memory snapshot of step 15 passed over")
    _end_attempt(d, crashed="n3")  # dropped: not considered again
    assert d.launches[-1].resume_step == 10 and "snapshot" not in _launch_event(d).message


def test_a_snapshot_held_only_on_a_lost_node_or_no_newer_than_the_commit_is_not_a_resume_point() -> None:
    d = _driver()
    d.steps(1, 10, snapshots={"n1": (5, 10)})  # n2's ranks never completed one
    _end_attempt(d, lost=("n1",))
    assert (d.launches[-1].resume_step, d.launches[-1].resume_snapshot) == (-1, 0)
    d.steps(1, 12, snapshots=(12,))
    d.send(CheckpointCommitted(step=12))
    _end_attempt(d, crashed="n2")
    assert "snapshot of step 12 passed over: committed step 12 is as new" in _launch_event(d).message
    assert (d.launches[-1].resume_step, d.launches[-1].resume_snapshot) == (12, 0)


def test_a_snapshot_the_ranks_refuse_is_dropped_and_the_relaunch_resumes_from_the_commit() -> None:
    d = _driver()
    _commit_10_then_snapshot_15(d)
    _end_attempt(d, crashed="n1")
    assert d.launches[-1].resume_snapshot == 1
    why = "snapshot of step 15 (attempt 1): rank 1's rank state (RNG, data position) has no holder"
    out = d.send(CheckpointInvalid(step=15, error=why, node="n1", attempt=2))
    out += d.send(CheckpointInvalid(step=15, error=why, node="n2", attempt=2))  # the other host's: once
    (ev,) = d.events(E.EVENT_KIND_CHECKPOINT_INVALID, out)
    assert "in-memory snapshot of step 15 refused by the load on n1" in ev.message
    assert "resumes from committed step 10" in ev.message
    (det,) = d.events(E.EVENT_KIND_DETECTION, out)
    assert det.detection.detector == E.DETECTOR_CHECKPOINT and not det.detection.nodes  # no node blamed
    assert d.sup.committed == {10}  # the commits stay
    for n in d.running_nodes():
        d.send(AttemptExited(node=n, attempt=2, exit_code=1, ended_at=d.now))
    d.advance(d.cfg.backoff_max_s + 1)
    d.answer_preflight()
    assert (d.launches[-1].resume_step, d.launches[-1].resume_snapshot) == (10, 0)


def test_a_non_finite_loss_right_after_a_snapshot_load_relaunches_from_the_commit() -> None:
    d = _driver()
    _commit_10_then_snapshot_15(d)
    _end_attempt(d, crashed="n1")
    assert d.launches[-1].resume_snapshot == 1
    out = d.progress(16, loaded=15, loss=lambda step, rank: math.nan)
    (ev,) = d.events(E.EVENT_KIND_LOSS_ANOMALY, out)
    assert (
        "came from the in-memory snapshot of step 15: dropped, relaunching from committed step 10"
        in ev.message
    )
    for n in d.running_nodes():
        d.send(AttemptExited(node=n, attempt=2, exit_code=-15, ended_at=d.now))
    d.advance(d.cfg.backoff_max_s + 1)
    d.answer_preflight()
    assert (d.launches[-1].resume_step, d.launches[-1].resume_snapshot) == (10, 0)


def test_snapshots_off_in_the_policy_reach_the_ranks_as_zero() -> None:
    d = _driver(snapshot_interval_s=0.0)
    assert d.launches[-1].snapshot_interval_s == 0.0


def test_a_new_leader_knows_its_adopted_attempt_resumed_from_a_snapshot() -> None:
    """The attempt record says so: the ranks' report of the step they loaded is not a commit, and a
    refusal of it is the snapshot's (relaunched from the commit, no node blamed)."""
    d = Driver(cfg=fast(), nodes=2, ranks_per_node=2)
    d.send(
        StoreListed(
            alive={"n1": 2, "n2": 2},
            attempt=3,
            attempt_nodes=("n1", "n2"),
            resume_step=25,
            resume_snapshot=2,
            committed_steps=(10,),
        )
    )
    assert d.sup.state is RunState.RUNNING and d.sup.cur.resume_snapshot == 2
    d.send(CheckpointCommitted(step=25, attempt=3))
    assert d.sup.committed == {10}
    out = d.send(CheckpointInvalid(step=25, error="no rank holds a copy", node="n1", attempt=3))
    (det,) = d.events(E.EVENT_KIND_DETECTION, out)
    assert det.detection.detector == E.DETECTOR_CHECKPOINT and not det.detection.nodes


def test_a_node_holds_the_steps_every_one_of_its_ranks_holds() -> None:
    from controller.supervisor.events import RankSample
    from controller.supervisor.snapshots import SnapshotTracker

    t = SnapshotTracker()
    t.observe(
        "n1",
        (RankSample(rank=0, step=9, snapshot_steps=(5, 10)), RankSample(rank=1, step=9, snapshot_steps=(5,))),
    )
    t.observe(
        "n2",
        (
            RankSample(rank=2, step=9, snapshot_steps=(5, 10)),
            RankSample(rank=3, step=9, snapshot_steps=(5, 10)),
        ),
    )
    assert t.held == {"n1": frozenset({5}), "n2": frozenset({5, 10})}
    # rank 1's state at 10: on n1 (its rank 1 has not taken it) or its buddy rank 3 on n2 (which has)
    assert t.uncovered(10, {"n1", "n2"}) == "" and t.uncovered(10, {"n1"}).startswith("rank 0's state")


def test_a_new_leader_learns_the_snapshots_from_the_ranks_next_reports() -> None:
    """Level-triggered: every report carries the snapshots its rank holds, so a controller that took
    over an attempt knows them one report interval later, and its relaunch resumes from them."""
    d = Driver(cfg=fast(), nodes=2, ranks_per_node=2)
    d.send(
        StoreListed(
            alive={"n1": 2, "n2": 2, "n3": 2}, attempt=3, attempt_nodes=("n1", "n2"), committed_steps=(10,)
        )
    )
    assert d.sup.state is RunState.RUNNING and d.sup.attempt == 3
    d.steps(11, 15, snapshots=(15,))
    _end_attempt(d, crashed="n1")
    launch: Launch = d.launches[-1]
    assert (launch.resume_step, launch.resume_snapshot) == (15, 3)
