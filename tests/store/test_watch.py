"""Prefix watches against a real etcd: resume across an etcd crash, relist after compaction."""

from __future__ import annotations

import threading
import time

from runwarden.store import EventType, Relisted, Store, StoreConfig, StoreUnavailable, WatchEvent
from testbed.etcd_server import EtcdServer
from testbed.wait import wait_until


def _history(etcd: EtcdServer, prefix: str, last_revision: int) -> list[WatchEvent]:
    """Every event under ``prefix`` from revision 1, read by a fresh client on one stream."""
    events: list[WatchEvent | Relisted] = []
    with Store.connect(StoreConfig(endpoints=(etcd.endpoint,))) as reader:
        watch = reader.watch_prefix(prefix, 1, events.append)
        wait_until(lambda: watch.next_revision > last_revision, 10, "the history watch to catch up")
        watch.cancel()
    assert all(isinstance(e, WatchEvent) for e in events)
    return [e for e in events if isinstance(e, WatchEvent)]


def test_watch_delivers_puts_before_during_and_after_etcd_restarts_exactly_once(
    etcd: EtcdServer, store: Store
) -> None:
    prefix = store.keys.progress_prefix("run1")
    delivered: list[WatchEvent] = []

    def on_change(item: WatchEvent | Relisted) -> None:
        assert isinstance(item, WatchEvent), "no relist expected: nothing was compacted"
        delivered.append(item)

    watch = store.watch_prefix(prefix, None, on_change)
    written: list[tuple[str, bytes, int]] = []

    def put(label: str, i: int) -> None:
        key, value = store.keys.progress("run1", f"n{i % 3}"), f"{label}-{i}".encode()
        written.append((key, value, store.put(key, value)))

    for i in range(5):
        put("before", i)
    wait_until(lambda: len(delivered) == 5, 5, "the first puts to be delivered")

    during_unseen = 0
    for cycle in range(2):
        etcd.kill()
        etcd.start()  # same data dir, same ports
        # The watcher is still backing off from the crash: these land while it is disconnected.
        disconnected = not watch.established.is_set()
        for i in range(5):
            put(f"during{cycle}", i)
        during_unseen += disconnected and not watch.established.is_set()
        resumed = cycle + 1
        wait_until(lambda: watch.resumes >= resumed, 10, "the watch to resume")  # noqa: B023 - used at once
        for i in range(5):
            put(f"after{cycle}", i)

    # a last put: one stream delivers in revision order, so a duplicate of an earlier one comes before it
    put("end", 0)
    last = written[-1][2]
    wait_until(lambda: bool(delivered) and delivered[-1].mod_revision >= last, 10, "all puts to be delivered")
    watch.cancel()

    print(
        f"{len(written)} puts over 2 etcd crashes; {during_unseen} of 2 'during' batches written while the "
        f"watch was down; resumes={watch.resumes}"
    )
    assert [(e.key, e.value, e.mod_revision) for e in delivered] == written
    assert all(e.type is EventType.PUT for e in delivered)
    assert delivered == _history(etcd, prefix, last)


def test_compacted_watch_relists_and_continues_without_losing_state(etcd: EtcdServer, store: Store) -> None:
    keys = store.keys
    prefix = keys.nodes_prefix()
    store.put(keys.node("c"), b"0")
    gate = threading.Event()
    received: list[WatchEvent | Relisted] = []

    def on_change(item: WatchEvent | Relisted) -> None:
        received.append(item)
        gate.wait(20)  # hold the watch thread so it cannot resume before the compaction

    watch = store.watch_prefix(prefix, None, on_change)
    store.put(keys.node("a"), b"1")
    wait_until(lambda: len(received) == 1, 5, "the first event")

    etcd.kill()
    etcd.start()
    store.put(keys.node("b"), b"1")
    store.delete(keys.node("c"))
    store.put(keys.node("a"), b"2")
    store.compact(store.revision())
    gate.set()

    wait_until(lambda: watch.relists == 1, 10, "the watch to relist")
    after = store.put(keys.node("d"), b"1")
    wait_until(
        lambda: isinstance(received[-1], WatchEvent) and received[-1].mod_revision == after,
        5,
        "the put after",
    )
    watch.cancel()

    view: dict[str, bytes] = {}
    for item in received:
        if isinstance(item, Relisted):
            view = {kv.key: kv.value for kv in item.kvs}
        elif item.type is EventType.PUT:
            view[item.key] = item.value
        else:
            view.pop(item.key, None)
    kvs, _ = store.get_prefix(prefix)
    assert view == {kv.key: kv.value for kv in kvs}
    assert view == {keys.node("a"): b"2", keys.node("b"): b"1", keys.node("d"): b"1"}
    relisted = [item for item in received if isinstance(item, Relisted)]
    assert len(relisted) == 1 and relisted[0].revision < after


def test_watch_from_a_compacted_revision_starts_with_a_relist(store: Store) -> None:
    key = store.keys.pool("n1")
    first = store.put(key, b"spare")
    store.put(key, b"active")
    store.compact(store.revision())
    received: list[WatchEvent | Relisted] = []
    watch = store.watch_prefix(store.keys.pool_prefix(), first, received.append)
    wait_until(lambda: len(received) >= 1, 5, "the relist")
    watch.cancel()
    assert isinstance(received[0], Relisted)
    assert [(kv.key, kv.value) for kv in received[0].kvs] == [(key, b"active")]


def test_write_while_etcd_is_down_raises_store_unavailable(etcd: EtcdServer) -> None:
    with Store.connect(StoreConfig(endpoints=(etcd.endpoint,), timeout_s=1.0)) as store:
        etcd.kill()
        started = time.monotonic()
        try:
            store.put(store.keys.stop("r"), b"x")
        except StoreUnavailable as err:
            assert "\n" not in str(err)
        else:
            raise AssertionError("put succeeded with etcd down")
        assert time.monotonic() - started < 3.0
        etcd.start()
        assert store.put(store.keys.stop("r"), b"x") > 0  # the same client recovers
