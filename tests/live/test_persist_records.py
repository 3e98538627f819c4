"""Node records are written many to a transaction (controller.live.executor: `_persist_all`): a
fleet's records at a run's start were a read and a transaction each on the loop's thread. Against a
real etcd: 300 records in a handful of transactions, each written only where this run may write it
(its claim, or no claim), a node held by another run left as that run wrote it, and a node whose claim
changes under a chunk written on its own."""

from __future__ import annotations

import queue

from controller.fleet.claims import Claims
from controller.live.executor import Executor, RunSettings
from controller.live.tasks import TaskPool
from controller.supervisor.actions import Batch, PersistNode
from controller.supervisor.pool import NodeRecordView
from runwarden.keys import run_election
from runwarden.store import Store
from runwarden.v1 import common_pb2, store_pb2

RUN = "persist"


class CountingStore:
    """The real store, its transactions counted (the one thing this test measures)."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.txns = 0
        self.keys = store.keys

    def txn(self, *args, **kwargs):
        self.txns += 1
        return self._store.txn(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._store, name)


def test_three_hundred_records_in_a_few_transactions_each_only_where_this_run_may_write(store: Store) -> None:
    leadership = store.campaign(run_election(RUN), RUN.encode(), ttl_s=30, timeout_s=5)
    counting = CountingStore(store)
    claims = Claims(store, RUN)
    nodes = [f"n{i:03d}" for i in range(300)]
    assert claims.take(nodes[:200], leadership) == []  # held by this run; n200.. held by none
    other = store_pb2.NodeClaim(node="n299", run="other", priority=0).SerializeToString()
    store.put(store.keys.claim("n299"), other)  # another run holds n299 (replacing nothing: none held it)
    store.put(store.keys.pool("n299"), b"the other run's")
    executor = Executor(
        RunSettings(run=RUN, command=("true",), env=(), procs_per_node=1, rpc_timeout_s=5.0),
        store=counting,
        leadership=leadership,
        eventlog=None,
        timers=None,
        backend=None,
        agents=None,
        pager=None,
        translator=None,
        claims=claims,
        tasks=TaskPool(),
        post=queue.Queue().put,
        relist=lambda: None,
        listeners=[],
    )
    records = [
        NodeRecordView(node=n, pool_state=common_pb2.POOL_STATE_ASSIGNED, straggler_flags=i)
        for i, n in enumerate(nodes)
    ]
    records.append(NodeRecordView(node="n007", pool_state=common_pb2.POOL_STATE_SPARE, straggler_flags=700))
    executor.execute(Batch(actions=tuple(PersistNode(record=r) for r in records)))

    assert counting.txns <= 6, counting.txns  # 299 writable records, 60 a transaction
    for i, n in enumerate(nodes[:299]):
        entry = store_pb2.PoolEntry.FromString(store.get(store.keys.pool(n)).value)
        rep = store_pb2.Reputation.FromString(store.get(store.keys.reputation(n)).value)
        want = (common_pb2.POOL_STATE_SPARE, 700) if n == "n007" else (common_pb2.POOL_STATE_ASSIGNED, i)
        assert (entry.state, rep.straggler_flags) == want, n  # a node twice: its last record
    assert store.get(store.keys.pool("n299")).value == b"the other run's"
    assert store.get(store.keys.reputation("n299")) is None

    # a claim that changes between the read and the chunk's transaction fails the chunk's compares:
    # each node of it is then decided on its own (here: written, this run still holds them)
    claim_kv = store.get(store.keys.claim("n010"))
    store.put(store.keys.claim("n010"), claim_kv.value)  # same holder, a new revision
    before = counting.txns
    real_get_prefix = store.get_prefix

    def stale_get_prefix(prefix: str):
        kvs, rev = real_get_prefix(prefix)
        return [kv if kv.key != store.keys.claim("n010") else claim_kv for kv in kvs], rev

    counting.get_prefix = stale_get_prefix  # the read of the claims comes back with n010 as it was
    executor.execute(
        Batch(
            actions=tuple(
                PersistNode(
                    record=NodeRecordView(node=n, pool_state=common_pb2.POOL_STATE_ASSIGNED, reason="again")
                )
                for n in nodes[:60]
            )
        )
    )
    assert counting.txns - before == 1 + 60  # the chunk, then each of its nodes
    assert all(
        store_pb2.PoolEntry.FromString(store.get(store.keys.pool(n)).value).reason == "again"
        for n in nodes[:60]
    )
    leadership.resign()
