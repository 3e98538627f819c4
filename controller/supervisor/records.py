"""The run's data as small records, below the rules that change them: a burn-in soak in flight, the
loss book, the ask of the queue, a control-plane pause. Plain data with no rules beyond their own
bookkeeping; the rule modules read and change them through `Run`."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from controller.supervisor.states import RunState

MAX_HISTORY_VALUES = 1 << 20  # (step, rank) losses kept for the replay comparison, at most


@dataclass(frozen=True, slots=True)
class Soak:
    nodes: tuple[str, ...]  # the burned-in node first, then its neighbours
    deadline: float


@dataclass(slots=True)
class ReplayedStep:
    """The worst comparison of one replayed step so far."""

    rank: int
    node: str
    loss: float
    earlier: float
    earlier_attempt: int
    rel: float
    ranks: int = 1


@dataclass(slots=True)
class LossBook:
    """The run's loss memory (outlives attempts) and the current attempt's loss bookkeeping."""

    history: dict[int, dict[int, tuple[int, float]]] = field(
        default_factory=dict
    )  # step -> rank -> (attempt, loss)
    values: int = 0
    max_step: int = -1
    windows: dict[int, deque[tuple[int, float]]] = field(default_factory=dict)  # rank -> (step, loss)
    rollback_before: int | None = None  # a stop for an anomaly: resume from a commit before this step
    reloaded_from_storage: int | None = None  # a bad restore of this step: it is reloaded from storage
    # steps whose loss was non-finite in an attempt that trained into them (not the first after a
    # load): a non-finite loss there after a load is the job's, not the load's (the newest few)
    non_finite_steps: set[int] = field(default_factory=set)
    stop_since: float = 0.0  # when the report that stops the attempt was made (detection latency)
    # the current attempt
    attempt: int = 0
    resume_step: int = -1
    replay_until: int = -1  # the newest step seen before this attempt: steps up to it are replays
    logged: set[str] = field(default_factory=set)  # rules logged in this attempt
    pending: dict[int, ReplayedStep] = field(default_factory=dict)  # replayed step -> worst point
    diverged: int = 0  # (step, rank) comparisons beyond the tolerance in this attempt
    unrecorded: list[tuple[int, int, float]] = field(default_factory=list)  # (step, rank, loss) to log
    unrecorded_since: float = 0.0  # when its oldest value came

    def new_attempt(self, number: int, resume_step: int) -> None:
        self.attempt, self.resume_step = number, resume_step
        self.replay_until = self.max_step
        self.logged = set()
        self.pending = {}
        self.diverged = 0
        for w in self.windows.values():  # losses past the resume point were undone with the state
            while w and w[-1][0] > resume_step:
                w.pop()

    def saw_non_finite(self, step: int) -> None:
        self.non_finite_steps.add(step)
        for old in sorted(self.non_finite_steps)[:-64]:
            self.non_finite_steps.discard(old)

    def prune(self, keep_steps: int) -> None:
        if len(self.history) <= keep_steps + 64 and self.values <= MAX_HISTORY_VALUES:
            return
        steps = sorted(self.history)
        low = self.max_step - keep_steps
        for s in steps:
            if s > low and self.values <= MAX_HISTORY_VALUES:
                break
            self.values -= len(self.history.pop(s))


@dataclass(slots=True)
class QueueAsk:
    """Asking the queue for nodes: nodes asked for and not come yet, asks refused in a row (the
    backoff: 5 s doubling to 5 min), when to ask again, and the nodes the queue gave."""

    outstanding: int = 0
    refusals: int = 0
    retry_at: float = 0.0
    nodes: set[str] = field(default_factory=set)


@dataclass(slots=True)
class SpareChecks:
    """Background preflights of idle spares (spare_checks.py): in flight, when each node was last
    asked (node -> the core's clock), and when the next sweep is due (its "spare_check" timer)."""

    asked: dict[str, float] = field(default_factory=dict)
    last_asked: dict[str, float] = field(default_factory=dict)
    next_sweep: float = 0.0


@dataclass(slots=True)
class Blind:
    """A control-plane pause: the state it paused (resolved back from it) and whether etcd itself
    was lost (then nothing resolves the pause before a `ControlPlaneRestored`)."""

    paused: RunState = RunState.WAITING_NODES
    etcd_lost: bool = False


@dataclass(slots=True)
class Preparing:
    """The attempt being prepared: a node per node rank (`slots`, kept while it runs), its preflight
    and bandwidth gate, and what the previous attempt left (`prev_slots`, `vacated`)."""

    slots: list[str | None] = field(default_factory=list)
    empty_slots: int = 0
    pending_preflight: set[str] = field(default_factory=set)
    preflight_deadline: float = 0.0
    vacated: dict[int, str] = field(default_factory=dict)  # node rank -> node that held it before
    prev_slots: list[str] = field(default_factory=list)
    unreachable: set[str] = field(default_factory=set)  # preflight could not reach them: not picked now
    preflight_resend: set[str] = field(default_factory=set)  # their RunPreflight never left: again at a tick
    preflight_retried: set[str] = field(default_factory=set)  # asked again after an inconclusive one (once)
    vouched: set[str] = field(default_factory=set)  # not preflighted: a recent pass or healthy training
    gate_pending: tuple[str, ...] | None = None  # the node set the bandwidth gate is measuring
    gate_passed: tuple[str, ...] | None = None  # the node set that passed it
    gate_deadline: float = 0.0
