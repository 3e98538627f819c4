"""Rules for `ActionFailed`: what the core does when the shell could not carry out an action, as a
nested table (`FAILED[state][action type]`, every action type written out in every state).

It reacts at once, never at a timeout: a launch that never happened is relaunched (a new attempt
number, nothing quarantined, no restart consumed, a backoff that grows while it keeps failing); a
node that preflight could not reach is replaced without being quarantined (temporary) or rejected
(permanent), a preflight never sent (`node == ""`) is sent again shortly; dumps that cannot be
collected stop the attempt now. The rest is recorded."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from controller.supervisor import burn_in, failure, prepare, restart, soak, spare_checks
from controller.supervisor.actions import (
    Action,
    AllocateFromQueue,
    CollectDumps,
    Launch,
    MeasureBandwidth,
    Page,
    PersistCheckpoint,
    PersistMemory,
    PersistNode,
    Quarantine,
    Release,
    RunPreflight,
    SetTimer,
    StopAttempt,
    TakeSpare,
)
from controller.supervisor.events import ActionFailed, AttemptExited
from controller.supervisor.states import TERMINAL, RunState
from runwarden.v1 import events_pb2 as E

if TYPE_CHECKING:
    from controller.supervisor.run import Run

# A refused ask of the queue (no such nodes, the scheduler down) is asked again after this, doubling.
QUEUE_RETRY_BASE_S = 5.0
QUEUE_RETRY_MAX_S = 300.0


def on_action_failed(sv: Run, ev: ActionFailed) -> None:
    kind = "temporary" if ev.temporary else "permanent"
    what = f"{type(ev.action).__name__}{' on ' + ev.node if ev.node else ''} failed ({kind}): {ev.reason}"
    FAILED[sv.state][type(ev.action)](sv, ev, what)


# (run, the failure, what failed in words)
FailedHandler = Callable[["Run", ActionFailed, str], None]


def _recorded(sv: Run, ev: ActionFailed, what: str) -> None:
    # StopAttempt: the stop deadline decides; Quarantine/Release/TakeSpare/Page/Persist*: the core's
    # own state is already right and is written again at the node's next change.
    sv.log(E.EVENT_KIND_CONTROL_PLANE, what)


def _launch_failed_on_node(sv: Run, ev: ActionFailed, what: str) -> None:
    """COLLECTING, STOPPING: one node's workers never started: as if they exited at once."""
    act = ev.action
    assert isinstance(act, Launch)
    if act.attempt != sv.attempt or not ev.node:
        _recorded(sv, ev, what)
        return
    sv.log(E.EVENT_KIND_CONTROL_PLANE, what)
    sv.apply(
        AttemptExited(node=ev.node, attempt=act.attempt, exit_code=127, detail=f"launch failed: {ev.reason}")
    )


def _launch_failed_running(sv: Run, ev: ActionFailed, what: str) -> None:
    """RUNNING: one node's launch failed (as above), or the whole launch never happened."""
    act = ev.action
    assert isinstance(act, Launch)
    if act.attempt == sv.attempt and not ev.node:
        _not_launched(sv, act, what)
    else:
        _launch_failed_on_node(sv, ev, what)


def _preflight_failed_preparing(sv: Run, ev: ActionFailed, what: str) -> None:
    """PREFLIGHT: the attempt's preflight (resent, or its node replaced), or a burn-in's."""
    act = ev.action
    assert isinstance(act, RunPreflight)
    if act.purpose == "spare":
        _spare_check_failed(sv, ev, what)
    elif act.purpose != "attempt":
        _preflight_failed(sv, ev, what)
    elif not ev.node:
        # the request never left (the log append failed): not the nodes' fault; ask again shortly
        again = sorted(n for n in act.nodes if n in sv.preparing.pending_preflight)
        if again:
            sv.preparing.preflight_resend.update(again)
            sv.preparing.preflight_deadline = sv.now + sv.backoff_s() + sv.cfg.preflight_timeout_s
            sv.emit(SetTimer(key="preflight", at=sv.now + sv.backoff_s()))
            sv.log(
                E.EVENT_KIND_CONTROL_PLANE,
                f"{what}; asking {', '.join(again)} again in {sv.backoff_s():g}s",
            )
    elif ev.node in sv.preparing.pending_preflight:
        if ev.temporary:
            sv.preparing.unreachable.add(ev.node)
            prepare.drop_from_slots(
                sv,
                ev.node,
                f"preflight could not reach it ({ev.reason}); replaced for this attempt, not quarantined",
            )
        else:
            # The agent could not run it (busy with a burn-in, refused the request): no verdict on
            # the node, so no quarantine and no strike; it is left out of this attempt.
            prepare.leave_out(sv, ev.node, f"preflight could not run: {ev.reason}")


def _preflight_failed(sv: Run, ev: ActionFailed, what: str) -> None:
    """Any state: a burn-in's preflight (the node stays in burn-in); an attempt's is late: recorded."""
    act = ev.action
    assert isinstance(act, RunPreflight)
    if act.purpose == "spare":
        _spare_check_failed(sv, ev, what)
        return
    if act.purpose != "burn_in":
        _recorded(sv, ev, what)
        return
    # It stays in burn-in and is asked again after the inconclusive burn-in's backoff (or at once
    # when its agent re-registers): the agent may be busy with a burn-in a previous leader asked for.
    delays = []
    for node in (ev.node,) if ev.node else act.nodes:
        if node in sv.burn_in:
            sv.burn_in.discard(node)
            delays.append(burn_in.retry_later(sv, node))
    again = f" (asked again in {max(delays):g}s)" if delays else ""
    sv.log(E.EVENT_KIND_CONTROL_PLANE, f"{what}; the node stays out until its burn-in can run{again}")


