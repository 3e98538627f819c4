"""Planned stops that do not start at the controller: a node draining (maintenance, SIGTERM to its
agent, a scheduler's notice), ranks that stopped on their own (a stop file, SIGTERM), and a run
waiting for nodes that never come. Driven through handle()."""

from __future__ import annotations

from controller.supervisor.actions import Page, Quarantine, StopAttempt, TakeSpare
from controller.supervisor.events import (
    AttemptExited,
    CheckpointCommitted,
    NodeDraining,
    NodeLost,
    StoreListed,
)
from controller.supervisor.machine import RunState
from runwarden.v1 import events_pb2
from tests.supervisor.harness import Driver, fast

E = events_pb2


def _running(spares: int = 1) -> Driver:
    d = Driver(cfg=fast(), nodes=2)
    d.start(2)
    d.add_nodes(spares, prefix="s")
    d.steps(1, 5)
    d.send(CheckpointCommitted(step=5, path="/ckpt/5"))
    return d


def _exit_everyone(d: Driver, planned: str = "") -> None:
    attempt = d.sup.attempt
    for n in d.running_nodes():
        d.send(AttemptExited(node=n, attempt=attempt, exit_code=0, ended_at=d.now, planned_stop=planned))


def test_a_draining_node_of_the_attempt_is_a_planned_stop_and_a_spare_takes_its_rank() -> None:
    d = _running()
    budget_before = d.sup.status(d.now).restarts_used
    out = d.send(NodeDraining(node="n2", reason="agent stopping (SIGTERM)"))
    assert d.sup.state is RunState.STOPPING
    stops = [a for a in out if isinstance(a, StopAttempt)]
    assert stops and stops[0].planned, "the ranks are asked to save, commit and exit 0"
    _exit_everyone(d)
    d.send(NodeLost(node="n2"))  # the drained agent leaves
    d.advance(d.cfg.backoff_max_s + 1)
    d.answer_preflight()
    assert d.sup.state is RunState.RUNNING
    assert d.running_nodes() == ["n1", "s1"], "the spare takes node rank 1"
    assert d.launches[-1].resume_step == 5, "relaunched from the committed step"
    assert not d.of(Quarantine), "nothing is quarantined for a drain"
    assert [t.node for t in d.of(TakeSpare)] == ["s1"]
    assert d.sup.status(d.now).restarts_used == budget_before, "a planned stop uses no restart"
    lost = [e for e in d.events(E.EVENT_KIND_NODE_LOST) if e.node.node == "n2"]
    assert lost and "left after draining" in lost[-1].message


def test_a_whole_allocation_leaving_after_a_drain_is_not_a_control_plane_outage() -> None:
    d = Driver(cfg=fast(mass_expiry_fraction=0.5), nodes=3)
    d.start(3)
    d.steps(1, 3)
    for n in ("n1", "n2", "n3"):
        d.send(NodeDraining(node=n, reason="scheduler notice (SIGUSR1)"))
    _exit_everyone(d)
    for n in ("n1", "n2", "n3"):
        d.send(NodeLost(node=n))
    assert d.sup.state is not RunState.CONTROL_PLANE
    assert not d.of(Quarantine)


def test_a_node_draining_while_the_attempt_is_prepared_is_replaced_not_rejected() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.add_nodes(3)
    assert d.sup.state is RunState.PREFLIGHT
    picked = list(d.sup.current_nodes)
    d.send(NodeDraining(node=picked[0], reason="maintenance"))
    d.answer_preflight()
    assert d.sup.state is RunState.RUNNING
    assert picked[0] not in d.running_nodes()
    assert not d.of(Quarantine)


def test_a_drained_node_takes_no_placement_until_its_drain_ends() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.add_nodes(1)
    d.send(NodeDraining(node="n1", reason="maintenance"))
    d.add_nodes(1, start=2)
    assert d.sup.state is RunState.WAITING_NODES, "n1 drains: one usable node of two"
    d.send(NodeDraining(node="n1", reason=""))
    assert d.sup.state is RunState.PREFLIGHT
    assert any("back in service" in e.message for e in d.events(E.EVENT_KIND_RELEASE))


def test_ranks_that_stopped_on_their_own_are_a_planned_stop_not_a_completed_run() -> None:
    d = _running(spares=0)
    attempt = d.sup.attempt
    d.send(AttemptExited(node="n1", attempt=attempt, exit_code=0, ended_at=d.now, planned_stop="stop file"))
    assert d.sup.state is RunState.STOPPING, d.sup.state
    d.send(AttemptExited(node="n2", attempt=attempt, exit_code=0, ended_at=d.now, planned_stop="stop file"))
    assert d.sup.state is not RunState.COMPLETED
    d.advance(d.cfg.backoff_max_s + 1)
    d.answer_preflight()
    assert d.sup.state is RunState.RUNNING and d.sup.attempt == attempt + 1
    assert d.launches[-1].resume_step == 5
    assert not d.of(Quarantine)


