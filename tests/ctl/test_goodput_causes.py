"""Goodput's cause per blame method: one table, the same answer for an old (string) and a new (enum) log line."""

from __future__ import annotations

import pytest

from controller.goodput.causes import CAUSE_BY_METHOD, METHOD_BY_NAME, UNKNOWN_METHOD, cause_from_attribution
from controller.goodput.report import US, compute_goodput
from runwarden.v1 import common_pb2, events_pb2

from .logbuild import LogBuilder

B = events_pb2.BlameMethod
T0 = 1_764_547_200.0


def _suspect(*evidence: common_pb2.Evidence) -> events_pb2.Suspect:
    return events_pb2.Suspect(node="n2", evidence=list(evidence))


def _xid(severity: int = common_pb2.SEVERITY_FATAL) -> common_pb2.Evidence:
    return common_pb2.Evidence(node="n2", kind=common_pb2.EVIDENCE_KIND_XID, severity=severity)


def _new(method: int, *suspects: events_pb2.Suspect) -> events_pb2.AttributionDetail:
    return events_pb2.AttributionDetail(blame_method=method, suspects=list(suspects))


def _old(method: str, *suspects: events_pb2.Suspect) -> events_pb2.AttributionDetail:
    return events_pb2.AttributionDetail(method=method, suspects=list(suspects))


# (enum, old string, suspects, cause): what the supervisor writes for each rung of its blame ladder
CASES = [
    (B.BLAME_METHOD_NONE, "none", (), "software"),
    (B.BLAME_METHOD_HARDWARE, "hardware", (_suspect(_xid()),), "hardware:xid"),
    (B.BLAME_METHOD_HARDWARE, "hardware", (_suspect(_xid(common_pb2.SEVERITY_APPLICATION)),), "software"),
    (
        B.BLAME_METHOD_HARDWARE,
        "hardware",
        (
            _suspect(
                common_pb2.Evidence(kind=common_pb2.EVIDENCE_KIND_NETWORK, severity=common_pb2.SEVERITY_FATAL)
            ),
        ),
        "network",
    ),
    (
        B.BLAME_METHOD_HARDWARE,
        "hardware",
        (_suspect(common_pb2.Evidence(kind=common_pb2.EVIDENCE_KIND_ECC_UNCORRECTABLE)),),
        "hardware:ecc",
    ),
    (B.BLAME_METHOD_HARDWARE, "hardware", (_suspect(),), "hardware:unknown"),
    (B.BLAME_METHOD_FLIGHT_RECORDER, "flight_recorder", (_suspect(),), "hardware:flight_recorder"),
    (B.BLAME_METHOD_HEARTBEAT, "heartbeat", (_suspect(),), "hardware:heartbeat"),
    (B.BLAME_METHOD_STRAGGLER, "straggler", (_suspect(),), "hardware:straggler"),
    (B.BLAME_METHOD_FIRST_EXIT, "first_exit", (_suspect(),), "unattributed:first_exit"),
]


@pytest.mark.parametrize(("method", "name", "suspects", "cause"), CASES)
def test_cause_per_method_for_new_and_old_lines(
    method: int, name: str, suspects: tuple[events_pb2.Suspect, ...], cause: str
) -> None:
    assert cause_from_attribution(_new(method, *suspects)) == cause
    assert cause_from_attribution(_old(name, *suspects)) == cause  # an old log: only the string


def test_the_table_covers_every_method_but_unspecified() -> None:
    named = {v for v in B.values() if v != B.BLAME_METHOD_UNSPECIFIED}
    assert set(CAUSE_BY_METHOD) == named
    assert set(METHOD_BY_NAME.values()) == named


def test_the_enum_wins_over_the_deprecated_string() -> None:
    both = events_pb2.AttributionDetail(
        method="hardware", blame_method=B.BLAME_METHOD_FIRST_EXIT, suspects=[_suspect(_xid())]
    )
    assert cause_from_attribution(both) == "unattributed:first_exit"


@pytest.mark.parametrize(
    "detail",
    [
        events_pb2.AttributionDetail(blame_method=99, suspects=[_suspect(_xid())]),
        events_pb2.AttributionDetail(method="telepathy", suspects=[_suspect(_xid())]),
        events_pb2.AttributionDetail(),
    ],
    ids=["unknown-enum", "unknown-string", "empty"],
)
def test_an_unknown_method_is_a_named_cause_not_a_crash(detail: events_pb2.AttributionDetail) -> None:
    assert cause_from_attribution(detail) == UNKNOWN_METHOD


@pytest.mark.parametrize(
    "detail",
    [
        _new(B.BLAME_METHOD_FIRST_EXIT, _suspect()),
        _old("first_exit", _suspect()),
        _old(
            "first_exit", _suspect(_xid())
        ),  # even with evidence attached, "first to exit" claims no hardware
    ],
    ids=["enum", "string", "string-with-evidence"],
)
def test_first_exit_never_counts_as_hardware(detail: events_pb2.AttributionDetail) -> None:
    b = LogBuilder()
    b.startup(T0)
    b.detect(T0 + 60, latency_s=0)
    b.attribute_detail(T0 + 61, detail)
    b.end(T0 + 70, outcome="crash_loop")
    r = compute_goodput(b.events)
    assert r.lost_by_cause_us["unattributed:first_exit"] == 20 * US
    assert not any(c.startswith("hardware:") for c in r.lost_by_cause_us)
    assert [i.cause for i in r.incidents] == ["unattributed:first_exit"]


def test_an_unknown_enum_in_a_log_still_gives_a_report() -> None:
    b = LogBuilder()
    b.startup(T0)
    b.detect(T0 + 60, latency_s=0)
    b.attribute_detail(T0 + 61, events_pb2.AttributionDetail(blame_method=42))
    b.end(T0 + 70, outcome="crash_loop")
    r = compute_goodput(b.events)
    assert r.lost_by_cause_us[UNKNOWN_METHOD] == 20 * US
    assert r.productive_us + r.lost_us == r.allocated_us
