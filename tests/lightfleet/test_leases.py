"""Leases: 64 agents of one process keep their leases over several TTLs on one keepalive stream; a
lease-loss fault makes exactly that node's key vanish within TTL + 1 s; a returning node comes back
under a new lease."""

from __future__ import annotations

import threading
import time

from lightfleet.settings import AgentSettings
from runwarden.store import EventType, Store, WatchEvent
from runwarden.v1 import store_pb2
from testbed.wait import wait_until

TTL_S = 3.0


def test_64_agents_keep_their_leases_and_a_lease_loss_takes_exactly_its_key(hosted, store: Store) -> None:
    h = hosted(64, AgentSettings(lease_ttl_s=TTL_S))
    keys = store.keys
    kvs, revision = store.get_prefix(keys.nodes_prefix())
    assert len(kvs) == 64 and len({kv.lease for kv in kvs}) == 64
    changes: list[tuple[float, WatchEvent]] = []
    lock = threading.Lock()

    def on_change(item: object) -> None:
        assert isinstance(item, WatchEvent)
        with lock:
            changes.append((time.monotonic(), item))

    watch = store.watch_prefix(keys.nodes_prefix(), revision + 1, on_change)
    held_from = time.monotonic()
    # over three and a half TTLs: no key vanishes (the keepalives go every TTL/3 on one stream)
    wait_until(lambda: time.monotonic() - held_from > 3.5 * TTL_S, 5 * TTL_S, "3.5 TTLs", interval_s=0.2)
    with lock:
        assert [c for _, c in changes if c.type is EventType.DELETE] == []
    assert len(store.get_prefix(keys.nodes_prefix())[0]) == 64
    stats = h.process.stats()
    assert stats["leases"] == 64 and stats["refreshes"] >= 64 * 3 and stats["threads"] < 40

    dark_at = time.monotonic()
    h.inject("lease-loss n17")
    deleted = wait_until(
        lambda: [(t, c.key) for t, c in list(changes) if c.type is EventType.DELETE],
        TTL_S + 2,
        "n17's key to vanish",
    )
    assert [key for _, key in deleted] == [keys.node("n17")]
    assert deleted[0][0] - dark_at <= TTL_S + 1.0
    assert len(store.get_prefix(keys.nodes_prefix())[0]) == 63  # nothing else went with it

    # revoked at once, and back after 1 s under a new lease: the controller sees it leave and return
    old_lease = store.get(keys.node("n40"))
    assert old_lease is not None
    h.inject("lease-loss n40 revoke return 1")
    back = wait_until(
        lambda: (kv := store.get(keys.node("n40"))) is not None and kv.lease != old_lease.lease and kv,
        10,
        "n40 back under a new lease",
    )
    assert store_pb2.NodeRecord.FromString(back.value).lease_id == back.lease

    def n40_seen() -> list[EventType]:
        with lock:
            return [c.type for _, c in changes if c.key == keys.node("n40")]

    # the watch delivers after etcd answered the read above: wait for it to have seen the return too
    n40 = wait_until(
        lambda: len(seen := n40_seen()) >= 2 and seen, 10, "the watch to see n40 leave and return"
    )
    assert n40[:2] == [EventType.DELETE, EventType.PUT]
    watch.cancel()
