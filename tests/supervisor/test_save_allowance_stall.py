"""Issue 26: a live commit carries its save's stall (an async save's staging only) as
save_duration_s. The hang allowance while a rank is saving must still learn the save as the
controller saw it, first "saving" report to commit, upload included: a rank waiting for its last
async save sits through the whole upload. A save never seen saving learns its reported duration."""

from __future__ import annotations

from controller.supervisor.events import CheckpointCommitted
from runwarden.v1 import events_pb2 as E
from tests.supervisor.harness import Driver, fast

STALL_S = 0.2  # what the trainer reports: the staging
UPLOAD_S = 25.0  # what the save takes, saving report to commit


def _async_saves(d: Driver, saves: int, *, seen_saving: bool) -> int:
    step = 0
    for _ in range(saves):
        d.steps(step + 1, step + 10)
        step += 10
        if seen_saving:  # the ranks report "saving" through the upload (the staging outlasted a write)
            d.progress(step, in_checkpoint=tuple(d.running_nodes()), dt=0.1)
            d.advance(UPLOAD_S)
        d.send(CheckpointCommitted(step=step, save_duration_s=STALL_S))
    d.steps(step + 1, step + 10)
    return step + 10


def test_the_allowance_learns_the_observed_save_not_the_stall() -> None:
    d = Driver(cfg=fast(checkpoint_barrier_s=120.0), nodes=2)
    d.start(2)
    last = _async_saves(d, 3, seen_saving=True)
    d.progress(last, in_checkpoint=("n1", "n2"), dt=0.1)  # the last save, waited for
    assert not d.events(E.EVENT_KIND_DETECTION, d.advance(70.0)), "3 x 25 s of upload is allowed"
    det = d.events(E.EVENT_KIND_DETECTION, d.advance(6.0))
    assert det and det[0].detection.detector == E.DETECTOR_HANG and "in a checkpoint" in det[0].message


def test_saves_never_seen_saving_learn_their_reported_duration() -> None:
    d = Driver(cfg=fast(checkpoint_barrier_s=120.0), nodes=2)
    d.start(2)
    last = _async_saves(d, 3, seen_saving=False)
    assert not d.events(E.EVENT_KIND_DETECTION)
    d.progress(last, in_checkpoint=("n1", "n2"), dt=0.1)
    assert not d.events(E.EVENT_KIND_DETECTION, d.advance(9.5))  # 3 x 0.2 s: the ordinary 10 s timeout
    assert d.events(E.EVENT_KIND_DETECTION, d.advance(1.0))
