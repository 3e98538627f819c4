"""The supervisor core: a deterministic, sans-IO state machine for one run.

Theory (etcd raft's and h11's): `Supervisor.handle(event, now) -> list[Action]`. No sockets, clock,
threads, store or randomness inside; `now` is an argument (seconds, any epoch, non-decreasing).
The same core runs under the live shell and under the fleet simulator. Rule 1 (h11): everything
that changes the run's state machine lives in this file; detectors (controller/supervisor/detectors.py) and
pool bookkeeping (controller/supervisor/pool.py) are pure helpers it calls. Transitions are data:
`TRANSITIONS[(state, event type)]` names the handler; an unknown pair raises `TransitionError`
naming both. Every decision is explained in words: the `message` of the event it appends.

The run's states:

    WAITING_NODES -> PREFLIGHT -> RUNNING -> COLLECTING -> STOPPING -> BACKOFF -> PREFLIGHT ...
          ^             |  (rejection: quarantine, replace; no attempt consumed)        |
          +-------------+----------------------- not enough nodes -------------------+
    any live state -> CONTROL_PLANE (etcd lost, mass lease expiry) -> reconcile -> ...
    terminal: COMPLETED, CRASH_LOOP, BUDGET_EXHAUSTED, STOPPED

The rules (DESIGN.md, "the supervisor's contract"):
* every attempt gets a new, strictly larger attempt number and rendezvous id `<run>-<attempt>`;
  it resumes from the latest *committed* checkpoint (-1: from scratch);
* every node of an attempt passes preflight first; a rejection quarantines it and does not
  consume an attempt; spares are taken first (best reputation), the queue is the fallback;
* failures (crash, hang, node lost, fatal evidence, straggler if configured) go: detect ->
  collect flight-recorder dumps -> stop -> blame (hardware > flight recorder > heartbeat >
  first-to-exit > none) -> quarantine -> budget and crash-loop check -> backoff -> relaunch;
* a crash with no evidence is attributed to the first node to exit but not quarantined; the
  same node first to exit at `repeat_offender_count` different steps is; no suspect and the same
  failure at the same step `crash_loop_count` times in a row -> crash loop: stop and page;
* restart budget per window and exponential backoff; planned stops and control-plane faults
  consume neither and quarantine nothing;
* persistent stragglers are quarantined at the next restart (killed mid-run only if configured);
* quarantined nodes come back only after burn-in; a node failing twice in the hold window is held.

Driving it (live shell, simulator, tests):

    sup = Supervisor(SupervisorConfig(...), RunPlan(run="llama", nodes=4))
    actions = sup.handle(NodeJoined(node="n1", local_ranks=8), now)   # ... one event at a time
    actions = sup.reconcile(Snapshot(...), now)                       # after a (re)start or watch gap
    sup.status(now)                                                   # read-only summary for APIs

Events and actions are in controller/supervisor/types.py, with the order in which a batch must be executed.
Answer `RunPreflight` with one `PreflightResult` per node, `CollectDumps` with `DumpsCollected`,
`StopAttempt` with the nodes' `AttemptExited` (or their `NodeLost`), `AllocateFromQueue` with the
new nodes' `NodeJoined`, and `SetTimer` with a `Tick` at (or after) its time. Progress is one
`ProgressObserved` per node per interval; nothing needs to be sent per rank per step. A rank's
`step` counts steps completed (N right after loading checkpoint N); a node whose ranks all carry
`loaded_step` but have not stepped past the resume point is a load mark, not progress: when every
node of the attempt has one, the core logs LOAD_DONE (the restart's load phase ends there).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from controller.supervisor import detectors
from controller.supervisor.policy import RunPlan, SupervisorConfig
from controller.supervisor.pool import ASSIGNED, BURN_IN, HELD, QUARANTINED, SPARE, STATE_NAMES, Pool
from controller.supervisor.types import (
    Action,
    AllocateFromQueue,
    AppendEvent,
    AttemptExited,
    AttributionLike,
    CheckpointCommitted,
    CheckpointFailed,
    CollectDumps,
    ControlPlaneLost,
    ControlPlaneRestored,
    DumpsCollected,
    EvidenceObserved,
    Launch,
    NodeJoined,
    NodeLost,
    NodeRank,
    OperatorQuarantine,
    OperatorRelease,
    Page,
    PersistNode,
    PreflightResult,
    ProgressObserved,
    Quarantine,
    Release,
    RunPreflight,
    SetTimer,
    Snapshot,
    StopAttempt,
    StopRequested,
    TakeSpare,
    Tick,
)
from runwarden.v1 import common_pb2, events_pb2

E = events_pb2
UNREPORTED = -2  # a node of the attempt that has not reported progress yet


class RunState(enum.Enum):
    WAITING_NODES = "waiting_nodes"
    PREFLIGHT = "preflight"
    RUNNING = "running"
    COLLECTING = "collecting"
    STOPPING = "stopping"
    BACKOFF = "backoff"
    CONTROL_PLANE = "control_plane"
    COMPLETED = "completed"
    CRASH_LOOP = "crash_loop"
    BUDGET_EXHAUSTED = "budget_exhausted"
    STOPPED = "stopped"


TERMINAL = frozenset({RunState.COMPLETED, RunState.CRASH_LOOP, RunState.BUDGET_EXHAUSTED, RunState.STOPPED})
LIVE = frozenset(RunState) - TERMINAL


@dataclass(frozen=True, slots=True, kw_only=True)
class SupervisorStatus:
    """A read-only summary of the run for status APIs (`Supervisor.status(now)`)."""

    state: RunState
    attempt: int
    rendezvous_id: str  # "" before the first launch
    job_step: int  # the slowest node's step in the current attempt (or the resume step), -1 unknown
    latest_committed: int  # -1: none
    restarts_used: int  # failure restarts counted against the budget (within the window)
    restart_budget: int
    since_last_progress_s: float  # -1: no progress seen in this attempt
    nodes: tuple[str, ...]  # the current attempt's nodes by node rank
    failure: str  # the failure being handled now, "" if none


class TransitionError(RuntimeError):
    """An event the state machine has no rule for in its current state."""


@dataclass(slots=True)
class Failure:
    """One failure (or planned stop) of the current attempt, from detection to decision."""

    detector: events_pb2.Detector.ValueType  # DETECTOR_UNSPECIFIED for planned stops
    reason: str
    nodes: list[str]
    step: int
    label: str = ""  # the failure's signature for the crash-loop rule, e.g. "signal:SIGKILL"
    ranks: list[int] = field(default_factory=list)
    planned: bool = False
    relaunch: bool = True
    control_plane: bool = False
    first_exit: str | None = None
    attribution: AttributionLike | None = None


# ---------------------------------------------------------------------------------------------
# The transition table: (state, event type) -> handler. Pool-level events (nodes, evidence,
# preflight, checkpoints, operators, snapshots, ticks) are handled in every state; attempt events
# only where an attempt is in flight; "_ignore" marks an event that is stale or meaningless there
# (a late answer for an attempt already stopped), never an error.
# ---------------------------------------------------------------------------------------------

_POOL: dict[type, str] = {
    NodeJoined: "_on_joined", NodeLost: "_on_lost", EvidenceObserved: "_on_evidence",
    PreflightResult: "_on_preflight", CheckpointCommitted: "_on_checkpoint", CheckpointFailed: "_on_checkpoint_failed",
    OperatorQuarantine: "_on_operator_quarantine", OperatorRelease: "_on_operator_release",
    Snapshot: "_on_snapshot", Tick: "_on_tick",
}
_NO_ATTEMPT: dict[type, str] = {ProgressObserved: "_ignore", AttemptExited: "_ignore", DumpsCollected: "_ignore"}
_CONTROL: dict[type, str] = {StopRequested: "_on_stop_request", ControlPlaneLost: "_on_control_plane_lost",
                             ControlPlaneRestored: "_ignore"}
_BY_STATE: dict[RunState, dict[type, str]] = {
    RunState.WAITING_NODES: {**_POOL, **_NO_ATTEMPT, **_CONTROL},
    RunState.PREFLIGHT: {**_POOL, **_NO_ATTEMPT, **_CONTROL},
    RunState.RUNNING: {**_POOL, **_CONTROL, ProgressObserved: "_on_progress", AttemptExited: "_on_exited",
                       DumpsCollected: "_ignore"},
    RunState.COLLECTING: {**_POOL, **_CONTROL, ProgressObserved: "_ignore", AttemptExited: "_on_exited",
                          DumpsCollected: "_on_dumps"},
    RunState.STOPPING: {**_POOL, **_CONTROL, ProgressObserved: "_ignore", AttemptExited: "_on_exited",
                        DumpsCollected: "_ignore"},
    RunState.BACKOFF: {**_POOL, **_NO_ATTEMPT, **_CONTROL},
    # blind: exits are recorded (reconciled later), progress and dumps are not evidence now
    RunState.CONTROL_PLANE: {**_POOL, **_CONTROL, ProgressObserved: "_ignore", AttemptExited: "_on_exited",
                             DumpsCollected: "_ignore", ControlPlaneRestored: "_on_control_plane_restored"},
    **{s: {**_POOL, **_NO_ATTEMPT, StopRequested: "_ignore", ControlPlaneLost: "_ignore",
           ControlPlaneRestored: "_ignore"} for s in TERMINAL},
}
TRANSITIONS: dict[tuple[RunState, type], str] = {
    (state, event): handler for state, table in _BY_STATE.items() for event, handler in table.items()
}


class Supervisor:
    """The run's supervisor core. Drive it with `handle(event, now)`; execute the actions in order."""

    def __init__(self, config: SupervisorConfig, plan: RunPlan) -> None:
        self.cfg = config
        self.plan = plan
        self.pool = Pool(config)
        # TRANSITIONS bound to this instance, per state; `state`'s setter picks the current row
        self._bound: dict[RunState, dict[type, Callable[[Any], None]]] = {s: {} for s in RunState}
        for (st, ev_type), name in TRANSITIONS.items():
            self._bound[st][ev_type] = getattr(self, name)
        self.state = RunState.WAITING_NODES
        self.attempt = 0  # last launched attempt number
        self.committed: set[int] = set()
        self.latest_committed = -1
        self._out: list[Action] = []
        self._now = 0.0
        # current / next attempt
        self.slots: list[str | None] = []  # node per node rank, for the attempt being prepared/run
        self._pending_preflight: set[str] = set()
        self._preflight_deadline = 0.0
        self._burn_in: set[str] = set()
        self._queue_outstanding = 0
        self._from_queue: set[str] = set()
        self._vacated: dict[int, str] = {}  # node rank -> node that held it in the previous attempt
        self._prev_slots: list[str] = []
        # running attempt
        self.launched_at = 0.0
        self.resume_step = -1
        self._node_step: dict[str, int] = {}
        self._step_count: dict[int, int] = {}
        self._min_step = UNREPORTED
        self._min_advanced_at = 0.0
        self._node_seen_at: dict[str, float] = {}  # last progress report per node (node-lost latency)
        self._ckpt_nodes: set[str] = set()
        # Save durations: first "saving step S" report -> commit of S (or the commit's own figure).
        # Kept across attempts: how long a save takes is the run's, not the attempt's.
        self._save_started: dict[int, float] = {}
        self._save_times: deque[float] = deque(maxlen=16)
        self._step_times: deque[float] = deque(maxlen=64)
        self._first_step_logged = False
        self._loaded_nodes: set[str] = set()  # nodes whose ranks all reported their load finished
        self._load_logged = False
        self._loads: dict[int, tuple[str, float, float]] = {}  # rank -> (node, ewma compute, ewma wait)
        self._straggler_hist: deque[tuple[float, int | None]] = deque(maxlen=config.straggler_window)
        self._straggler_nodes: set[str] = set()  # flagged: quarantine at the next restart
        self._exited: dict[str, str] = {}  # node -> exit label, current attempt
        self.job_step = -1
        # failure pipeline
        self.failure: Failure | None = None
        self._deadline = 0.0  # COLLECTING / STOPPING / BACKOFF / CONTROL_PLANE deadline
        self._end_after_stop = False
        self._restart_times: list[float] = []
        self._consecutive_failures = 0
        self._loop_signature: tuple[str, int] | None = None
        self._loop_count = 0
        self._offences: dict[str, set[int]] = {}
        self._loss_times: deque[float] = deque(maxlen=4096)
        self._cp_etcd_lost = False
        self._pending_stop: StopRequested | None = None
        self._cp_prev = RunState.WAITING_NODES
        self._empty_slots = 0
        self._waiting_since: float | None = None
        self._awaiting_exit: set[str] = set()

    @property
    def state(self) -> RunState:
        return self._state

    @state.setter
    def state(self, value: RunState) -> None:
        self._state = value
        self._handlers = self._bound[value]

    # --- the one entry point ------------------------------------------------------------------

    def handle(self, event: Any, now: float) -> list[Action]:
        """Apply one event at time `now`; return the actions to execute, in order."""
        handler = self._handlers.get(type(event))
        if handler is None:
            raise TransitionError(f"no rule for event {type(event).__name__} in state {self._state.name}")
        if now > self._now:
            self._now = now
        self._out = []
        handler(event)
        if self._state is RunState.WAITING_NODES:
            self._try_start()
        out, self._out = self._out, []
        return out

    def status(self, now: float) -> SupervisorStatus:
        window = self.cfg.restart_budget_window_s
        used = sum(1 for t in self._restart_times if not window or now - t < window)
        progressing = self._state == RunState.RUNNING and self._min_step != UNREPORTED
        return SupervisorStatus(
            state=self._state, attempt=self.attempt,
            rendezvous_id=f"{self.plan.run}-{self.attempt}" if self.attempt else "", job_step=self.job_step,
            latest_committed=self.latest_committed, restarts_used=used, restart_budget=self.cfg.restart_budget,
            since_last_progress_s=max(0.0, now - self._min_advanced_at) if progressing else -1.0,
            nodes=self.current_nodes, failure=self.failure.reason if self.failure else "")

    def reconcile(self, snapshot: Snapshot, now: float) -> list[Action]:
        """Rebuild the view from the store (level-triggered); same as handle(snapshot, now)."""
        return self.handle(snapshot, now)

    # --- small helpers ------------------------------------------------------------------------

    def _log(self, kind: events_pb2.EventKind.ValueType, message: str, step: int | None = None,
             **detail: Any) -> None:
        ev = E.Event(ts=self._now, run=self.plan.run, attempt=self.attempt,
                     step=self.job_step if step is None else step,
                     kind=kind, message=message, **detail)
        self._out.append(AppendEvent(event=ev))

    def _persist(self, node: str) -> None:
        self._out.append(PersistNode(record=self.pool.get(node).view()))

    @property
    def current_nodes(self) -> tuple[str, ...]:
        """The nodes of the attempt being prepared or run, in node-rank order (read-only view)."""
        return tuple(n for n in self.slots if n is not None)

    def _attempt_nodes(self) -> list[str]:
        return [n for n in self.slots if n is not None]

    def _ignore(self, event: object) -> None:
        return None

    def _in_attempt(self, node: str) -> bool:
        return self._state in (RunState.RUNNING, RunState.COLLECTING, RunState.STOPPING) and node in self._node_step

    # --- pool-level events --------------------------------------------------------------------

    def _on_joined(self, ev: NodeJoined) -> None:
        node = self.pool.set_alive(ev.node, True, ev.local_ranks)
        if self._queue_outstanding > 0 and node.state == SPARE:
            self._queue_outstanding -= 1
            self._from_queue.add(ev.node)
        self._log(E.EVENT_KIND_NODE_JOINED, f"node {ev.node} joined ({ev.local_ranks} ranks), pool state "
                  f"{STATE_NAMES.get(node.state, 'unknown')}",
                  node=E.NodeDetail(node=ev.node, reason="lease registered"))
        if node.state in (QUARANTINED, BURN_IN):
            self._begin_burn_in(ev.node)
        elif node.state == ASSIGNED and not self._in_attempt(ev.node) and ev.node not in self.slots:
            self.pool.set_state(ev.node, SPARE)
        if self._state == RunState.PREFLIGHT:
            self._fill_slots()
        elif self._state == RunState.CONTROL_PLANE and not self._cp_etcd_lost:
            self._control_plane_maybe_resolved()

    def _on_lost(self, ev: NodeLost) -> None:
        node = self.pool.set_alive(ev.node, False)
        self._burn_in.discard(ev.node)
        self._loss_times.append(self._now)
        while self._loss_times and self._now - self._loss_times[0] > self.cfg.mass_expiry_window_s:
            self._loss_times.popleft()
        self._log(E.EVENT_KIND_NODE_LOST, f"node {ev.node} lost: its lease expired",
                  node=E.NodeDetail(node=ev.node, reason="lease expired"))
        if self._state in TERMINAL:
            return
        if self._state != RunState.CONTROL_PLANE and detectors.is_mass_expiry(
                self._loss_times, self._now, len(self.pool.nodes), self.cfg):
            self._enter_control_plane(etcd_lost=False, reason=(
                f"{len(self._loss_times)} leases expired within {self.cfg.mass_expiry_window_s:g}s: a control-plane fault, "
                "not hardware; nothing is quarantined for it"))
            return
        if self._state == RunState.RUNNING and ev.node in self._node_step:
            last = self._node_seen_at.get(ev.node, self.launched_at)
            self._begin_failure(Failure(
                detector=E.DETECTOR_NODE_LOST, nodes=[ev.node], step=self.job_step, label="node_lost",
                reason=f"node {ev.node} lost its lease (last progress report {self._now - last:.1f}s ago)"),
                latency=self._now - last)
        elif self._state in (RunState.COLLECTING, RunState.STOPPING) and ev.node in self._node_step:
            self._exited.setdefault(ev.node, "lost")
            if self._state == RunState.STOPPING:
                self._maybe_stopped(ev.node)
        elif self._state == RunState.PREFLIGHT and ev.node in self.slots:
            self._drop_from_slots(ev.node, f"node {ev.node} lost during preflight")
        if node.state == ASSIGNED and not self._in_attempt(ev.node) and ev.node not in self.slots:
            self.pool.set_state(ev.node, SPARE)

    def _on_evidence(self, ev: EvidenceObserved) -> None:
        e = ev.evidence
        self.pool.add_evidence(e.node, e, self._now)
        if not detectors.is_fatal_evidence(e):
            return
        latency = max(0.0, self._now - e.observed_at) if e.observed_at > 0 else 0.0
        kind = common_pb2.EvidenceKind.Name(e.kind) if e.kind in common_pb2.EvidenceKind.values() else str(e.kind)
        reason = f"fatal {kind} on {e.node}: {e.detail}".rstrip(": ")
        if self._state == RunState.RUNNING and e.node in self._node_step:
            self._begin_failure(Failure(detector=E.DETECTOR_EVIDENCE, nodes=[e.node], step=self.job_step,
                                        label="evidence", reason=reason), latency=latency)
            return
        self._log(E.EVENT_KIND_DETECTION, reason, detection=E.DetectionDetail(
            detector=E.DETECTOR_EVIDENCE, nodes=[e.node], latency_s=latency, reason=reason))
        if self._in_attempt(e.node) or (self._state == RunState.CONTROL_PLANE and e.node in self._node_step):
            return  # blamed by hardware evidence when the attempt's failure is decided
        state = self.pool.get(e.node).state
        if state in (SPARE, BURN_IN) or (state == ASSIGNED and e.node in self.slots):
            self._quarantine(e.node, reason, evidence=[e])
            if self._state == RunState.PREFLIGHT and e.node in self.slots:
                self._drop_from_slots(e.node, reason)

    def _on_checkpoint(self, ev: CheckpointCommitted) -> None:
        if ev.step in self.committed:
            return
        self.committed.add(ev.step)
        self.latest_committed = max(self.latest_committed, ev.step)
        started = self._save_started.get(ev.step)
        if ev.save_duration_s > 0:
            self._save_times.append(ev.save_duration_s)
        elif started is not None:
            self._save_times.append(self._now - started)
        if self._save_started:
            self._save_started = {s: t for s, t in self._save_started.items() if s > ev.step}
        self._log(E.EVENT_KIND_CHECKPOINT_COMMIT, f"checkpoint at step {ev.step} committed", step=ev.step,
                  checkpoint=E.CheckpointDetail(path=ev.path, save_duration_s=ev.save_duration_s))
        if self._state == RunState.RUNNING and self._min_step != UNREPORTED:
            if started is not None:
                # The save, from its first "saving" report to this commit, is not time the step stood
                # still (else a 25 s save trips a 10 s hang timeout the moment it commits). Only the
                # observed save is credited: a commit alone must not postpone a hang that began
                # right after it.
                self._min_advanced_at = min(self._now, self._min_advanced_at
                                            + max(0.0, self._now - max(started, self._min_advanced_at)))
            if self._ckpt_nodes:
                # Every rank finished that save. A node still shown "saving" it is stale (a rank
                # stopped right after its save): it must not keep the long checkpoint timeout.
                self._ckpt_nodes = {n for n in self._ckpt_nodes if self._node_step.get(n, UNREPORTED) > ev.step}
                if not self._ckpt_nodes:
                    self._check_hang()  # re-arms the hang timer at the ordinary deadline

    def _on_checkpoint_failed(self, ev: CheckpointFailed) -> None:
        where = f" on {ev.node}" if ev.node else ""
        self._log(E.EVENT_KIND_CHECKPOINT_FAILED,
                  f"checkpoint at step {ev.step} failed{where}: {ev.error}; no commit marker, the latest "
                  f"committed step stays {self.latest_committed}", step=ev.step,
                  checkpoint=E.CheckpointDetail(error=ev.error))

    def _on_operator_quarantine(self, ev: OperatorQuarantine) -> None:
        reason = f"operator: {ev.reason}"
        self._quarantine(ev.node, reason, operator=True)
        if self._state == RunState.RUNNING and ev.node in self._node_step:
            self._begin_failure(Failure(detector=E.DETECTOR_UNSPECIFIED, nodes=[ev.node], step=self.job_step,
                                        planned=True, reason=f"{reason}: restarting without {ev.node}"),
                                latency=0.0)
        elif self._state == RunState.PREFLIGHT and ev.node in self.slots:
            self._drop_from_slots(ev.node, reason)

    def _on_operator_release(self, ev: OperatorRelease) -> None:
        node = self.pool.operator_release(ev.node)
        self._log(E.EVENT_KIND_RELEASE, f"operator released {ev.node} ({ev.reason}); it returns after "
                  f"{self.cfg.burn_in_passes} burn-in passes",
                  release=E.ReleaseDetail(node=ev.node, reason=ev.reason, operator=True))
        self._persist(ev.node)
        if node.alive and node.state == BURN_IN:
            self._begin_burn_in(ev.node)

    def _on_preflight(self, ev: PreflightResult) -> None:
        if ev.node in self._burn_in:
            self._on_burn_in_result(ev)
        elif ev.node in self._pending_preflight and (self._state == RunState.PREFLIGHT or (
                self._state == RunState.CONTROL_PLANE and self._cp_prev == RunState.PREFLIGHT)):
            self._on_attempt_preflight(ev)  # during a control-plane pause: recorded, launched after it

    # --- burn-in ------------------------------------------------------------------------------

    def _begin_burn_in(self, node: str) -> None:
        if self.pool.get(node).state == HELD or not self.pool.start_burn_in(node):
            return
        self._burn_in.add(node)
        self._persist(node)
        self._out.append(RunPreflight(nodes=(node,), mode=self.cfg.burn_in_mode, purpose="burn_in",
                                      timeout_s=self.cfg.preflight_timeout_s))

    def _on_burn_in_result(self, ev: PreflightResult) -> None:
        self._burn_in.discard(ev.node)
        outcome = self.pool.burn_in_result(ev.node, ev.passed)
        node = self.pool.get(ev.node)
        self._log(E.EVENT_KIND_PREFLIGHT_RESULT, f"burn-in of {ev.node}: {'passed' if ev.passed else 'failed'} "
                  f"({node.burn_in_passes if outcome != 'released' else self.cfg.burn_in_passes}/"
                  f"{self.cfg.burn_in_passes} in a row)" + (f"; failed {', '.join(ev.failed_checks)}"
                                                            if ev.failed_checks else ""),
                  preflight=_preflight_detail(ev))
        self._persist(ev.node)
        if outcome == "released":
            reason = f"passed {self.cfg.burn_in_passes} burn-in preflights in a row"
            self._log(E.EVENT_KIND_RELEASE, f"{ev.node} returns to the spare pool: {reason}",
                      release=E.ReleaseDetail(node=ev.node, reason=reason))
            self._out.append(Release(node=ev.node, reason=reason))
            if self._state == RunState.PREFLIGHT:
                self._fill_slots()
        elif outcome == "failed":  # needs repair: burn-in again when it re-registers or an operator releases it
            self.pool.set_state(ev.node, QUARANTINED, f"burn-in failed: {', '.join(ev.failed_checks) or '?'}")
            self._persist(ev.node)
        elif node.alive:
            self._begin_burn_in(ev.node)

    # --- starting an attempt ------------------------------------------------------------------

    def _try_start(self) -> None:
        """WAITING_NODES: pick nodes (previous attempt's first, then spares); else ask the queue."""
        need = self.plan.nodes
        if self.pool.free_count() < need:
            if self._waiting_since is None:
                self._waiting_since = self._now
                if self.attempt == 0 and self.cfg.queue_wait_s > 0:  # the first nodes are still joining
                    self._out.append(SetTimer(key="queue", at=self._now + self.cfg.queue_wait_s))
            if self.attempt == 0 and self._now < self._waiting_since + self.cfg.queue_wait_s:
                return
            missing = need - self.pool.free_count()
            ask = missing - self._queue_outstanding
            if ask > 0:
                self._queue_outstanding += ask
                reason = f"need {need} nodes, {self.pool.free_count()} usable spares: asking the queue for {ask}"
                self._log(E.EVENT_KIND_ALLOCATE, reason)
                self._out.append(AllocateFromQueue(count=ask, reason=reason))
            return
        self._waiting_since = None
        keep = {n for n in self._prev_slots if self.pool.usable(n) and self.pool.get(n).state == SPARE}
        self.slots = [None] * need
        self._empty_slots = need
        for rank, n in enumerate(self._prev_slots[:need]):
            if n in keep:
                self.slots[rank] = n
                self._empty_slots -= 1
                self.pool.set_state(n, ASSIGNED)
        self._vacated = {r: n for r, n in enumerate(self._prev_slots[:need]) if self.slots[r] != n}
        self.state = RunState.PREFLIGHT
        self._pending_preflight = set()
        self._preflight_deadline = self._now + self.cfg.preflight_timeout_s
        fresh = [n for n in self.slots if n is not None]
        self._fill_slots(also=fresh)

    def _fill_slots(self, also: Iterable[str] = ()) -> None:
        """Fill empty slots from spares (queue as fallback), preflight new nodes; launch when done."""
        empty = [r for r, n in enumerate(self.slots) if n is None] if self._empty_slots else []
        picked = self.pool.pick_spares(len(empty), self._now)
        new = list(also)
        for rank, n in zip(empty, picked, strict=False):
            self.slots[rank] = n
            self._empty_slots -= 1
            self.pool.set_state(n, ASSIGNED)
            new.append(n)
            replaces = self._vacated.get(rank, "")
            if replaces:
                source = "queue" if n in self._from_queue else "spare"
                self._log(E.EVENT_KIND_SPARE_TAKEN, f"{n} ({source}) replaces {replaces} as node rank {rank}",
                          spare=E.SpareDetail(node=n, replaces=replaces, source=source))
                self._out.append(TakeSpare(node=n, replaces=replaces))
            self._from_queue.discard(n)
        still_empty = len(empty) - len(picked)
        if still_empty > self._queue_outstanding:
            ask = still_empty - self._queue_outstanding
            self._queue_outstanding += ask
            reason = f"no spare left for {still_empty} node ranks: asking the queue for {ask}"
            self._log(E.EVENT_KIND_ALLOCATE, reason)
            self._out.append(AllocateFromQueue(count=ask, reason=reason))
        if new:
            self._pending_preflight.update(new)
            self._out.append(RunPreflight(nodes=tuple(new), mode=self.cfg.preflight_mode, purpose="attempt",
                                          timeout_s=self.cfg.preflight_timeout_s))
            self._preflight_deadline = self._now + self.cfg.preflight_timeout_s
            self._out.append(SetTimer(key="preflight", at=self._preflight_deadline))
        self._maybe_launch()

    def _drop_from_slots(self, node: str, reason: str) -> None:
        rank = self.slots.index(node)
        self.slots[rank] = None
        self._empty_slots += 1
        self._vacated.setdefault(rank, node)
        self._pending_preflight.discard(node)
        if self.pool.get(node).state == ASSIGNED:
            self.pool.set_state(node, SPARE)
        self._fill_slots()

    def _on_attempt_preflight(self, ev: PreflightResult) -> None:
        self._pending_preflight.discard(ev.node)
        if ev.passed:
            self._maybe_launch()
            return
        reason = f"preflight ({ev.mode}) failed: {', '.join(ev.failed_checks) or 'no check named'}"
        self._log(E.EVENT_KIND_PREFLIGHT_RESULT, f"{ev.node} rejected before attempt {self.attempt + 1}: "
                  f"{reason}; quarantined, the attempt is not consumed", preflight=_preflight_detail(ev))
        self.pool.get(ev.node).preflight_rejections += 1
        self._quarantine(ev.node, reason)
        self._drop_from_slots(ev.node, reason)

    def _maybe_launch(self) -> None:
        if self._state != RunState.PREFLIGHT or self._pending_preflight or self._empty_slots:
            return
        for n in self.slots:  # the gate: no launch ever includes a node that is not usable now
            p = self.pool.get(n) if n is not None else None
            if p is not None and not (p.alive and p.state == ASSIGNED):
                self._drop_from_slots(p.name, f"{p.name} is no longer usable ({STATE_NAMES.get(p.state, '?')})")
                return
        nodes = [n for n in self.slots if n is not None]
        self._log(E.EVENT_KIND_PREFLIGHT_RESULT, f"all {len(nodes)} nodes passed {self.cfg.preflight_mode} "
                  "preflight", preflight=E.PreflightDetail(summary=common_pb2.PreflightSummary(
                      mode=self.cfg.preflight_mode, passed=True, pass_count=len(nodes))))
        self._launch(nodes)

    def _launch(self, nodes: list[str]) -> None:
        self.attempt += 1
        self.resume_step = self.latest_committed
        rdzv = f"{self.plan.run}-{self.attempt}"
        self.state = RunState.RUNNING
        self.launched_at = self._now
        self._node_step = dict.fromkeys(nodes, UNREPORTED)
        self._step_count = {UNREPORTED: len(nodes)}
        self._min_step = UNREPORTED
        self._min_advanced_at = self._now
        self._node_seen_at = {}
        self._ckpt_nodes = set()
        self._save_started = {}
        self._first_step_logged = False
        self._loaded_nodes = set()
        self._load_logged = False
        self._loads = {}
        self._straggler_hist.clear()
        self._exited = {}
        self.failure = None
        self._prev_slots = list(nodes)
        self.job_step = self.resume_step
        resume = f"committed step {self.resume_step}" if self.resume_step >= 0 else "scratch"
        self._log(E.EVENT_KIND_LAUNCH, f"attempt {self.attempt} ({rdzv}) on {len(nodes)} nodes from {resume}",
                  launch=E.LaunchDetail(rendezvous_id=rdzv, nodes=nodes, resume_step=self.resume_step))
        self._out.append(Launch(run=self.plan.run, attempt=self.attempt, rendezvous_id=rdzv,
                                nodes=tuple(NodeRank(node=n, node_rank=r) for r, n in enumerate(nodes)),
                                resume_step=self.resume_step))
        self._out.append(SetTimer(key="hang", at=self._now + self.cfg.startup_timeout_s))
        if self._pending_stop is not None:
            stop, self._pending_stop = self._pending_stop, None
            self._on_stop_request(stop)

    # --- the running attempt ------------------------------------------------------------------

    def _on_progress(self, ev: ProgressObserved) -> None:
        # the hottest path (one call per node per interval): one pass over the ranks, no generators
        old = self._node_step.get(ev.node)
        if old is None or ev.attempt != self.attempt or not ev.ranks:
            return  # the state is RUNNING (the table routes nothing else here)
        self._node_seen_at[ev.node] = self._now
        if not self._load_logged:
            loaded = True
            stepped = False
            resume = self.resume_step if self.resume_step > 0 else 0
            for r in ev.ranks:
                loaded = loaded and r.loaded_step is not None
                stepped = stepped or r.step > resume
            if loaded:
                self._on_node_loaded(ev.node)
                if not stepped:
                    return  # a load mark: no step was taken yet, so no step accounting
        alpha = self.cfg.straggler_ewma_alpha
        loads = self._loads
        node_step = ev.ranks[0].step
        step_time = 0.0
        saving = False
        for r in ev.ranks:
            if r.step < node_step:
                node_step = r.step
            if r.step_time_s > step_time:
                step_time = r.step_time_s
            # "saving step S" after S was committed is stale: every rank finished that save
            if r.in_checkpoint and r.step > self.latest_committed:
                saving = True
                if r.step not in self._save_started and len(self._save_started) < 64:
                    self._save_started[r.step] = self._now
            prev = loads.get(r.rank)
            if prev is None:
                loads[r.rank] = (ev.node, r.compute_s, r.wait_s)
            else:
                loads[r.rank] = (ev.node, prev[1] + alpha * (r.compute_s - prev[1]),
                                 prev[2] + alpha * (r.wait_s - prev[2]))
        if saving:
            self._ckpt_nodes.add(ev.node)
        elif self._ckpt_nodes:
            self._ckpt_nodes.discard(ev.node)
        self._step_times.append(step_time)
        if node_step <= old:
            return
        self._node_step[ev.node] = node_step
        count = self._step_count
        count[old] -= 1
        if not count[old]:
            del count[old]
        count[node_step] = count.get(node_step, 0) + 1
        new_min = min(count)
        if new_min > self._min_step:
            startup = self._min_step == UNREPORTED
            self._min_step = new_min
            self._min_advanced_at = self._now
            self.job_step = new_min
            self._on_job_step(first=startup)

    def _on_node_loaded(self, node: str) -> None:
        self._loaded_nodes.add(node)
        if len(self._loaded_nodes) < len(self._node_step):
            return
        self._load_logged = True
        loaded = f"checkpoint step {self.resume_step}" if self.resume_step >= 0 else "no checkpoint (scratch)"
        self._log(E.EVENT_KIND_LOAD_DONE, f"all {len(self._node_step)} nodes loaded {loaded}, "
                  f"{self._now - self.launched_at:.1f}s after launch", step=self.resume_step)

    def _on_job_step(self, *, first: bool) -> None:
        if first:  # every node reported: hang detection switches from the startup timeout to steps
            med = detectors.median(self._step_times) if self._step_times else None
            timeout = detectors.hang_timeout(self.cfg, med, in_checkpoint=bool(self._ckpt_nodes),
                                             recent_saves_s=self._save_times)
            self._out.append(SetTimer(key="hang", at=self._now + timeout))
        if not self._first_step_logged and self._min_step > self.resume_step:
            self._first_step_logged = True
            self._log(E.EVENT_KIND_FIRST_STEP, f"first step after launch: step {self._min_step} "
                      f"(resumed from {self.resume_step}), {self._now - self.launched_at:.1f}s after launch")
        if len(self._loads) < 2:
            return
        cand = detectors.straggler_candidate(self._loads, self.cfg)
        self._straggler_hist.append((self._now, cand.rank if cand else None))
        rank = detectors.persistent_straggler((r for _, r in self._straggler_hist), self.cfg)
        if rank is None or cand is None or cand.rank != rank:
            return
        node = cand.node
        if node in self._straggler_nodes:
            return
        self._straggler_nodes.add(node)
        flagged_at = next(t for t, r in self._straggler_hist if r == rank)
        self.pool.get(node).straggler_flags += 1
        self._persist(node)
        action = ("stopping the attempt now" if self.cfg.kill_stragglers_mid_run
                  else "quarantine candidate at the next restart; not killed mid-run")
        reason = f"persistent straggler over {self.cfg.straggler_window} steps: {cand.reason}; {action}"
        if self.cfg.kill_stragglers_mid_run:
            self._begin_failure(Failure(detector=E.DETECTOR_STRAGGLER, nodes=[node], ranks=[rank],
                                        step=self.job_step, label="straggler", reason=reason),
                                latency=self._now - flagged_at)
        else:
            self._log(E.EVENT_KIND_DETECTION, reason, detection=E.DetectionDetail(
                detector=E.DETECTOR_STRAGGLER, nodes=[node], ranks=[rank], latency_s=self._now - flagged_at,
                reason=reason))

    def _on_exited(self, ev: AttemptExited) -> None:
        # routed here in RUNNING, COLLECTING, STOPPING and CONTROL_PLANE only (see TRANSITIONS)
        if ev.attempt != self.attempt or ev.node not in self._node_step or ev.node in self._exited:
            return
        cls = detectors.classify_exit(ev.exit_code, ev.signal, stopping=False)
        self._exited[ev.node] = cls.label
        st = self._state
        if st is RunState.CONTROL_PLANE:
            return
        if st is RunState.RUNNING:
            if cls.kind == "clean":
                if len(self._exited) == len(self._node_step) and all(v == "clean" for v in self._exited.values()):
                    self._finish(RunState.COMPLETED, "completed", "every node exited 0: the run completed")
                return
            latency = max(0.0, self._now - ev.ended_at) if ev.ended_at else 0.0
            rank = f" rank {ev.rank}" if ev.rank is not None else ""
            reason = f"{ev.node}{rank} exited first ({cls.label}{': ' + ev.detail if ev.detail else ''})"
            self._log_exit(ev, cls.label, f"{ev.node} exited: {cls.label}")
            self._begin_failure(Failure(detector=E.DETECTOR_CRASH, nodes=[ev.node], step=self.job_step,
                                        label=cls.label, reason=reason, first_exit=ev.node,
                                        ranks=[ev.rank] if ev.rank is not None else []), latency=latency)
            return
        # victims' exits (COLLECTING/STOPPING) are counted in the attempt's one EXIT summary at the decision
        if st is RunState.STOPPING:
            self._maybe_stopped(ev.node)

    def _log_exit(self, ev: AttemptExited, label: str, message: str) -> None:
        status = common_pb2.ExitStatus(ended_at=ev.ended_at or 0.0, detail=ev.detail)
        if ev.exit_code is not None:
            status.exit_code = ev.exit_code
        if ev.signal is not None:
            status.signal = ev.signal
        self._log(E.EVENT_KIND_EXIT, message, exit=E.ExitDetail(node=ev.node, status=status, classification=label))

    def _on_stop_request(self, ev: StopRequested) -> None:
        what = "stop and relaunch" if ev.relaunch else "stop the run"
        self._log(E.EVENT_KIND_STOP_REQUEST, f"planned stop requested ({ev.reason}): {what}; nothing is "
                  "quarantined", stop=E.StopDetail(reason=ev.reason, requested_by=ev.requested_by))
        if self._state == RunState.RUNNING:
            self._begin_failure(Failure(detector=E.DETECTOR_UNSPECIFIED, nodes=[], step=self.job_step,
                                        planned=True, relaunch=ev.relaunch, reason=f"planned stop: {ev.reason}"),
                                latency=0.0)
        elif self._state == RunState.CONTROL_PLANE:
            self._pending_stop = ev
        elif not ev.relaunch:
            if self._state in (RunState.COLLECTING, RunState.STOPPING):
                self._end_after_stop = True
            else:
                self._release_slots()
                self._finish(RunState.STOPPED, "stopped", f"stopped on request: {ev.reason}")

    # --- failures -----------------------------------------------------------------------------

    def _begin_failure(self, f: Failure, *, latency: float) -> None:
        self.failure = f
        if not f.planned:
            self._log(E.EVENT_KIND_DETECTION, f.reason, detection=E.DetectionDetail(
                detector=f.detector, nodes=f.nodes, ranks=f.ranks, latency_s=max(0.0, latency), reason=f.reason))
        live = [n for n in self._node_step if n not in self._exited and self.pool.nodes[n].alive]
        if self.cfg.collect_dumps and not f.planned and not f.control_plane and live:
            self.state = RunState.COLLECTING
            self._deadline = self._now + self.cfg.dump_timeout_s
            self._out.append(CollectDumps(attempt=self.attempt, nodes=tuple(live), timeout_s=self.cfg.dump_timeout_s))
            self._out.append(SetTimer(key="dumps", at=self._deadline))
        else:
            self._stop()

    def _on_dumps(self, ev: DumpsCollected) -> None:
        if self._state != RunState.COLLECTING or ev.attempt != self.attempt or self.failure is None:
            return
        self.failure.attribution = ev.attribution
        self._stop()

    def _stop(self) -> None:
        assert self.failure is not None
        f = self.failure
        live = [n for n in self._node_step if n not in self._exited and self.pool.nodes[n].alive]
        self.state = RunState.STOPPING
        self._awaiting_exit = set(live)
        if not live:
            self._decide()
            return
        # A planned stop lets the trainer finish its step, save and commit: as long as the longest
        # legitimate barrier (a synchronous save), not the short grace a failed attempt gets.
        grace = max(self.cfg.stop_grace_s, self.cfg.checkpoint_barrier_s) if f.planned else self.cfg.stop_grace_s
        self._deadline = self._now + grace + self.cfg.stop_margin_s
        self._out.append(StopAttempt(attempt=self.attempt, nodes=tuple(live), grace_s=grace, planned=f.planned,
                                     reason=f.reason))
        self._out.append(SetTimer(key="stop", at=self._deadline))

    def _maybe_stopped(self, node: str) -> None:
        self._awaiting_exit.discard(node)
        if not self._awaiting_exit:
            self._decide()

    def _blame(self, f: Failure) -> tuple[str, list[tuple[str, list[int], float, str, list[Any]]]]:
        """Suspects, strongest evidence first: hardware > flight recorder > heartbeat > first exit."""
        hw: list[tuple[str, list[int], float, str, list[Any]]] = []
        for n in self._node_step:  # evidence received since this attempt launched (older was acted on)
            evs = [e for at, e in self.pool.nodes[n].evidence if at >= self.launched_at and detectors.is_fatal_evidence(e)]
            if evs:
                hw.append((n, [], 1.0, f"fatal hardware evidence: {evs[-1].detail or common_pb2.EvidenceKind.Name(evs[-1].kind)}", evs))
        if hw:
            return "hardware", hw
        if f.detector == E.DETECTOR_NODE_LOST:
            return "heartbeat", [(n, [], 0.9, "its lease expired: heartbeats stopped", []) for n in f.nodes]
        if f.detector == E.DETECTOR_STRAGGLER:
            return "straggler", [(n, f.ranks, 0.8, "persistent straggler", []) for n in f.nodes]
        if f.detector == E.DETECTOR_HANG:
            fr = f.attribution
            if fr is not None:
                sus = [(s.node, list(s.ranks), s.confidence, s.reason) for s in fr.suspects
                       if s.confidence >= self.cfg.fr_min_confidence and s.node in self._node_step]
                if sus:
                    method = fr.method if fr.method in ("flight_recorder", "heartbeat", "hardware") else "flight_recorder"
                    return method, [(*s, []) for s in sus]
            hb = detectors.heartbeat_suspect(self._node_step)
            if hb is not None:
                return "heartbeat", [(hb, [], 0.6, f"its progress stopped first (step {self._node_step[hb]})", [])]
        if f.first_exit is not None:
            return "first_exit", [(f.first_exit, f.ranks, 0.5, f"first to exit ({f.label})", [])]
        return "none", []

    def _decide(self) -> None:
        """The attempt is stopped: blame, quarantine, crash loop, budget, backoff; then relaunch."""
        assert self.failure is not None
        f = self.failure
        labels: dict[str, int] = {}
        for n in self._node_step:
            label = self._exited.get(n, "lost" if not self.pool.nodes[n].alive else "no exit confirmed")
            labels[label] = labels.get(label, 0) + 1
        summary = ", ".join(f"{k} x{v}" for k, v in sorted(labels.items()))
        self._log(E.EVENT_KIND_EXIT, f"attempt {self.attempt} ended on {len(self._node_step)} nodes: {summary}",
                  exit=E.ExitDetail(classification="planned_stop" if f.planned else
                                    "control_plane" if f.control_plane else "stopped"))
        to_quarantine: list[tuple[str, str, list[Any]]] = []
        if not f.planned and not f.control_plane:
            method, suspects = self._blame(f)
            explanation = str(getattr(f.attribution, "explanation", "") or "") if f.attribution else ""
            self._log(E.EVENT_KIND_ATTRIBUTION, _attribution_message(method, suspects, f),
                      attribution=E.AttributionDetail(method=method, explanation=explanation, suspects=[
                          E.Suspect(node=n, ranks=r, confidence=c, reason=why, evidence=evs)
                          for n, r, c, why, evs in suspects]))
            if method in ("hardware", "flight_recorder", "heartbeat", "straggler"):
                to_quarantine = [(n, f"{method}: {why}", evs) for n, _, _, why, evs in suspects]
            elif method == "first_exit" and f.first_exit is not None:
                steps = self._offences.setdefault(f.first_exit, set())
                steps.add(f.step)
                if len(steps) >= self.cfg.repeat_offender_count:
                    to_quarantine = [(f.first_exit, f"first to exit at {len(steps)} different steps "
                                      f"({sorted(steps)}) with no hardware evidence", [])]
        if not f.control_plane:
            to_quarantine += [(n, "persistent straggler (quarantined at restart)", [])
                              for n in sorted(self._straggler_nodes) if n in self._node_step]
        seen: set[str] = set()
        for n, why, evs in to_quarantine:
            if n not in seen and self.pool.get(n).state not in (QUARANTINED, HELD, BURN_IN):
                seen.add(n)
                self._quarantine(n, why, evidence=evs)
        self._straggler_nodes.clear()
        self._release_slots()
        if self._end_after_stop or not f.relaunch:
            self._finish(RunState.STOPPED, "stopped", f"stopped on request: {f.reason}")
            return
        if f.planned or f.control_plane:
            self._loop_signature, self._loop_count = None, 0
            self._begin_backoff(0.0, f"{'planned stop' if f.planned else 'control-plane fault'}: relaunching "
                                "without consuming the restart budget")
            return
        if seen:
            self._loop_signature, self._loop_count = None, 0
        else:
            sig = (f.label, f.step)
            self._loop_count = self._loop_count + 1 if sig == self._loop_signature else 1
            self._loop_signature = sig
            if self._loop_count >= self.cfg.crash_loop_count:
                self._page(f"crash loop: {f.label} at step {f.step} {self._loop_count} times with no suspect")
                self._finish(RunState.CRASH_LOOP, "crash_loop",
                             f"crash loop: the same failure ({f.label}) at step {f.step} {self._loop_count} "
                             "times in a row with no suspect; stopped and paged")
                return
        window = self.cfg.restart_budget_window_s
        recent = [t for t in self._restart_times if not window or self._now - t < window]
        if len(recent) >= self.cfg.restart_budget:
            self._page(f"restart budget exhausted: {len(recent)} restarts"
                       + (f" within {window:g}s" if window else ""))
            self._finish(RunState.BUDGET_EXHAUSTED, "budget_exhausted",
                         f"restart budget of {self.cfg.restart_budget} exhausted; not relaunching")
            return
        self._restart_times = [*recent, self._now]
        if self._now - self.launched_at >= self.cfg.backoff_reset_s:
            self._consecutive_failures = 0
        self._consecutive_failures += 1
        delay = min(self.cfg.backoff_max_s, self.cfg.backoff_base_s * 2 ** (self._consecutive_failures - 1))
        self._begin_backoff(delay, f"restart {len(self._restart_times)}/{self.cfg.restart_budget} after "
                            f"{f.label or 'failure'}; backoff {delay:g}s")

    def _begin_backoff(self, delay: float, reason: str) -> None:
        self._log(E.EVENT_KIND_RESTART, reason)
        self.failure = None
        self.state = RunState.BACKOFF
        self._deadline = self._now + delay
        if delay <= 0:
            self.state = RunState.WAITING_NODES
        else:
            self._out.append(SetTimer(key="backoff", at=self._deadline))

    def _release_slots(self) -> None:
        for n in self._attempt_nodes():
            if self.pool.nodes[n].state == ASSIGNED:
                self.pool.set_state(n, SPARE)
        for n in list(self._node_step):
            if self.pool.nodes[n].state == ASSIGNED:
                self.pool.set_state(n, SPARE)
        self._pending_preflight.clear()
        self.slots = []

    def _quarantine(self, node: str, reason: str, evidence: Iterable[Any] = (), operator: bool = False) -> None:
        evs = list(evidence)
        p = self.pool.quarantine(node, self._now, reason, count_failure=not operator, operator=operator, evidence=evs)
        held = p.state == HELD
        why = reason + (f"; held: {self.pool.recent_failures(p, self._now)} failures within "
                        f"{self.cfg.hold_window_s / 86400:g} days, out until an operator releases it"
                        if held and not operator else "; held until an operator releases it" if held else
                        f"; returns after {self.cfg.burn_in_passes} burn-in passes")
        self._log(E.EVENT_KIND_QUARANTINE, f"quarantined {node}: {why}", quarantine=E.QuarantineDetail(
            node=node, reason=reason, evidence=evs, operator=operator))
        self._persist(node)
        self._out.append(Quarantine(node=node, reason=reason, evidence=tuple(evs), held=held))
        if not held and p.alive:
            self._begin_burn_in(node)

    def _page(self, reason: str) -> None:
        self._log(E.EVENT_KIND_PAGE, reason, page=E.PageDetail(reason=reason, severity="critical"))
        self._out.append(Page(reason=reason))

    def _finish(self, state: RunState, outcome: str, reason: str) -> None:
        self._release_slots()
        self.state = state
        self.failure = None
        self._log(E.EVENT_KIND_RUN_END, reason, run_detail=E.RunDetail(nodes=self.plan.nodes, outcome=outcome))

    # --- timers -------------------------------------------------------------------------------

    def _on_tick(self, ev: Tick) -> None:
        now = self._now
        if self._state == RunState.RUNNING:
            self._check_hang()
        elif self._state == RunState.PREFLIGHT and self._pending_preflight and now >= self._preflight_deadline:
            for n in sorted(self._pending_preflight):
                self._pending_preflight.discard(n)
                reason = f"no preflight answer within {self.cfg.preflight_timeout_s:g}s"
                self._log(E.EVENT_KIND_PREFLIGHT_RESULT, f"{n} rejected: {reason}; quarantined, the attempt is "
                          "not consumed", preflight=E.PreflightDetail(node=n))
                self._quarantine(n, reason)
                self._drop_from_slots(n, reason)
        elif self._state == RunState.COLLECTING and now >= self._deadline:
            self._stop()
        elif self._state == RunState.STOPPING and now >= self._deadline:
            self._decide()
        elif self._state == RunState.BACKOFF and now >= self._deadline:
            self.state = RunState.WAITING_NODES
        elif self._state == RunState.CONTROL_PLANE and not self._cp_etcd_lost and now >= self._deadline:
            self._control_plane_resolve(timed_out=True)

    def _check_hang(self) -> None:
        now = self._now
        if self._min_step == UNREPORTED:
            deadline = self.launched_at + self.cfg.startup_timeout_s
            if now >= deadline:
                silent = sorted(n for n, s in self._node_step.items() if s == UNREPORTED)
                self._begin_failure(Failure(
                    detector=E.DETECTOR_HANG, nodes=silent, step=self.job_step, label="hang:startup",
                    reason=f"no progress from {_names(silent)} within {self.cfg.startup_timeout_s:g}s "
                    "of launch"), latency=now - self.launched_at)
                return
        else:
            med = detectors.median(self._step_times) if self._step_times else None
            timeout = detectors.hang_timeout(self.cfg, med, in_checkpoint=bool(self._ckpt_nodes),
                                             recent_saves_s=self._save_times)
            deadline = self._min_advanced_at + timeout
            if detectors.is_hung(now, self._min_advanced_at, timeout):
                behind = sorted(n for n, s in self._node_step.items() if s == self._min_step)
                med_txt = f"{med:.3g}s" if med else "unknown"
                self._begin_failure(Failure(
                    detector=E.DETECTOR_HANG, nodes=behind, step=self._min_step, label="hang",
                    reason=f"hang: step {self._min_step} did not advance for {now - self._min_advanced_at:.1f}s "
                    f"(timeout {timeout:.3g}s = max(floor, {self.cfg.hang_step_multiple:g} x median step "
                    f"{med_txt}){'; a rank is in a checkpoint' if self._ckpt_nodes else ''})"),
                    latency=now - self._min_advanced_at)
                return
        self._out.append(SetTimer(key="hang", at=deadline))

    # --- control plane ------------------------------------------------------------------------

    def _enter_control_plane(self, *, etcd_lost: bool, reason: str) -> None:
        if self._state == RunState.CONTROL_PLANE:
            self._cp_etcd_lost = self._cp_etcd_lost or etcd_lost
            return
        self._cp_prev = self._state
        self._cp_etcd_lost = etcd_lost
        if self.failure is not None:
            self.failure.control_plane = True
        self.state = RunState.CONTROL_PLANE
        self._deadline = self._now + self.cfg.control_plane_grace_s
        self._log(E.EVENT_KIND_CONTROL_PLANE, reason + "; waiting to reconcile")
        if not etcd_lost:
            self._out.append(SetTimer(key="control_plane", at=self._deadline))

    def _on_control_plane_lost(self, ev: ControlPlaneLost) -> None:
        self._enter_control_plane(etcd_lost=True, reason="the controller lost etcd: no observation is evidence "
                                  "about nodes now; nothing is quarantined")

    def _on_control_plane_restored(self, ev: ControlPlaneRestored) -> None:
        if self._state != RunState.CONTROL_PLANE:
            return
        self._cp_etcd_lost = False
        self._deadline = self._now + self.cfg.control_plane_grace_s
        self._log(E.EVENT_KIND_CONTROL_PLANE, "etcd reachable again: reconciling from a fresh listing")
        self._out.append(SetTimer(key="control_plane", at=self._deadline))

    def _control_plane_maybe_resolved(self) -> None:
        if all(self.pool.nodes[n].alive for n in self._node_step):
            self._control_plane_resolve(timed_out=False)

    def _control_plane_resolve(self, *, timed_out: bool) -> None:
        """Leave CONTROL_PLANE: keep a healthy attempt running; otherwise go on without quarantine."""
        prev = self._cp_prev
        missing = sorted(n for n in self._node_step if not self.pool.nodes[n].alive)
        f = self.failure
        if prev in (RunState.RUNNING, RunState.COLLECTING) and (f is None or f.detector == E.DETECTOR_NODE_LOST):
            self.state = RunState.RUNNING
            self.failure = None
            crashed = sorted(n for n, label in self._exited.items() if label not in ("clean", "lost"))
            if not missing and not crashed:
                self._exited = {n: label for n, label in self._exited.items() if label != "lost"}
                self._min_advanced_at = self._now  # hang clock restarts: we were blind, not the job
                self._log(E.EVENT_KIND_CONTROL_PLANE, f"control plane recovered: attempt {self.attempt} kept "
                          "running on all its nodes, not relaunched")
                self._out.append(SetTimer(key="hang", at=self._now + self.cfg.hang_timeout_floor_s))
            elif missing:
                self._begin_failure(Failure(
                    detector=E.DETECTOR_NODE_LOST, nodes=missing, step=self.job_step, label="control_plane",
                    control_plane=True, reason=f"after the control-plane fault {_names(missing)} did not "
                    "come back: relaunching without them, nothing quarantined"), latency=0.0)
            else:  # a real crash while we were blind: handled like any crash
                first = crashed[0]
                label = self._exited[first]
                self._begin_failure(Failure(
                    detector=E.DETECTOR_CRASH, nodes=[first], step=self.job_step, label=label, first_exit=first,
                    reason=f"{first} exited ({label}) during the control-plane fault"), latency=0.0)
        elif prev == RunState.COLLECTING and f is not None:
            self.state = RunState.COLLECTING
            self._stop()
        elif prev == RunState.STOPPING and f is not None:
            f.control_plane = f.control_plane or f.detector == E.DETECTOR_NODE_LOST
            self.state = RunState.STOPPING
            self._awaiting_exit = {n for n in self._awaiting_exit if n not in self._exited and self.pool.nodes[n].alive}
            if not self._awaiting_exit:
                self._decide()
            else:
                self._deadline = self._now + self.cfg.stop_margin_s
                self._out.append(SetTimer(key="stop", at=self._deadline))
        elif prev == RunState.PREFLIGHT:
            self.state = RunState.PREFLIGHT
            self._preflight_deadline = self._now + self.cfg.preflight_timeout_s
            self._out.append(SetTimer(key="preflight", at=self._preflight_deadline))
            for n in [n for n in self.slots if n is not None and not self.pool.get(n).alive]:
                self._drop_from_slots(n, "lost during the control-plane fault")
            self._maybe_launch()
        else:
            self.state = RunState.WAITING_NODES if prev == RunState.BACKOFF else prev
        if self._pending_stop is not None and self._state == RunState.RUNNING:
            stop, self._pending_stop = self._pending_stop, None
            self._on_stop_request(stop)
        elif self._pending_stop is not None and self._state not in (RunState.COLLECTING, RunState.STOPPING):
            stop, self._pending_stop = self._pending_stop, None
            if not stop.relaunch:
                self._finish(RunState.STOPPED, "stopped", f"stopped on request: {stop.reason}")

    # --- reconcile ----------------------------------------------------------------------------

    def _on_snapshot(self, snap: Snapshot) -> None:
        self.pool.load(snap.records)
        quiet = self._state == RunState.CONTROL_PLANE or (self.attempt == 0 and self._state == RunState.WAITING_NODES)
        for name in [n for n, p in self.pool.nodes.items() if p.alive and n not in snap.alive]:
            if quiet:
                self.pool.set_alive(name, False)
                self._burn_in.discard(name)
            else:
                self._on_lost(NodeLost(node=name))  # a DELETE missed in a watch gap
        for name, ranks in snap.alive.items():
            if quiet or self.pool.get(name).alive:
                self.pool.set_alive(name, True, ranks)
            else:
                self._on_joined(NodeJoined(node=name, local_ranks=ranks))
        for s in snap.committed_steps:
            self.committed.add(s)
            self.latest_committed = max(self.latest_committed, s)
        self.job_step = max(self.job_step, self.latest_committed)
        fresh = self.attempt == 0 and self._state == RunState.WAITING_NODES
        self.attempt = max(self.attempt, snap.attempt)
        self._log(E.EVENT_KIND_CONTROL_PLANE, f"reconciled from the store: {len(snap.alive)} nodes alive, "
                  f"attempt record {snap.attempt}, latest committed step {self.latest_committed}")
        if self._state == RunState.CONTROL_PLANE:
            self._cp_etcd_lost = False
            self._control_plane_resolve(timed_out=False)
        elif fresh and snap.attempt > 0 and snap.attempt_nodes:
            self._adopt(snap)
        for name, p in self.pool.nodes.items():
            if p.alive and p.state in (QUARANTINED, BURN_IN) and name not in self._burn_in:
                self._begin_burn_in(name)
        if snap.stop_requested is not None and self._state in LIVE:
            self._on_stop_request(snap.stop_requested)

    def _adopt(self, snap: Snapshot) -> None:
        """After a controller restart: keep a healthy running attempt; restart one that lost nodes."""
        nodes = list(snap.attempt_nodes)
        self._prev_slots = nodes
        self.slots = list(nodes)
        self.resume_step = snap.resume_step
        self.launched_at = self._now
        self._node_step = dict.fromkeys(nodes, UNREPORTED)
        self._step_count = {UNREPORTED: len(nodes)}
        self._min_step = UNREPORTED
        self._min_advanced_at = self._now
        self._exited = {}
        self._first_step_logged = True
        self._load_logged = True
        self.state = RunState.RUNNING
        for n in nodes:
            self.pool.set_state(n, ASSIGNED)
        missing = [n for n in nodes if not self.pool.get(n).alive]
        if missing:
            self._begin_failure(Failure(
                detector=E.DETECTOR_NODE_LOST, nodes=missing, step=self.job_step, label="reconcile",
                control_plane=True, reason=f"reconcile: attempt {self.attempt} lost {_names(missing)} while no "
                "controller watched; relaunching, nothing quarantined"), latency=0.0)
            return
        self._log(E.EVENT_KIND_CONTROL_PLANE, f"reconcile: attempt {self.attempt} is running on all "
                  f"{len(nodes)} nodes; adopted, not relaunched")
        self._out.append(SetTimer(key="hang", at=self._now + self.cfg.startup_timeout_s))


def _names(nodes: list[str], limit: int = 8) -> str:
    """Node names for a message, bounded (the event's detail carries the full list)."""
    shown = ", ".join(nodes[:limit])
    return shown + (f" (+{len(nodes) - limit} more)" if len(nodes) > limit else "")


def _preflight_detail(ev: PreflightResult) -> events_pb2.PreflightDetail:
    return E.PreflightDetail(node=ev.node, summary=common_pb2.PreflightSummary(
        mode=ev.mode, passed=ev.passed, fail_count=len(ev.failed_checks), duration_s=ev.duration_s,
        failed_checks=list(ev.failed_checks)))


def _attribution_message(method: str, suspects: list[tuple[str, list[int], float, str, list[Any]]],
                         f: Failure) -> str:
    if not suspects:
        return f"no suspect for {f.label or 'the failure'} at step {f.step}: software or data (crash-loop rule decides)"
    top = "; ".join(f"{n}{' ranks ' + str(r) if r else ''}: {why} (confidence {c:.2f})"
                    for n, r, c, why, _ in suspects)
    if method == "first_exit":
        return f"blamed by first exit: {top}; no hardware evidence, so not quarantined on a first offence"
    return f"blamed by {method.replace('_', ' ')}: {top}"
