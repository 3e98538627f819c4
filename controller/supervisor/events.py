"""Events into the supervisor core: what the shell (live controller, simulator, tests) observed.

Every value is a frozen, slotted, keyword-only dataclass, validated on construction, so a bad value
fails at the boundary (in the shell's translation from etcd or RPC answers) with a clear message,
never inside `Supervisor.handle`. Results of the core's actions come back as events: `PreflightResult`,
`AttemptExited`, `DumpsCollected`, `NodeJoined` for a node allocated from the queue, and
`ActionFailed` for an action the shell could not carry out. Events that arrive late (for an older
attempt, or for a node no longer in play) are ignored by the core, never an error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from controller.supervisor.blame import FlightRecorderVerdict
from controller.supervisor.policy import SupervisorConfig
from controller.supervisor.pool import NodeRecordView
from runwarden.names import check_name as _check_name
from runwarden.v1 import common_pb2, store_pb2

if TYPE_CHECKING:
    from controller.supervisor.actions import Action


def _check_finite(what: str, value: float) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{what}: expected a finite number, got {value!r}")


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


def proto_losses(p: common_pb2.RankProgress) -> tuple[tuple[int, float], ...]:
    """A RankProgress's (step, loss) list: recent_losses, or the one `loss` of an older trainer."""
    if p.recent_losses:
        return tuple((x.step, x.loss) for x in p.recent_losses)
    return ((p.step, p.loss),) if p.HasField("loss") else ()


def _check_losses(losses: tuple[tuple[int, float], ...], dropped: int) -> None:
    if not isinstance(dropped, int) or isinstance(dropped, bool) or dropped < 0:
        raise ValueError(f"RankSample.losses_dropped: must be an integer >= 0, got {dropped!r}")
    for item in losses:
        ok = isinstance(item, tuple) and len(item) == 2
        step, loss = item if ok else (None, None)
        if not (
            ok
            and isinstance(step, int)
            and not isinstance(step, bool)
            and step >= 0
            and isinstance(loss, int | float)
            and not isinstance(loss, bool)
        ):
            raise ValueError(f"RankSample.losses: (step >= 0, loss) pairs required, got {item!r}")


