"""A live Controller API server: StoreBackedView over the real etcd fixture and a real event log."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from controller.api.access import AccessPolicy
from controller.api.server import ServerTLS, build_server
from controller.api.store_view import StoreBackedView
from runwarden.eventlog import EventLog
from runwarden.store import Store
from runwarden.v1 import common_pb2, store_pb2

from .logbuild import LogBuilder

T0 = 1_764_547_200.0
RUN = "llm"


@dataclass
class LiveController:
    address: str
    log_path: Path
    store: Store
    log: EventLog


def incident_log() -> LogBuilder:
    b = LogBuilder(run=RUN)
    b.startup(T0)
    b.commit(T0 + 100, step=100, save_s=5)
    b.detect(T0 + 200, latency_s=10)
    b.attribute(T0 + 203)
    b.quarantine(T0 + 210)
    b.spare(T0 + 211)
    b.preflight(T0 + 230, node="n4")
    b.launch(T0 + 235, resume_step=100)
    b.load_done(T0 + 250)
    b.first_step(T0 + 260)
    b.end(T0 + 300)
    return b


def populate(store: Store, now: float, *, claims: bool = True) -> None:
    """`claims`: the run's claims on its attempt's nodes (False: the test takes them itself)."""
    k = store.keys
    for i in range(5):
        node = f"n{i}"
        rec = store_pb2.NodeRecord(
            node=node,
            host=f"host{i}",
            address=f"10.0.0.{i}:7071",
            gpu_count=8,
            state=common_pb2.NODE_STATE_RUNNING if i < 4 else common_pb2.NODE_STATE_READY,
            registered_at=now - 30,
            last_preflight=common_pb2.PreflightSummary(
                mode="quick", passed=True, pass_count=9, finished_at=now - 60
            ),
        )
        if i != 2:  # n2 lost its lease: its node key is gone, only its pool entry remains
            store.put(k.node(node), rec.SerializeToString())
        # As the live controller writes them: a node's entry changes with its standing (n2
        # quarantined), not when a slot takes it (n0, n1, n3 and n4 run the attempt with spare entries).
        state = common_pb2.POOL_STATE_QUARANTINED if i == 2 else common_pb2.POOL_STATE_SPARE
        entry = store_pb2.PoolEntry(
            node=node,
            state=state,
            run=RUN if i == 2 else "",
            reason="xid 79" if i == 2 else "",
            since=now - 100,
        )
        store.put(k.pool(node), entry.SerializeToString())
    xid = common_pb2.Evidence(
        node="n2",
        kind=common_pb2.EVIDENCE_KIND_XID,
        severity=common_pb2.SEVERITY_FATAL,
        gpu_index=3,
        xid=79,
        detail="Xid 79: GPU has fallen off the bus",
        observed_at=now - 90,
    )
    store.put(k.evidence("n2", 1), store_pb2.EvidenceRecord(evidence=xid).SerializeToString())
    store.put(k.reputation("n2"), store_pb2.Reputation(node="n2", failures=1).SerializeToString())
    store.put(k.spec(RUN), store_pb2.RunSpec(run=RUN, nodes=4, max_attempts=5).SerializeToString())
    # the supervisor's memory: two failure restarts within the budget's hour, one long before it
    memory = store_pb2.SupervisorMemory(
        run=RUN,
        restart_budget=5,
        restart_budget_window_s=3600.0,
        restart_times=[now - 7200, now - 600, now - 60],
    )
    store.put(k.memory(RUN), memory.SerializeToString())
    nodes = ["n0", "n1", "n3", "n4"]
    for node in nodes if claims else ():  # as controller/fleet/claims.py writes them
        store.put(k.claim(node), store_pb2.NodeClaim(node=node, run=RUN).SerializeToString())
    store.put(
        k.attempt(RUN),
        store_pb2.AttemptRecord(
            run=RUN, attempt=2, rendezvous_id=f"{RUN}-2", nodes=nodes, resume_step=100
        ).SerializeToString(),
    )
    for i, node in enumerate(nodes):
        ranks = [common_pb2.RankProgress(rank=8 * i + r, step=140 + (r % 2)) for r in range(8)]
        prog = store_pb2.NodeProgress(node=node, run=RUN, attempt=2, ranks=ranks, written_at=now - 2)
        store.put(k.progress(RUN, node), prog.SerializeToString())
    store.put(k.checkpoint(RUN, 100), store_pb2.CheckpointCommit(run=RUN, step=100).SerializeToString())


def _start(
    store: Store,
    tmp_path: Path,
    *,
    tls: ServerTLS | None = None,
    policy: AccessPolicy | None = None,
    with_end: bool = False,
) -> Iterator[LiveController]:
    log_path = tmp_path / "events.jsonl"
    log = EventLog(log_path)
    events = incident_log().events
    for ev in events if with_end else events[:-1]:
        log.append(ev)
    populate(store, time.time())
    view = StoreBackedView(store, log_path)
    server, port = build_server(view, "127.0.0.1:0", tls=tls, policy=policy, poll_s=0.05)
    server.start()
    try:
        yield LiveController(address=f"127.0.0.1:{port}", log_path=log_path, store=store, log=log)
    finally:
        server.stop(grace=None)
        log.close()


@pytest.fixture
def live(store: Store, tmp_path: Path) -> Iterator[LiveController]:
    """The run is still going (no RUN_END): status shows it running at attempt 2."""
    yield from _start(store, tmp_path)


@pytest.fixture
def live_ended(store: Store, tmp_path: Path) -> Iterator[LiveController]:
    yield from _start(store, tmp_path, with_end=True)