def _spare_check_failed(sv: Run, ev: ActionFailed, what: str) -> None:
    """A spare's background preflight could not run or reach it: no verdict, asked again later."""
    act = ev.action
    assert isinstance(act, RunPreflight)
    spare_checks.unanswered(sv, act, ev.node)
    sv.log(E.EVENT_KIND_CONTROL_PLANE, f"{what}; no verdict on the spare, asked again at the next interval")


def _bandwidth_failed_preparing(sv: Run, ev: ActionFailed, what: str) -> None:
    """PREFLIGHT: a burn-in soak's, or the bandwidth gate's for the node set in play."""
    act = ev.action
    assert isinstance(act, MeasureBandwidth)
    if act.purpose != "burn_in" and act.nodes == sv.preparing.gate_pending:
        prepare.gate_unanswered(sv, what)
    else:
        _bandwidth_failed(sv, ev, what)


def _bandwidth_failed(sv: Run, ev: ActionFailed, what: str) -> None:
    """Any state: a burn-in soak's goes without its answer; a gate's is late: recorded."""
    act = ev.action
    assert isinstance(act, MeasureBandwidth)
    if act.purpose == "burn_in":
        soak.unanswered(sv, act.nodes, what, burn_in.record)
    else:
        _recorded(sv, ev, what)


def _dumps_failed_collecting(sv: Run, ev: ActionFailed, what: str) -> None:
    """COLLECTING: the attempt stops now, without the flight recorder."""
    act = ev.action
    assert isinstance(act, CollectDumps)
    if act.attempt != sv.attempt:
        _recorded(sv, ev, what)
        return
    sv.log(E.EVENT_KIND_CONTROL_PLANE, f"{what}; stopping without the flight recorder")
    failure.stop(sv)


def _queue_refused(sv: Run, ev: ActionFailed, what: str) -> None:
    """Any state: the queue refused an ask: asked again after a backoff, if a slot still needs a node."""
    act = ev.action
    assert isinstance(act, AllocateFromQueue)
    sv.queue.outstanding = max(0, sv.queue.outstanding - act.count)
    sv.queue.refusals += 1
    delay = min(QUEUE_RETRY_MAX_S, QUEUE_RETRY_BASE_S * 2 ** (sv.queue.refusals - 1))
    sv.queue.retry_at = sv.now + delay
    sv.emit(SetTimer(key="queue_retry", at=sv.queue.retry_at))
    sv.log(E.EVENT_KIND_CONTROL_PLANE, f"{what}; asking again in {delay:g}s if a slot still needs a node")


def _row(
    *, launch: FailedHandler, preflight: FailedHandler, bandwidth: FailedHandler, dumps: FailedHandler
) -> dict[type[Action], FailedHandler]:
    return {
        Launch: launch,
        RunPreflight: preflight,
        MeasureBandwidth: bandwidth,
        CollectDumps: dumps,
        AllocateFromQueue: _queue_refused,  # in every state
        # recorded in every state: the core's own state is already right (or a deadline decides)
        StopAttempt: _recorded,
        Quarantine: _recorded,
        Release: _recorded,
        TakeSpare: _recorded,
        Page: _recorded,
        SetTimer: _recorded,
        PersistNode: _recorded,
        PersistMemory: _recorded,
        PersistCheckpoint: _recorded,
    }


_S = RunState
_IDLE = _row(launch=_recorded, preflight=_preflight_failed, bandwidth=_bandwidth_failed, dumps=_recorded)

FAILED: dict[RunState, dict[type[Action], FailedHandler]] = {
    _S.WAITING_NODES: _IDLE,
    _S.PREFLIGHT: _row(
        launch=_recorded,
        preflight=_preflight_failed_preparing,
        bandwidth=_bandwidth_failed_preparing,
        dumps=_recorded,
    ),
    _S.RUNNING: _row(
        launch=_launch_failed_running,
        preflight=_preflight_failed,
        bandwidth=_bandwidth_failed,
        dumps=_recorded,
    ),
    _S.COLLECTING: _row(
        launch=_launch_failed_on_node,
        preflight=_preflight_failed,
        bandwidth=_bandwidth_failed,
        dumps=_dumps_failed_collecting,
    ),
    _S.STOPPING: _row(
        launch=_launch_failed_on_node,
        preflight=_preflight_failed,
        bandwidth=_bandwidth_failed,
        dumps=_recorded,
    ),
    _S.BACKOFF: _IDLE,
    _S.CONTROL_PLANE: _IDLE,
    **{s: _IDLE for s in TERMINAL},
}


def _not_launched(sv: Run, act: Launch, what: str) -> None:
    sv.history.launch_failures += 1
    delay = restart.launch_retry_delay(sv.cfg, sv.history)
    sv.log(
        E.EVENT_KIND_CONTROL_PLANE,
        f"attempt {act.attempt} was not launched: {what}; nothing is quarantined and no restart is consumed",
    )
    sv.release_slots()
    sv.failure = None
    failure.begin_backoff(
        sv,
        delay,
        f"relaunching as attempt {sv.next_attempt} after {delay:g}s "
        f"({sv.history.launch_failures} launch{'es' if sv.history.launch_failures > 1 else ''} "
        "in a row not carried out)",
    )
