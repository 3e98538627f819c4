"""Issue 26: where a save's stall goes around a planned stop. Before the stop, each commit's
save_duration_s is checkpoint_stall; the stop's own save (a commit at or after the step the stop was
requested at) is the stop's cost, `planned`, from the save's start to the relaunch's first step; the
training between the stop request and that save is kept. A save begun before the stop whose commit
reaches the log after it (an async upload) is an ordinary save: its stall is checkpoint_stall and
the training after it stays productive."""

from __future__ import annotations

from controller.goodput.report import US, compute_goodput

from .logbuild import LogBuilder

T0 = 1_764_547_200.0


def _relaunch(b: LogBuilder, t: float, step: int) -> None:
    b.exit(t)
    b.launch(t + 10, resume_step=step)
    b.load_done(t + 15)
    b.first_step(t + 20)


def test_the_stops_own_save_is_planned_and_earlier_stalls_are_checkpoint_stall() -> None:
    b = LogBuilder()
    b.startup(T0)  # training from T0 + 40
    b.commit(T0 + 60, step=20, save_s=1.5)  # stall 58.5..60
    b.step = 30
    b.stop(T0 + 80)
    b.commit(T0 + 90, step=32, save_s=3)  # the stop's save: 87..90, planned
    _relaunch(b, T0 + 91, 32)  # first step at T0 + 111
    b.end(T0 + 131)
    r = compute_goodput(b.events)
    assert r.lost_by_cause_us["checkpoint_stall"] == int(1.5 * US)
    assert r.lost_by_cause_us["planned"] == (111 - 87) * US
    assert r.productive_us == int((87 - 40 - 1.5 + 20) * US)
    assert r.productive_us + r.lost_us == r.allocated_us == 131 * US


def test_an_earlier_saves_commit_after_the_stop_request_is_an_ordinary_save() -> None:
    b = LogBuilder()
    b.startup(T0)
    b.step = 30
    b.stop(T0 + 80)  # the step-20 save began before the stop; its upload ended after it
    b.commit(T0 + 82, step=20, save_s=0.5)  # stall 81.5..82: training goes on to the stop's save
    b.commit(T0 + 90, step=32, save_s=3)  # the stop's save: 87..90
    _relaunch(b, T0 + 91, 32)
    b.end(T0 + 131)
    r = compute_goodput(b.events)
    assert r.lost_by_cause_us["checkpoint_stall"] == int(0.5 * US)
    assert r.lost_by_cause_us["planned"] == (111 - 87) * US
    assert r.productive_us == int((87 - 40 - 0.5 + 20) * US)
    assert r.productive_us + r.lost_us == r.allocated_us == 131 * US
