"""The Ray backend on a real Ray cluster: a head (no CPUs, so no bundle lands there) and four worker
nodes, each a real raylet on its own loopback address (ray.cluster_utils.Cluster on this host:
network namespaces would give nothing more here, since Ray's own processes are what is tested),
and a real etcd the agents register in. One cluster for the module (Ray is heavy); the tests run
in order and each leaves the state the next one starts from."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")

from controller.backends.base import BackendError, RunOutcome  # noqa: E402
from controller.backends.ray import MARK_PREFIX, RayScheduler  # noqa: E402
from runwarden.store import Store, StoreConfig  # noqa: E402
from testbed.etcd_server import EtcdServer, free_port  # noqa: E402
from testbed.ray_cluster import start_ray_cluster  # noqa: E402
from testbed.wait import wait_until  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]

NAMESPACE = "runwarden-raytest"
HEAD_IP = "127.0.0.40"
WORKER_IPS = ("127.0.0.41", "127.0.0.42", "127.0.0.43", "127.0.0.44")
LEASE_TTL_S = 2.0


def wait_for(what: str, check: Callable[[], Any], timeout_s: float = 30.0) -> Any:
    return wait_until(check, timeout_s, what, interval_s=0.1)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Env:
    def __init__(self, cluster: Any, store: Store, sched: RayScheduler, root: Path):
        self.cluster = cluster
        self.store = store
        self.sched = sched
        self.root = root
        self.state: dict[str, Any] = {}

    def registered(self) -> set[str]:
        kvs, _ = self.store.get_prefix(self.store.keys.nodes_prefix())
        return {kv.key.rsplit("/", 1)[1] for kv in kvs}

    def groups(self) -> dict[str, dict[str, Any]]:
        prefix = f"{NAMESPACE}/"
        return {
            e["name"][len(prefix) :]: e
            for e in ray.util.placement_group_table().values()
            if e["name"].startswith(prefix) and e["state"] != "REMOVED"
        }

    def actors(self) -> list[str]:
        return [
            a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE
        ]

    def agents(self) -> dict[str, dict[str, Any]]:
        """node name -> the actor's info, for every agent actor that answers."""
        return {a.node: ray.get(a.handle.info.remote(), timeout=10) for a in self.sched._agents()}


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    root = tmp_path_factory.mktemp("ray")
    etcd = EtcdServer(root / "etcd", fast=True).start()
    store = Store.connect(StoreConfig(endpoints=(etcd.endpoint,), timeout_s=5.0))
    agent_config = root / "nodeagent.toml"
    agent_config.write_text(
        f'lease_ttl_s = {LEASE_TTL_S}\nprogress_interval_s = 0.5\nkernel_log = "none"\n'
        f'nvml_interval_s = 0.0\nlocal_ranks = 1\nstop_grace_s = 2.0\nallowed_executables = ["{sys.executable}"]\n'
        "warm_workers = false\n"
    )
    cluster = None
    try:
        cluster = start_ray_cluster(HEAD_IP, WORKER_IPS)
        # The driver attaches to the head's raylet (by default Ray picks the last node started here,
        # which a test may kill).
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False, _node_ip_address=HEAD_IP)
        sched = RayScheduler.from_section(
            {
                "address": cluster.address,
                "node_ip_address": HEAD_IP,
                "namespace": NAMESPACE,
                "bundle": {"CPU": 1},
                "agent_config": str(agent_config),
                "etcd_endpoints": [etcd.endpoint],
                "agent_run_dir": str(root / "agents"),
                "agent_port": free_port(),
                "stop_timeout_s": 5.0,
                "call_timeout_s": 3.0,
                "allocate_timeout_s": 60.0,
            },
            "[ray]",
        )
        yield Env(cluster, store, sched, root)
    finally:
        with contextlib.suppress(Exception):
            if ray.is_initialized():
                RayScheduler.from_section({"namespace": NAMESPACE, "call_timeout_s": 2.0}, "[ray]").finish(
                    RunOutcome.FAILED
                )
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        store.close()
        etcd.discard()


def test_allocate_places_one_agent_per_ray_node_and_each_registers(env: Env) -> None:
    allocation = env.sched.allocate(2, 1)
    nodes = set(allocation.nodes)
    assert len(allocation.nodes) == 3 and allocation.id.startswith("ray:")
    assert nodes <= {f"ray-{ip}" for ip in WORKER_IPS}  # one per worker node, never the head
    wait_for("the three agents in etcd", lambda: env.registered() == nodes)
    infos = env.agents()
    assert set(infos) == nodes and len({i["node_id"] for i in infos.values()}) == 3
    assert all(alive(i["pid"]) for i in infos.values())
    env.state.update(nodes=nodes, pids={n: i["pid"] for n, i in infos.items()})


def test_an_agent_that_exits_is_restarted_by_its_actor(env: Env) -> None:
    node = sorted(env.state["nodes"])[-1]
    os.kill(env.state["pids"][node], signal.SIGKILL)  # the lease stays until it expires
    wait_for("the agent restarted", lambda: env.agents()[node]["pid"] != env.state["pids"][node], 15)
    info = env.agents()[node]
    assert info["starts"] == 2 and alive(info["pid"])
    wait_for("the restarted agent registered", lambda: node in env.registered())
    env.state["pids"][node] = info["pid"]


