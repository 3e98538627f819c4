"""Actions out of the supervisor core, and the `Batch` that carries them with their log entries.

`Supervisor.handle(event, now)` returns one frozen `Batch`; every shell (controller/live/, the
simulator, the tests' harness) carries it out under the order of obligations `Batch` states, and
answers what it could not do with `ActionFailed`. The actions are plain data: no I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass

from controller.supervisor.pool import NodeRecordView
from runwarden.v1 import common_pb2, events_pb2, store_pb2


@dataclass(frozen=True, slots=True, kw_only=True)
class RunPreflight:
    """Run preflight on each node: `mode` "quick" (or "full") before an attempt, the policy's
    burn_in_mode ("burn_in", the burn-in pipeline, by default) for a burn-in.

    Answer with one `PreflightResult` per node. purpose: "attempt" or "burn_in".
    """

    nodes: tuple[str, ...]
    mode: str
    purpose: str = "attempt"
    timeout_s: float = 120.0


@dataclass(frozen=True, slots=True, kw_only=True)
class MeasureBandwidth:
    """Measure all-reduce bus bandwidth across exactly `nodes` (the next attempt's set), within `timeout_s`.

    The shell runs `preflight.collective` on the nodes together (one rank per node: gloo on CPU, NCCL
    on GPUs) and, to locate a slow link, in pairs around the ring ((0,1), (2,3), ... then (1,2), ...).
    Answer with `BandwidthMeasured`: the set's figure and each node's best pair figure.

    purpose: "gate" (the next attempt's set) or "burn_in" (a burned-in node soaked with idle
    neighbours, `nodes[0]` the node). iterations: timed all-reduces per group (0: the shell's own)."""

    nodes: tuple[str, ...]
    timeout_s: float
    purpose: str = "gate"
    iterations: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeRank:
    node: str
    node_rank: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Launch:
    """Start attempt `attempt` on `nodes` (torchrun --max-restarts=0, rdzv id `rendezvous_id`).

    resume_step: the latest *committed* checkpoint step, -1 = from scratch. leader_fence: 0 here;
    the shell fills in its leadership fence when it writes the attempt record (CAS). cold: every
    node starts torchrun even where a parked group is ready (one of them did not go warm before).
    """

    run: str
    attempt: int
    rendezvous_id: str
    nodes: tuple[NodeRank, ...]
    resume_step: int
    leader_fence: int = 0
    cold: bool = False
    resume_snapshot: int = (
        0  # > 0: resume_step is that attempt's in-memory snapshot (RUNWARDEN_RESUME_SNAPSHOT)
    )
    snapshot_interval_s: float = 0.0  # the ranks' snapshot interval (RUNWARDEN_SNAPSHOT_INTERVAL_S; 0: none)


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


@dataclass(frozen=True, slots=True, kw_only=True)
class PersistMemory:
    """Write the run's supervisor memory (runs/<run>/memory): restart budget, crash-loop candidate,
    offences, blast-radius quarantines. Built fresh for each action; never changed after."""

    record: store_pb2.SupervisorMemory


@dataclass(frozen=True, slots=True, kw_only=True)
class PersistCheckpoint:
    """Record an accepted commit in the store (runs/<run>/checkpoints/<step>): a resume point that a
    `StoreListed` gives back after a controller restart. A superseded attempt's commit never gets one.
    `invalid`: why a load refused the step; the record stays, and is no resume point."""

    step: int
    path: str
    attempt: int
    save_duration_s: float = 0.0
    invalid: str = ""


Action = (
    RunPreflight
    | MeasureBandwidth
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
    | PersistMemory
    | PersistCheckpoint
)


@dataclass(frozen=True, slots=True)
class Batch:
    """What one `handle` call asks of the shell: log `entries` first, then execute `actions`, in
    order. The order of obligations (raft's `Ready`):

    1. Append every entry of `batch.entries` to the event log, in order, and fsync, *before* executing
       any action. If the append fails, execute no action (the log is the truth: an unlogged action must
       not happen) except `SetTimer`, keep the entries to append again first, and answer each skipped
       action with `ActionFailed(temporary=True)`.
    2. Execute `batch.actions` in order. `Launch`: first write the attempt record with a
       compare-and-swap (attempt fencing, the leader's fence in `leader_fence`), then start the workers;
       a refused CAS is `ActionFailed(action=launch, temporary=False)`.
    3. `SetTimer(key, at)`: replace any pending timer with the same key; deliver `Tick()` at `at`
       (late is fine, early is harmless). Extra ticks are always allowed. `controller.supervisor.timers`
       keeps these rules for every shell.
    4. `PersistNode`: write the node's pool entry and reputation to the store (level-triggered state
       that `StoreListed` gives back after a controller restart); `PersistMemory` the run's supervisor
       memory (`StoreListed.memory` gives it to a fresh core).
    5. An action that fails is answered with `ActionFailed` (temporary or permanent, with its reason);
       results come back as events (`PreflightResult`, `AttemptExited`, `DumpsCollected`, `NodeJoined`).
    """

    entries: tuple[events_pb2.Event, ...] = ()
    actions: tuple[Action, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.entries or self.actions)
