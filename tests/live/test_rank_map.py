"""Rank -> node for blame is what torch assigned, not the node rank the controller asked for.

c10d ranks the nodes at the rendezvous: global rank 0 may land on any node. The translator maps each
rank to the node whose agent carried its progress report (with the RANK the rank itself read), so a
flight-recorder verdict about rank 0 blames the node rank 0 actually ran on."""

from __future__ import annotations

from controller.live.translate import Listing, Translator
from controller.supervisor import flight_recorder
from runwarden import __version__
from runwarden.keys import KeySchema
from runwarden.store import EventType, KeyValue, WatchEvent
from runwarden.v1 import agent_pb2, common_pb2, store_pb2

KEYS = KeySchema()
RUN = "live"


def progress(node: str, attempt: int, ranks: list[int]) -> store_pb2.NodeProgress:
    return store_pb2.NodeProgress(
        node=node,
        run=RUN,
        attempt=attempt,
        ranks=[
            common_pb2.RankProgress(rank=r, local_rank=i, step=5, world_size=4) for i, r in enumerate(ranks)
        ],
    )


def put(prog: store_pb2.NodeProgress) -> WatchEvent:
    return WatchEvent(
        type=EventType.PUT,
        key=KEYS.progress(RUN, prog.node),
        value=prog.SerializeToString(),
        mod_revision=1,
        create_revision=1,
    )


def test_ranks_map_to_the_node_torch_placed_them_on():
    tr = Translator(KEYS, RUN)
    tr.new_attempt(2)
    # The controller asked for node rank 0 = "a", node rank 1 = "b"; c10d made "b" hold ranks 0-1.
    tr.watch_event(put(progress("a", 2, [2, 3])))
    tr.watch_event(put(progress("b", 2, [0, 1])))
    assert tr.ranks() == {0: "b", 1: "b", 2: "a", 3: "a"}

    # Rank 0 is stopped (no dump, /proc "T"): the verdict names the node it really ran on.
    dumps = [agent_pb2.RankDump(rank=0, ok=False, error="timed out", process_state="T")]
    verdict = flight_recorder.verdict_from_rank_dumps(dumps, tr.ranks())
    assert verdict.suspects and verdict.suspects[0].node == "b" and 0 in verdict.suspects[0].ranks


def test_a_new_attempt_forgets_the_old_placement_and_late_writes_of_it_change_nothing():
    tr = Translator(KEYS, RUN)
    tr.new_attempt(1)
    tr.watch_event(put(progress("a", 1, [0])))
    tr.watch_event(put(progress("b", 1, [1])))
    tr.new_attempt(2)
    assert tr.ranks() == {}
    tr.watch_event(put(progress("b", 2, [0])))
    tr.watch_event(put(progress("a", 1, [0])))  # a late write of attempt 1
    assert tr.ranks() == {0: "b"}


def test_a_relist_maps_the_current_attempts_ranks_from_the_stored_progress():
    tr = Translator(KEYS, RUN)
    attempt = store_pb2.AttemptRecord(run=RUN, attempt=4, nodes=["a", "b"])

    def kv(key: str, msg) -> KeyValue:
        return KeyValue(key=key, value=msg.SerializeToString(), mod_revision=1, create_revision=1, lease=0)

    listing = Listing(
        nodes=(),
        pool=(),
        reputation=(),
        attempt=kv(KEYS.attempt(RUN), attempt),
        checkpoints=(),
        stop=None,
        progress=(
            kv(KEYS.progress(RUN, "a"), progress("a", 4, [1])),
            kv(KEYS.progress(RUN, "b"), progress("b", 4, [0])),
            kv(KEYS.progress(RUN, "c"), progress("c", 3, [0])),  # an earlier attempt's record
        ),
        now=0.0,
    )
    _, _, follow, _ = tr.snapshot(listing)
    assert tr.ranks() == {0: "b", 1: "a"}
    # where the current attempt's ranks stand follows the snapshot (an attempt hung before this
    # leader watched writes no later progress); an earlier attempt's record is not fed
    assert [(type(e).__name__, e.node, e.attempt, [r.step for r in e.ranks]) for e in follow] == [
        ("ProgressObserved", "a", 4, [5]),
        ("ProgressObserved", "b", 4, [5]),
    ]


def test_the_rendezvous_comes_from_the_node_record():
    tr = Translator(KEYS, RUN)
    rec = store_pb2.NodeRecord(
        node="a",
        address="10.0.0.11:50051",
        torch_host="10.0.0.11",
        rdzv_port=29411,
        agent_version=__version__,
    )
    old = store_pb2.NodeRecord(node="b", address="10.0.0.12:50051", agent_version=__version__)  # reports none
    for r in (rec, old):
        tr.watch_event(
            WatchEvent(
                type=EventType.PUT,
                key=KEYS.node(r.node),
                value=r.SerializeToString(),
                mod_revision=1,
                create_revision=1,
            )
        )
    got = tr.rendezvous("a")
    assert got is not None and got.endpoint == "10.0.0.11:29411"
    assert tr.rendezvous("b") is None and tr.rendezvous("nobody") is None
