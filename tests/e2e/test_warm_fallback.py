"""A warm attempt falls back together: one node of a run whose agents keep parked groups (the shipped
default) refuses the warm path for a reason that will not pass (its agent's warm_workers is off).
The others' warm ranks would wait out the warm rendezvous for that node; instead the controller sees
the launch paths disagree, stops the attempt at once and relaunches it cold on every node, without
counting a failure, and the event log says why. Real agents, controller and etcd on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from examples.cluster import ClusterSpec, LocalCluster, leftover_processes
from runwarden.eventlog import LogEntry
from runwarden.v1 import events_pb2

E = events_pb2
pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

COLD_NODE = "node2"


class OneColdNode(LocalCluster):
    """The shipped agent config everywhere but on COLD_NODE, whose agent has warm_workers off."""

    def agent_config(self, node: str) -> Path:
        path = super().agent_config(node)
        if node == COLD_NODE:
            assert "warm_workers" not in path.read_text()
            with path.open("a") as f:
                f.write("warm_workers = false\n")
        return path


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[OneColdNode]:
    c = OneColdNode(tmp_path / "cluster", ClusterSpec(active=2, spares=0))
    try:
        yield c.start()
    finally:
        c.stop()
    assert leftover_processes(c.root) == []


def test_one_node_refusing_the_warm_path_sends_the_whole_attempt_cold_at_once(cluster: OneColdNode) -> None:
    def tail() -> str:
        return "\n".join(
            f"{e.seq} {E.EventKind.Name(e.kind)} a{e.attempt}: {e.message}" for e in cluster.events()[-40:]
        )

    def mixed(e: LogEntry) -> bool:
        return {n.path for n in e.workers_started.nodes} == {"warm", "cold"}

    disagreed = cluster.wait_for_event(E.EVENT_KIND_WORKERS_STARTED, 0, 240, pred=mixed)
    assert disagreed is not None, tail()
    cold = {n.node: n.detail for n in disagreed.workers_started.nodes if n.path == "cold"}
    assert list(cold) == [COLD_NODE] and "warm_workers is off" in cold[COLD_NODE], cold
    restart = cluster.wait_for_event(
        E.EVENT_KIND_RESTART,
        disagreed.seq,
        30,
        pred=lambda e: "every node goes cold: relaunching at once" in e.message,
    )
    assert restart is not None, tail()
    assert f"launch paths of attempt {disagreed.attempt} disagree" in restart.message
    assert "no restart consumed" in restart.message
    relaunch = cluster.wait_for_event(E.EVENT_KIND_LAUNCH, restart.seq, 30)
    assert relaunch is not None, tail()
    # seconds, never the warm rendezvous' 120 s timeout
    assert relaunch.ts - disagreed.ts < 30.0, (relaunch.ts - disagreed.ts, tail())
    started = cluster.wait_for_event(
        E.EVENT_KIND_WORKERS_STARTED, relaunch.seq, 120, pred=lambda e: e.attempt == relaunch.attempt
    )
    assert started is not None, tail()
    assert {n.path for n in started.workers_started.nodes} == {"cold"}, started.message
    first = cluster.wait_for_event(
        E.EVENT_KIND_FIRST_STEP, relaunch.seq, 150, pred=lambda e: e.attempt == relaunch.attempt
    )
    assert first is not None, tail()
    assert not [e for e in cluster.events() if e.kind == E.EVENT_KIND_QUARANTINE], tail()