LOAD_SOURCES = frozenset({"memory", "peer", "storage"})  # RankProgress.loaded_from values


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
    loaded_from: str = ""  # where that state came from: "memory", "peer", "storage" ("": not said)
    load_fallback: str = ""  # why the load passed over a faster source ("": it did not)
    finished: bool = False  # took its last step and is exiting (training is done)
    # (step, loss) of every step since the rank's previous report, oldest first (RankProgress's
    # recent_losses, or its one `loss` from an older trainer); NaN and inf are reports, not errors
    losses: tuple[tuple[int, float], ...] = ()
    losses_dropped: int = 0  # more steps than the agent keeps per write: the oldest were dropped
    # collectives the rank entered on the default group this attempt (None: not reported), and how
    # long before the agent's write it entered the newest (RankProgress.collective_age_s)
    collectives_entered: int | None = None
    collective_age_s: float = 0.0
    in_eval: bool = False  # inside an evaluation the script declared (ProgressReporter.evaluating)
    snapshot_steps: tuple[
        int, ...
    ] = ()  # the in-memory snapshots it holds complete (controller/supervisor/snapshots.py)

    def __post_init__(self) -> None:
        if self.losses or self.losses_dropped:
            _check_losses(self.losses, self.losses_dropped)
        try:  # one chained comparison each: NaN, infinities and negatives all fail it
            ok = (
                self.rank >= 0
                and self.step >= -1
                and 0.0 <= self.step_time_s < math.inf
                and 0.0 <= self.compute_s < math.inf
                and 0.0 <= self.wait_s < math.inf
                and (self.loaded_step is None or self.loaded_step >= -1)
                and (self.collectives_entered is None or self.collectives_entered >= 0)
                and 0.0 <= self.collective_age_s < math.inf
            )
        except TypeError:
            ok = False
        if not ok:
            for name in ("rank", "step", "step_time_s", "compute_s", "wait_s", "collective_age_s"):
                _check_finite(f"RankSample.{name}", getattr(self, name))
            raise ValueError(
                "RankSample: rank >= 0, step >= -1, loaded_step >= -1, collectives_entered >= 0 and "
                f"times >= 0 required, got {self!r}"
            )

    @classmethod
    def from_proto(
        cls, p: common_pb2.RankProgress, losses: tuple[tuple[int, float], ...] | None = None
    ) -> RankSample:
        """losses: the rank's (step, loss) list as the shell validated it (None: taken as stored)."""
        if losses is None:
            losses = proto_losses(p)
        return cls(
            losses=losses,
            losses_dropped=max(0, p.losses_dropped),
            rank=p.rank,
            step=p.step,
            step_time_s=max(0.0, p.step_time_s),
            compute_s=max(0.0, p.compute_s),
            wait_s=max(0.0, p.wait_s),
            in_checkpoint=p.in_checkpoint,
            reported_at=p.reported_at,
            loaded_step=p.loaded_step if p.HasField("loaded_step") else None,
            loaded_from=p.loaded_from if p.loaded_from in LOAD_SOURCES else "",
            load_fallback=p.load_fallback[:1024],
            finished=p.finished,
            collectives_entered=p.collectives_entered if p.HasField("collectives_entered") else None,
            collective_age_s=p.collective_age_s,
            in_eval=p.in_eval,
            snapshot_steps=tuple(s for s in p.snapshot_steps[:4] if s > 0),
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
    """A node's preflight finished (the answer to `RunPreflight`).

    inconclusive_checks: checks that could not tell (they measured the host's load, not the node);
    with none failed, the result is neither a pass nor evidence: run it again later."""

    node: str
    passed: bool
    mode: str = "quick"
    failed_checks: tuple[str, ...] = ()
    duration_s: float = 0.0
    inconclusive_checks: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_name("PreflightResult.node", self.node)
        if self.passed and self.inconclusive_checks:
            raise ValueError("PreflightResult: a check that could not tell is no pass")

    @property
    def inconclusive(self) -> bool:
        """Not passed, nothing failed, something could not tell: retry, never a strike."""
        return not self.passed and not self.failed_checks and bool(self.inconclusive_checks)


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
    planned_stop: str = ""  # the ranks ended on a stop request (why): a planned stop, not the end
    # the node has no worker of the attempt at all: an adopted attempt whose launch never reached it
    # (the previous leader died first); no exit of the job's, nothing about the node
    never_started: bool = False

    def __post_init__(self) -> None:
        _check_name("AttemptExited.node", self.node)


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeDraining:
    """A node is leaving for maintenance or a scheduler's notice (its agent says DRAINING, with why),
    or is back in service (reason ""). Never a failure: a planned stop and a hand-over to a spare."""

    node: str
    reason: str

    def __post_init__(self) -> None:
        _check_name("NodeDraining.node", self.node)


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


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointInvalid:
    """A rank's load refused committed step `step`: its content is not what its commit recorded
    (a shard's checksum differs). Not a resume point any more."""

    step: int
    error: str
    node: str = ""
    attempt: int = 0


LAUNCH_PATHS = ("warm", "cold", "")  # "": an agent that does not say (an older agent)


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeLaunchPath:
    """How one node started its ranks: the agent's LaunchWorkersResponse.launch_path / launch_detail."""

    node: str
    path: str
    detail: str = ""

    def __post_init__(self) -> None:
        _check_name("NodeLaunchPath.node", self.node)
        if self.path not in LAUNCH_PATHS:
            raise ValueError(f"NodeLaunchPath.path: one of warm, cold or empty, got {self.path!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkersStarted:
    """Every node of `attempt` accepted its launch (the shell's answer to a `Launch` that fully started)."""

    attempt: int
    nodes: tuple[NodeLaunchPath, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class DumpsCollected:
    """Flight-recorder dumps of `attempt` were collected and analysed (answer to `CollectDumps`).

    verdict: the flight-recorder rung of the blame ladder only (controller/supervisor/flight_recorder.py);
    the core ranks it below hardware evidence and above heartbeats (controller/supervisor/blame.py)."""

    attempt: int
    verdict: FlightRecorderVerdict


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlPlaneLost:
    """The controller cannot reach etcd: nothing observed now is evidence about nodes."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlPlaneRestored:
    """etcd is reachable again. The shell relists and sends a `StoreListed` next."""


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
class PolicyChanged:
    """The supervisor policy in force changed (the run's policy key in etcd: `controllerctl config`,
    SIGHUP to the controller): the core decides with `config` from the next decision on."""

    config: SupervisorConfig
    changed_by: str = ""
    reason: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.config, SupervisorConfig):
            raise ValueError(f"PolicyChanged.config: expected a SupervisorConfig, got {self.config!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeClaimed:
    """The fleet's claims (several runs share one fleet; each node belongs to one run at a time):
    another run took `node` (`run`: that run), or gave it back to the shared pool (`run` ""). This
    run's own claims never come as events: the shell takes them (controller/fleet/claims.py).

    record: the node's stored pool entry and reputation when it was given back, so its failures,
    strikes, holds and repairs follow it from run to run (None: nothing stored)."""

    node: str
    run: str = ""
    record: NodeRecordView | None = None

    def __post_init__(self) -> None:
        _check_name("NodeClaimed.node", self.node)
        if self.run:
            _check_name("NodeClaimed.run", self.run)
        if self.record is not None and self.record.node != self.node:
            raise ValueError(f"NodeClaimed: the record is {self.record.node!r}'s, not {self.node!r}'s")


@dataclass(frozen=True, slots=True, kw_only=True)
class LossHistory:
    """The loss history a predecessor core kept for the replay comparison, as its LOSS_RECORD events
    logged it (read back by the shell for a fresh core; controller/supervisor/loss.py).

    points: (step, rank, attempt, loss) in log order, the steps a rollback undid already left out.
    logged: (attempt, rule) of the loss rules already logged (DIVERGENCE, LOSS_ANOMALY).
    rollback_before: an attempt stopped for a loss anomaly and not relaunched yet: resume before it."""

    points: tuple[tuple[int, int, int, float], ...] = ()
    logged: tuple[tuple[int, str], ...] = ()
    rollback_before: int | None = None

    def __post_init__(self) -> None:
        for step, rank, attempt, loss in self.points:
            if step < 0 or rank < 0 or attempt < 1:
                raise ValueError(f"LossHistory: bad point (step {step}, rank {rank}, attempt {attempt})")
            _check_finite(f"LossHistory loss at step {step} rank {rank}", loss)


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreListed:
    """The store's state, listed by the shell after a (re)start or a watch gap (level-triggered).

    alive: nodes whose keys exist now, with their local rank counts. records: persisted pool/
    reputation entries. attempt/attempt_nodes: the fenced attempt record (0: none). policy: the
    stored policy (None: none stored), applied before anything else in the snapshot. losses: the
    loss history read back from the event log, for a fresh core only (None: a relist after a watch
    gap, where the core keeps its own).
    """

    alive: dict[str, int] = field(default_factory=dict)
    records: tuple[NodeRecordView, ...] = ()
    attempt: int = 0
    attempt_nodes: tuple[str, ...] = ()
    resume_step: int = -1
    resume_snapshot: int = 0  # > 0: resume_step is that attempt's in-memory snapshot
    committed_steps: tuple[int, ...] = ()
    stop_requested: StopRequested | None = None
    draining: dict[str, str] = field(default_factory=dict)  # node -> why, as the node records say
    policy: PolicyChanged | None = None
    claimed_elsewhere: dict[str, str] = field(default_factory=dict)  # node -> the other run holding it
    losses: LossHistory | None = None
    memory: store_pb2.SupervisorMemory | None = None  # the run's supervisor memory (a fresh core takes it)
    logged_attempt: int = 0  # the highest attempt a LAUNCH of this run in the event log names (fresh core)


@dataclass(frozen=True, slots=True, kw_only=True)
class BandwidthMeasured:
    """The answer to `MeasureBandwidth`: bus bandwidth in GB/s (1e9 bytes/s, nccl-tests' busbw).

    set_gbps: all of `nodes` together (0: not measured). per_node_gbps: each node's best figure over
    the pairs it was in (a slow link is slow in both of its pairs; a healthy node has a healthy one).
    detail: how it was measured (sizes, backend), for the log."""

    nodes: tuple[str, ...]
    set_gbps: float
    per_node_gbps: tuple[tuple[str, float], ...]
    duration_s: float = 0.0
    detail: str = ""

    def __post_init__(self) -> None:
        _check_finite("BandwidthMeasured.set_gbps", self.set_gbps)
        for node, gbps in self.per_node_gbps:
            _check_name("BandwidthMeasured.per_node_gbps", node)
            _check_finite(f"BandwidthMeasured.per_node_gbps[{node}]", gbps)
            if gbps < 0:
                raise ValueError(f"BandwidthMeasured: {node} has a negative bandwidth {gbps}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ActionFailed:
    """The shell could not carry out `action` (raft's Advance, with the bad news).

    temporary: the cause may pass (UNAVAILABLE, DEADLINE_EXCEEDED, a full disk) and the shell already
    retried with backoff; permanent: retrying cannot help (the agent refused the request, another
    leader holds the attempt record). node: the node it failed for when the action names several
    ("" for the whole action). The core reacts at once (a launch that never happened is relaunched,
    an unreachable node is replaced without being quarantined), not at a timeout.
    """

    action: Action
    temporary: bool
    reason: str
    node: str = ""

    def __post_init__(self) -> None:
        if self.node:
            _check_name("ActionFailed.node", self.node)


Event = (
    NodeJoined
    | NodeLost
    | NodeDraining
    | ProgressObserved
    | EvidenceObserved
    | PreflightResult
    | AttemptExited
    | StopRequested
    | CheckpointCommitted
    | CheckpointFailed
    | CheckpointInvalid
    | WorkersStarted
    | DumpsCollected
    | ControlPlaneLost
    | ControlPlaneRestored
    | OperatorQuarantine
    | OperatorRelease
    | Tick
    | StoreListed
    | BandwidthMeasured
    | ActionFailed
    | PolicyChanged
    | NodeClaimed
)
