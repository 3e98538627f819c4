"""The one blame ladder (controller/supervisor/blame.py): its order, and the sentence each decision logs.

These tests were the tier-order tests of the flight recorder's own `attribute()` (hardware > flight
recorder > heartbeat > none); the flight-recorder rung alone is tested in tests/flightrec.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from controller.supervisor.blame import (
    Blame,
    BlameMethod,
    FailureFacts,
    FlightRecorderVerdict,
    Suspect,
    blame,
    heartbeat_suspect,
)
from controller.supervisor.flight_recorder import CONFIDENCE_LAGGING, CONFIDENCE_STOPPED, verdict
from controller.supervisor.policy import SupervisorConfig
from runwarden.evidence import is_fatal
from runwarden.v1 import common_pb2, events_pb2
from tests.flightrec.handmade import default_only

K = common_pb2.EvidenceKind
NODES = {0: "a", 1: "a", 2: "b", 3: "b"}
STEPS = {"a": 100, "b": 100}
FR_MIN = SupervisorConfig().fr_min_confidence


def _evidence(node: str, kind: int, severity: int, **kw: object) -> common_pb2.Evidence:
    return common_pb2.Evidence(node=node, kind=kind, severity=severity, detail="d", observed_at=100.0, **kw)


def _facts(
    detector: int = events_pb2.DETECTOR_HANG,
    *,
    nodes: tuple[str, ...] = (),
    first_exit: str | None = None,
    label: str = "hang",
    ranks: tuple[int, ...] = (),
) -> FailureFacts:
    return FailureFacts(
        detector=detector, nodes=nodes, ranks=ranks, step=100, label=label, first_exit=first_exit
    )


def _blame(
    f: FailureFacts,
    *,
    evidence: Sequence[common_pb2.Evidence] = (),
    fr: FlightRecorderVerdict | None = None,
    steps: Mapping[str, int] = STEPS,
) -> Blame:
    by_node: dict[str, list[common_pb2.Evidence]] = {}
    for ev in evidence:
        by_node.setdefault(ev.node, []).append(ev)
    return blame(f, evidence=by_node, verdict=fr, node_steps=steps, fr_min_confidence=FR_MIN)


def test_hardware_evidence_on_a_gpu_names_the_rank_that_sat_on_it() -> None:
    """An Xid that names GPU 1 of node b (global ranks 2, 3: node b's local rank 1 on device 1) names
    rank 3, so the attribution says which rank's GPU broke; evidence without a GPU names none."""
    xid = _evidence("b", K.EVIDENCE_KIND_XID, common_pb2.SEVERITY_FATAL, xid=79, gpu_index=1)
    by_node = {"b": [xid]}
    ranks = {"a": range(0, 2), "b": range(2, 4)}
    result = blame(
        _facts(), evidence=by_node, verdict=None, node_steps=STEPS, fr_min_confidence=FR_MIN, node_ranks=ranks
    )
    (suspect,) = result.suspects
    assert suspect.node == "b" and suspect.ranks == (3,)
    assert "b ranks [3]" in result.reason
    off = _evidence(
        "b", K.EVIDENCE_KIND_XID, common_pb2.SEVERITY_FATAL, xid=79, gpu_index=7
    )  # not one of its
    none = _evidence("b", K.EVIDENCE_KIND_XID, common_pb2.SEVERITY_FATAL, xid=79)
    for ev in (off, none):
        again = blame(
            _facts(),
            evidence={"b": [ev]},
            verdict=None,
            node_steps=STEPS,
            fr_min_confidence=FR_MIN,
            node_ranks=ranks,
        )
        assert again.suspects[0].ranks == ()


def test_hardware_evidence_beats_the_flight_recorder() -> None:
    fr = verdict(rank_to_node=NODES, dumps=default_only(4, {0: 5, 1: 5, 2: 5, 3: 4}))
    assert [s.node for s in fr.suspects] == ["b"]  # the flight recorder blames b ...
    xid = _evidence("a", K.EVIDENCE_KIND_XID, common_pb2.SEVERITY_FATAL, xid=79)
    result = _blame(_facts(), evidence=[xid], fr=fr)  # ... but a's fatal Xid is stronger
    assert result.method is BlameMethod.HARDWARE
    (suspect,) = result.suspects
    assert suspect.node == "a" and suspect.evidence == (xid,) and suspect.confidence == 1.0
    assert result.reason == "blamed by hardware: a: fatal hardware evidence: d (confidence 1.00)"
    proto = result.to_proto()
    assert proto.blame_method == events_pb2.BLAME_METHOD_HARDWARE and proto.method == "hardware"
    assert proto.suspects[0].evidence[0].xid == 79
    assert events_pb2.AttributionDetail.FromString(proto.SerializeToString()) == proto
    # without the hardware evidence the flight recorder's suspect stands, with its explanation
    fallback = _blame(_facts(), fr=fr)
    assert fallback.method is BlameMethod.FLIGHT_RECORDER and fallback.suspects == fr.suspects
    assert fallback.explanation == fr.explanation
    assert fallback.reason.startswith(
        "blamed by flight recorder: b ranks [3]: rank 3 never called collective #5"
    )
    assert fallback.reason.endswith(f"(confidence {CONFIDENCE_LAGGING:.2f})")


def test_application_and_non_fatal_evidence_blame_nobody() -> None:
    evidence = [
        _evidence("a", K.EVIDENCE_KIND_XID, common_pb2.SEVERITY_APPLICATION, xid=13),
        _evidence("a", K.EVIDENCE_KIND_XID, common_pb2.SEVERITY_WARNING, xid=63),
        _evidence("b", K.EVIDENCE_KIND_THROTTLE, common_pb2.SEVERITY_WARNING),
        _evidence("b", K.EVIDENCE_KIND_ECC_UNCORRECTABLE, common_pb2.SEVERITY_APPLICATION),  # the job's fault
    ]
    result = _blame(_facts(events_pb2.DETECTOR_CRASH, label="exit code 1"), evidence=evidence)
    assert result.method is BlameMethod.NONE and result.suspects == ()
    assert result.reason == (
        "no suspect for exit code 1 at step 100: software or data (crash-loop rule decides)"
    )


@pytest.mark.parametrize("xid", [13, 31, 43])
def test_application_xids_never_blame_even_when_marked_fatal_elsewhere(xid: int) -> None:
    ev = _evidence("a", K.EVIDENCE_KIND_XID, common_pb2.SEVERITY_APPLICATION, xid=xid)
    result = _blame(_facts(events_pb2.DETECTOR_CRASH, first_exit="a", label="exit code 1"), evidence=[ev])
    assert result.method is BlameMethod.FIRST_EXIT and not is_fatal(ev)


def test_only_evidence_on_a_node_of_the_attempt_counts() -> None:
    """The ladder reads evidence of the attempt's nodes only (the core passes what arrived since launch;
    older evidence was acted on when it arrived)."""
    gone = _evidence("z", K.EVIDENCE_KIND_GPU_LOST, common_pb2.SEVERITY_FATAL)
    result = _blame(_facts(events_pb2.DETECTOR_CRASH, label="exit code 1"), evidence=[gone])
    assert result.method is BlameMethod.NONE
    assert result.reason.startswith("no suspect for exit code 1 at step 100")


def test_ecc_is_fatal_whatever_its_severity_says() -> None:
    ev = _evidence("b", K.EVIDENCE_KIND_ECC_UNCORRECTABLE, common_pb2.SEVERITY_WARNING)
    result = _blame(_facts(), evidence=[ev])
    assert result.method is BlameMethod.HARDWARE and [s.node for s in result.suspects] == ["b"]
    assert result.reason == "blamed by hardware: b: fatal hardware evidence: d (confidence 1.00)"


def test_a_record_of_another_kind_is_fatal_when_its_agent_marked_it_fatal() -> None:
    """The old flight-recorder tier knew a list of hardware kinds; the one definition asks the severity."""
    for kind in (K.EVIDENCE_KIND_NETWORK, K.EVIDENCE_KIND_PCIE_DEGRADED, K.EVIDENCE_KIND_THROTTLE):
        ev = common_pb2.Evidence(node="a", kind=kind, severity=common_pb2.SEVERITY_FATAL)
        result = _blame(_facts(), evidence=[ev])
        assert result.method is BlameMethod.HARDWARE, K.Name(kind)
        name = K.Name(kind)  # no detail: the kind's name is the reason
        assert result.reason == f"blamed by hardware: a: fatal hardware evidence: {name} (confidence 1.00)"
        warning = common_pb2.Evidence(node="a", kind=kind, severity=common_pb2.SEVERITY_WARNING)
        assert _blame(_facts(), evidence=[warning]).method is BlameMethod.NONE


def test_hardware_and_the_flight_recorder_on_the_same_node_blame_it_once_by_hardware() -> None:
    fr = verdict(rank_to_node=NODES, dumps=default_only(4, {0: 5, 1: 5, 2: 4, 3: 5}))
    ev = _evidence("b", K.EVIDENCE_KIND_ROW_REMAP_FAILURE, common_pb2.SEVERITY_FATAL)
    result = _blame(_facts(), evidence=[ev], fr=fr)
    (suspect,) = result.suspects
    assert result.method is BlameMethod.HARDWARE and suspect.node == "b" and suspect.evidence == (ev,)
    assert result.reason == "blamed by hardware: b: fatal hardware evidence: d (confidence 1.00)"


def test_heartbeats_only_when_nothing_stronger() -> None:
    steps = {"a": 100, "b": 97, "c": 100}
    result = _blame(_facts(), steps=steps)
    assert result.method is BlameMethod.HEARTBEAT and [s.node for s in result.suspects] == ["b"]
    assert result.reason == "blamed by heartbeat: b: its progress stopped first (step 97) (confidence 0.60)"
    assert heartbeat_suspect(steps) == "b"
    # no single node behind: nobody (there is no time margin; a step behind every other node is the test)
    close = _blame(_facts(), steps={"a": 1, "b": 1})
    assert close.method is BlameMethod.NONE and close.reason.startswith("no suspect for hang at step 100")
    # the flight recorder outranks the heartbeat
    fr = verdict(
        rank_to_node={0: "a", 1: "b", 2: "c", 3: "c"}, dumps=default_only(4, {0: 5, 1: 5, 2: 5, 3: 4})
    )
    assert _blame(_facts(), steps=steps, fr=fr).method is BlameMethod.FLIGHT_RECORDER


def test_flight_recorder_suspects_below_the_minimum_confidence_are_dropped() -> None:
    # rank 0 stopped: the ranks behind it are its victims, below fr_min_confidence
    dumps = default_only(4, {1: 4, 2: 5, 3: 4})
    r2n = {0: "a", 1: "b", 2: "c", 3: "d"}
    fr = verdict(rank_to_node=r2n, dumps=dumps, no_dump={0: "no dump: no answer"}, stopped=[0])
    steps = dict.fromkeys("abcd", 50)
    result = _blame(_facts(), fr=fr, steps=steps)
    assert result.method is BlameMethod.FLIGHT_RECORDER and [s.node for s in result.suspects] == ["a"]
    assert result.reason == (
        f"blamed by flight recorder: a ranks [0]: rank 0 gave no dump and its process is stopped "
        f"(no dump: no answer) (confidence {CONFIDENCE_STOPPED:.2f})"
    )
    weak = FlightRecorderVerdict(suspects=tuple(s for s in fr.suspects if s.node != "a"), explanation="weak")
    assert weak.suspects and all(s.confidence < FR_MIN for s in weak.suspects)
    fallen = _blame(_facts(), fr=weak, steps={**steps, "b": 49})  # falls through to the heartbeat
    assert fallen.method is BlameMethod.HEARTBEAT and fallen.explanation == "weak"
    assert [s.node for s in fallen.suspects] == ["b"]
    nothing = _blame(_facts(), fr=weak, steps=steps)
    assert nothing.method is BlameMethod.NONE and nothing.suspects == () and nothing.explanation == "weak"


def test_a_flight_recorder_suspect_outside_the_attempt_is_dropped() -> None:
    fr = FlightRecorderVerdict(
        suspects=(
            Suspect(node="", ranks=(7,), confidence=0.9, reason="unknown rank"),
            Suspect(node="z", ranks=(8,), confidence=0.9, reason="old node"),
        )
    )
    assert _blame(_facts(), fr=fr).method is BlameMethod.NONE


def test_the_rank_that_reported_the_timeout_is_never_blamed_through_the_ladder() -> None:
    fr = verdict(
        rank_to_node={0: "a", 1: "a", 2: "b"},
        dumps=default_only(3, {0: 5, 1: 5, 2: 4}),
        reported_timeout=[0, 1],
    )
    result = _blame(_facts(), fr=fr)
    assert result.method is BlameMethod.FLIGHT_RECORDER and [s.node for s in result.suspects] == ["b"]


def test_first_exit_when_a_crash_has_nothing_stronger() -> None:
    result = _blame(_facts(events_pb2.DETECTOR_CRASH, first_exit="b", label="exit code 1", ranks=(2,)))
    assert result.method is BlameMethod.FIRST_EXIT and not result.method.quarantines
    (suspect,) = result.suspects
    assert suspect.node == "b" and suspect.ranks == (2,)
    assert result.reason == (
        "blamed by first exit: b ranks [2]: first to exit (exit code 1) (confidence 0.50); "
        "no hardware evidence, so not quarantined on a first offence"
    )
    assert result.to_proto().blame_method == events_pb2.BLAME_METHOD_FIRST_EXIT
    ev = _evidence("a", K.EVIDENCE_KIND_GPU_LOST, common_pb2.SEVERITY_WARNING)  # always fatal
    assert (
        _blame(_facts(events_pb2.DETECTOR_CRASH, first_exit="b"), evidence=[ev]).method
        is BlameMethod.HARDWARE
    )


def test_none_is_software_or_data() -> None:
    result = _blame(_facts(), steps={"a": 3})
    assert result.method is BlameMethod.NONE and result.suspects == () and not result.method.quarantines
    assert result.reason == "no suspect for hang at step 100: software or data (crash-loop rule decides)"
    proto = result.to_proto()
    assert (
        proto.blame_method == events_pb2.BLAME_METHOD_NONE and proto.method == "none" and not proto.suspects
    )


def test_a_lost_node_and_a_straggler_are_blamed_by_their_detector() -> None:
    lost = _blame(_facts(events_pb2.DETECTOR_NODE_LOST, nodes=("b",), label="node lost"))
    assert lost.method is BlameMethod.HEARTBEAT and lost.method.quarantines
    assert lost.reason == "blamed by heartbeat: b: its lease expired: heartbeats stopped (confidence 0.90)"
    slow = _blame(_facts(events_pb2.DETECTOR_STRAGGLER, nodes=("a",), ranks=(1,), label="straggler"))
    assert slow.method is BlameMethod.STRAGGLER
    assert slow.reason == "blamed by straggler: a ranks [1]: persistent straggler (confidence 0.80)"
