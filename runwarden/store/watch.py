"""A prefix watch that survives etcd restarts: no lost and no duplicated event.

The thread remembers the next revision it owes the callback (last delivered + 1). After any
disconnect it opens a new stream from exactly that revision and drops anything older (a resumed
stream never re-sends what was delivered). If that revision was compacted away the callback gets
``Relisted(kvs, revision)`` — the whole prefix at ``revision`` — and the watch goes on from
``revision + 1``. Progress notices move the revision forward, so an idle watch rarely needs a relist.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Protocol

from runwarden.store.config import StoreConfig
from runwarden.store.types import (
    KeyValue,
    Relisted,
    RevisionCompacted,
    StoreError,
    WatchBatch,
    WatchEvent,
)

_log = logging.getLogger(__name__)

WatchCallback = Callable[[WatchEvent | Relisted], None]

_FIRST_BACKOFF_S = 0.05
_MAX_BACKOFF_S = 1.0


class BatchStream(Protocol):
    """One raw watch stream from ``start_revision`` (the store's gRPC stream is one)."""

    def batches(self) -> Iterator[WatchBatch]:
        """Yield batches; raise StoreUnavailable on disconnect, RevisionCompacted, or StoreError."""
        ...

    def cancel(self) -> None: ...


class WatchStore(Protocol):
    """What a watch needs of its store (``runwarden.store.Store`` is one)."""

    @property
    def config(self) -> StoreConfig: ...

    def open_watch_stream(self, prefix: str, start_revision: int) -> BatchStream: ...

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]: ...

    def relogin_if_needed(self, err: StoreError) -> None: ...

    def untrack(self, item: Watch) -> None: ...


class Watch:
    """See ``Store.watch_prefix``. The callback runs on the watch's own thread, one item at a time."""

    def __init__(self, store: WatchStore, prefix: str, start_revision: int, callback: WatchCallback) -> None:
        self.prefix = prefix
        self.resumes = 0  # streams opened after the first (disconnects survived)
        self.relists = 0
        self.established = threading.Event()  # set while a stream is open and created
        self._store = store
        self._callback = callback
        self._next_revision = start_revision
        self._lock = threading.Lock()
        self._stream: BatchStream | None = None
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watch {prefix}", daemon=True)

    @property
    def next_revision(self) -> int:
        """The first revision not yet delivered."""
        return self._next_revision

    def start(self) -> None:
        self._thread.start()

    def cancel(self) -> None:
        """Stop watching; no callback runs after this returns (unless called from the callback)."""
        self._cancelled.set()
        with self._lock:
            stream = self._stream
        if stream is not None:
            stream.cancel()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=self._store.config.timeout_s + 2)
        self._store.untrack(self)

    def _run(self) -> None:
        backoff = _FIRST_BACKOFF_S
        streams = 0
        while not self._cancelled.is_set():
            try:
                stream = self._store.open_watch_stream(self.prefix, self._next_revision)
                with self._lock:
                    self._stream = stream
                if self._cancelled.is_set():
                    stream.cancel()
                    return
                for batch in stream.batches():
                    if batch.created:
                        streams += 1
                        if streams > 1:
                            self.resumes += 1
                        self.established.set()
                        backoff = _FIRST_BACKOFF_S
                    self._deliver(batch)
            except RevisionCompacted:
                self._relist()
                continue
            except StoreError as err:
                _log.info(
                    "watch of %s interrupted, resuming from revision %d: %s",
                    self.prefix,
                    self._next_revision,
                    err,
                )
                self._store.relogin_if_needed(err)
            except Exception:  # a bug must not silently end the watch
                _log.exception("watch of %s failed unexpectedly; resuming", self.prefix)
            finally:
                self.established.clear()
                with self._lock:
                    self._stream = None
            if self._cancelled.wait(backoff):
                return
            backoff = min(backoff * 2, _MAX_BACKOFF_S)

    def _deliver(self, batch: WatchBatch) -> None:
        fresh = [event for event in batch.events if event.mod_revision >= self._next_revision]
        for event in fresh:
            if self._cancelled.is_set():
                return
            self._call(event)
        if fresh:
            self._next_revision = max(event.mod_revision for event in fresh) + 1
        elif not batch.events and not batch.created:
            # A progress notice: every revision up to batch.revision has been sent.
            self._next_revision = max(self._next_revision, batch.revision + 1)

    def _relist(self) -> None:
        try:
            kvs, revision = self._store.get_prefix(self.prefix)
        except StoreError:
            self._cancelled.wait(_MAX_BACKOFF_S)
            return
        self.relists += 1
        _log.info("watch of %s relisted at revision %d (%d keys)", self.prefix, revision, len(kvs))
        self._call(Relisted(kvs=tuple(kvs), revision=revision))
        self._next_revision = revision + 1

    def _call(self, item: WatchEvent | Relisted) -> None:
        if self._cancelled.is_set():
            return
        try:
            self._callback(item)
        except Exception:
            _log.exception("watch callback for %s failed on %r", self.prefix, item)
