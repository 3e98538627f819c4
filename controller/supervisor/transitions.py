"""Every change of the run's state: the only module that assigns `Run.state` (raft's becomeX).

Each `become_*` sets the state together with what the state promises (its deadline, its timer, the
bookkeeping it starts), after `Run.check_move` (the machine's table) has accepted the move. The
rules decide which move to make and call these; nothing else writes the state
(tests/supervisor/test_structure.py checks)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from controller.supervisor.actions import CollectDumps, Launch, SetTimer, StopAttempt
from controller.supervisor.states import RunState
from runwarden.v1 import events_pb2 as E

if TYPE_CHECKING:
    from controller.supervisor.run import Run


def _enter(sv: Run, state: RunState) -> None:
    if state is sv.state:
        return
    sv.check_move(sv.state, state)
    sv.state = state


def become_waiting(sv: Run) -> None:
    """WAITING_NODES: the machine prepares an attempt once enough usable nodes are free."""
    _enter(sv, RunState.WAITING_NODES)


def become_preflight(sv: Run) -> None:
    """PREFLIGHT for a new attempt: no preflight asked yet, the preflight's deadline from now."""
    _enter(sv, RunState.PREFLIGHT)
    sv.preparing.pending_preflight = set()
    sv.preparing.preflight_deadline = sv.now + sv.cfg.preflight_timeout_s


def resume_preflight(sv: Run) -> None:
    """PREFLIGHT again after a control-plane fault: the gate measures again, a fresh deadline."""
    _enter(sv, RunState.PREFLIGHT)
    sv.preparing.gate_pending = None  # an answer that came while blind was dropped: measure again
    sv.preparing.preflight_deadline = sv.now + sv.cfg.preflight_timeout_s
    sv.emit(SetTimer(key="preflight", at=sv.preparing.preflight_deadline))


def become_running(sv: Run, *, hang_after_s: float, launch: Launch | None = None) -> None:
    """RUNNING: the attempt (launched now, or kept through a fault, or adopted) is watched for a
    hang from now; `launch` is sent first when the attempt is new."""
    _enter(sv, RunState.RUNNING)
    if launch is not None:
        sv.emit(launch)
    sv.cur.hang_timer_at = sv.now + hang_after_s
    sv.emit(SetTimer(key="hang", at=sv.cur.hang_timer_at))


def become_collecting(sv: Run, live: list[str], *, hold_s: float | None = None) -> None:
    """COLLECTING: evidence before the stop. The live nodes dump their flight recorders, until the
    dump deadline; or, with `hold_s`, nothing is collected and the other leases get that long to
    show a mass expiry (the control plane's fault: the attempt is kept, not stopped)."""
    _enter(sv, RunState.COLLECTING)
    if hold_s is None:
        sv.deadline = sv.now + sv.cfg.dump_timeout_s
        sv.emit(CollectDumps(attempt=sv.attempt, nodes=tuple(live), timeout_s=sv.cfg.dump_timeout_s))
    else:
        sv.deadline = sv.now + hold_s
    sv.emit(SetTimer(key="collecting", at=sv.deadline))


def become_stopping(sv: Run, awaiting: set[str], *, wait_s: float, stop: StopAttempt | None = None) -> None:
    """STOPPING: wait up to `wait_s` for `awaiting` to exit (`stop` asks them). With none to wait
    for, no deadline: the caller decides at once."""
    _enter(sv, RunState.STOPPING)
    sv.cur.awaiting_exit = awaiting
    if not awaiting:
        return
    sv.deadline = sv.now + wait_s
    if stop is not None:
        sv.emit(stop)
    sv.emit(SetTimer(key="stop", at=sv.deadline))


def become_backoff(sv: Run, delay: float) -> None:
    """BACKOFF for `delay` seconds before the relaunch; a zero delay waits for nodes at once."""
    _enter(sv, RunState.BACKOFF)
    sv.deadline = sv.now + delay
    if delay <= 0:
        _enter(sv, RunState.WAITING_NODES)
    else:
        sv.emit(SetTimer(key="backoff", at=sv.deadline))


def become_blind(sv: Run, *, etcd_lost: bool, reason: str) -> None:
    """Any live state -> CONTROL_PLANE: blind until the store is listed again (remembering the
    state it left); nothing is quarantined meanwhile. Already blind: only etcd's loss is noted."""
    if sv.state is RunState.CONTROL_PLANE:
        sv.blind.etcd_lost = sv.blind.etcd_lost or etcd_lost
        return
    sv.blind.paused = sv.state
    sv.blind.etcd_lost = etcd_lost
    if sv.failure is not None:
        sv.failure.control_plane = True
    _enter(sv, RunState.CONTROL_PLANE)
    sv.deadline = sv.now + sv.cfg.control_plane_grace_s
    sv.log(E.EVENT_KIND_CONTROL_PLANE, reason + "; waiting to reconcile")
    if not etcd_lost:
        sv.emit(SetTimer(key="control_plane", at=sv.deadline))


def finish(sv: Run, state: RunState, outcome: str, reason: str) -> None:
    """The run ends in `state` (terminal): its nodes are given back, the end is logged."""
    sv.release_slots()
    _enter(sv, state)
    sv.failure = None
    sv.log(E.EVENT_KIND_RUN_END, reason, run_detail=E.RunDetail(nodes=sv.plan.nodes, outcome=outcome))
