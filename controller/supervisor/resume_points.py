"""Rules for a resume point a load refused (`CheckpointInvalid`: a committed step's content is not
what its commit recorded), in every state: the step stops being a resume point, in the store too,
and the attempt that refused it fails on no node. controller/supervisor/table.py says which state
runs which rule."""

from __future__ import annotations

from typing import TYPE_CHECKING

from controller.supervisor import failure
from controller.supervisor.actions import PersistCheckpoint
from controller.supervisor.attempt import Failure
from controller.supervisor.events import CheckpointInvalid
from runwarden.v1 import events_pb2 as E

if TYPE_CHECKING:
    from controller.supervisor.run import Run


def on_checkpoint_invalid(sv: Run, ev: CheckpointInvalid) -> bool:
    """Every state: the current attempt's load found step `ev.step` not what its commit recorded.
    It stops being a resume point, in the store too (a rebuilt core lists it as invalid), so the
    relaunch that follows the attempt's exit resumes from the commit before it instead of failing
    on the same bytes again. A late report of an earlier attempt is not acted on (the step may have
    been committed again). An in-memory snapshot the attempt resumed from is dropped instead (its
    ranks could not load it: some rank's state had no holder left). Whether it was acted on (the
    first report of it)."""
    if ev.attempt != sv.attempt:
        return False
    if sv.cur.resume_snapshot and ev.step == sv.cur.resume_step:
        return _snapshot_refused(sv, ev)
    if ev.step not in sv.committed:
        return False
    sv.committed.discard(ev.step)
    sv.latest_committed = max(sv.committed, default=-1)
    where = f" on {ev.node}" if ev.node else ""
    then = (
        f"committed step {sv.latest_committed}"
        if sv.latest_committed >= 0
        else "scratch (no commit before it)"
    )
    sv.log(
        E.EVENT_KIND_CHECKPOINT_INVALID,
        f"checkpoint at step {ev.step} refused by the load{where}: {ev.error}; no longer a resume "
        f"point: the next attempt resumes from {then}",
        step=ev.step,
        checkpoint=E.CheckpointDetail(error=ev.error),
    )
    sv.emit(PersistCheckpoint(step=ev.step, path="", attempt=ev.attempt, invalid=ev.error[:1000]))
    return True


def _snapshot_refused(sv: Run, ev: CheckpointInvalid) -> bool:
    if sv.cur.snapshot_refused:
        return False  # a second node's report of the same refusal
    sv.cur.snapshot_refused = True
    sv.resumed_snapshot = None
    where = f" on {ev.node}" if ev.node else ""
    then = f"committed step {sv.latest_committed}" if sv.latest_committed >= 0 else "scratch"
    sv.log(
        E.EVENT_KIND_CHECKPOINT_INVALID,
        f"in-memory snapshot of step {ev.step} refused by the load{where}: {ev.error}; dropped: the next "
        f"attempt resumes from {then}",
        step=ev.step,
        checkpoint=E.CheckpointDetail(error=ev.error),
    )
    return True


def on_checkpoint_invalid_idle(sv: Run, ev: CheckpointInvalid) -> None:
    """No attempt running: the step stops being a resume point (`on_checkpoint_invalid`)."""
    on_checkpoint_invalid(sv, ev)


_INVALID_LABEL = "checkpoint:invalid"


def _invalid_reason(ev: CheckpointInvalid) -> str:
    return f"the load refused resume point {ev.step}: {ev.error}"


def on_checkpoint_invalid_running(sv: Run, ev: CheckpointInvalid) -> None:
    """RUNNING: the attempt's ranks refused its resume point and are exiting: the attempt fails
    now, on no node (the files are at fault; the ranks' exits that follow are not crashes to blame
    on whoever exited first), and the relaunch resumes from the commit before it."""
    if not on_checkpoint_invalid(sv, ev) or ev.step != sv.cur.resume_step:
        return
    failure.begin(
        sv,
        Failure(
            detector=E.DETECTOR_CHECKPOINT,
            nodes=[],
            step=ev.step,
            label=_INVALID_LABEL,
            reason=_invalid_reason(ev),
            dumps=False,
        ),
        latency=0.0,
    )


def on_checkpoint_invalid_ending(sv: Run, ev: CheckpointInvalid) -> None:
    """COLLECTING, STOPPING: as in RUNNING, and a rank's exit that reached the controller first (its
    host's write raced the refusal's) began the attempt's failure as a crash: it is the refusal's,
    so no node is blamed for it."""
    f = sv.failure
    if not on_checkpoint_invalid(sv, ev) or ev.step != sv.cur.resume_step or f is None:
        return
    if f.detector == E.DETECTOR_CRASH and not f.planned:
        f.detector, f.label, f.reason = E.DETECTOR_CHECKPOINT, _INVALID_LABEL, _invalid_reason(ev)
        f.nodes, f.ranks, f.first_exit, f.first_exit_at = [], [], None, None  # nobody exited first