def test_allocate_adopts_the_runs_placement(env: Env) -> None:
    groups = env.groups()
    again = env.sched.allocate(2, 1)
    assert set(again.nodes) == env.state["nodes"]
    # A new controller (a restart, the standby) adopts it too: same group, same actors, same agents.
    other = RayScheduler(env.sched.config)
    assert set(other.allocate(2, 1).nodes) == env.state["nodes"]
    assert env.groups().keys() == groups.keys() == {"alloc"}
    assert {n: i["pid"] for n, i in env.agents().items()} == env.state["pids"]
    assert len(env.actors()) == 3
    with pytest.raises(BackendError, match="already holds an allocation of 3"):
        env.sched.allocate(3, 1)


def test_quarantine_keeps_the_node_out_of_new_placements(env: Env) -> None:
    node = sorted(env.state["nodes"])[0]
    pid = env.state["pids"][node]
    env.sched.quarantine(node, "fatal Xid 79")
    env.sched.quarantine(node, "again")  # idempotent
    assert MARK_PREFIX + node in env.groups()
    # The agent stays (the pool's burn-in preflights through it), as under a Slurm drain.
    assert node in env.registered() and alive(pid)
    # One free worker node is left: a request lands there, never on the quarantined node.
    free = {f"ray-{ip}" for ip in WORKER_IPS} - env.state["nodes"]
    request = env.sched.request_nodes(1, exclude=(), reason="spare pool empty")
    assert request.count == 1 and request.id.startswith("ray:req-1:")
    wait_for("the requested agent in etcd", lambda: free <= env.registered())
    # Nothing is left that is not held or quarantined: the ask waits in Ray's queue (once).
    queued = env.sched.request_nodes(1, exclude=(), reason="more")
    assert queued.id.startswith("ray:req-2-queued:") and queued.count == 1
    assert env.groups()["req-2-queued"]["state"] == "PENDING"
    assert env.sched.request_nodes(2, exclude=(), reason="still more").id == queued.id
    assert node not in env.registered() - env.state["nodes"]  # it landed nowhere new
    assert env.sched.release(node) is True
    assert MARK_PREFIX + node not in env.groups()
    assert env.sched.release(node) is True  # no mark: nothing changes
    infos = env.agents()
    assert set(infos) == env.state["nodes"] | free and infos[node]["pid"] == pid
    env.state["pids"] = {n: i["pid"] for n, i in infos.items()}
    env.state["requested"] = free.pop()


def test_quarantine_that_stops_the_agent_and_release_brings_it_back(env: Env) -> None:
    stopper = RayScheduler(dataclasses.replace(env.sched.config, quarantine_stops_agent=True))
    node = sorted(env.state["nodes"])[0]
    pid = env.state["pids"][node]
    actors = len(env.actors())
    stopper.quarantine(node, "burnt-in twice and failed")
    assert node not in env.registered()  # the agent stopped and revoked its lease
    assert not alive(pid)
    assert node not in env.agents() and len(env.actors()) == actors - 1
    assert MARK_PREFIX + node in env.groups()
    # allocate again (a controller restart: a fresh scheduler) does not bring it back
    assert node not in RayScheduler(env.sched.config).allocate(2, 1).nodes
    assert node not in env.registered()
    assert stopper.release(node) is True
    assert MARK_PREFIX + node not in env.groups()
    wait_for("the released node's agent back in etcd", lambda: node in env.registered())
    infos = env.agents()
    assert set(infos) == env.state["nodes"] | {env.state["requested"]} and infos[node]["pid"] != pid
    env.state["pids"] = {n: i["pid"] for n, i in infos.items()}


def test_killing_a_ray_node_makes_its_agents_lease_vanish(env: Env) -> None:
    node = env.state["requested"]
    ip = node.removeprefix("ray-")
    victim = next(n for n in env.cluster.worker_nodes if n.node_ip_address == ip)
    pid = env.state["pids"][node]
    assert node in env.registered()
    started = time.monotonic()
    env.cluster.remove_node(victim, allow_graceful=False)  # the raylet is SIGKILLed: the node is lost
    wait_for(
        "the lost node's lease to vanish", lambda: node not in env.registered(), timeout_s=LEASE_TTL_S + 20
    )
    lost_after = time.monotonic() - started
    wait_for("the lost node's agent process to end", lambda: not alive(pid), timeout_s=10)
    print(f"node lost: lease gone {lost_after:.1f} s after the raylet was killed")
    # the other agents are untouched
    assert env.state["nodes"] <= env.registered()


def test_finish_leaves_no_actor_no_placement_group_and_no_agent(env: Env) -> None:
    pids = [p for n, p in env.state["pids"].items() if n != env.state["requested"]]
    env.sched.quarantine(sorted(env.state["nodes"])[1], "a mark finish must remove too")
    env.sched.finish(RunOutcome.COMPLETED)
    assert env.groups() == {}
    assert env.actors() == []
    wait_for("every agent process to end", lambda: not any(alive(p) for p in pids), timeout_s=15)
    wait_for("no agent left in etcd", lambda: env.registered() == set(), timeout_s=LEASE_TTL_S + 5)
    env.sched.finish(RunOutcome.COMPLETED)  # idempotent
