"""Leader election the etcd way: each contender puts one key under the election prefix, under its own
lease; the key with the lowest create revision is the leader, and that create revision is the fencing
token. A contender waits only for the key just ahead of it to go (no thundering herd).

The leader's key exists exactly as long as its lease: when the leader dies or stalls past its TTL the
key is deleted and the next contender wins. ``Store.fenced_put`` compares the leader key's create
revision with the fence inside the write's transaction, so a stale leader's write is refused even if
it has not noticed yet.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from runwarden.keys import KeySchema
from runwarden.store.lease import LeaseKeeper
from runwarden.store.types import (
    CampaignTimeout,
    EventType,
    KeyValue,
    Lease,
    Relisted,
    StoreError,
    WatchEvent,
)
from runwarden.store.watch import Watch, WatchCallback

_log = logging.getLogger(__name__)

_POLL_S = 0.05


class ElectionStore(Protocol):
    """What an election needs of its store (``runwarden.store.Store`` is one)."""

    @property
    def keys(self) -> KeySchema: ...

    def get(self, key: str) -> KeyValue | None: ...

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]: ...

    def cas(
        self, key: str, value: bytes, expected_mod_revision: int, lease: Lease | int | None = None
    ) -> bool: ...

    def grant_lease(self, ttl_s: float) -> Lease: ...

    def revoke(self, lease: Lease | int) -> None: ...

    def keep_alive(self, lease: Lease, on_lost: Callable[[], None] | None = None) -> LeaseKeeper: ...

    def watch_prefix(self, prefix: str, start_revision: int | None, callback: WatchCallback) -> Watch: ...


class Leadership:
    """Won leadership. ``lost`` is set when the key or lease is gone, a fenced write is refused, or
    on ``resign()``; from then on this holder must stop acting as leader."""

    def __init__(
        self,
        store: ElectionStore,
        *,
        name: str,
        key: str,
        value: bytes,
        fence: int,
        lease: Lease,
        keeper: LeaseKeeper,
        lost: threading.Event,
    ) -> None:
        self.name = name
        self.key = key
        self.value = value
        self.fence = fence
        self.lease = lease
        self.lost = lost
        self.reason = ""
        self._store = store
        self._keeper = keeper
        self._watch: Watch | None = None

    def start_watching(self) -> None:
        def on_change(item: WatchEvent | Relisted) -> None:
            if isinstance(item, Relisted):
                if not any(kv.key == self.key and kv.create_revision == self.fence for kv in item.kvs):
                    self.mark_lost("leader key gone (seen on relist)")
            elif item.key == self.key and (
                item.type is EventType.DELETE or item.create_revision != self.fence
            ):
                self.mark_lost("leader key deleted")

        self._watch = self._store.watch_prefix(self.key, self.fence + 1, on_change)

    def may_expire_at(self) -> float:
        """The monotonic time from which etcd may have expired this leadership's lease (and another
        contender may lead): the last confirmed refresh's send time + TTL."""
        return self._keeper.confirmed_at + self.lease.ttl_s

    def certain_for(self) -> float:
        """Seconds this leadership is certainly still held (its lease's `certain_for`; 0 once lost)."""
        return 0.0 if self.lost.is_set() else self._keeper.certain_for()

    def mark_lost(self, reason: str) -> None:
        if not self.lost.is_set():
            self.reason = reason
            _log.warning("leadership of %r (fence %d) lost: %s", self.name, self.fence, reason)
            self.lost.set()

    def resign(self) -> None:
        """Give up leadership: delete the key (by revoking the lease) and stop the background work."""
        self.mark_lost("resigned")
        if self._watch is not None:
            self._watch.cancel()
        self._keeper.stop()
        with contextlib.suppress(StoreError):
            self._store.revoke(self.lease)


def campaign(store: ElectionStore, name: str, value: bytes, ttl_s: float, timeout_s: float) -> Leadership:
    prefix = store.keys.election(name)
    deadline = time.monotonic() + timeout_s
    lease = store.grant_lease(ttl_s)
    lost = threading.Event()
    keeper = store.keep_alive(lease, on_lost=lost.set)
    key = f"{prefix}{lease.id:016x}"
    try:
        if not store.cas(key, value, 0, lease=lease):
            raise StoreError(f"election {name!r}: contender key {key} already exists")
        mine = store.get(key)
        if mine is None:
            raise StoreError(f"election {name!r}: contender key vanished right after it was created")
        _wait_for_turn(store, name, prefix, mine, lost, deadline)
    except BaseException:
        keeper.stop()
        with contextlib.suppress(StoreError):
            store.revoke(lease)
        raise
    leadership = Leadership(
        store,
        name=name,
        key=key,
        value=value,
        fence=mine.create_revision,
        lease=lease,
        keeper=keeper,
        lost=lost,
    )
    leadership.start_watching()
    return leadership


def _wait_for_turn(
    store: ElectionStore, name: str, prefix: str, mine: KeyValue, lost: threading.Event, deadline: float
) -> None:
    """Return once ``mine`` has the lowest create revision under ``prefix``."""
    while True:
        if lost.is_set():
            raise StoreError(f"election {name!r}: contender lease lost while waiting to lead")
        kvs, revision = store.get_prefix(prefix)
        if not any(kv.key == mine.key for kv in kvs):
            raise StoreError(f"election {name!r}: contender key {mine.key} disappeared while waiting")
        ahead = [kv for kv in kvs if kv.create_revision < mine.create_revision]
        if not ahead:
            return
        predecessor = max(ahead, key=lambda kv: kv.create_revision)
        gone, watch = _watch_for_delete(store, predecessor.key, revision + 1)
        try:
            while not gone.wait(_POLL_S):
                if lost.is_set():
                    break
                if time.monotonic() > deadline:
                    raise CampaignTimeout(
                        f"election {name!r}: not leader within the timeout ({predecessor.key} leads)"
                    )
        finally:
            watch.cancel()


def _watch_for_delete(store: ElectionStore, key: str, start_revision: int) -> tuple[threading.Event, Watch]:
    """An Event set when ``key`` is deleted (or a relist means it must be looked up again)."""
    gone = threading.Event()

    def on_change(item: WatchEvent | Relisted) -> None:
        if isinstance(item, Relisted) or item.type is EventType.DELETE:
            gone.set()

    return gone, store.watch_prefix(key, start_revision, on_change)
