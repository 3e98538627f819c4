"""The supervisor core: a deterministic, sans-IO state machine for one run.

Theory (etcd raft's and h11's): `Supervisor.handle(event, now) -> Batch`. No sockets, clock,
threads, store or randomness inside; `now` is an argument (seconds, any epoch, non-decreasing).
The same core runs under the live shell (controller/live/) and the fleet simulator
(controller/sim/). Rule 1 (h11): the state graph lives in one place, as data. `TABLE[state][event
type]` is a `Rule`: the function that handles it (in the small rule modules: nodes, prepare,
running, failure, control_plane, failed_actions) and the legal first moves; `EDGES` is the whole
graph; `STATE_TRIGGERED` the moves the machine makes on its own. The state setter refuses a move
outside them (`IllegalTransition`: a bug); an unknown (state, event) pair raises `TransitionError`
naming both, before anything changes. Late answers (for an older attempt, or a node no longer in
play) have explicit IGNORE entries. Every decision is explained in words: the message it logs.

The graph is data in controller/supervisor/table.py (its docstring shows it, generated from the
table). Driving it (live shell, simulator, tests):

    sup = Supervisor(SupervisorConfig(...), RunPlan(run="llama", nodes=4))
    batch = sup.handle(NodeJoined(node="n1", local_ranks=8), now)  # ... one event at a time
    batch = sup.handle(Snapshot(...), now)                          # after a (re)start or watch gap
    sup.status(now)                                                 # read-only summary for APIs

Answer `RunPreflight` with one `PreflightResult` per node, `CollectDumps` with `DumpsCollected`,
`StopAttempt` with the nodes' `AttemptExited` (or their `NodeLost`), `AllocateFromQueue` with the
new nodes' `NodeJoined`, `SetTimer` with a `Tick` at (or after) its time, and any action that could
not be carried out with `ActionFailed`. Progress is one `ProgressObserved` per node per interval. A
rank's `step` counts steps completed (N right after loading checkpoint N); a node whose ranks all
carry `loaded_step` but have not stepped past the resume point is a load mark: when every node of
the attempt has one, the core logs LOAD_DONE (the restart's load phase ends there).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from controller.supervisor import memory, prepare, soak
from controller.supervisor.actions import (
    Action,
    Batch,
    PersistNode,
    Quarantine,
    Release,
    RunPreflight,
)
from controller.supervisor.actions import Page as PageAction
from controller.supervisor.attempt import UNREPORTED, Attempt, Failure
from controller.supervisor.events import (
    Event,
    StopRequested,
)
from controller.supervisor.loss import LossBook
from controller.supervisor.policy import RunPlan, SupervisorConfig, burn_in_passes_text
from controller.supervisor.pool import OUT_OF_SERVICE, Pool, PoolState, needs_repair
from controller.supervisor.restart import RestartHistory
from controller.supervisor.states import IN_ATTEMPT, TERMINAL, IllegalTransition, RunState, TransitionError
from controller.supervisor.table import EDGES, STATE_TRIGGERED, TABLE, diagram
from runwarden.v1 import common_pb2, events_pb2
from runwarden.v1 import events_pb2 as E

__all__ = [
    "EDGES",
    "STATE_TRIGGERED",
    "TABLE",
    "RunState",
    "Supervisor",
    "SupervisorStatus",
    "TransitionError",
    "diagram",
]


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
    waiting_for_nodes: int = 0  # WAITING_NODES: usable nodes still missing
    waiting_since: float | None = None  # since when the run waits for them


# ---------------------------------------------------------------------------------------------
# The machine
# ---------------------------------------------------------------------------------------------


class Supervisor:
    """The run's supervisor core. Drive it with `handle(event, now)`; execute each `Batch` in order.

    It holds the run's state; the rules (the modules the table names) read and change it. What
    belongs to one attempt is `cur` (an `Attempt`, built fresh per launch or adoption)."""

    def __init__(self, config: SupervisorConfig, plan: RunPlan) -> None:
        self.cfg = config
        self.plan = plan
        self.pool = Pool(config)
        self._state = RunState.WAITING_NODES
        self._row = TABLE[self._state]
        self._first_moves: frozenset[RunState] | None = None  # the handled event's legal first moves
        self.attempt = 0  # last launched attempt number
        self.cur = Attempt.none()
        self.committed: set[int] = set()
        self.latest_committed = -1
        self.job_step = -1
        self.now = 0.0
        self._entries: list[events_pb2.Event] = []
        self._actions: list[Action] = []
        # preparing an attempt
        self.slots: list[str | None] = []  # node per node rank, for the attempt being prepared/run
        self.empty_slots = 0
        self.pending_preflight: set[str] = set()
        self.preflight_deadline = 0.0
        self.vacated: dict[int, str] = {}  # node rank -> node that held it in the previous attempt
        self.prev_slots: list[str] = []
        self.unreachable: set[str] = set()  # preflight could not reach them: not picked for this attempt
        self.preflight_resend: set[str] = set()  # their RunPreflight never left: sent again at the next tick
        self.preflight_retried: set[str] = set()  # asked again after an inconclusive preflight (once)
        self.gate_pending: tuple[str, ...] | None = None  # the node set the bandwidth gate is measuring
        self.gate_passed: tuple[str, ...] | None = None  # the node set that passed it
        self.gate_deadline = 0.0
        self.waiting_since: float | None = None
        self.waiting_paged = False  # this wait for nodes has paged (once per wait)
        self.queue_outstanding = 0
        self.queue_refusals = 0  # asks of the queue refused in a row (backoff: 5 s doubling to 5 min)
        self.queue_retry_at = 0.0
        self.from_queue: set[str] = set()
        self.burn_in: set[str] = set()
        self.soaks: dict[str, soak.Soak] = {}  # burned-in nodes soaking an all-reduce with neighbours
        self.burn_in_retry: dict[str, float] = {}  # inconclusive burn-ins: node -> when it runs again
        self.burn_in_inconclusive: dict[str, int] = {}  # inconclusive burn-ins in a row (the backoff)
        # what outlives an attempt: how long saves and steps take, restarts, offences, losses
        self.save_times: deque[float] = deque(maxlen=16)
        self.step_times: deque[float] = deque(maxlen=64)
        self.history = RestartHistory()
        self.decided_attempt = 0  # the last attempt whose end was decided (durable: a new leader skips it)
        self.offences: dict[str, set[int]] = {}
        self.quarantine_times: list[float] = []  # automatic quarantines, for the blast radius
        self.blast_paged = False  # this trip of the blast radius has paged (once per trip)
        self.loss_times: deque[float] = deque(maxlen=4096)
        self.losses = LossBook()  # the training loss: per (step, rank), spike windows (loss.py)
        # the failure pipeline and the control plane
        self.failure: Failure | None = None
        self.deadline = 0.0  # COLLECTING / STOPPING / BACKOFF / CONTROL_PLANE deadline
        self.end_after_stop = False
        self.pending_stop: StopRequested | None = None
        self.cp_prev = RunState.WAITING_NODES
        self.cp_etcd_lost = False

    @property
    def state(self) -> RunState:
        return self._state

    @state.setter
    def state(self, value: RunState) -> None:
        cur = self._state
        if value is cur:
            return
        first, self._first_moves = self._first_moves, None
        if first is not None and value not in first and value not in STATE_TRIGGERED.get(cur, ()):
            raise IllegalTransition(f"{cur.name} -> {value.name} is not a legal first move for this event")
        if (cur, value) not in EDGES:
            raise IllegalTransition(f"{cur.name} -> {value.name} is not an edge of the table")
        self._state = value
        self._row = TABLE[value]

    # --- the one entry point ------------------------------------------------------------------

    def handle(self, event: Event, now: float) -> Batch:
        """Apply one event at time `now`; return what the shell must log and do, in order."""
        rule = self._row.get(type(event))
        if rule is None:
            raise TransitionError(f"no rule for event {type(event).__name__} in state {self._state.name}")
        if now > self.now:
            self.now = now
        self._entries, self._actions = [], []
        self._first_moves = rule.to
        rule.handler(self, event)
        self._first_moves = None
        if self._state is RunState.WAITING_NODES:  # the state-triggered move (STATE_TRIGGERED)
            prepare.try_start(self)
        batch = Batch(entries=tuple(self._entries), actions=tuple(self._actions))
        self._entries, self._actions = [], []
        return batch

    def apply(self, event: Event) -> None:
        """Run the current state's rule for `event` inside the event being handled (a snapshot's
        missed DELETE, a failed launch on one node), into the same batch."""
        rule = self._row.get(type(event))
        if rule is None:
            raise TransitionError(f"no rule for event {type(event).__name__} in state {self._state.name}")
        rule.handler(self, event)

    def status(self, now: float) -> SupervisorStatus:
        a = self.cur
        progressing = self._state is RunState.RUNNING and a.min_step != UNREPORTED
        return SupervisorStatus(
            state=self._state,
            attempt=self.attempt,
            rendezvous_id=f"{self.plan.run}-{self.attempt}" if self.attempt else "",
            job_step=self.job_step,
            latest_committed=self.latest_committed,
            restarts_used=self.history.used(self.cfg, now),
            restart_budget=self.cfg.restart_budget,
            since_last_progress_s=max(0.0, now - a.min_advanced_at) if progressing else -1.0,
            nodes=self.current_nodes,
            failure=self.failure.reason if self.failure else "",
            **self._waiting(),
        )

    def _waiting(self) -> dict[str, Any]:
        if self._state is not RunState.WAITING_NODES or self.waiting_since is None:
            return {}
        missing = max(0, self.plan.nodes - self.pool.free_count())
        return {"waiting_for_nodes": missing, "waiting_since": self.waiting_since}

    @property
    def current_nodes(self) -> tuple[str, ...]:
        """The nodes of the attempt being prepared or run, in node-rank order (read-only view)."""
        return tuple(n for n in self.slots if n is not None)

    # --- effects (the rules' shared vocabulary) -----------------------------------------------

    def log(
        self,
        kind: events_pb2.EventKind.ValueType,
        message: str,
        step: int | None = None,
        attempt: int | None = None,
        **detail: Any,
    ) -> None:
        self._entries.append(
            E.Event(
                ts=self.now,
                run=self.plan.run,
                attempt=self.attempt if attempt is None else attempt,
                step=self.job_step if step is None else step,
                kind=kind,
                message=message,
                **detail,
            )
        )

    def emit(self, action: Action) -> None:
        self._actions.append(action)

    def persist(self, node: str) -> None:
        self.emit(PersistNode(record=self.pool.get(node).view()))

    def emit_release(self, node: str, reason: str) -> None:
        self.emit(Release(node=node, reason=reason))

    def backoff_s(self) -> float:
        """The short wait before doing again what the shell could not do (the restart backoff's base)."""
        return max(self.cfg.backoff_base_s, 0.1)

    def in_attempt(self, node: str) -> bool:
        return self._state in IN_ATTEMPT and node in self.cur.node_step

    def live_nodes(self) -> list[str]:
        """The attempt's nodes that have not exited and whose lease is alive, in node-rank order."""
        a = self.cur
        return [n for n in a.node_step if n not in a.exited and self.pool.nodes[n].alive]

    @staticmethod
    def names(nodes: list[str], limit: int = 8) -> str:
        """Node names for a message, bounded (the event's detail carries the full list)."""
        shown = ", ".join(nodes[:limit])
        return shown + (f" (+{len(nodes) - limit} more)" if len(nodes) > limit else "")

    def release_slots(self) -> None:
        for n in [*self.current_nodes, *self.cur.node_step]:
            self.pool.unassign(n)
        self.pending_preflight.clear()
        self.slots = []

    def quarantine(
        self, node: str, reason: str, evidence: Iterable[common_pb2.Evidence] = (), operator: bool = False
    ) -> bool:
        """Quarantine `node` (an operator's always; an automatic one only within the blast radius).
        Returns whether it was quarantined."""
        evs = list(evidence)
        if not operator and not self._within_blast_radius(node, reason):
            return False
        p = self.pool.quarantine(
            node, self.now, reason, count_failure=not operator, operator=operator, evidence=evs
        )
        held = p.state is PoolState.HELD
        if held and not operator and needs_repair(evs):
            why = (
                f"{reason}; needs repair: no burn-in until an operator marks it repaired "
                f"(controllerctl repaired {node} --note ...), then burn-in"
            )
        elif held and not operator:
            why = (
                f"{reason}; held: {self.pool.recent_failures(p, self.now)} failures within "
                f"{self.cfg.hold_window_s / 86400:g} days, out until an operator releases it"
            )
        elif held:
            why = f"{reason}; held until an operator releases it"
        else:
            why = f"{reason}; returns after {burn_in_passes_text(self.cfg.burn_in_passes)}"
        self.log(
            E.EVENT_KIND_QUARANTINE,
            f"quarantined {node}: {why}",
            quarantine=E.QuarantineDetail(node=node, reason=reason, evidence=evs, operator=operator),
        )
        self.persist(node)
        self.emit(Quarantine(node=node, reason=reason, evidence=tuple(evs), held=held))
        if not operator:
            self.quarantine_times.append(self.now)
            memory.persist(self)
        if not held and p.alive:
            self.begin_burn_in(node)
        return True

    def blast_radius(self) -> int:
        """How many automatic quarantines the window allows (the policy's count, or its fraction of
        the nodes known, whichever is larger)."""
        share = math.ceil(self.cfg.blast_radius_fraction * len(self.pool.nodes))
        return max(self.cfg.blast_radius_nodes, share)

    def _within_blast_radius(self, node: str, reason: str) -> bool:
        window = self.cfg.blast_radius_window_s
        self.quarantine_times = [t for t in self.quarantine_times if self.now - t < window]
        limit = self.blast_radius()
        if len(self.quarantine_times) < limit:
            self.blast_paged = False
            return True
        message = (
            f"blast radius: {len(self.quarantine_times)} nodes quarantined within {window:g}s (limit "
            f"{limit}); automatic quarantine stopped: {node} stays in service ({reason}); an operator "
            f"decides (controllerctl quarantine {node})"
        )
        self.log(
            E.EVENT_KIND_QUARANTINE_HELD_BACK,
            message,
            node=E.NodeDetail(node=node, reason=reason),
        )
        if not self.blast_paged:
            self.blast_paged = True
            self.page(message)
        return False

    def holds(self) -> frozenset[str]:
        """The nodes this run keeps a claim on (controller/live/claims.py takes and gives them back):
        the attempt's (being prepared, running, or the last one, kept across a restart's backoff so
        the relaunch finds them) and the out-of-service nodes it answers for (their burn-in, an
        operator's release). None once the run is over; never a node another run holds."""
        if self._state in TERMINAL:
            return frozenset()
        mine = {n for n in (*self.slots, *self.prev_slots, *self.cur.node_step) if n is not None}
        mine.update(self.burn_in)
        mine.update(n for n, p in self.pool.nodes.items() if p.state in OUT_OF_SERVICE)
        return frozenset(n for n in mine if not self.pool.get(n).elsewhere)

    def begin_burn_in(self, node: str) -> None:
        if self.pool.get(node).elsewhere:
            return  # the run that holds it burns it in
        if not self.pool.start_burn_in(node):
            return
        self.burn_in.add(node)
        self.persist(node)
        self.emit(
            RunPreflight(
                nodes=(node,),
                mode=self.cfg.burn_in_mode,
                purpose="burn_in",
                timeout_s=self.cfg.burn_in_timeout_s,
            )
        )

    def page(self, reason: str) -> None:
        self.log(E.EVENT_KIND_PAGE, reason, page=E.PageDetail(reason=reason, severity="critical"))
        self.emit(PageAction(reason=reason))

    def finish(self, state: RunState, outcome: str, reason: str) -> None:
        self.release_slots()
        self.state = state
        self.failure = None
        self.log(E.EVENT_KIND_RUN_END, reason, run_detail=E.RunDetail(nodes=self.plan.nodes, outcome=outcome))
