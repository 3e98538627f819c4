"""The store: the project's only door to etcd (see runwarden.store.client for its semantics).

Modules, each importing only those before it: ``types`` (errors and values), ``config``
(``StoreConfig``), ``lease`` (keepalive), ``watch`` (resuming prefix watches), ``election``
(leader election and fencing), ``client`` (``Store``, the only importer of the etcd client).
"""

from runwarden.store.client import START_WAIT_S, Store, until_reachable
from runwarden.store.config import Endpoint, StoreConfig, parse_endpoint
from runwarden.store.election import Leadership
from runwarden.store.lease import LeaseKeeper
from runwarden.store.types import (
    CampaignTimeout,
    Compare,
    Delete,
    EventType,
    KeyValue,
    Lease,
    NotLeader,
    Put,
    Relisted,
    RevisionCompacted,
    StoreError,
    StoreUnavailable,
    TxnResult,
    WatchBatch,
    WatchEvent,
)
from runwarden.store.watch import Watch, WatchCallback

__all__ = [
    "START_WAIT_S",
    "CampaignTimeout",
    "Compare",
    "Delete",
    "Endpoint",
    "EventType",
    "KeyValue",
    "Leadership",
    "Lease",
    "LeaseKeeper",
    "NotLeader",
    "Put",
    "Relisted",
    "RevisionCompacted",
    "Store",
    "StoreConfig",
    "StoreError",
    "StoreUnavailable",
    "TxnResult",
    "Watch",
    "WatchBatch",
    "WatchCallback",
    "WatchEvent",
    "parse_endpoint",
    "until_reachable",
]
