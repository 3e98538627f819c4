"""Issue 26: a commit's save stall, as the ranks report it, becomes CheckpointCommitted.save_duration_s
(what the supervisor logs on CHECKPOINT_COMMIT and goodput counts as checkpoint_stall). The longest
of the node's ranks reporting that commit counts; a value from outside that is not a number of
seconds in [0, a day] counts as 0 and is logged, and the commit itself is never lost for it."""

from __future__ import annotations

import logging

import pytest

from controller.live.translate import MAX_SAVE_STALL_S, Translator
from controller.supervisor.events import CheckpointCommitted
from runwarden.keys import KeySchema
from runwarden.store import EventType, WatchEvent
from runwarden.v1 import common_pb2, store_pb2

KEYS = KeySchema()
RUN = "live"


def _commits(tr: Translator, *ranks: common_pb2.RankProgress, attempt: int = 2) -> list[CheckpointCommitted]:
    prog = store_pb2.NodeProgress(node="n1", run=RUN, attempt=attempt, ranks=ranks)
    ev = WatchEvent(
        type=EventType.PUT,
        key=KEYS.progress(RUN, "n1"),
        value=prog.SerializeToString(),
        mod_revision=1,
        create_revision=1,
    )
    events, _ = tr.watch_event(ev)
    return [e for e in events if isinstance(e, CheckpointCommitted)]


def _rank(rank: int, committed: int, stall: float | None = None) -> common_pb2.RankProgress:
    r = common_pb2.RankProgress(rank=rank, step=committed, committed_step=committed)
    if stall is not None:
        r.save_stall_s = stall
    return r


def test_the_reported_stall_is_the_commits_save_duration() -> None:
    tr = Translator(KEYS, RUN)
    tr.new_attempt(2)
    assert _commits(tr, _rank(0, 10, 0.42)) == [CheckpointCommitted(step=10, attempt=2, save_duration_s=0.42)]
    # not measured (an older trainer, a commit resumed from): 0, as before
    assert _commits(tr, _rank(0, 20)) == [CheckpointCommitted(step=20, attempt=2, save_duration_s=0.0)]


def test_the_longest_stall_of_the_ranks_reporting_that_commit_counts() -> None:
    tr = Translator(KEYS, RUN)
    tr.new_attempt(2)
    ranks = (_rank(0, 30, 0.2), _rank(1, 30, 0.5), _rank(2, 20, 9.0))  # rank 2: an older commit's
    assert _commits(tr, *ranks) == [CheckpointCommitted(step=30, attempt=2, save_duration_s=0.5)]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), -0.5, MAX_SAVE_STALL_S * 2])
def test_a_stall_that_is_not_a_sane_duration_counts_as_zero_and_the_commit_stands(
    bad: float, caplog: pytest.LogCaptureFixture
) -> None:
    tr = Translator(KEYS, RUN)
    tr.new_attempt(2)
    with caplog.at_level(logging.WARNING, logger="controller.live.translate"):
        commits = _commits(tr, _rank(0, 40, bad), _rank(1, 40, 0.3))
    assert commits == [CheckpointCommitted(step=40, attempt=2, save_duration_s=0.3)]
    assert "save stall" in caplog.text and "rank 0" in caplog.text
    assert _commits(tr, _rank(0, 50, bad)) == [CheckpointCommitted(step=50, attempt=2, save_duration_s=0.0)]
