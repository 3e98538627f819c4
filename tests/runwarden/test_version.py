"""runwarden.version: the skew rule between an agent's version and the controller's, and the live
controller's translator applying it to node records (a watch event and a relist)."""

from __future__ import annotations

import logging

import pytest

from controller.live.translate import Listing, Translator
from controller.supervisor.events import NodeDraining, NodeJoined
from runwarden import __version__
from runwarden.keys import KeySchema
from runwarden.store import EventType, KeyValue, WatchEvent
from runwarden.v1 import store_pb2
from runwarden.version import agent_skew, parse

KEYS = KeySchema()


def test_versions_are_read_as_three_numbers() -> None:
    assert parse("0.1.0") == (0, 1, 0)
    assert parse("1.12.3.dev4+g1234") == (1, 12, 3)
    assert parse("") is None and parse("latest") is None and parse("1.2") is None
    assert parse(__version__) is not None


@pytest.mark.parametrize(
    ("agent", "controller", "why"),
    [
        ("0.4.2", "0.4.0", ""),  # same minor, any patch
        ("0.3.9", "0.4.0", ""),  # one minor older
        ("0.2.0", "0.4.0", "more than one minor version older than controller 0.4.0: upgrade the agent"),
        ("0.5.0", "0.4.0", "newer than controller 0.4.0: upgrade the controller first"),
        ("1.4.0", "0.4.0", "different major versions"),
        ("", "0.4.0", "reports no version"),
        ("0.4.0", "dev", "is not a version"),
    ],
)
def test_an_agent_may_be_the_controllers_version_or_one_minor_older(
    agent: str, controller: str, why: str
) -> None:
    found = agent_skew(agent, controller)
    assert (found == "") if not why else (why in found)


def _record(node: str, version: str) -> bytes:
    return store_pb2.NodeRecord(
        node=node, address="10.0.0.1:50051", agent_version=version
    ).SerializeToString()


def put(node: str, version: str) -> WatchEvent:
    return WatchEvent(
        type=EventType.PUT,
        key=KEYS.node(node),
        value=_record(node, version),
        mod_revision=1,
        create_revision=1,
    )


def test_an_agent_outside_the_rule_drains_never_lost_and_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A node this controller does not drive stays alive, so it is never seen as lost (a strike): it
    drains for its version (no placement; an attempt it runs in stops as planned, a spare replaces it)."""
    tr = Translator(KEYS, "r", controller_version="0.4.0")
    why = "agent 0.2.7 is more than one minor version older than controller 0.4.0: upgrade the agent"
    with caplog.at_level(logging.ERROR, logger="controller.live.translate"):
        assert [type(e) for e in tr.watch_event(put("old", "0.3.1"))[0]] == [NodeJoined]
        events, addresses = tr.watch_event(put("older", "0.2.7"))
        assert events == [
            NodeJoined(node="older", local_ranks=1),
            NodeDraining(node="older", reason=f"version: {why}"),
        ]
        assert addresses.set == {"older": ("10.0.0.1:50051", 0)}
        assert tr.watch_event(put("older", "0.2.7"))[0] == []
        # an agent of the running attempt that a controller two minors ahead meets: no NodeLost
        events, _ = tr.watch_event(put("old", "0.2.9"))
        assert [type(e) for e in events] == [NodeDraining] and "0.2.9" in events[0].reason
    errors = [r.getMessage() for r in caplog.records]
    assert errors == [
        f"node older is left out: {why}",
        "node old is left out: agent 0.2.9 is more than one minor version older than controller 0.4.0: "
        "upgrade the agent",
    ]
    # a relist sees it alive and draining; once upgraded, its drain ends
    listing = Listing(
        nodes=tuple(
            KeyValue(key=KEYS.node(n), value=_record(n, v), mod_revision=1, create_revision=1)
            for n, v in (("old", "0.3.1"), ("older", "0.2.7"))
        ),
        pool=(),
        reputation=(),
        attempt=None,
        checkpoints=(),
        stop=None,
        progress=(),
        now=0.0,
    )
    listed, addresses, _, _ = tr.snapshot(listing)
    assert set(addresses.set) == {"old", "older"} and set(listed.alive) == {"old", "older"}
    assert listed.draining == {"older": f"version: {why}"}
    assert tr.watch_event(put("older", "0.4.0"))[0] == [NodeDraining(node="older", reason="")]
    assert tr.left_out == {}
