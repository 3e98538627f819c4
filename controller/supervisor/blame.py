"""The blame ladder: who is to blame for a failed attempt. One ladder, one vocabulary; pure.

The core's failure rules call `blame(...)` with the facts of a failed attempt and the evidence
about its nodes; it returns a frozen `Blame` whose `reason` is the sentence the event log records.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from runwarden.evidence import is_fatal, kind_name
from runwarden.v1 import common_pb2, events_pb2


class BlameMethod(enum.Enum):
    """How the suspects were chosen; mirrors `runwarden.v1.BlameMethod` (`.proto` gives the wire value)."""

    NONE = events_pb2.BLAME_METHOD_NONE
    HARDWARE = events_pb2.BLAME_METHOD_HARDWARE
    FLIGHT_RECORDER = events_pb2.BLAME_METHOD_FLIGHT_RECORDER
    HEARTBEAT = events_pb2.BLAME_METHOD_HEARTBEAT
    STRAGGLER = events_pb2.BLAME_METHOD_STRAGGLER
    FIRST_EXIT = events_pb2.BLAME_METHOD_FIRST_EXIT

    @property
    def proto(self) -> events_pb2.BlameMethod.ValueType:
        return events_pb2.BlameMethod.ValueType(self.value)

    @property
    def label(self) -> str:
        """The old free-text name ("first_exit"), still written to the deprecated `method` field."""
        return self.name.lower()

    @property
    def quarantines(self) -> bool:
        """Whether its suspects are quarantined on a first offence."""
        return self not in (BlameMethod.NONE, BlameMethod.FIRST_EXIT)


@dataclass(frozen=True, slots=True, kw_only=True)
class Suspect:
    """One blamed node (the only suspect type: the flight recorder's, the core's and the log's)."""

    node: str  # "" when the rank -> node mapping does not know the rank
    ranks: tuple[int, ...] = ()
    confidence: float = 1.0
    reason: str = ""
    evidence: tuple[common_pb2.Evidence, ...] = ()

    def to_proto(self) -> events_pb2.Suspect:
        return events_pb2.Suspect(
            node=self.node,
            ranks=list(self.ranks),
            confidence=self.confidence,
            reason=self.reason,
            evidence=list(self.evidence),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class FlightRecorderVerdict:
    """The flight-recorder rung alone: suspects strongest first, and the evidence in a few lines."""

    suspects: tuple[Suspect, ...] = ()
    explanation: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Blame:
    method: BlameMethod
    suspects: tuple[Suspect, ...]
    reason: str  # the ATTRIBUTION event's message
    explanation: str = ""

    def to_proto(self) -> events_pb2.AttributionDetail:
        return events_pb2.AttributionDetail(
            blame_method=self.method.proto,
            method=self.method.label,
            explanation=self.explanation,
            suspects=[s.to_proto() for s in self.suspects],
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class FailureFacts:
    """What the ladder reads about the failure (a view of the core's `Failure`)."""

    detector: events_pb2.Detector.ValueType
    nodes: tuple[str, ...]
    ranks: tuple[int, ...]
    step: int
    label: str
    first_exit: str | None


def ranks_on_gpus(evidence: Sequence[common_pb2.Evidence], ranks: range) -> tuple[int, ...]:
    """The global ranks that sat on the GPUs the evidence names: torchrun's local rank i runs on CUDA
    device i, so a node whose ranks are `ranks` had rank ranks[i] on GPU i (the agent's GpuMap names
    the same in the evidence's detail). () when no evidence names a GPU of the node."""
    return tuple(
        sorted(
            {
                ranks[e.gpu_index]
                for e in evidence
                if e.HasField("gpu_index") and 0 <= e.gpu_index < len(ranks)
            }
        )
    )


def blame(
    f: FailureFacts,
    *,
    evidence: Mapping[str, Sequence[common_pb2.Evidence]],
    verdict: FlightRecorderVerdict | None,
    node_steps: Mapping[str, int],
    fr_min_confidence: float,
    node_ranks: Mapping[str, range] | None = None,
) -> Blame:
    """Walk the ladder. evidence: each attempt node's evidence since launch. node_ranks: each
    node's global ranks in the attempt (a hardware suspect names the rank on the broken GPU).

    Evidence, strongest first (DESIGN.md, "Blame from evidence"):

    1. HARDWARE: fatal evidence (`runwarden.evidence.is_fatal`) on a node of the attempt, received since
       it launched (older evidence was acted on when it arrived);
    2. HEARTBEAT for a lost node: its lease expired, its heartbeats stopped;
    3. STRAGGLER: the persistent straggler the detector flagged;
    4. FLIGHT_RECORDER for a hang: the suspects of the flight-recorder verdict
       (controller/supervisor/flight_recorder.py) at or above `fr_min_confidence`;
    5. HEARTBEAT for a hang: the one node whose progress stopped first (behind every other node); for
       a stalled checkpoint load (`hang:load`), the nodes still loading while more of the others
       finished (when most nodes stall, it is the storage, not a node: no suspect);
    6. FIRST_EXIT for a crash with nothing stronger: the first node to exit. Not quarantined on a first
       offence (the repeat-offender rule in the core decides);
    7. NONE: software or data; the crash-loop rule decides.
    """
    hw = []
    for node in node_steps:
        fatal = tuple(e for e in evidence.get(node, ()) if is_fatal(e))
        if fatal:
            why = fatal[-1].detail or kind_name(fatal[-1].kind)
            ranks = ranks_on_gpus(fatal, (node_ranks or {}).get(node, range(0)))
            hw.append(
                Suspect(
                    node=node,
                    ranks=ranks,
                    confidence=1.0,
                    reason=f"fatal hardware evidence: {why}",
                    evidence=fatal,
                )
            )
    if hw:
        return _blamed(BlameMethod.HARDWARE, tuple(hw), f)
    if f.detector == events_pb2.DETECTOR_NODE_LOST:
        return _blamed(
            BlameMethod.HEARTBEAT,
            tuple(
                Suspect(node=n, confidence=0.9, reason="its lease expired: heartbeats stopped")
                for n in f.nodes
            ),
            f,
        )
    if f.detector == events_pb2.DETECTOR_STRAGGLER:
        return _blamed(
            BlameMethod.STRAGGLER,
            tuple(
                Suspect(node=n, ranks=f.ranks, confidence=0.8, reason="persistent straggler") for n in f.nodes
            ),
            f,
        )
    if f.detector == events_pb2.DETECTOR_HANG:
        if verdict is not None:
            fr = tuple(
                s for s in verdict.suspects if s.confidence >= fr_min_confidence and s.node in node_steps
            )
            if fr:
                return _blamed(BlameMethod.FLIGHT_RECORDER, fr, f, verdict.explanation)
        if f.label == "hang:load" and f.nodes and 2 * len(f.nodes) < len(node_steps):
            return _blamed(
                BlameMethod.HEARTBEAT,
                tuple(
                    Suspect(
                        node=n, confidence=0.7, reason="its checkpoint load stalled while the others loaded"
                    )
                    for n in f.nodes
                ),
                f,
                verdict.explanation if verdict else "",
            )
        behind = heartbeat_suspect(node_steps)
        if behind is not None:
            return _blamed(
                BlameMethod.HEARTBEAT,
                (
                    Suspect(
                        node=behind,
                        confidence=0.6,
                        reason=f"its progress stopped first (step {node_steps[behind]})",
                    ),
                ),
                f,
                verdict.explanation if verdict else "",
            )
    if f.first_exit is not None:
        return _blamed(
            BlameMethod.FIRST_EXIT,
            (Suspect(node=f.first_exit, ranks=f.ranks, confidence=0.5, reason=f"first to exit ({f.label})"),),
            f,
        )
    return _blamed(BlameMethod.NONE, (), f, verdict.explanation if verdict else "")


def heartbeat_suspect(steps: Mapping[str, int]) -> str | None:
    """The one node whose progress stopped first: its step is behind every other node's.

    None when no single node is behind (in a synchronous job the victims usually report the same
    step as the culprit; then only the flight recorder can tell them apart).
    """
    if len(steps) < 2:
        return None
    order = sorted(steps.items(), key=lambda kv: (kv[1], kv[0]))
    (first, s0), (_, s1) = order[0], order[1]
    return first if s0 < s1 else None


def _blamed(
    method: BlameMethod, suspects: tuple[Suspect, ...], f: FailureFacts, explanation: str = ""
) -> Blame:
    return Blame(
        method=method, suspects=suspects, reason=_sentence(method, suspects, f), explanation=explanation
    )


def _sentence(method: BlameMethod, suspects: tuple[Suspect, ...], f: FailureFacts) -> str:
    if not suspects:
        return f"no suspect for {f.label or 'the failure'} at step {f.step}: software or data (crash-loop rule decides)"
    top = "; ".join(
        f"{s.node}{' ranks ' + str(list(s.ranks)) if s.ranks else ''}: {s.reason} "
        f"(confidence {s.confidence:.2f})"
        for s in suspects
    )
    if method is BlameMethod.FIRST_EXIT:
        return f"blamed by first exit: {top}; no hardware evidence, so not quarantined on a first offence"
    return f"blamed by {method.label.replace('_', ' ')}: {top}"
