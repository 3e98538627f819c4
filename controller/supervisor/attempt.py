"""One attempt's bookkeeping, and one failure's: values built fresh, never reset by hand.

`Attempt` is created by the core at each launch (`Attempt.launched`) or adoption after a controller
restart (`Attempt.adopted`); everything that belongs to one attempt (per-node steps, load marks,
per-rank load averages, straggler history, exits) lives here and dies with it. What outlives an
attempt (save durations, step times, restart history, reputation) stays on the core.

`Failure` is one failure (or planned stop) of the current attempt, from detection to decision.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from controller.supervisor.blame import FailureFacts, FlightRecorderVerdict
from controller.supervisor.collectives import CollectiveMarks
from controller.supervisor.snapshots import SnapshotTracker
from runwarden.v1 import events_pb2

UNREPORTED = -2  # a node of the attempt that has not reported progress yet


@dataclass(slots=True, kw_only=True)
class Attempt:
    number: int  # 0: no attempt yet
    nodes: tuple[str, ...]
    resume_step: int
    launched_at: float
    resume_snapshot: int = 0  # > 0: resume_step is that attempt's in-memory snapshot, not a commit
    snapshot_refused: bool = False  # its ranks refused that snapshot (CheckpointInvalid)
    node_step: dict[str, int]  # node -> its slowest rank's step (UNREPORTED until it reports)
    step_count: dict[int, int]  # step -> how many nodes are at it (the minimum in O(distinct steps))
    min_step: int = UNREPORTED
    min_advanced_at: float = 0.0
    node_seen_at: dict[str, float] = field(default_factory=dict)  # last progress report (node-lost latency)
    node_advanced_at: dict[str, float] = field(default_factory=dict)  # its step last went up (it trained)
    ckpt_nodes: set[str] = field(default_factory=set)  # nodes with a rank inside a checkpoint save
    eval_nodes: set[str] = field(default_factory=set)  # nodes with a rank inside a declared evaluation
    eval_since: float = 0.0  # when the first of them began it
    collectives: CollectiveMarks = field(default_factory=CollectiveMarks)  # the collective rule's counts
    collective_armed: tuple[int, float] | None = None  # the stall the hang timer was last armed for
    hang_timer_at: float = float("inf")  # when the hang timer is due (every SetTimer "hang" sets it)
    snapshots: SnapshotTracker = field(default_factory=SnapshotTracker)  # what its ranks hold in memory
    save_started: dict[int, float] = field(default_factory=dict)  # step -> first "saving" report
    first_step_logged: bool = False
    loaded_nodes: set[str] = field(default_factory=set)  # nodes whose ranks all reported their load
    loaded_from: dict[str, str] = field(default_factory=dict)  # node -> where its ranks' state came from
    load_fallbacks: dict[str, str] = field(default_factory=dict)  # node -> why a rank passed over a source
    first_loaded_at: float = 0.0  # when the first of them did (the load-stall rule's clock)
    finished_nodes: set[str] = field(default_factory=set)  # nodes whose ranks all took their last step
    finished_at: float = 0.0  # when the last of them did
    load_logged: bool = False
    loads: dict[int, tuple[str, float, float]] = field(
        default_factory=dict
    )  # rank -> (node, ewma compute, wait)
    straggler_hist: deque[tuple[float, int | None]] = field(default_factory=deque)
    straggler_nodes: set[str] = field(default_factory=set)  # flagged: quarantined at the next restart
    exited: dict[str, str] = field(default_factory=dict)  # node -> exit label
    awaiting_exit: set[str] = field(default_factory=set)  # STOPPING: nodes whose exit is still due

    @classmethod
    def none(cls) -> Attempt:
        return cls(number=0, nodes=(), resume_step=-1, launched_at=0.0, node_step={}, step_count={})

    @classmethod
    def launched(
        cls, number: int, nodes: tuple[str, ...], *, resume_step: int, now: float, straggler_window: int
    ) -> Attempt:
        return cls(
            number=number,
            nodes=nodes,
            resume_step=resume_step,
            launched_at=now,
            node_step=dict.fromkeys(nodes, UNREPORTED),
            step_count={UNREPORTED: len(nodes)},
            min_advanced_at=now,
            straggler_hist=deque(maxlen=straggler_window),
        )

    @classmethod
    def adopted(
        cls, number: int, nodes: tuple[str, ...], *, resume_step: int, now: float, straggler_window: int
    ) -> Attempt:
        """Found running after a controller restart: its load and first step happened unwatched."""
        a = cls.launched(number, nodes, resume_step=resume_step, now=now, straggler_window=straggler_window)
        a.first_step_logged = a.load_logged = True
        return a


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
    first_exit_at: float | None = None  # when it ended, as its agent said
    verdict: FlightRecorderVerdict | None = None
    # collect flight-recorder dumps first (False: nothing to hang on: the loss rules, a lost lease, a
    # failure of no one)
    dumps: bool = True
    # without dumps, wait this long before the stop (a lost lease: a mass expiry shows itself in it)
    hold_s: float = 0.0
    # a failure of no one (the launch paths disagreed, a launch never reached a node): nothing
    # blamed, counted or waited for; relaunched at once
    no_fault: bool = False

    def facts(self) -> FailureFacts:
        return FailureFacts(
            detector=self.detector,
            nodes=tuple(self.nodes),
            ranks=tuple(self.ranks),
            step=self.step,
            label=self.label,
            first_exit=self.first_exit,
        )
