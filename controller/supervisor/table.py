"""The state graph as data (h11's Rule 1): `TABLE`, `EDGES`, `STATE_TRIGGERED`.

`TABLE[state][event type]` is a `Rule`: the per-state function that handles it (in the rule
modules; every column written out in every row) and its legal first moves; `AUTOMATIC` what the
machine runs on its own in a state, `STATE_TRIGGERED` the moves that may make; `EDGES` is the whole
graph. `Supervisor.handle` (machine.py) dispatches on it, and every move goes through transitions.py,
which refuses anything outside `EDGES`.

The graph, generated from the table (tests/supervisor/test_machine.py keeps it in step):

    WAITING_NODES
      -> COLLECTING        StoreListed
      -> CONTROL_PLANE     NodeLost, ControlPlaneLost, StoreListed
      -> PREFLIGHT         (state-triggered)
      -> RUNNING           StoreListed
      -> STOPPED           StopRequested, StoreListed
      -> STOPPING          StoreListed
    PREFLIGHT
      -> CONTROL_PLANE     NodeLost, ControlPlaneLost, StoreListed
      -> RUNNING           NodeJoined, NodeLost, NodeDraining, PreflightResult, Tick, EvidenceObserved, OperatorQuarantine, StoreListed, ActionFailed, BandwidthMeasured, NodeClaimed
      -> STOPPED           StopRequested, StoreListed
    RUNNING
      -> BACKOFF           ActionFailed
      -> COLLECTING        NodeLost, NodeDraining, ProgressObserved, AttemptExited, StopRequested, Tick, CheckpointCommitted, CheckpointInvalid, WorkersStarted, EvidenceObserved, OperatorQuarantine, StoreListed, ActionFailed
      -> COMPLETED         AttemptExited
      -> CONTROL_PLANE     NodeLost, ControlPlaneLost, StoreListed
      -> STOPPING          NodeLost, NodeDraining, ProgressObserved, AttemptExited, StopRequested, Tick, CheckpointCommitted, CheckpointInvalid, WorkersStarted, EvidenceObserved, OperatorQuarantine, StoreListed, ActionFailed
      -> WAITING_NODES     ActionFailed
    COLLECTING
      -> CONTROL_PLANE     NodeLost, ControlPlaneLost, StoreListed
      -> STOPPING          DumpsCollected, Tick, ActionFailed
    STOPPING
      -> BACKOFF           NodeLost, AttemptExited, Tick, StoreListed, ActionFailed, (state-triggered)
      -> BUDGET_EXHAUSTED  NodeLost, AttemptExited, Tick, StoreListed, ActionFailed, (state-triggered)
      -> CONTROL_PLANE     NodeLost, ControlPlaneLost, StoreListed
      -> CRASH_LOOP        NodeLost, AttemptExited, Tick, StoreListed, ActionFailed, (state-triggered)
      -> STOPPED           NodeLost, AttemptExited, Tick, StoreListed, ActionFailed, (state-triggered)
      -> WAITING_NODES     NodeLost, AttemptExited, Tick, StoreListed, ActionFailed, (state-triggered)
    BACKOFF
      -> CONTROL_PLANE     NodeLost, ControlPlaneLost, StoreListed
      -> STOPPED           StopRequested, StoreListed
      -> WAITING_NODES     Tick, (state-triggered)
    CONTROL_PLANE
      -> COLLECTING        NodeJoined, Tick, StoreListed
      -> PREFLIGHT         NodeJoined, Tick, StoreListed
      -> RUNNING           NodeJoined, Tick, StoreListed
      -> STOPPED           NodeJoined, Tick, StoreListed
      -> STOPPING          NodeJoined, Tick, StoreListed
      -> WAITING_NODES     NodeJoined, Tick, StoreListed
    terminal: BUDGET_EXHAUSTED, COMPLETED, CRASH_LOOP, STOPPED
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from controller.supervisor import (
    burn_in,
    control_plane,
    failed_actions,
    failure,
    nodes,
    prepare,
    reconfigure,
    resume_points,
    running,
    soak,
    stops,
)
from controller.supervisor.events import (
    ActionFailed,
    AttemptExited,
    BandwidthMeasured,
    CheckpointCommitted,
    CheckpointFailed,
    CheckpointInvalid,
    ControlPlaneLost,
    ControlPlaneRestored,
    DumpsCollected,
    EvidenceObserved,
    NodeClaimed,
    NodeDraining,
    NodeJoined,
    NodeLost,
    OperatorQuarantine,
    OperatorRelease,
    PolicyChanged,
    PreflightResult,
    ProgressObserved,
    StopRequested,
    StoreListed,
    Tick,
    WorkersStarted,
)
from controller.supervisor.states import TERMINAL, RunState

if TYPE_CHECKING:
    from controller.supervisor.run import Run

Ev = TypeVar("Ev", contravariant=True)


@dataclass(frozen=True, slots=True)
class Rule(Generic[Ev]):
    handler: Callable[[Run, Ev], None]
    to: frozenset[RunState]  # the legal first moves (empty: the state stays)


def _ignore(sv: Run, ev: object) -> None:
    return None


def _on(fn: Callable[[Run, Ev], None], *to: RunState) -> Rule[Ev]:
    return Rule(fn, frozenset(to))


IGNORE = Rule(_ignore, frozenset())
S = RunState
_FAIL = (S.COLLECTING, S.STOPPING)  # a failure detected: collect dumps, or stop at once
_BLIND = (S.CONTROL_PLANE,)
_DECIDED = (
    S.BACKOFF,
    S.WAITING_NODES,
    S.STOPPED,
    S.CRASH_LOOP,
    S.BUDGET_EXHAUSTED,
)  # a stopped attempt's fate
_AFTER_CP = (S.RUNNING, S.COLLECTING, S.STOPPING, S.PREFLIGHT, S.WAITING_NODES, S.STOPPED)


def _tick(fn: Callable[[Run], None]) -> Callable[[Run, Tick], None]:
    def on_tick(sv: Run, ev: Tick) -> None:
        soak.expire(sv, burn_in.record)  # a burn-in soak past its deadline, in any live state
        burn_in.retry_due(sv)  # inconclusive burn-ins whose backoff is over
        fn(sv)

    on_tick.__name__ = f"tick:{getattr(fn, '__module__', '').rsplit('.', 1)[-1]}.{fn.__name__}"
    return on_tick


def _row(
    *,
    joined: Rule[NodeJoined],
    lost: Rule[NodeLost],
    drain: Rule[NodeDraining],
    preflight: Rule[PreflightResult],
    progress: Rule[ProgressObserved],
    exited: Rule[AttemptExited],
    dumps: Rule[DumpsCollected],
    stop: Rule[StopRequested],
    tick: Rule[Tick],
    checkpoint: Rule[CheckpointCommitted],
    checkpoint_failed: Rule[CheckpointFailed],
    checkpoint_invalid: Rule[CheckpointInvalid],
    started: Rule[WorkersStarted],
    evidence: Rule[EvidenceObserved],
    operator_q: Rule[OperatorQuarantine],
    operator_release: Rule[OperatorRelease],
    cp_lost: Rule[ControlPlaneLost],
    cp_restored: Rule[ControlPlaneRestored],
    listed: Rule[StoreListed],
    failed: Rule[ActionFailed],
    bandwidth: Rule[BandwidthMeasured],
    policy: Rule[PolicyChanged],
    claimed: Rule[NodeClaimed],
) -> dict[type, Rule[Any]]:
    """One state's row: a rule for every event type (no defaults: each column is written out)."""
    return {
        NodeJoined: joined,
        NodeLost: lost,
        NodeDraining: drain,
        PreflightResult: preflight,
        ProgressObserved: progress,
        AttemptExited: exited,
        DumpsCollected: dumps,
        StopRequested: stop,
        Tick: tick,
        CheckpointCommitted: checkpoint,
        CheckpointFailed: checkpoint_failed,
        CheckpointInvalid: checkpoint_invalid,
        WorkersStarted: started,
        EvidenceObserved: evidence,
        OperatorQuarantine: operator_q,
        OperatorRelease: operator_release,
        ControlPlaneLost: cp_lost,
        ControlPlaneRestored: cp_restored,
        StoreListed: listed,
        ActionFailed: failed,
        BandwidthMeasured: bandwidth,
        PolicyChanged: policy,
        NodeClaimed: claimed,
    }


