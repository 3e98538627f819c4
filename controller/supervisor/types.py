"""Events into the supervisor core and actions out of it.

The core (`controller.supervisor.machine.Supervisor`) is sans-IO: the shell (live controller or fleet simulator)
turns what it observes into the *events* below, calls `Supervisor.handle(event, now)`, and executes
the returned *actions* in order. Every value here is a frozen, slotted, keyword-only dataclass,
validated on construction, so a bad value fails at the boundary with a clear message.

Order of obligations for a returned batch (`Batch` = `list[Action]`), like raft's `Ready`:

1. Execute actions in list order. Every `AppendEvent` comes *before* the actions it explains
   (a `Quarantine` is preceded by its QUARANTINE event, a `Launch` by its LAUNCH event):
   append it to the event log and fsync *before* executing anything after it. If the append
   fails, stop executing the batch (the log is the truth; an unlogged action must not happen).
2. `Launch`: first write the attempt record with a compare-and-swap (attempt fencing, the leader's
   fence in `leader_fence`), then start the workers. A refused CAS means another leader: stop.
3. `SetTimer(key, at)`: replace any pending timer with the same key; deliver `Tick()` at `at`
   (late is fine, early is harmless). Extra ticks are always allowed.
4. `PersistNode`: write the node's pool entry and reputation to the store (level-triggered state
   that `Snapshot` gives back after a controller restart).
Results of actions come back as events (`PreflightResult`, `AttemptExited`, `DumpsCollected`,
`NodeJoined` for a node allocated from the queue). Events that arrive late (for an older attempt,
or for a node no longer in play) are ignored by the core, never an error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from runwarden.v1 import common_pb2, events_pb2

_GOOD_NAMES: set[str] = set()  # names already validated: events are built millions of times in simulation


def _check_name(what: str, value: str) -> None:
    if type(value) is str and value in _GOOD_NAMES:
        return
    if not isinstance(value, str) or not value or len(value) > 253 or " " in value or not value.isprintable():
        raise ValueError(f"{what}: bad name {value!r} (non-empty, no whitespace, at most 253 chars)")
    if len(_GOOD_NAMES) < 1 << 17:
        _GOOD_NAMES.add(value)


def _check_finite(what: str, value: float) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{what}: expected a finite number, got {value!r}")


# ---------------------------------------------------------------------------------------------
# Events in
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeJoined:
    """A node agent registered (its node key appeared under its lease)."""

    node: str
    local_ranks: int = 1

    def __post_init__(self) -> None:
        _check_name("NodeJoined.node", self.node)
        if self.local_ranks < 1:
            raise ValueError(f"NodeJoined.local_ranks: must be >= 1, got {self.local_ranks}")


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeLost:
    """The node's key was deleted: its lease expired (or the agent revoked it)."""

    node: str

    def __post_init__(self) -> None:
        _check_name("NodeLost.node", self.node)


