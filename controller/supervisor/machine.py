"""The supervisor core: a deterministic, sans-IO state machine for one run.

`Supervisor.handle(event, now) -> Batch`: no sockets, clock, threads, store or randomness inside;
`now` is an argument (seconds, any epoch, non-decreasing). The live shell (controller/live/) and the
fleet simulator (controller/sim/) drive the same core. `handle` runs the rule `table.TABLE[state]
[event type]` names (an unknown pair raises `TransitionError` before anything changes), then
`table.AUTOMATIC` to a fixed point; every state change goes through transitions.py, and a move
outside `table.EDGES` raises `IllegalTransition` (a bug). Every decision is logged in words.

    sup = Supervisor(SupervisorConfig(...), RunPlan(run="llama", nodes=4))
    batch = sup.handle(NodeJoined(node="n1", local_ranks=8), now)  # ... one event at a time
    batch = sup.handle(StoreListed(...), now)  # after a (re)start or a watch gap
    sup.status(now)  # read-only summary for APIs

Answer `RunPreflight` with one `PreflightResult` per node, `CollectDumps` with `DumpsCollected`,
`StopAttempt` with the nodes' `AttemptExited` (or their `NodeLost`), `AllocateFromQueue` with the
new nodes' `NodeJoined`, `SetTimer` with a `Tick` at (or after) its time, and any action that could
not be carried out with `ActionFailed`. Progress is one `ProgressObserved` per node per interval. A
rank's `step` counts steps completed (N right after loading checkpoint N); a node whose ranks all
carry `loaded_step` but have not stepped past the resume point is a load mark: when every node of
the attempt has one, the core logs LOAD_DONE (the restart's load phase ends there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from controller.supervisor.actions import (
    Batch,
)
from controller.supervisor.attempt import UNREPORTED
from controller.supervisor.events import (
    Event,
)
from controller.supervisor.policy import RunPlan, SupervisorConfig
from controller.supervisor.run import Run
from controller.supervisor.states import IllegalTransition, RunState, TransitionError
from controller.supervisor.table import AUTOMATIC, EDGES, STATE_TRIGGERED, TABLE, diagram

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


class Supervisor(Run):
    """The run's supervisor core. Drive it with `handle(event, now)`; execute each `Batch` in order.

    It holds the run's state; the rules (the modules the table names) read and change it. What
    belongs to one attempt is `cur` (an `Attempt`, built fresh per launch or adoption)."""

    def __init__(self, config: SupervisorConfig, plan: RunPlan) -> None:
        super().__init__(config, plan)
        self.check_move = self._check_move
        self.apply = self._apply
        self._first_moves: frozenset[RunState] | None = None  # the handled event's legal first moves

    def _check_move(self, cur: RunState, value: RunState) -> None:
        first, self._first_moves = self._first_moves, None
        if first is not None and value not in first and value not in STATE_TRIGGERED.get(cur, ()):
            raise IllegalTransition(f"{cur.name} -> {value.name} is not a legal first move for this event")
        if (cur, value) not in EDGES:
            raise IllegalTransition(f"{cur.name} -> {value.name} is not an edge of the table")

    # --- the one entry point ------------------------------------------------------------------

    def handle(self, event: Event, now: float) -> Batch:
        """Apply one event at time `now`; return what the shell must log and do, in order."""
        rule = TABLE[self.state].get(type(event))
        if rule is None:
            raise TransitionError(f"no rule for event {type(event).__name__} in state {self.state.name}")
        if now > self.now:
            self.now = now
        self._entries, self._actions = [], []
        self._first_moves = rule.to
        rule.handler(self, event)
        self._first_moves = None
        while (automatic := AUTOMATIC.get(self.state)) is not None:  # to a fixed point
            before = self.state
            automatic(self)
            if self.state is before:
                break
        batch = Batch(entries=tuple(self._entries), actions=tuple(self._actions))
        self._entries, self._actions = [], []
        return batch

    def _apply(self, event: Event) -> None:
        """Run the current state's rule for `event` inside the event being handled (a snapshot's
        missed DELETE, a failed launch on one node), into the same batch."""
        rule = TABLE[self.state].get(type(event))
        if rule is None:
            raise TransitionError(f"no rule for event {type(event).__name__} in state {self.state.name}")
        rule.handler(self, event)

    def status(self, now: float) -> SupervisorStatus:
        a = self.cur
        progressing = self.state is RunState.RUNNING and a.min_step != UNREPORTED
        return SupervisorStatus(
            state=self.state,
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
        if self.state is not RunState.WAITING_NODES or self.waiting_since is None:
            return {}
        missing = max(0, self.plan.nodes - self.pool.free_count())
        return {"waiting_for_nodes": missing, "waiting_since": self.waiting_since}
