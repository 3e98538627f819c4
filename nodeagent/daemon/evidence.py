"""Publishing evidence: each new piece goes to etcd at once, under keys.evidence(node, seq).

Monitors call `publish()` from their own threads; a single writer thread puts records in order
so a slow etcd never blocks a monitor. Sequence numbers start at the wall clock in microseconds,
so a restarted agent never overwrites its earlier records. A failed put is retried with backoff;
the queue is bounded (oldest dropped, logged) so a long etcd outage cannot exhaust memory.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

from nodeagent.daemon.metrics import AgentMetrics
from runwarden.v1 import common_pb2, store_pb2

log = logging.getLogger(__name__)


class EvidencePublisher:
    def __init__(
        self, *, store: Any, node: str, metrics: AgentMetrics, recent: int = 50, queue_max: int = 10_000
    ):
        self._store = store
        self._node = node
        self._metrics = metrics
        self._recent: deque[common_pb2.Evidence] = deque(maxlen=recent)
        self._queue: queue.Queue[tuple[int, common_pb2.Evidence] | None] = queue.Queue(maxsize=queue_max)
        self._seq = time.time_ns() // 1000
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._listeners: list[Any] = []

    def add_listener(self, fn: Any) -> None:
        """fn(evidence) runs in the publishing thread for every piece (e.g. node state updates)."""
        self._listeners.append(fn)

    def start(self) -> None:
        if self._store is not None:
            self._thread = threading.Thread(target=self._writer, name="evidence-writer", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)

    def publish(self, evidence: common_pb2.Evidence) -> int:
        if not evidence.node:
            evidence.node = self._node
        if not evidence.observed_at:
            evidence.observed_at = time.time()
        with self._lock:
            self._seq += 1
            seq = self._seq
            self._recent.append(evidence)
        self._metrics.evidence.labels(kind=common_pb2.EvidenceKind.Name(evidence.kind)).inc()
        log.warning("evidence %d: %s", seq, evidence.detail)
        for fn in self._listeners:
            try:
                fn(evidence)
            except Exception:
                log.exception("evidence listener failed")
        if self._thread is not None:
            try:
                self._queue.put_nowait((seq, evidence))
            except queue.Full:
                log.error("evidence queue full (etcd unreachable?): dropping seq %d", seq)
        return seq

    def recent(self) -> list[common_pb2.Evidence]:
        with self._lock:
            return list(self._recent)

    def _writer(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            seq, evidence = item
            value = store_pb2.EvidenceRecord(evidence=evidence).SerializeToString()
            delay = 0.1
            while True:
                try:
                    self._store.put(self._store.keys.evidence(self._node, seq), value)
                    break
                except Exception as exc:
                    log.warning("evidence %d not written yet: %s", seq, exc)
                    time.sleep(delay)
                    delay = min(delay * 2, 5.0)
