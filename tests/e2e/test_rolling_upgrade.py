"""Issue 32: a rolling upgrade of runwarden itself while a run trains, on one real cluster (etcd,
three agents with the shipped warm workers, a leader and a standby controller, torchrun with gloo).
The new version here is the current one restarted in place, what an operator does host by host:

* each agent in turn: SIGTERM (`systemctl stop nodeagent`: a drain, a planned stop of the attempt if
  it runs a rank, never a quarantine), then started again; it registers with its version and serves
  again;
* the controller: a standby of the new version joins, the leader gets SIGTERM and the standby leads
  on, without relaunching the healthy attempt; the old leader comes back as the standby.

The records say their versions: each node record its agent's, the attempt record its leader's.
"""

from __future__ import annotations

import json
import signal
import time

import pytest

import runwarden
from examples.cluster import LocalCluster
from runwarden.eventlog import LogEntry
from runwarden.store import Store, StoreConfig
from runwarden.v1 import events_pb2, store_pb2
from testbed.fleet_cluster import controllerctl
from testbed.wait import wait_contender

E = events_pb2
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
WAIT_S = 90.0


def _tail(c: LocalCluster, log: str = "controller.log") -> str:
    path = c.run_dir / log
    return path.read_text(errors="replace")[-3000:] if path.exists() else f"(no {log})"


def _last_seq(c: LocalCluster) -> int:
    events = c.events()
    return events[-1].seq if events else 0


def _launch(c: LocalCluster) -> LogEntry:
    return next(e for e in reversed(c.events()) if e.kind == E.EVENT_KIND_LAUNCH)


def _nodes(address: str) -> dict[str, dict[str, object]]:
    out = controllerctl(address, "nodes", "--json")
    assert out.returncode == 0, out.stderr
    return {n["node"]: n for n in json.loads(out.stdout)["nodes"]}


def _wait_serving(c: LocalCluster, address: str, node: str) -> None:
    """The node's agent is registered again and the pool has it in service (active or a spare)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        info = _nodes(address).get(node, {})
        if info.get("alive") and info.get("pool_state") in ("POOL_STATE_ACTIVE", "POOL_STATE_SPARE"):
            return
        time.sleep(0.2)
    raise AssertionError(f"{node} did not serve again: {_nodes(address).get(node)}\n{_tail(c)}")


def test_agents_host_by_host_then_the_controller_with_its_standby_while_the_run_trains(make_cluster) -> None:
    c: LocalCluster = make_cluster(active=2, spares=1, ckpt_every=5, warm_workers=None)
    assert c.wait_for_event(E.EVENT_KIND_FIRST_STEP, 0, 150) is not None, _tail(c)
    start = _last_seq(c)
    leader = c.controller_address

    for node in list(c.nodes):
        mark = _last_seq(c)
        ran_a_rank = node in _launch(c).launch.nodes
        agent = c.agents[node]
        agent.send_signal(signal.SIGTERM)
        if ran_a_rank:  # its rank's attempt stops as planned, commits, and goes on without it
            launch = c.wait_for_event(E.EVENT_KIND_LAUNCH, mark, WAIT_S)
            assert launch is not None and node not in launch.launch.nodes, _tail(c)
        assert agent.wait(timeout=60) == 0, f"{node}'s agent did not leave cleanly"
        c.start_agent(node)  # the new version, on the same host and state directory
        _wait_serving(c, leader, node)
        if ran_a_rank:  # the run trains on without it
            assert c.wait_for_event(E.EVENT_KIND_FIRST_STEP, mark, WAIT_S) is not None, _tail(c)

    standby_port = c.start_standby("controller-b")
    assert c.etcd is not None and c.controller is not None
    wait_contender(c.etcd.endpoint, c.spec.run, "controller-b")
    launches = sum(e.kind == E.EVENT_KIND_LAUNCH for e in c.events())
    stopped_at = time.time()
    c.controller.send_signal(signal.SIGTERM)  # it resigns: the standby leads at once, not after a TTL
    assert c.controller.wait(timeout=30) == 0, _tail(c)  # no RPC or wait of the old leader holds it
    took_over = c.wait_for_event(E.EVENT_KIND_CONTROL_PLANE, 0, 30, pred=lambda e: e.ts > stopped_at)
    assert took_over is not None, _tail(c, "controller-b.log")
    assert took_over.ts - stopped_at < 10.0, "the standby waited for a lease to expire"
    c.start_standby("controller-a")  # the old leader, upgraded, is the standby now
    wait_contender(c.etcd.endpoint, c.spec.run, "controller-a")
    resumed = time.time()
    commit = c.wait_for_event(E.EVENT_KIND_CHECKPOINT_COMMIT, 0, WAIT_S, pred=lambda e: e.ts > resumed)
    assert commit is not None, _tail(c, "controller-b.log")
    assert sum(e.kind == E.EVENT_KIND_LAUNCH for e in c.events()) == launches, "a healthy attempt relaunched"

    during = [e for e in c.events() if e.seq > start]
    assert not [e for e in during if e.kind == E.EVENT_KIND_QUARANTINE], "the upgrade quarantined a node"
    assert not [e for e in during if e.kind == E.EVENT_KIND_DETECTION], "the upgrade was taken for a failure"
    assert not any(e.kind == E.EVENT_KIND_RUN_END for e in during)
    nodes = _nodes(f"127.0.0.1:{standby_port}")
    assert all(int(n.get("failures", 0)) == 0 for n in nodes.values()), nodes
    assert {n["agent_version"] for n in nodes.values()} == {runwarden.__version__}
    with Store.connect(StoreConfig(endpoints=(c.etcd.endpoint,))) as store:
        kv = store.get(store.keys.attempt(c.spec.run))
        assert kv is not None
        assert store_pb2.AttemptRecord.FromString(kv.value).controller_version == runwarden.__version__
