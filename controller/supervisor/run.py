"""The run's data: what one `Supervisor` knows of its run, below the rules that change it.

`Run` holds the state, the current attempt, the pool, the attempt being prepared, the asks of the
queue, the burn-ins, what outlives an attempt (restarts, offences, losses) and the failure being
handled; it inherits the effect vocabulary (`Effects`). The rule modules take a `Run`; the table
names the rules; `Supervisor` (machine.py) drives them. The state changes only in transitions.py."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from controller.supervisor.actions import RunPreflight
from controller.supervisor.attempt import Attempt, Failure
from controller.supervisor.effects import Effects
from controller.supervisor.events import Event, StopRequested
from controller.supervisor.policy import RunPlan, SupervisorConfig
from controller.supervisor.pool import OUT_OF_SERVICE, Pool
from controller.supervisor.records import Blind, LossBook, Preparing, QueueAsk, Soak, SpareChecks
from controller.supervisor.restart import RestartHistory
from controller.supervisor.snapshots import SnapshotTracker
from controller.supervisor.states import IN_ATTEMPT, TERMINAL, RunState


class Run(Effects):
    """One run's data and the effects of the event being handled. What belongs to one attempt is
    `cur` (an `Attempt`, built fresh per launch or adoption)."""

    def __init__(self, config: SupervisorConfig, plan: RunPlan) -> None:
        super().__init__()
        self.cfg = config
        self.plan = plan
        self.pool = Pool(config)
        self.state = RunState.WAITING_NODES  # changed only by transitions.py
        # checks a move before transitions.py makes it (the machine's table); raises IllegalTransition
        self.check_move: Callable[[RunState, RunState], None] = _no_check
        # runs the current state's rule for an event inside the one being handled (the machine's table)
        self.apply: Callable[[Event], None] = _no_rules
        self.attempt = 0  # last launched attempt number
        # the highest attempt a predecessor's LAUNCH in the event log names: one it logged and died
        # before its attempt record was written; its number is never launched again
        self.logged_attempt = 0
        self.cur = Attempt.none()
        self.committed: set[int] = set()
        self.latest_committed = -1
        # the attempt whose in-memory snapshot the current attempt resumed from, and what its ranks
        # held (snapshots.py: a candidate again at the next launch)
        self.resumed_snapshot: tuple[int, SnapshotTracker] | None = None
        self.job_step = -1
        self.now = 0.0
        self.preparing = Preparing()  # the attempt being prepared (its slots are also the running one's)
        self.waiting_since: float | None = None
        self.waiting_paged = False  # this wait for nodes has paged (once per wait)
        self.queue = QueueAsk()  # asking the queue for nodes
        # burn-ins
        self.burn_in: set[str] = set()
        self.soaks: dict[str, Soak] = {}  # burned-in nodes soaking an all-reduce with neighbours
        self.burn_in_retry: dict[str, float] = {}  # inconclusive burn-ins: node -> when it runs again
        self.burn_in_inconclusive: dict[str, int] = {}  # burn-ins in a row without a verdict (the backoff)
        self.spare_checks = SpareChecks()  # idle spares preflighted in the background
        # nodes that went cold while others of their attempt went warm (why): attempts with them go cold
        self.went_cold: dict[str, str] = {}
        # what outlives an attempt: how long saves and steps take, restarts, offences, losses
        self.save_times: deque[float] = deque(maxlen=16)
        self.step_times: deque[float] = deque(maxlen=64)
        # how late ranks entered their peers' collectives without a hang (the collective rule's bound)
        self.collective_lateness: deque[float] = deque(maxlen=64)
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
        self.blind = Blind()  # what a control-plane pause paused

    @property
    def next_attempt(self) -> int:
        """The number the next launch takes: past the last launched, and past one only logged."""
        return max(self.attempt, self.logged_attempt) + 1

    @property
    def current_nodes(self) -> tuple[str, ...]:
        """The nodes of the attempt being prepared or run, in node-rank order (read-only view)."""
        return tuple(n for n in self.preparing.slots if n is not None)

    def backoff_s(self) -> float:
        """The short wait before doing again what the shell could not do (the restart backoff's base)."""
        return max(self.cfg.backoff_base_s, 0.1)

    def in_attempt(self, node: str) -> bool:
        return self.state in IN_ATTEMPT and node in self.cur.node_step

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
        self.preparing.pending_preflight.clear()
        self.preparing.slots = []

    def holds(self) -> frozenset[str]:
        """The nodes this run keeps a claim on (controller/fleet/claims.py takes and gives them back):
        the attempt's (being prepared, running, or the last one, kept across a restart's backoff so
        the relaunch finds them) and the out-of-service nodes it answers for (their burn-in, an
        operator's release). None once the run is over; never a node another run holds."""
        if self.state in TERMINAL:
            return frozenset()
        mine = {
            n
            for n in (*self.preparing.slots, *self.preparing.prev_slots, *self.cur.node_step)
            if n is not None
        }
        mine.update(self.burn_in)
        mine.update(self.spare_checks.asked)
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

    def forget_burn_in(self, node: str) -> None:
        """The node left (lost, claimed by another run): its burn-in, soak and retry decide nothing now;
        its next registration (or its holder) burns it in afresh."""
        self.burn_in.discard(node)
        self.burn_in_retry.pop(node, None)
        self.burn_in_inconclusive.pop(node, None)
        self.soaks.pop(node, None)  # its soak no longer decides anything


def _no_check(cur: RunState, to: RunState) -> None:
    return None


def _no_rules(event: Event) -> None:
    raise NotImplementedError("a Run alone has no rules: the Supervisor (machine.py) applies events")
