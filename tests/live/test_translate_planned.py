"""What agents write becomes the core's planned-stop events: a node record that says DRAINING is
`NodeDraining` (and its end one with no reason), an exit record with `planned_stop` is an exit the
core treats as a planned stop; a StoreListed carries the drains it lists. Reasons from outside are
bounded to one printable line."""

from __future__ import annotations

from controller.live.translate import Listing, Translator
from controller.supervisor.events import AttemptExited, CheckpointCommitted, NodeDraining, NodeJoined
from runwarden import __version__
from runwarden.keys import KeySchema
from runwarden.store import EventType, KeyValue, WatchEvent
from runwarden.v1 import common_pb2, store_pb2

KEYS = KeySchema()
RUN = "live"


def _put(key: str, value: bytes) -> WatchEvent:
    return WatchEvent(type=EventType.PUT, key=key, value=value, mod_revision=1, create_revision=1)


def _record(node: str, state: int, reason: str = "") -> WatchEvent:
    rec = store_pb2.NodeRecord(
        node=node, address="10.0.0.1:50051", state=state, drain_reason=reason, agent_version=__version__
    )
    return _put(KEYS.node(node), rec.SerializeToString())


def test_a_record_that_turns_draining_is_one_drain_event_and_its_end_another() -> None:
    tr = Translator(KEYS, RUN)
    events, _ = tr.watch_event(_record("n1", common_pb2.NODE_STATE_READY))
    assert [type(e) for e in events] == [NodeJoined]
    events, _ = tr.watch_event(_record("n1", common_pb2.NODE_STATE_DRAINING, "agent stopping (SIGTERM)"))
    assert events == [NodeDraining(node="n1", reason="agent stopping (SIGTERM)")]
    events, _ = tr.watch_event(_record("n1", common_pb2.NODE_STATE_DRAINING, "agent stopping (SIGTERM)"))
    assert events == [], "a re-put of the same drain is not a new one"
    events, _ = tr.watch_event(_record("n1", common_pb2.NODE_STATE_RUNNING))
    assert events == [NodeDraining(node="n1", reason="")]


def test_a_drain_reason_from_outside_is_one_bounded_printable_line() -> None:
    tr = Translator(KEYS, RUN)
    events, _ = tr.watch_event(
        _record("n2", common_pb2.NODE_STATE_DRAINING, "bad\x1b[31m\nreason" + "x" * 900)
    )
    drain = next(e for e in events if isinstance(e, NodeDraining))
    assert drain.reason.startswith("bad [31m reason") and len(drain.reason) == 500
    events, _ = tr.watch_event(_record("n3", common_pb2.NODE_STATE_DRAINING, ""))
    assert next(e for e in events if isinstance(e, NodeDraining)).reason == "draining (no reason given)"


def test_an_exit_on_a_stop_request_carries_its_reason_to_the_core() -> None:
    tr = Translator(KEYS, RUN)
    tr.new_attempt(3)
    prog = store_pb2.NodeProgress(
        node="n1",
        run=RUN,
        attempt=3,
        exit=common_pb2.ExitStatus(exit_code=0, ended_at=5.0, planned_stop="stop file /run/stop"),
    )
    events, _ = tr.watch_event(_put(KEYS.progress(RUN, "n1"), prog.SerializeToString()))
    exits = [e for e in events if isinstance(e, AttemptExited)]
    assert exits and exits[0].exit_code == 0 and exits[0].planned_stop == "stop file /run/stop"


def test_a_snapshot_lists_the_nodes_that_drain() -> None:
    tr = Translator(KEYS, RUN)
    nodes = [
        KeyValue(
            key=KEYS.node(n),
            value=store_pb2.NodeRecord(
                node=n, address="a:1", state=state, drain_reason=why, agent_version=__version__
            ).SerializeToString(),
            mod_revision=1,
            create_revision=1,
        )
        for n, state, why in (
            ("n1", common_pb2.NODE_STATE_READY, ""),
            ("n2", common_pb2.NODE_STATE_DRAINING, "maintenance"),
        )
    ]
    snap, _, _, _ = tr.snapshot(
        Listing(
            nodes=tuple(nodes),
            pool=(),
            reputation=(),
            attempt=None,
            checkpoints=(),
            stop=None,
            progress=(),
            now=0.0,
        )
    )
    assert snap.draining == {"n2": "maintenance"}
    assert set(snap.alive) == {"n1", "n2"}


def test_a_commit_reported_by_any_rank_is_one_commit_event() -> None:
    """Rank 0 reports a commit as it writes it; the other ranks once they see its marker, so a
    commit still reaches the core when rank 0's host cannot report (its agent lost)."""
    tr = Translator(KEYS, RUN)
    tr.new_attempt(2)

    def report(node: str, rank: int, committed: int) -> list[object]:
        prog = store_pb2.NodeProgress(
            node=node,
            run=RUN,
            attempt=2,
            ranks=[common_pb2.RankProgress(rank=rank, step=committed + 3, committed_step=committed)],
        )
        events, _ = tr.watch_event(_put(KEYS.progress(RUN, node), prog.SerializeToString()))
        return [e for e in events if isinstance(e, CheckpointCommitted)]

    assert report("n2", 1, 70) == [CheckpointCommitted(step=70, attempt=2)]  # rank 0's host silent
    assert report("n3", 2, 70) == [], "the same commit from another rank is not a new one"
    assert report("n1", 0, 60) == [], "an older commit reported late changes nothing"
    assert report("n1", 0, 80) == [CheckpointCommitted(step=80, attempt=2)]


def test_an_attempt_older_than_the_current_one_counts_as_exited_everywhere() -> None:
    """A planned stop's wait for a node's exit ends once a later attempt begins, although the
    later attempt forgets the older exits (else the wait runs on to its grace, holding a thread)."""
    tr = Translator(KEYS, RUN)
    tr.new_attempt(2)
    assert not tr.has_exited("n1", 2)
    tr.mark_exited("n1", 2)
    assert tr.has_exited("n1", 2) and not tr.has_exited("n2", 2)
    tr.new_attempt(3)
    assert tr.has_exited("n1", 2) and tr.has_exited("n2", 2) and not tr.has_exited("n1", 3)
