"""Issue 19: a replay after a controller restart is still compared with the losses before it.

Against a real etcd, the real `LiveController` and `Supervisor`, and an agent double (no ranks: the
test writes the node's progress records into etcd as the agent would, with the losses its ranks
reported). The first controller logs the losses it keeps as LOSS_RECORD events; it stops; a second
controller leads the same run with the same event log, reads them back, and when attempt 2 replays
steps 21-30 of attempt 1 with a different loss, that is a DIVERGENCE against attempt 1's values.
The record interval (10 s) is cut to 0 for the test, so each put's values are logged at once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from controller.live.loss_history import last_launch, loss_history, read_history
from controller.supervisor import loss
from runwarden.eventlog import read_events
from runwarden.store import Store
from runwarden.v1 import common_pb2, store_pb2
from runwarden.v1 import events_pb2 as E
from tests.live.shell import RUN, agent_double, is_launch, live_shell

pytestmark = pytest.mark.timeout(120)


def _ev(
    kind: E.EventKind.ValueType,
    attempt: int,
    step: int = 0,
    run: str = RUN,
    *,
    rule: str = "",
    action: str = "",
    points: Sequence[E.LossPoint] = (),
) -> E.Event:
    ev = E.Event(run=run, attempt=attempt, step=step, kind=kind, message="m")
    if rule:
        ev.loss.CopyFrom(E.LossDetail(rule=rule, action=action, points=points))
    return ev


def _rec(attempt: int, steps: range, run: str = RUN) -> E.Event:
    points = [E.LossPoint(step=s, rank=0, loss=_curve(s)) for s in steps]
    return _ev(E.EVENT_KIND_LOSS_RECORD, attempt, steps[-1], run, rule="record", points=points)


def test_the_history_read_back_undoes_an_anomaly_rollback_at_its_relaunch_and_skips_bad_values() -> None:
    nan = E.LossPoint(step=40, rank=0, loss=math.nan)
    events = [
        _rec(1, range(1, 31)),
        _rec(1, range(1, 99), run="other-run"),  # another run's record: not this run's history
        _ev(E.EVENT_KIND_LOSS_ANOMALY, 1, 25, rule="spike", action="stop"),
        _rec(1, range(26, 29)),  # reported before the stop took effect: undone with the rest
        _ev(E.EVENT_KIND_LOSS_RECORD, 1, 40, rule="record", points=[nan]),  # a bad line's value
    ]
    pending = loss_history(events, RUN)  # stopped for the anomaly, not relaunched yet
    assert pending.rollback_before == 25 and len(pending.points) == 33
    launched = loss_history([*events, _ev(E.EVENT_KIND_LAUNCH, 2, 20), _rec(2, range(21, 25))], RUN)
    assert launched.rollback_before is None
    assert launched.points == (
        *((s, 0, 1, _curve(s)) for s in range(1, 25)),
        *((s, 0, 2, _curve(s)) for s in range(21, 25)),
    )
    assert launched.logged == ((1, "spike"),)


def _curve(step: int) -> float:
    return 2.0 / (1.0 + 0.05 * step)


def _put(store: Store, attempt: int, steps: range, scale: float = 1.0, committed: int | None = None) -> None:
    """n1's progress record as its agent writes it: rank 0 at steps[-1], the losses of `steps`."""
    now = time.time()
    rank = common_pb2.RankProgress(
        rank=0,
        step=steps[-1],
        step_time_s=0.05,
        reported_at=now,
        recent_losses=[common_pb2.StepLoss(step=s, loss=_curve(s) * scale) for s in steps],
        committed_step=committed,
    )
    prog = store_pb2.NodeProgress(node="n1", run=RUN, attempt=attempt, ranks=[rank], written_at=now)
    store.put(store.keys.progress(RUN, "n1"), prog.SerializeToString())


def test_a_replay_after_a_controller_restart_is_compared_with_the_losses_logged_before_it(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loss, "RECORD_EVERY_S", 0.0)
    run_dir = tmp_path / "run"  # both controllers' run dir: one event log, as on shared storage
    with agent_double(store), live_shell(store, run_dir) as (_shell, log):
        log.wait(is_launch(1), 20)
        for first in (1, 11, 21):
            _put(store, 1, range(first, first + 10), committed=20 if first == 21 else None)
            log.wait(lambda e: e.kind == E.EVENT_KIND_LOSS_RECORD and e.step == first + 9, 10)  # noqa: B023
        log.wait(lambda e: e.kind == E.EVENT_KIND_LOSS_RECORD and e.step == 30, 10)
        log.wait(lambda e: e.kind == E.EVENT_KIND_CHECKPOINT_COMMIT and e.step == 20, 10)
    recorded = read_events(run_dir / "events.jsonl").entries
    points = [(p.step, p.loss) for e in recorded if e.kind == E.EVENT_KIND_LOSS_RECORD for p in e.loss.points]
    assert points == [(s, _curve(s)) for s in range(1, 31)]

    # A new leader: nothing of the first core's memory, only etcd and the event log.
    with agent_double(store), live_shell(store, run_dir) as (_shell, log):
        exited = common_pb2.ExitStatus(exit_code=1, ended_at=time.time())
        prog = store_pb2.NodeProgress(node="n1", run=RUN, attempt=1, exit=exited)
        store.put(store.keys.progress(RUN, "n1"), prog.SerializeToString())
        _, launch = log.wait(is_launch(2), 30)
        assert launch.launch.resume_step == 20
        _put(store, 2, range(21, 31), scale=1.1)  # 10 %: beyond the default 5 %
        _, div = log.wait(lambda e: e.kind == E.EVENT_KIND_DIVERGENCE, 10)
        _, replay = log.wait(lambda e: e.kind == E.EVENT_KIND_LOSS_REPLAY and e.attempt == 2, 10)
    (p,) = div.loss.points
    assert (div.attempt, p.step, p.rank, p.earlier_attempt) == (2, 21, 0, 1)
    assert p.earlier_loss == _curve(21) and p.rel_diff == pytest.approx(0.1, rel=1e-6)
    assert [x.step for x in replay.loss.points] == list(range(21, 31))  # every replayed step compared
    assert all(x.earlier_attempt == 1 for x in replay.loss.points)


def test_the_last_launch_is_the_highest_attempt_a_launch_of_this_run_names(tmp_path: Path) -> None:
    events = [
        _ev(E.EVENT_KIND_LAUNCH, 1),
        _ev(E.EVENT_KIND_LAUNCH, 2),
        _ev(E.EVENT_KIND_LAUNCH, 7, run="other"),
    ]
    assert last_launch(events, RUN) == 2 and last_launch([], RUN) == 0
    missing = read_history(tmp_path / "no-such-log.jsonl", RUN)  # unreadable: nothing, no crash
    assert missing[1] == 0 and not missing[0].points
