"""Leases against a real etcd: kept alive past several TTLs, and a dead keeper's key deleted in time."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable

import pytest

from runwarden.store import EventType, Relisted, Store, WatchEvent
from testbed.etcd_server import EtcdServer
from testbed.wait import wait_until
from tests.store.helpers import Peer

TTL_S = 2
# etcd checks lease expiry every 500 ms, so a DELETE comes up to TTL + 0.5 s after the last refresh,
# which happened before the kill; 0.1 s more covers raft commit and watch delivery.
DELETE_BOUND_S = TTL_S + 0.6


@pytest.mark.slow
def test_kept_alive_lease_outlives_several_ttls_and_dies_with_its_keeper(
    etcd: EtcdServer, store: Store, spawn_peer: Callable[..., Peer]
) -> None:
    key = store.keys.node("n1")
    deletes: list[tuple[float, WatchEvent]] = []
    others: list[WatchEvent | Relisted] = []

    def on_change(item: WatchEvent | Relisted) -> None:
        if isinstance(item, WatchEvent) and item.type is EventType.DELETE:
            deletes.append((time.monotonic(), item))
        else:
            others.append(item)

    watch = store.watch_prefix(store.keys.nodes_prefix(), None, on_change)
    keeper = spawn_peer("keeper", etcd.endpoint, key, str(TTL_S))
    keeper.expect("READY", timeout_s=20)

    time.sleep(3 * TTL_S + 0.5)  # the span under test (the key outlives 3 TTLs), not a wait for an event
    kv = store.get(key)
    assert kv is not None and kv.value == b"alive", "the kept-alive key vanished within 3 TTLs"
    assert not deletes
    assert store.lease_ttl(kv.lease) > 0

    killed_at = keeper.signal(signal.SIGKILL)
    wait_until(lambda: bool(deletes), timeout_s=TTL_S + 5, what="the DELETE of the dead keeper's key")
    delay = deletes[0][0] - killed_at
    print(f"DELETE seen {delay:.3f} s after SIGKILL of the keeper (TTL {TTL_S} s, bound {DELETE_BOUND_S} s)")
    assert deletes[0][1].key == key
    assert delay <= DELETE_BOUND_S
    assert store.get(key) is None
    watch.cancel()


def test_keeper_reports_revoked_lease_as_lost(store: Store) -> None:
    lease = store.grant_lease(1)
    called = threading.Event()
    keeper = store.keep_alive(lease, on_lost=called.set)
    wait_until(lambda: keeper.refreshes >= 1, 5, "the keeper's first keepalive answer")
    assert not keeper.lost.is_set()
    store.revoke(lease)
    assert called.wait(3.0), "on_lost was not called after the lease was revoked"
    assert keeper.lost.is_set()
    assert "TTL 0" in keeper.reason
    assert not keeper.running


def test_keeper_reports_loss_when_etcd_stays_silent_past_the_ttl(etcd: EtcdServer, store: Store) -> None:
    lease = store.grant_lease(1)
    keeper = store.keep_alive(lease)
    wait_until(lambda: keeper.refreshes >= 1, 5, "the keeper's first keepalive answer")
    etcd.kill()
    started = time.monotonic()
    assert keeper.lost.wait(5.0), "the keeper did not notice that etcd stopped answering"
    assert time.monotonic() - started < 1 + 2.0
    assert "no keepalive answer" in keeper.reason
