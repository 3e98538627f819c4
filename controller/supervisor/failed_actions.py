"""Rules for `ActionFailed`: what the core does when the shell could not carry out an action.

It reacts at once, never at a timeout: a launch that never happened is relaunched (a new attempt
number, nothing quarantined, no restart consumed, a backoff that grows while it keeps failing); a
node that preflight could not reach is replaced without being quarantined (temporary) or rejected
(permanent), while a preflight that was never sent at all (`node == ""`: the log append failed) is
sent again after a short delay; dumps that cannot be collected stop the attempt now. The rest is recorded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from controller.supervisor import burn_in, failure, prepare, restart, soak
from controller.supervisor.actions import (
    AllocateFromQueue,
    CollectDumps,
    Launch,
    MeasureBandwidth,
    RunPreflight,
    SetTimer,
)
from controller.supervisor.events import ActionFailed, AttemptExited
from controller.supervisor.states import IN_ATTEMPT, RunState
from runwarden.v1 import events_pb2 as E

if TYPE_CHECKING:
    from controller.supervisor.run import Run

# A refused ask of the queue (no such nodes, the scheduler down) is asked again after this, doubling.
QUEUE_RETRY_BASE_S = 5.0
QUEUE_RETRY_MAX_S = 300.0


def on_action_failed(sv: Run, ev: ActionFailed) -> None:
    act = ev.action
    kind = "temporary" if ev.temporary else "permanent"
    what = f"{type(act).__name__}{' on ' + ev.node if ev.node else ''} failed ({kind}): {ev.reason}"
    match act:
        case Launch() if act.attempt == sv.attempt and sv.state in IN_ATTEMPT and ev.node:
            # that node's workers never started: as if they exited at once
            sv.log(E.EVENT_KIND_CONTROL_PLANE, what)
            sv.apply(
                AttemptExited(
                    node=ev.node, attempt=act.attempt, exit_code=127, detail=f"launch failed: {ev.reason}"
                )
            )
        case Launch() if act.attempt == sv.attempt and sv.state is RunState.RUNNING:
            _not_launched(sv, act, what)
        case RunPreflight(purpose="attempt") if sv.state is RunState.PREFLIGHT and not ev.node:
            # the request never left (the log append failed): not the nodes' fault; ask again shortly
            again = sorted(n for n in act.nodes if n in sv.pending_preflight)
            if again:
                sv.preflight_resend.update(again)
                sv.preflight_deadline = sv.now + sv.backoff_s() + sv.cfg.preflight_timeout_s
                sv.emit(SetTimer(key="preflight", at=sv.now + sv.backoff_s()))
                sv.log(
                    E.EVENT_KIND_CONTROL_PLANE,
                    f"{what}; asking {', '.join(again)} again in {sv.backoff_s():g}s",
                )
        case RunPreflight(purpose="attempt") if sv.state is RunState.PREFLIGHT:
            node = ev.node
            if node not in sv.pending_preflight:
                return
            if ev.temporary:
                sv.unreachable.add(node)
                prepare.drop_from_slots(
                    sv,
                    node,
                    f"preflight could not reach it ({ev.reason}); replaced for this attempt, not quarantined",
                )
            else:
                # The agent could not run it (busy with a burn-in, refused the request): no verdict on
                # the node, so no quarantine and no strike; it is left out of this attempt.
                prepare.leave_out(sv, node, f"preflight could not run: {ev.reason}")
        case RunPreflight(purpose="burn_in"):
            for node in (ev.node,) if ev.node else act.nodes:
                sv.burn_in.discard(node)  # it stays in burn-in; it runs again when the node re-registers
            sv.log(E.EVENT_KIND_CONTROL_PLANE, f"{what}; the node stays out until its burn-in can run")
        case MeasureBandwidth(purpose="burn_in"):
            soak.unanswered(sv, act.nodes, what, burn_in.record)
        case MeasureBandwidth() if sv.state is RunState.PREFLIGHT and act.nodes == sv.gate_pending:
            prepare.gate_unanswered(sv, what)
        case CollectDumps() if sv.state is RunState.COLLECTING and act.attempt == sv.attempt:
            sv.log(E.EVENT_KIND_CONTROL_PLANE, f"{what}; stopping without the flight recorder")
            failure.stop(sv)
        case AllocateFromQueue():
            sv.queue_outstanding = max(0, sv.queue_outstanding - act.count)
            sv.queue_refusals += 1
            delay = min(QUEUE_RETRY_MAX_S, QUEUE_RETRY_BASE_S * 2 ** (sv.queue_refusals - 1))
            sv.queue_retry_at = sv.now + delay
            sv.emit(SetTimer(key="queue_retry", at=sv.queue_retry_at))
            sv.log(
                E.EVENT_KIND_CONTROL_PLANE, f"{what}; asking again in {delay:g}s if a slot still needs a node"
            )
        case _:
            # StopAttempt: the stop deadline decides; Quarantine/Release/TakeSpare/Page/PersistNode: the
            # core's own state is already right and is written again at the node's next change.
            sv.log(E.EVENT_KIND_CONTROL_PLANE, what)


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
        f"relaunching as attempt {sv.attempt + 1} after {delay:g}s "
        f"({sv.history.launch_failures} launch{'es' if sv.history.launch_failures > 1 else ''} "
        "in a row not carried out)",
    )
