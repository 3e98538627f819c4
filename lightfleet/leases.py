"""Many leases kept alive over one LeaseKeepAlive stream: what etcd's own clients do.

`Store.keep_alive` runs a thread per lease and `Store.refresh_lease` opens a stream per refresh: right
for one agent, and what starved 2,048 impersonated agents on 2 cores (BENCHMARKS.md, etcd at fleet
scale). Here a process's leases share one persistent bidirectional stream over the store's own
connection: a sender thread refreshes each lease every TTL/3 (the real keeper's cadence), a reader
thread matches the answers. A lease is lost when etcd answers TTL 0 (expired or revoked) or, as the
real keeper decides, when no refresh was answered for a whole TTL; `on_lost(lease_id, reason)` is
called once, from a thread. A broken stream (etcd restarting) is reopened at once, then every 0.2 s.
"""

from __future__ import annotations

import heapq
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from runwarden.store import Lease, Store
from runwarden.store import (
    client as store_client,  # its etcd request types: runwarden.store stays the one etcd importer
)

log = logging.getLogger(__name__)
_REOPEN_S = 0.2
_END = object()


class LeaseStream:
    def __init__(self, store: Store, on_lost: Callable[[int, str], None]) -> None:
        self._store = store
        self._on_lost = on_lost
        self._lock = threading.Lock()
        self._leases: dict[int, Lease] = {}
        self._sent: dict[int, float] = {}  # lease -> monotonic time of its oldest unanswered refresh
        self._confirmed: dict[int, float] = {}  # lease -> when its last answered refresh was sent
        self._due: list[tuple[float, int]] = []  # (monotonic due time, lease id), a heap
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._call: Any = None
        self._threads: list[threading.Thread] = []
        self.refreshes = 0
        self.reopened = 0

    # --- the leases ------------------------------------------------------------------------------

    def add(self, lease: Lease) -> None:
        """Keep `lease` alive from now on (its grant counts as its first confirmation)."""
        now = time.monotonic()
        with self._lock:
            self._leases[lease.id] = lease
            self._confirmed[lease.id] = now
            heapq.heappush(self._due, (now + self._interval(lease), lease.id))
        self._wake.set()

    def discard(self, lease_id: int) -> None:
        """Stop refreshing it (it expires after its TTL unless revoked)."""
        with self._lock:
            self._leases.pop(lease_id, None)
            self._sent.pop(lease_id, None)
            self._confirmed.pop(lease_id, None)

    def confirmed_at(self, lease_id: int) -> float | None:
        with self._lock:
            return self._confirmed.get(lease_id)

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    @staticmethod
    def _interval(lease: Lease) -> float:
        return max(lease.ttl_s / 3.0, 0.1)

    # --- the threads -----------------------------------------------------------------------------

    def start(self) -> None:
        self._open()
        for target, name in ((self._send_loop, "lease-send"), (self._read_loop, "lease-read")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._closed.set()
        self._wake.set()
        self._requests.put(_END)
        call = self._call
        if call is not None:
            call.cancel()
        for t in self._threads:
            t.join(timeout=5)

    def _open(self) -> None:
        self._requests = queue.SimpleQueue()
        requests = self._requests

        def feed() -> Iterator[Any]:
            while (item := requests.get()) is not _END:
                yield item

        conn = self._store.conn
        self._call = conn.stub("Lease").LeaseKeepAlive(feed(), metadata=conn.metadata())
        with self._lock:
            self._sent.clear()  # refreshes on the old stream will never be answered

    def _send_loop(self) -> None:
        request = store_client.etcdrpc.LeaseKeepAliveRequest
        while not self._closed.is_set():
            now = time.monotonic()
            lost: list[tuple[int, str]] = []
            with self._lock:
                while self._due and self._due[0][0] <= now:
                    _, lease_id = heapq.heappop(self._due)
                    lease = self._leases.get(lease_id)
                    if lease is None:
                        continue
                    silent = now - self._confirmed[lease_id]
                    if silent > lease.ttl_s:  # the real keeper's rule: a whole TTL unanswered
                        lost.append(
                            (lease_id, f"no keepalive answer for {silent:.1f} s (TTL {lease.ttl_s} s)")
                        )
                        self._forget(lease_id)
                        continue
                    self._sent.setdefault(lease_id, now)
                    self._requests.put(request(ID=lease_id))
                    heapq.heappush(self._due, (now + self._interval(lease), lease_id))
                wait = self._due[0][0] - now if self._due else 1.0
            for lease_id, reason in lost:
                self._lose(lease_id, reason)
            self._wake.wait(max(0.0, min(wait, 1.0)))
            self._wake.clear()

    def _read_loop(self) -> None:
        while not self._closed.is_set():
            call = self._call
            try:
                for reply in call:
                    self._answer(int(reply.ID), int(reply.TTL))
            except Exception as exc:  # grpc.RpcError (etcd gone, cancelled) or a bug: reopen either way
                if self._closed.is_set():
                    return
                log.warning("lease keepalive stream broke (reopening): %s", str(exc).splitlines()[0][:200])
            if self._closed.is_set():
                return
            self._closed.wait(_REOPEN_S if self.reopened else 0.0)
            try:
                self._requests.put(_END)  # ends the old stream's feed
                self._open()
                self.reopened += 1
            except Exception as exc:  # the store is closed: nothing left to keep
                log.warning("cannot reopen the lease keepalive stream: %s", exc)
                self._closed.wait(_REOPEN_S)

    def _answer(self, lease_id: int, ttl: int) -> None:
        with self._lock:
            if lease_id not in self._leases:
                return
            if ttl <= 0:
                self._forget(lease_id)
                lost = True
            else:
                sent = self._sent.pop(lease_id, None)
                if sent is not None:
                    self._confirmed[lease_id] = sent
                self.refreshes += 1
                lost = False
        if lost:
            self._lose(lease_id, "etcd reports the lease expired or revoked (TTL 0 on refresh)")

    def _forget(self, lease_id: int) -> None:
        self._leases.pop(lease_id, None)
        self._sent.pop(lease_id, None)
        self._confirmed.pop(lease_id, None)

    def _lose(self, lease_id: int, reason: str) -> None:
        log.warning("lease %x lost: %s", lease_id, reason)
        try:
            self._on_lost(lease_id, reason)
        except Exception:
            log.exception("on_lost of lease %x failed", lease_id)