def test_every_node_exiting_zero_without_a_stop_still_completes_the_run() -> None:
    d = _running(spares=0)
    _exit_everyone(d)
    assert d.sup.state is RunState.COMPLETED


def test_waiting_for_nodes_too_long_pages_once_and_status_says_how_long() -> None:
    d = Driver(cfg=fast(waiting_page_s=240.0), nodes=2)
    d.add_nodes(1)
    status = d.sup.status(d.now)
    assert status.state is RunState.WAITING_NODES
    assert status.waiting_for_nodes == 1 and status.waiting_since == d.now
    d.advance(200)
    assert not d.of(Page)
    d.advance(60)
    pages = d.of(Page)
    assert len(pages) == 1 and "waiting for 1 node for 4 min" in pages[0].reason, pages
    assert any("waiting for 1 node" in e.message for e in d.events(E.EVENT_KIND_PAGE))
    d.advance(600)
    assert len(d.of(Page)) == 1, "once per wait"
    d.add_nodes(1, start=2)
    assert d.sup.status(d.now).waiting_for_nodes == 0


def test_a_snapshot_that_shows_a_drain_missed_in_a_watch_gap_stops_the_attempt() -> None:
    d = _running()
    alive = {n: 1 for n in ("n1", "n2", "s1")}
    d.send(
        StoreListed(
            alive=alive,
            attempt=d.sup.attempt,
            attempt_nodes=("n1", "n2"),
            committed_steps=(5,),
            draining={"n2": "maintenance"},
        )
    )
    assert d.sup.state is RunState.STOPPING
    assert not d.of(Quarantine)


def test_a_refused_ask_of_the_queue_is_asked_again_after_a_doubling_backoff_not_at_once() -> None:
    from controller.supervisor.actions import AllocateFromQueue
    from controller.supervisor.events import ActionFailed, NodeJoined

    d = Driver(cfg=fast(waiting_page_s=0.0), nodes=2)
    d.add_nodes(1)
    assert len(d.of(AllocateFromQueue)) == 1
    waits = []
    for _ in range(3):
        refused_at = d.now
        d.send(ActionFailed(action=d.of(AllocateFromQueue)[-1], temporary=True, reason="no such nodes"))
        d.send(NodeJoined(node="n1", local_ranks=1))  # any event: no hot retry
        before = len(d.of(AllocateFromQueue))
        d.advance(60)
        assert len(d.of(AllocateFromQueue)) == before + 1, "asked again once, after the backoff"
        asked_at = d.events(E.EVENT_KIND_ALLOCATE)[-1].ts
        waits.append(asked_at - refused_at)
    assert waits == [5.0, 10.0, 20.0]


def _finish(d: Driver, step: int) -> None:
    from controller.supervisor.events import ProgressObserved, RankSample

    d.now += 1.0
    for node_rank, node in enumerate(d.running_nodes()):
        ranks = (RankSample(rank=node_rank, step=step, step_time_s=1.0, reported_at=d.now, finished=True),)
        d.send(ProgressObserved(node=node, attempt=d.sup.attempt, ranks=ranks))


def test_ranks_that_took_their_last_step_get_the_exit_timeout_not_the_hang_timeout() -> None:
    d = Driver(cfg=fast(hang_timeout_floor_s=10.0, exit_timeout_s=60.0), nodes=2)
    d.start(2)
    d.steps(1, 5)
    _finish(d, 6)
    d.advance(45)  # slow teardown on a loaded machine: far past the hang timeout
    assert d.sup.state is RunState.RUNNING, "a run that finished training is not hung"
    _exit_everyone(d)
    assert d.sup.state is RunState.COMPLETED
    assert not d.of(Quarantine)


def test_ranks_that_took_their_last_step_and_never_exit_are_a_hang_at_exit() -> None:
    d = Driver(cfg=fast(hang_timeout_floor_s=10.0, exit_timeout_s=60.0, collect_dumps=False), nodes=2)
    d.start(2)
    d.steps(1, 5)
    _finish(d, 6)
    d.advance(61)
    detections = d.events(E.EVENT_KIND_DETECTION)
    assert detections and "did not exit within 60s" in detections[-1].message