@dataclass(frozen=True, slots=True, kw_only=True)
class RankSample:
    """One rank's latest progress, as aggregated by its node agent (mirrors `RankProgress`)."""

    rank: int
    step: int
    step_time_s: float = 0.0
    compute_s: float = 0.0
    wait_s: float = 0.0
    in_checkpoint: bool = False
    reported_at: float = 0.0
    loaded_step: int | None = None  # the committed step this rank resumed from (-1: scratch), once loaded

    def __post_init__(self) -> None:
        try:  # one chained comparison each: NaN, infinities and negatives all fail it
            ok = (self.rank >= 0 and self.step >= -1 and 0.0 <= self.step_time_s < math.inf
                  and 0.0 <= self.compute_s < math.inf and 0.0 <= self.wait_s < math.inf
                  and (self.loaded_step is None or self.loaded_step >= -1))
        except TypeError:
            ok = False
        if not ok:
            for name in ("rank", "step", "step_time_s", "compute_s", "wait_s"):
                _check_finite(f"RankSample.{name}", getattr(self, name))
            raise ValueError(f"RankSample: rank >= 0, step >= -1, loaded_step >= -1 and times >= 0 required, "
                             f"got {self!r}")

    @classmethod
    def from_proto(cls, p: common_pb2.RankProgress) -> RankSample:
        return cls(
            rank=p.rank,
            step=p.step,
            step_time_s=max(0.0, p.step_time_s),
            compute_s=max(0.0, p.compute_s),
            wait_s=max(0.0, p.wait_s),
            in_checkpoint=p.in_checkpoint,
            reported_at=p.reported_at,
            loaded_step=p.loaded_step if p.HasField("loaded_step") else None,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ProgressObserved:
    """One node's progress put (all its local ranks), for one attempt."""

    node: str
    attempt: int
    ranks: tuple[RankSample, ...]

    def __post_init__(self) -> None:
        _check_name("ProgressObserved.node", self.node)


@dataclass(frozen=True, slots=True, kw_only=True)
class EvidenceObserved:
    """Hardware/host evidence an agent published (`runwarden.v1.Evidence`)."""

    evidence: common_pb2.Evidence

    def __post_init__(self) -> None:
        _check_name("EvidenceObserved.evidence.node", self.evidence.node)


@dataclass(frozen=True, slots=True, kw_only=True)
class PreflightResult:
    """A node's preflight finished (the answer to `RunPreflight`)."""

    node: str
    passed: bool
    mode: str = "quick"
    failed_checks: tuple[str, ...] = ()
    duration_s: float = 0.0

    def __post_init__(self) -> None:
        _check_name("PreflightResult.node", self.node)


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptExited:
    """A node's worker group for `attempt` ended. Exactly one of exit_code/signal is normally set."""

    node: str
    attempt: int
    exit_code: int | None = None
    signal: int | None = None
    ended_at: float | None = None
    rank: int | None = None
    detail: str = ""

    def __post_init__(self) -> None:
        _check_name("AttemptExited.node", self.node)


@dataclass(frozen=True, slots=True, kw_only=True)
class StopRequested:
    """A planned stop (time limit, preemption, drain). relaunch=False ends the run."""

    reason: str
    requested_by: str = ""
    relaunch: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointCommitted:
    """A checkpoint's commit marker was written (after fsync): it may be resumed from."""

    step: int
    path: str = ""
    attempt: int = 0
    save_duration_s: float = 0.0

    def __post_init__(self) -> None:
        if self.step < 0:
            raise ValueError(f"CheckpointCommitted.step: must be >= 0, got {self.step}")


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointFailed:
    """A rank reported that saving checkpoint `step` failed: no commit marker, not a resume point."""

    step: int
    error: str
    node: str = ""
    attempt: int = 0


class SuspectLike(Protocol):
    """What the core reads from one suspect (controller.supervisor.flight_recorder may return its own type)."""

    @property
    def node(self) -> str: ...
    @property
    def ranks(self) -> Sequence[int]: ...
    @property
    def confidence(self) -> float: ...
    @property
    def reason(self) -> str: ...


class AttributionLike(Protocol):
    """What the core reads from a flight-recorder attribution: suspects strongest first + method."""

    @property
    def suspects(self) -> Sequence[SuspectLike]: ...
    @property
    def method(self) -> str: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Suspect:
    node: str
    ranks: tuple[int, ...] = ()
    confidence: float = 1.0
    reason: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Attribution:
    suspects: tuple[Suspect, ...] = ()
    method: str = "none"


@dataclass(frozen=True, slots=True, kw_only=True)
class DumpsCollected:
    """Flight-recorder dumps of `attempt` were collected and analysed (answer to `CollectDumps`)."""

    attempt: int
    attribution: AttributionLike
    missing_nodes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlPlaneLost:
    """The controller cannot reach etcd: nothing observed now is evidence about nodes."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlPlaneRestored:
    """etcd is reachable again. The shell relists and sends a `Snapshot` next."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OperatorQuarantine:
    node: str
    reason: str

    def __post_init__(self) -> None:
        _check_name("OperatorQuarantine.node", self.node)


@dataclass(frozen=True, slots=True, kw_only=True)
class OperatorRelease:
    node: str
    reason: str

    def __post_init__(self) -> None:
        _check_name("OperatorRelease.node", self.node)


@dataclass(frozen=True, slots=True, kw_only=True)
class Tick:
    """Time passed (a `SetTimer` fired, or the shell's periodic tick)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeRecordView:
    """A node's persisted pool entry + reputation, as read back from the store."""

    node: str
    pool_state: int = common_pb2.POOL_STATE_SPARE
    reason: str = ""
    burn_in_passes: int = 0
    operator_hold: bool = False
    failure_times: tuple[float, ...] = ()
    straggler_flags: int = 0
    preflight_rejections: int = 0
    evidence: tuple[common_pb2.Evidence, ...] = ()  # why it is quarantined (PoolEntry.evidence)
    evidence_kinds: tuple[int, ...] = ()  # fatal evidence kinds seen, oldest first (Reputation.evidence_kinds)


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    """The store's state, listed by the shell after a (re)start or a watch gap (level-triggered).

    alive: nodes whose keys exist now, with their local rank counts. records: persisted pool/
    reputation entries. attempt/attempt_nodes: the fenced attempt record (0: none).
    progress_nodes: nodes whose progress for that attempt was written recently (the shell decides
    "recently", e.g. within the hang timeout).
    """

    alive: dict[str, int] = field(default_factory=dict)
    records: tuple[NodeRecordView, ...] = ()
    attempt: int = 0
    attempt_nodes: tuple[str, ...] = ()
    resume_step: int = -1
    committed_steps: tuple[int, ...] = ()
    stop_requested: StopRequested | None = None
    progress_nodes: tuple[str, ...] = ()


Event = (
    NodeJoined
    | NodeLost
    | ProgressObserved
    | EvidenceObserved
    | PreflightResult
    | AttemptExited
    | StopRequested
    | CheckpointCommitted
    | DumpsCollected
    | ControlPlaneLost
    | ControlPlaneRestored
    | OperatorQuarantine
    | OperatorRelease
    | Tick
    | Snapshot
)


# ---------------------------------------------------------------------------------------------
# Actions out
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class AppendEvent:
    """Append `event` to the event log (fsync) before executing any later action of the batch."""

    event: events_pb2.Event


@dataclass(frozen=True, slots=True, kw_only=True)
class RunPreflight:
    """Run preflight (`mode` "quick" before an attempt, "full" for burn-in) on each node.

    Answer with one `PreflightResult` per node. purpose: "attempt" or "burn_in".
    """

    nodes: tuple[str, ...]
    mode: str
    purpose: str = "attempt"
    timeout_s: float = 120.0


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeRank:
    node: str
    node_rank: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Launch:
    """Start attempt `attempt` on `nodes` (torchrun --max-restarts=0, rdzv id `rendezvous_id`).

    resume_step: the latest *committed* checkpoint step, -1 = from scratch. leader_fence: 0 here;
    the shell fills in its leadership fence when it writes the attempt record (CAS).
    """

    run: str
    attempt: int
    rendezvous_id: str
    nodes: tuple[NodeRank, ...]
    resume_step: int
    leader_fence: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class StopAttempt:
    """Stop `attempt`'s workers on `nodes`: SIGTERM (the trainer saves if planned), SIGKILL after grace."""

    attempt: int
    nodes: tuple[str, ...]
    grace_s: float
    planned: bool
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectDumps:
    """Ask the live ranks of `attempt` for flight-recorder dumps, analyse, answer `DumpsCollected`."""

    attempt: int
    nodes: tuple[str, ...]
    timeout_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Quarantine:
    node: str
    reason: str
    evidence: tuple[common_pb2.Evidence, ...] = ()
    held: bool = False  # failed twice within the window: out until an operator releases it


@dataclass(frozen=True, slots=True, kw_only=True)
class Release:
    node: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class TakeSpare:
    node: str
    replaces: str


@dataclass(frozen=True, slots=True, kw_only=True)
class AllocateFromQueue:
    """Ask the scheduler backend for `count` more nodes; they arrive as `NodeJoined`."""

    count: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Page:
    reason: str
    severity: str = "critical"


@dataclass(frozen=True, slots=True, kw_only=True)
class SetTimer:
    """Deliver `Tick()` at time `at` (replaces the pending timer with the same key)."""

    key: str
    at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class PersistNode:
    """Write the node's pool entry (pool/<node>) and reputation (reputation/<node>)."""

    record: NodeRecordView


Action = (
    AppendEvent
    | RunPreflight
    | Launch
    | StopAttempt
    | CollectDumps
    | Quarantine
    | Release
    | TakeSpare
    | AllocateFromQueue
    | Page
    | SetTimer
    | PersistNode
)

# A batch of actions, executed in order; see the module docstring for the order of obligations.
Batch = list[Action]
