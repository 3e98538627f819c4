"""Every rule for a `StopRequested`, one per kind of state the table names, and the stop a
control-plane pause held back. A running attempt stops the planned way (finish the step, save,
commit, exit 0) through the failure pipeline; nothing else is quarantined or blamed."""

from __future__ import annotations

from typing import TYPE_CHECKING

from controller.supervisor import failure, transitions
from controller.supervisor.attempt import Failure
from controller.supervisor.events import StopRequested
from controller.supervisor.states import RunState
from runwarden.v1 import events_pb2 as E

if TYPE_CHECKING:
    from controller.supervisor.run import Run


def log_stop_request(sv: Run, ev: StopRequested) -> None:
    what = "stop and relaunch" if ev.relaunch else "stop the run"
    sv.log(
        E.EVENT_KIND_STOP_REQUEST,
        f"planned stop requested ({ev.reason}): {what}; nothing is quarantined",
        stop=E.StopDetail(reason=ev.reason, requested_by=ev.requested_by),
    )


def on_stop_request_running(sv: Run, ev: StopRequested) -> None:
    """RUNNING: finish the step, save, commit, exit 0 (the planned-stop path of this pipeline)."""
    log_stop_request(sv, ev)
    failure.begin(
        sv,
        Failure(
            detector=E.DETECTOR_UNSPECIFIED,
            nodes=[],
            step=sv.job_step,
            planned=True,
            relaunch=ev.relaunch,
            reason=f"planned stop: {ev.reason}",
        ),
        latency=0.0,
    )


def deliver_pending_stop(sv: Run) -> None:
    """A stop request held during a control-plane pause reaches the attempt once one runs."""
    # called right after a move (a pause resolved, a launch): only an attempt that now runs takes it
    if sv.pending_stop is not None and sv.state is RunState.RUNNING:
        held, sv.pending_stop = sv.pending_stop, None
        on_stop_request_running(sv, held)


def on_stop_request_stopping(sv: Run, ev: StopRequested) -> None:
    """COLLECTING, STOPPING: the attempt is ending anyway; a stop that ends the run ends it after."""
    log_stop_request(sv, ev)
    if not ev.relaunch:
        sv.end_after_stop = True


def on_stop_request_idle(sv: Run, ev: StopRequested) -> None:
    """WAITING_NODES, PREFLIGHT, BACKOFF: nothing runs; a stop that ends the run ends it now."""
    log_stop_request(sv, ev)
    if not ev.relaunch:
        transitions.finish(sv, RunState.STOPPED, "stopped", f"stopped on request: {ev.reason}")
    # a relaunching stop while nothing runs: the next launch is the relaunch


def on_stop_request_blind(sv: Run, ev: StopRequested) -> None:
    """CONTROL_PLANE: held until the control plane is back."""
    log_stop_request(sv, ev)
    sv.pending_stop = ev
