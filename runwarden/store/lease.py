"""Lease keepalive: a thread that refreshes one lease every TTL/3 and says when it is lost.

etcd does not raise when a dead lease is refreshed: it answers TTL 0. So loss is either that answer,
or no successful refresh for a whole TTL (etcd has certainly expired the lease by then, unless it
restarted meanwhile and reset the countdown; we still call it lost, and the owner takes a new lease).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from runwarden.store.config import StoreConfig
from runwarden.store.types import Lease

_log = logging.getLogger(__name__)

# After a failed refresh, try again this soon (the server may be back in well under TTL/3).
_RETRY_S = 0.2


class LeaseStore(Protocol):
    """What a keeper needs of its store (``runwarden.store.Store`` is one)."""

    @property
    def config(self) -> StoreConfig: ...

    def refresh_lease(self, lease: Lease, timeout_s: float | None = None) -> int: ...

    def untrack(self, item: LeaseKeeper) -> None: ...


class LeaseKeeper:
    """Keeps one lease alive; see ``Store.keep_alive``. ``stop()`` does not revoke the lease."""

    def __init__(self, store: LeaseStore, lease: Lease, on_lost: Callable[[], None] | None) -> None:
        self.lease = lease
        self.lost = threading.Event()
        self.reason = ""
        self.refreshes = 0
        self.expired = False  # etcd itself answered that the lease is gone (not just silence)
        # When a refresh that succeeded was *sent*: etcd restarted the countdown no earlier than that,
        # so the lease is certainly alive until confirmed_at + TTL (the grant counts as one).
        self.confirmed_at = time.monotonic()
        self._store = store
        self._on_lost = on_lost
        self._stop = threading.Event()
        self._interval = max(lease.ttl_s / 3.0, 0.1)
        self._thread = threading.Thread(target=self._run, name=f"lease-keeper-{lease.id:x}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop refreshing (the lease then expires after its TTL unless revoked)."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=self._store.config.timeout_s + 1)
        self._store.untrack(self)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def certain_for(self) -> float:
        """Seconds the lease is certainly still alive on etcd (<= 0: it may have expired already).

        A holder that acts on the lease's behalf (a leader appending, launching, stopping) must stop
        before this reaches 0: past it another contender may hold the key."""
        if self.lost.is_set():
            return 0.0
        return self.confirmed_at + self.lease.ttl_s - time.monotonic()

    def _run(self) -> None:
        last_ok = time.monotonic()
        wait = self._interval
        while not self._stop.wait(wait):
            sent = time.monotonic()
            try:
                ttl = self._store.refresh_lease(self.lease, timeout_s=self._interval)
            except Exception as err:  # StoreError, or a bug: either way no refresh happened
                silent_for = time.monotonic() - last_ok
                if silent_for > self.lease.ttl_s:
                    self._lose(
                        f"no keepalive answer for {silent_for:.1f} s (TTL {self.lease.ttl_s} s): {err}"
                    )
                    return
                _log.debug("keepalive of lease %x failed, retrying: %s", self.lease.id, err)
                wait = _RETRY_S
                continue
            if ttl <= 0:
                self.expired = True
                self._lose("etcd reports the lease expired or revoked (TTL 0 on refresh)")
                return
            self.refreshes += 1
            self.confirmed_at = sent
            last_ok = time.monotonic()
            wait = self._interval

    def _lose(self, reason: str) -> None:
        if self._stop.is_set():
            return
        self.reason = reason
        _log.warning("lease %x lost: %s", self.lease.id, reason)
        self.lost.set()
        self._store.untrack(self)
        if self._on_lost is not None:
            try:
                self._on_lost()
            except Exception:
                _log.exception("on_lost callback of lease %x failed", self.lease.id)