# the same in every state
_CHECKPOINT_FAILED = _on(nodes.on_checkpoint_failed)
_CHECKPOINT_INVALID = _on(resume_points.on_checkpoint_invalid_idle)  # the next launch's resume point changes
_STARTED = _on(running.on_workers_started)  # logged in any state: the attempt's record
_RELEASE = _on(nodes.on_operator_release)
_POLICY = _on(reconfigure.on_policy_changed)  # the next decision uses it
_CP_LOST = _on(control_plane.on_lost_etcd, *_BLIND)
_FAILED = _on(failed_actions.on_action_failed)  # recorded, or a refill of the attempt being prepared

TABLE: dict[RunState, dict[type, Rule[Any]]] = {
    S.WAITING_NODES: _row(
        joined=_on(nodes.on_joined),
        lost=_on(nodes.on_lost_idle, *_BLIND),
        preflight=_on(nodes.on_preflight),
        progress=IGNORE,
        exited=IGNORE,
        dumps=IGNORE,
        stop=_on(stops.on_stop_request_idle, S.STOPPED),
        tick=_on(_tick(prepare.on_tick_waiting)),
        checkpoint=_on(nodes.on_checkpoint),
        evidence=_on(nodes.on_evidence),
        operator_q=_on(nodes.on_operator_quarantine),
        cp_lost=_CP_LOST,
        cp_restored=IGNORE,
        listed=_on(control_plane.on_store_listed_waiting, S.RUNNING, *_FAIL, *_BLIND, S.STOPPED),
        failed=_FAILED,
        drain=_on(nodes.on_draining),
        bandwidth=_on(nodes.on_bandwidth),  # a burn-in soak's answer
        claimed=_on(nodes.on_claimed),  # another run took or gave back a node
        checkpoint_failed=_CHECKPOINT_FAILED,
        checkpoint_invalid=_CHECKPOINT_INVALID,
        started=_STARTED,
        operator_release=_RELEASE,
        policy=_POLICY,
    ),
    S.PREFLIGHT: _row(
        joined=_on(nodes.on_joined_preflight, S.RUNNING),
        lost=_on(nodes.on_lost_preflight, S.RUNNING, *_BLIND),
        preflight=_on(nodes.on_preflight_preparing, S.RUNNING),
        progress=IGNORE,
        exited=IGNORE,
        dumps=IGNORE,
        stop=_on(stops.on_stop_request_idle, S.STOPPED),
        tick=_on(_tick(prepare.on_tick), S.RUNNING),
        checkpoint=_on(nodes.on_checkpoint),
        evidence=_on(nodes.on_evidence_preflight, S.RUNNING),
        operator_q=_on(nodes.on_operator_quarantine_preflight, S.RUNNING),
        cp_lost=_CP_LOST,
        cp_restored=IGNORE,
        listed=_on(control_plane.on_store_listed, S.RUNNING, *_BLIND, S.STOPPED),
        failed=_on(failed_actions.on_action_failed, S.RUNNING),
        bandwidth=_on(nodes.on_bandwidth_preflight, S.RUNNING),
        drain=_on(nodes.on_draining_preflight, S.RUNNING),
        claimed=_on(nodes.on_claimed_preflight, S.RUNNING),  # a refill may launch
        checkpoint_failed=_CHECKPOINT_FAILED,
        checkpoint_invalid=_CHECKPOINT_INVALID,
        started=_STARTED,
        operator_release=_RELEASE,
        policy=_POLICY,
    ),
    S.RUNNING: _row(
        joined=_on(nodes.on_joined),
        lost=_on(nodes.on_lost_running, *_FAIL, *_BLIND),
        preflight=_on(nodes.on_preflight),
        progress=_on(running.on_progress, *_FAIL),
        exited=_on(running.on_exited, *_FAIL, S.COMPLETED),
        dumps=IGNORE,
        stop=_on(stops.on_stop_request_running, *_FAIL),
        tick=_on(_tick(running.on_tick), *_FAIL),
        checkpoint=_on(running.on_checkpoint, *_FAIL),
        evidence=_on(nodes.on_evidence_running, *_FAIL),
        operator_q=_on(nodes.on_operator_quarantine_running, *_FAIL),
        cp_lost=_CP_LOST,
        cp_restored=IGNORE,
        listed=_on(control_plane.on_store_listed, *_FAIL, *_BLIND),
        failed=_on(failed_actions.on_action_failed, *_FAIL, S.BACKOFF, S.WAITING_NODES),
        drain=_on(nodes.on_draining_running, *_FAIL),
        bandwidth=_on(nodes.on_bandwidth),  # a burn-in soak's answer
        claimed=_on(nodes.on_claimed),  # another run took or gave back a node
        checkpoint_failed=_CHECKPOINT_FAILED,
        checkpoint_invalid=_on(resume_points.on_checkpoint_invalid_running, *_FAIL),
        started=_on(running.on_workers_started_running, *_FAIL),
        operator_release=_RELEASE,
        policy=_POLICY,
    ),
    S.COLLECTING: _row(
        joined=_on(nodes.on_joined),
        lost=_on(nodes.on_lost_collecting, *_BLIND),
        preflight=_on(nodes.on_preflight),
        progress=_on(running.on_progress_ending),
        exited=_on(running.on_exited_ending),
        dumps=_on(failure.on_dumps, S.STOPPING),
        stop=_on(stops.on_stop_request_stopping),
        tick=_on(_tick(failure.on_tick_collecting), S.STOPPING),
        checkpoint=_on(nodes.on_checkpoint),
        evidence=_on(nodes.on_evidence),
        operator_q=_on(nodes.on_operator_quarantine),
        cp_lost=_CP_LOST,
        cp_restored=IGNORE,
        listed=_on(control_plane.on_store_listed, *_BLIND),
        failed=_on(failed_actions.on_action_failed, S.STOPPING),
        drain=_on(nodes.on_draining),
        bandwidth=_on(nodes.on_bandwidth),  # a burn-in soak's answer
        claimed=_on(nodes.on_claimed),  # another run took or gave back a node
        checkpoint_failed=_CHECKPOINT_FAILED,
        checkpoint_invalid=_on(resume_points.on_checkpoint_invalid_ending),
        started=_STARTED,
        operator_release=_RELEASE,
        policy=_POLICY,
    ),
    S.STOPPING: _row(
        joined=_on(nodes.on_joined),
        lost=_on(nodes.on_lost_stopping, *_DECIDED, *_BLIND),
        preflight=_on(nodes.on_preflight),
        progress=_on(running.on_progress_ending),
        exited=_on(running.on_exited_stopping, *_DECIDED),
        dumps=IGNORE,
        stop=_on(stops.on_stop_request_stopping),
        tick=_on(_tick(failure.on_tick_stopping), *_DECIDED),
        checkpoint=_on(nodes.on_checkpoint),
        evidence=_on(nodes.on_evidence),
        operator_q=_on(nodes.on_operator_quarantine),
        cp_lost=_CP_LOST,
        cp_restored=IGNORE,
        listed=_on(control_plane.on_store_listed, *_DECIDED, *_BLIND),
        failed=_on(failed_actions.on_action_failed, *_DECIDED),
        drain=_on(nodes.on_draining),
        bandwidth=_on(nodes.on_bandwidth),  # a burn-in soak's answer
        claimed=_on(nodes.on_claimed),  # another run took or gave back a node
        checkpoint_failed=_CHECKPOINT_FAILED,
        checkpoint_invalid=_on(resume_points.on_checkpoint_invalid_ending),
        started=_STARTED,
        operator_release=_RELEASE,
        policy=_POLICY,
    ),
    S.BACKOFF: _row(
        joined=_on(nodes.on_joined),
        lost=_on(nodes.on_lost_idle, *_BLIND),
        preflight=_on(nodes.on_preflight),
        progress=IGNORE,
        exited=IGNORE,
        dumps=IGNORE,
        stop=_on(stops.on_stop_request_idle, S.STOPPED),
        tick=_on(_tick(failure.on_tick_backoff), S.WAITING_NODES),
        checkpoint=_on(nodes.on_checkpoint),
        evidence=_on(nodes.on_evidence),
        operator_q=_on(nodes.on_operator_quarantine),
        cp_lost=_CP_LOST,
        cp_restored=IGNORE,
        listed=_on(control_plane.on_store_listed, *_BLIND, S.STOPPED),
        failed=_FAILED,
        drain=_on(nodes.on_draining),
        bandwidth=_on(nodes.on_bandwidth),  # a burn-in soak's answer
        claimed=_on(nodes.on_claimed),  # another run took or gave back a node
        checkpoint_failed=_CHECKPOINT_FAILED,
        checkpoint_invalid=_CHECKPOINT_INVALID,
        started=_STARTED,
        operator_release=_RELEASE,
        policy=_POLICY,
    ),
    # blind: exits are recorded (reconciled later), progress and dumps are not evidence now
    S.CONTROL_PLANE: _row(
        joined=_on(control_plane.on_joined, *_AFTER_CP),
        lost=_on(nodes.on_lost_unwatched),
        preflight=_on(nodes.on_preflight_blind),
        progress=IGNORE,
        exited=_on(running.on_exited_ending),
        dumps=IGNORE,
        stop=_on(stops.on_stop_request_blind),
        tick=_on(_tick(control_plane.on_tick), *_AFTER_CP),
        checkpoint=_on(nodes.on_checkpoint),
        evidence=_on(nodes.on_evidence_blind),
        operator_q=_on(nodes.on_operator_quarantine),
        cp_lost=_CP_LOST,
        cp_restored=_on(control_plane.on_restored),
        listed=_on(control_plane.on_store_listed_blind, *_AFTER_CP),
        failed=_on(failed_actions.on_action_failed),
        drain=_on(nodes.on_draining),
        bandwidth=_on(nodes.on_bandwidth),  # a burn-in soak's answer
        claimed=_on(nodes.on_claimed),  # another run took or gave back a node
        checkpoint_failed=_CHECKPOINT_FAILED,
        checkpoint_invalid=_CHECKPOINT_INVALID,
        started=_STARTED,
        operator_release=_RELEASE,
        policy=_POLICY,
    ),
    **{
        s: _row(
            joined=_on(nodes.on_joined),
            lost=_on(nodes.on_lost_unwatched),
            preflight=_on(nodes.on_preflight),
            progress=IGNORE,
            exited=IGNORE,
            dumps=IGNORE,
            stop=IGNORE,
            tick=IGNORE,
            checkpoint=_on(nodes.on_checkpoint),
            evidence=_on(nodes.on_evidence),
            operator_q=_on(nodes.on_operator_quarantine),
            cp_lost=IGNORE,
            cp_restored=IGNORE,
            listed=_on(control_plane.on_store_listed),
            failed=_on(failed_actions.on_action_failed),
            drain=_on(nodes.on_draining),
            bandwidth=_on(nodes.on_bandwidth),  # a burn-in soak's answer
            claimed=_on(nodes.on_claimed),  # another run took or gave back a node
            checkpoint_failed=_CHECKPOINT_FAILED,
            checkpoint_invalid=_CHECKPOINT_INVALID,
            started=_STARTED,
            operator_release=_RELEASE,
            policy=_POLICY,
        )
        for s in TERMINAL
    },
}

