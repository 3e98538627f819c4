"""The store: the project's only door to etcd (see runwarden.store.client for its semantics).

Modules, each importing only those before it: ``types`` (errors and values), ``config``
(``StoreConfig``), ``lease`` (keepalive), ``watch`` (resuming prefix watches), ``election``
(leader election and fencing), ``client`` (``Store``, the only importer of the etcd client).
"""

from runwarden.store.client import Store
from runwarden.store.config import Endpoint, StoreConfig, parse_endpoint
from runwarden.store.election import Leadership
from runwarden.store.lease import LeaseKeeper
from runwarden.store.types import (
    CampaignTimeout,
    EventType,
    KeyValue,
    Lease,
    NotLeader,
    Relisted,
    RevisionCompacted,
    StoreError,
    StoreUnavailable,
    WatchBatch,
    WatchEvent,
)
from runwarden.store.watch import Watch, WatchCallback

__all__ = [
    "CampaignTimeout",
    "Endpoint",
    "EventType",
    "KeyValue",
    "Leadership",
    "Lease",
    "LeaseKeeper",
    "NotLeader",
    "Relisted",
    "RevisionCompacted",
    "Store",
    "StoreConfig",
    "StoreError",
    "StoreUnavailable",
    "Watch",
    "WatchBatch",
    "WatchCallback",
    "WatchEvent",
    "parse_endpoint",
]
