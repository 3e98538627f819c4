"""Values and errors of the store interface (runwarden.store re-exports all of them).

The bottom of the package: it imports nothing else from runwarden.store.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class StoreError(Exception):
    """Any store failure. ``str(error)`` is one line fit for a log or a CLI, and never holds a secret."""


class StoreUnavailable(StoreError):
    """etcd did not answer (down, restarting, unreachable, or too slow). Worth retrying later."""


class RevisionCompacted(StoreError):
    """The revision asked for was compacted away; relist."""

    def __init__(self, message: str, compact_revision: int) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision


class NotLeader(StoreError):
    """A fenced write was refused: the caller's leadership key is gone or was superseded."""


class CampaignTimeout(StoreError):
    """No leadership was won within the campaign's timeout; the contender key was withdrawn."""


@dataclass(frozen=True, slots=True, kw_only=True)
class KeyValue:
    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int = 0
    version: int = 0


class EventType(enum.Enum):
    PUT = "PUT"
    DELETE = "DELETE"


@dataclass(frozen=True, slots=True, kw_only=True)
class WatchEvent:
    """One change. For DELETE, ``value`` is b"" and ``create_revision`` is 0 (etcd does not send them)."""

    type: EventType
    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Relisted:
    """Delivered instead of events a watch could not get (their revision was compacted).

    ``kvs`` is the whole prefix as of ``revision``: replace your view with it. Events with a
    mod_revision above ``revision`` follow.
    """

    kvs: tuple[KeyValue, ...]
    revision: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Lease:
    id: int
    ttl_s: int


@dataclass(frozen=True, slots=True, kw_only=True)
class WatchBatch:
    """One response of a watch stream: events, or a progress notice (all up to ``revision`` sent)."""

    events: tuple[WatchEvent, ...]
    revision: int
    created: bool