# The moves the machine makes on its own, inside whatever event it handles.
STATE_TRIGGERED: dict[RunState, frozenset[RunState]] = {
    S.WAITING_NODES: frozenset({S.PREFLIGHT}),  # enough usable nodes: prepare an attempt
    S.STOPPING: frozenset(_DECIDED),  # nothing left to wait for: decide
    S.BACKOFF: frozenset({S.WAITING_NODES}),  # a zero backoff
}

# What the machine runs on its own in a state, after the event's rule (machine.Supervisor.handle
# runs them to a fixed point: until the state stops changing). Their moves are STATE_TRIGGERED's.
AUTOMATIC: dict[RunState, Callable[[Run], None]] = {
    S.WAITING_NODES: prepare.try_start,  # enough usable nodes: prepare an attempt
}

EDGES: frozenset[tuple[RunState, RunState]] = frozenset(
    {(s, t) for s, row in TABLE.items() for rule in row.values() for t in rule.to if t is not s}
    | {(s, t) for s, ts in STATE_TRIGGERED.items() for t in ts}
)


def diagram() -> str:
    """The graph as text: each state's moves, and the events that make them."""
    lines = []
    for s, row in TABLE.items():
        if s in TERMINAL:
            continue
        by_target: dict[RunState, list[str]] = {}
        for ev, rule in row.items():
            for t in sorted(rule.to - {s}, key=lambda x: x.name):
                by_target.setdefault(t, []).append(ev.__name__)
        for t in sorted(STATE_TRIGGERED.get(s, ()), key=lambda x: x.name):
            by_target.setdefault(t, []).append("(state-triggered)")
        lines.append(f"    {s.name}")
        for t, evs in sorted(by_target.items(), key=lambda kv: kv[0].name):
            lines.append(f"      -> {t.name:<17} {', '.join(evs)}")
    lines.append("    terminal: " + ", ".join(sorted(s.name for s in TERMINAL)))
    return "\n".join(lines)
