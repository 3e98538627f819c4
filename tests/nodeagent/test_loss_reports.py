"""Every step's loss reaches the controller: trainer -> agent datagram -> ProgressTable -> etcd value ->
Translator -> RankSample.losses, NaN included; bad pairs are dropped alone; the lists are bounded."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import pytest

from controller.live.translate import Translator
from controller.supervisor.events import ProgressObserved
from nodeagent import trainer
from nodeagent.daemon import validate
from nodeagent.daemon.progress import MAX_RECENT_LOSSES, ProgressTable
from runwarden.keys import KeySchema
from runwarden.store import EventType, WatchEvent
from runwarden.v1 import agent_pb2, common_pb2, store_pb2
from tests.nodeagent.helpers import AgentSocket

KEYS = KeySchema()
RUN = "lossrun"


def put(prog: store_pb2.NodeProgress) -> WatchEvent:
    return WatchEvent(
        type=EventType.PUT,
        key=KEYS.progress(RUN, prog.node),
        value=prog.SerializeToString(),
        mod_revision=1,
        create_revision=1,
    )


def rank(
    step: int, losses: list[tuple[int, float]], *, r: int = 0, dropped: int = 0
) -> common_pb2.RankProgress:
    return common_pb2.RankProgress(
        rank=r,
        step=step,
        reported_at=time.time(),
        recent_losses=[common_pb2.StepLoss(step=s, loss=v) for s, v in losses],
        losses_dropped=dropped,
    )


def observed(tr: Translator, prog: store_pb2.NodeProgress) -> ProgressObserved:
    (ev,) = [e for e in tr.watch_event(put(prog))[0] if isinstance(e, ProgressObserved)]
    return ev


def test_the_agent_keeps_every_loss_between_two_writes_and_writes_each_once() -> None:
    table = ProgressTable()
    table.record(RUN, 1, [rank(1, [(1, 2.0)])])
    table.record(RUN, 1, [rank(2, [(2, 1.9)])])  # replaces rank 0's report: its loss is kept
    table.record(RUN, 1, [rank(3, [(3, math.nan)])])
    ((_, prog),) = table.take_dirty("n1")
    (r,) = prog.ranks
    assert [(x.step, x.loss) for x in r.recent_losses][:2] == [(1, 2.0), (2, 1.9)]
    assert r.recent_losses[2].step == 3 and math.isnan(r.recent_losses[2].loss)
    table.record(RUN, 1, [rank(4, [(4, 1.7)])])
    ((_, prog),) = table.take_dirty("n1")
    assert [(x.step, x.loss) for x in prog.ranks[0].recent_losses] == [(4, 1.7)]  # written once
    table.mark_dirty(RUN)
    ((_, prog),) = table.take_dirty("n1")
    assert not prog.ranks[0].recent_losses  # a rewrite of the same report carries none again


def test_the_agent_bounds_the_list_and_counts_what_it_dropped() -> None:
    table = ProgressTable()
    for s in range(1, 101):
        table.record(RUN, 1, [rank(s, [(s, 1.0 / s)], dropped=1 if s == 50 else 0)])
    ((_, prog),) = table.take_dirty("n1")
    (r,) = prog.ranks
    assert len(r.recent_losses) == MAX_RECENT_LOSSES
    assert [x.step for x in r.recent_losses] == list(range(101 - MAX_RECENT_LOSSES, 101))  # the newest
    assert r.losses_dropped == 100 - MAX_RECENT_LOSSES + 1


def test_an_older_report_s_losses_still_count() -> None:
    table = ProgressTable()
    table.record(RUN, 1, [rank(5, [(5, 1.0)])])
    late = rank(4, [(4, 1.1)])
    late.reported_at = 0.0  # older in both step and time: not the rank's newest report
    table.record(RUN, 1, [late])
    ((_, prog),) = table.take_dirty("n1")
    assert prog.ranks[0].step == 5 and [x.step for x in prog.ranks[0].recent_losses] == [5, 4]


def test_the_agent_keeps_nan_losses_and_drops_bad_steps_alone() -> None:
    r = rank(3, [(1, 1.0), (-4, 2.0), (2, math.inf), (3, math.nan)])
    r.loss = math.nan
    req = agent_pb2.ReportProgressRequest(run=RUN, attempt=1, reports=[r])
    validate.progress_request(req)
    (out,) = req.reports
    assert math.isnan(out.loss)  # the trainer's news, not a bad request
    assert [x.step for x in out.recent_losses] == [1, 2, 3] and out.losses_dropped == 1
    many = agent_pb2.ReportProgressRequest(
        run=RUN, attempt=1, reports=[rank(200, [(s, 1.0) for s in range(200)])]
    )
    validate.progress_request(many)
    assert len(many.reports[0].recent_losses) == 64 and many.reports[0].recent_losses[0].step == 136
    assert many.reports[0].losses_dropped == 136


def test_the_controller_drops_a_bad_pair_alone_with_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    tr = Translator(KEYS, RUN)
    prog = store_pb2.NodeProgress(
        node="n1",
        run=RUN,
        attempt=1,
        ranks=[rank(3, [(1, 1.0), (-2, 5.0), (3, math.nan)]), rank(3, [(3, 0.5)], r=1)],
    )
    with caplog.at_level(logging.WARNING, logger="controller.live.translate"):
        ev = observed(tr, prog)
    r0, r1 = ev.ranks
    assert r0.losses[0] == (1, 1.0) and r0.losses[1][0] == 3 and math.isnan(r0.losses[1][1])
    assert r1.losses == ((3, 0.5),) and r0.step == 3  # the rest of the value is untouched
    assert "negative steps [-2] dropped" in caplog.text
    big = store_pb2.NodeProgress(
        node="n1", run=RUN, attempt=1, ranks=[rank(500, [(s, 1.0) for s in range(100)])]
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="controller.live.translate"):
        ev = observed(tr, big)
    assert (
        len(ev.ranks[0].losses) == 64 and ev.ranks[0].losses[0][0] == 36 and "newest 64 kept" in caplog.text
    )


def test_an_older_trainer_s_single_loss_still_arrives() -> None:
    tr = Translator(KEYS, RUN)
    old = common_pb2.RankProgress(rank=0, step=7, loss=math.inf)
    ev = observed(tr, store_pb2.NodeProgress(node="n1", run=RUN, attempt=1, ranks=[old]))
    assert ev.ranks[0].losses == ((7, math.inf),)
    ev = observed(
        tr,
        store_pb2.NodeProgress(
            node="n1", run=RUN, attempt=1, ranks=[common_pb2.RankProgress(rank=0, step=8)]
        ),
    )
    assert ev.ranks[0].losses == ()


def test_a_new_attempt_s_commits_reach_the_core_again_after_a_rollback() -> None:
    tr = Translator(KEYS, RUN)

    def commit(attempt: int, step: int) -> list[int]:
        r = common_pb2.RankProgress(rank=0, step=step, committed_step=step)
        evs, _ = tr.watch_event(put(store_pb2.NodeProgress(node="n1", run=RUN, attempt=attempt, ranks=[r])))
        return [e.step for e in evs if type(e).__name__ == "CheckpointCommitted"]

    assert commit(1, 100) == [100] and commit(1, 200) == [200] and commit(1, 200) == []
    assert commit(2, 100) == [100]  # resumed from 100 (rolled back): its rank 0 says so
    assert commit(2, 200) == [200]  # the new attempt's own step 200 is news to the core


def test_every_reported_loss_travels_from_the_trainer_to_the_agent(tmp_path: Path) -> None:
    agent = AgentSocket(tmp_path)
    got, seen = agent.got, agent.seen
    rep = trainer.ProgressReporter(
        run=RUN, attempt=1, rank=0, local_rank=0, world_size=1, agent_socket=agent.path, flush_interval_s=30.0
    )
    try:
        for s in range(1, 11):
            rep.report(s, step_time_s=0.01, loss=math.nan if s == 7 else 1.0 / s)
        assert rep.flush() and seen.wait(5)
        (r,) = got[-1].reports
        assert [x.step for x in r.recent_losses] == list(range(1, 11)) and r.step == 10
        assert math.isnan(r.recent_losses[6].loss) and r.recent_losses[9].loss == 0.1
        for s in range(11, 11 + trainer.MAX_RECENT_LOSSES + 5):
            rep.report(s, step_time_s=0.01, loss=1.0)
        seen.clear()
        assert rep.flush() and seen.wait(5)
        (r,) = got[-1].reports
        assert len(r.recent_losses) == trainer.MAX_RECENT_LOSSES and r.losses_dropped == 5
        assert r.recent_losses[0].step == 16
    finally:
        rep.close()
        agent.stop()
