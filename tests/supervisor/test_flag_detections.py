"""Issue 26: a detection that does not end the attempt is logged as a flag (``flag_only``), and the
goodput of the core's own log has no incident for it; a detection that stops the attempt has one."""

from __future__ import annotations

from controller.goodput.report import compute_goodput
from controller.supervisor.events import CheckpointCommitted, ControlPlaneLost, EvidenceObserved
from controller.supervisor.states import RunState
from runwarden.v1 import common_pb2, events_pb2
from tests.supervisor.harness import Driver, fast

E = events_pb2


def _straggle(d: Driver, first: int, last: int, slow: str) -> None:
    for s in range(first, last + 1):
        d.progress(s, dt=1.0, compute={slow: 0.9})


def _detections(d: Driver) -> list[events_pb2.Event]:
    return d.events(E.EVENT_KIND_DETECTION)


def test_a_straggler_left_running_is_a_flag_and_no_incident() -> None:
    d = Driver(cfg=fast(), nodes=4)
    d.start(4)
    _straggle(d, 1, 40, "n3")
    d.send(CheckpointCommitted(step=40))
    _straggle(d, 41, 80, "n3")
    (det,) = _detections(d)
    assert det.detection.detector == E.DETECTOR_STRAGGLER and det.detection.flag_only
    assert d.sup.state is RunState.RUNNING and len(d.launches) == 1
    r = compute_goodput(d.events())
    assert not r.incidents
    assert r.lost_by_cause_us.keys() <= {"startup:preflight", "startup:launch", "startup:first_step"}


def test_a_straggler_stopped_mid_run_is_no_flag_and_an_incident() -> None:
    d = Driver(cfg=fast(kill_stragglers_mid_run=True), nodes=4)
    d.start(4)
    _straggle(d, 1, 40, "n3")
    (det,) = _detections(d)
    assert det.detection.detector == E.DETECTOR_STRAGGLER and not det.detection.flag_only
    assert len(compute_goodput(d.events()).incidents) == 1


def test_fatal_evidence_on_an_attempt_node_while_blind_is_a_flag() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.start(2)
    d.steps(1, 10)
    d.send(ControlPlaneLost())
    assert d.sup.state is RunState.CONTROL_PLANE
    xid = common_pb2.Evidence(
        node="n1", kind=common_pb2.EVIDENCE_KIND_XID, xid=79, severity=common_pb2.SEVERITY_FATAL
    )
    d.send(EvidenceObserved(evidence=xid))
    (det,) = _detections(d)
    assert det.detection.nodes == ["n1"] and det.detection.flag_only
    assert not compute_goodput(d.events()).incidents


def test_fatal_evidence_on_a_running_attempt_node_ends_it_and_is_no_flag() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.start(2)
    d.steps(1, 10)
    xid = common_pb2.Evidence(
        node="n1", kind=common_pb2.EVIDENCE_KIND_XID, xid=79, severity=common_pb2.SEVERITY_FATAL
    )
    d.send(EvidenceObserved(evidence=xid))
    (det,) = _detections(d)
    assert not det.detection.flag_only and d.sup.state is not RunState.RUNNING
    assert len(compute_goodput(d.events()).incidents) == 1
