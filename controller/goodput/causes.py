"""The lost-time cause of an incident, from its first ATTRIBUTION: one table (`CAUSE_BY_METHOD`),
blame method -> cause. The cause is a function of ``AttributionDetail.blame_method``, never of free
text; an old log's deprecated ``method`` string is mapped onto the same enum first
(``METHOD_BY_NAME``). Bad input is a value, not a crash: an unknown method gives
``unattributed:unknown_method``. Called by `controller.goodput.report` and `windows`.
"""

from __future__ import annotations

from collections.abc import Callable

from runwarden.evidence import KIND_NAMES
from runwarden.v1 import common_pb2, events_pb2

B = events_pb2.BlameMethod

UNKNOWN_METHOD = "unattributed:unknown_method"
FIRST_EXIT = "unattributed:first_exit"

# The deprecated free-text method of an old log line, onto the enum.
METHOD_BY_NAME: dict[str, int] = {
    "none": B.BLAME_METHOD_NONE,
    "hardware": B.BLAME_METHOD_HARDWARE,
    "flight_recorder": B.BLAME_METHOD_FLIGHT_RECORDER,
    "heartbeat": B.BLAME_METHOD_HEARTBEAT,
    "straggler": B.BLAME_METHOD_STRAGGLER,
    "first_exit": B.BLAME_METHOD_FIRST_EXIT,
}


def _from_evidence(attr: events_pb2.AttributionDetail) -> str:
    """A hardware blame: the strongest suspect's first evidence record that names a kind."""
    for ev in attr.suspects[0].evidence if attr.suspects else ():
        if ev.severity == common_pb2.SEVERITY_APPLICATION:
            return "software"  # e.g. Xid 13/31/43: the application, not the node
        if ev.kind == common_pb2.EVIDENCE_KIND_NETWORK:
            return "network"
        name = KIND_NAMES.get(ev.kind)
        if name is not None:
            return f"hardware:{name}"
    return "hardware:unknown"


def _fixed(cause: str) -> Callable[[events_pb2.AttributionDetail], str]:
    return lambda _attr: cause


# The one table: blame method -> how its cause is found.
CAUSE_BY_METHOD: dict[int, Callable[[events_pb2.AttributionDetail], str]] = {
    B.BLAME_METHOD_NONE: _fixed("software"),
    B.BLAME_METHOD_HARDWARE: _from_evidence,
    B.BLAME_METHOD_FLIGHT_RECORDER: _fixed("hardware:flight_recorder"),
    B.BLAME_METHOD_HEARTBEAT: _fixed("hardware:heartbeat"),
    B.BLAME_METHOD_STRAGGLER: _fixed("hardware:straggler"),
    B.BLAME_METHOD_FIRST_EXIT: _fixed(FIRST_EXIT),
}


def blame_method_of(attr: events_pb2.AttributionDetail) -> int:
    """The attribution's blame method; for an old log line, its deprecated string mapped onto the enum.

    An old string that names no method gives UNSPECIFIED, which has no cause in the table.
    """
    if attr.blame_method != B.BLAME_METHOD_UNSPECIFIED:
        return int(attr.blame_method)
    return METHOD_BY_NAME.get(attr.method, B.BLAME_METHOD_UNSPECIFIED)  # deprecated: old logs only


def cause_from_attribution(attr: events_pb2.AttributionDetail) -> str:
    """The lost-time cause an attribution names.

    NONE: ``software``. HARDWARE: from the strongest suspect's evidence, ``hardware:<kind>``
    (``runwarden.evidence.KIND_NAMES``), ``software`` for an application-severity Xid, ``network`` for
    network evidence, ``hardware:unknown`` when no evidence names a kind. FLIGHT_RECORDER, HEARTBEAT,
    STRAGGLER: ``hardware:<method>``. FIRST_EXIT: ``unattributed:first_exit`` (the first node to exit
    is not a claim that its hardware failed).
    """
    rule = CAUSE_BY_METHOD.get(blame_method_of(attr))
    return rule(attr) if rule is not None else UNKNOWN_METHOD
