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


@dataclass(frozen=True, slots=True, kw_only=True)
class Compare:
    """One condition of a transaction (``Store.txn``), on one key: exactly one of ``absent`` (the key
    must not exist), ``mod_revision`` (its last write), ``create_revision`` (its creation, a fence) or
    ``written_before`` (with ``prefix``: every key under ``key`` was last written before that
    revision; one compare for many keys, where etcd bounds a transaction's compares (its
    ``--max-txn-ops``, 128 by default). It sees a key created or changed since, not one deleted)."""

    key: str
    absent: bool = False
    mod_revision: int | None = None
    create_revision: int | None = None
    written_before: int | None = None
    prefix: bool = False

    def __post_init__(self) -> None:
        given = [
            self.absent,
            self.mod_revision is not None,
            self.create_revision is not None,
            self.written_before is not None,
        ]
        if sum(given) != 1:
            raise StoreError(
                f"compare on {self.key}: give exactly one of absent, mod_revision, create_revision, "
                "written_before"
            )
        if self.prefix != (self.written_before is not None):
            raise StoreError(f"compare on {self.key}: written_before is a compare over a prefix, and only it")
        for what in ("mod_revision", "create_revision", "written_before"):
            value = getattr(self, what)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise StoreError(f"compare on {self.key}: {what} must be a positive integer, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Put:
    """A put inside a transaction; ``lease`` 0: none."""

    key: str
    value: bytes
    lease: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Delete:
    """A delete of one key inside a transaction."""

    key: str


@dataclass(frozen=True, slots=True, kw_only=True)
class TxnResult:
    """Whether every compare held (then every op was applied, atomically), and the store's revision."""

    succeeded: bool
    revision: int
