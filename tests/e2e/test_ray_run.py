"""`controller run` with `[controller] backend = "ray"`: the controller allocates its nodes from a
real Ray cluster (a head with no CPUs and four worker raylets, each on its own loopback address,
ray.cluster_utils on this host), one node agent per Ray node placed by the Ray backend, and
supervises a real 2-node DDP run (examples/train.py, torchrun + gloo) through those agents:
a crash, a lost Ray node (its raylet SIGKILLed) and a straggler are each detected by the right
detector, blamed on the right node and recovered from; a planned stop ends the run, and the
controller gives the allocation back (no actor, no placement group, no agent left). Ray moves the
lost node's bundle to the free worker (a new agent joins), and the quarantined straggler node keeps
its agent, passes its burn-in and returns to the spare pool."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")

from examples.cluster import leftover_processes  # noqa: E402
from examples.demo import Injection, current_nodes, inject, last_seq, recoveries  # noqa: E402
from runwarden.eventlog import LogEntry  # noqa: E402
from runwarden.v1 import events_pb2  # noqa: E402
from testbed.etcd_server import EtcdServer, free_port  # noqa: E402
from testbed.fleet_cluster import (  # noqa: E402
    ClusterBase,
    ClusterSpec,
    agent_settings,
    controller_settings,
    controllerctl,
    preflight_settings,
    start_controller,
    write_toml,
)
from testbed.ray_cluster import start_ray_cluster  # noqa: E402
from tests.e2e.five_faults import EXPECTED_DETECTOR  # noqa: E402

E = events_pb2
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

HEAD_IP = "127.0.0.60"
WORKER_IPS = ("127.0.0.61", "127.0.0.62", "127.0.0.63", "127.0.0.64")
FAULTS = ("crash", "node-lost", "straggler")


class RayRun(ClusterBase):
    """etcd, a Ray cluster and `controller run` with the ray backend; the agents are Ray's."""

    def __init__(self, root: Path, spec: ClusterSpec) -> None:
        self.root = root
        self.spec = spec
        self.agents = {}
        self.namespace = f"runwarden-{spec.run}"
        self.etcd: EtcdServer | None = None
        self.ray_cluster: Any = None
        self.controller: subprocess.Popen[bytes] | None = None
        self.api_port = free_port()

    def start(self) -> RayRun:
        for d in (self.root, self.run_dir, self.ckpt_dir, self.loss_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.etcd = EtcdServer(self.root / "etcd", fast=True).start()
        write_toml(self.root / "preflight.toml", preflight_settings(self.ckpt_dir))
        agent = agent_settings(
            "unused",  # each agent's --node, --listen, --unix-socket and --run-dir come from the backend
            self.spec,
            listen="127.0.0.1:0",
            state_dir=self.root / "unused",
            etcd_endpoints=[self.etcd.endpoint],
            preflight_config=self.root / "preflight.toml",
        )
        for key in ("node", "listen", "unix_socket", "run_dir"):
            agent.pop(key)
        write_toml(self.root / "nodeagent.toml", {"": agent})
        self.ray_cluster = start_ray_cluster(HEAD_IP, WORKER_IPS)
        settings = controller_settings(
            self.spec,
            store={"endpoints": [self.etcd.endpoint]},
            run_dir=self.run_dir,
            ckpt_dir=self.ckpt_dir,
            loss_dir=self.loss_dir,
            api_address=f"127.0.0.1:{self.api_port}",
            metrics_address=f"127.0.0.1:{free_port()}",
        )
        settings["controller"].update(backend="ray", spares=self.spec.spares)
        settings["ray"] = {
            "address": self.ray_cluster.address,
            "node_ip_address": HEAD_IP,
            "agent_config": str(self.root / "nodeagent.toml"),
            "agent_run_dir": str(self.root / "agents"),
            "agent_port": free_port(),
            "stop_timeout_s": 10.0,
            "call_timeout_s": 5.0,
            "allocate_timeout_s": 60.0,
        }
        write_toml(self.run_dir / "controller.toml", settings)
        self.controller = start_controller(self.run_dir / "controller.toml", self.run_dir / "controller.log")
        return self

    def ctl(self, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        return controllerctl(f"127.0.0.1:{self.api_port}", *args, timeout=timeout)

    def lose_ray_node(self, node: str) -> None:
        ip = node.removeprefix("ray-")
        victim = next(n for n in self.ray_cluster.worker_nodes if n.node_ip_address == ip)
        self.ray_cluster.remove_node(victim, allow_graceful=False)

    def held(self) -> tuple[list[str], list[str]]:
        """The run's named actors and placement groups in Ray, seen from a driver on the head."""
        if not ray.is_initialized():
            ray.init(
                address=self.ray_cluster.address,
                namespace=self.namespace,
                log_to_driver=False,
                _node_ip_address=HEAD_IP,
            )
        actors = [
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == self.namespace
        ]
        groups = [
            e["name"]
            for e in ray.util.placement_group_table().values()
            if e["name"].startswith(self.namespace + "/") and e["state"] != "REMOVED"
        ]
        return actors, groups

    def stop(self) -> None:
        if self.controller is not None and self.controller.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.controller.pid, signal.SIGTERM)
            try:
                self.controller.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.controller.pid, signal.SIGKILL)
                self.controller.wait(5)
        ray.shutdown()
        if self.ray_cluster is not None:
            self.ray_cluster.shutdown()
        if self.etcd is not None:
            self.etcd.discard()


def _tail(run: RayRun) -> str:
    return (run.run_dir / "controller.log").read_text(errors="replace")[-4000:]


def _wait_commit_after(run: RayRun, first_step: LogEntry) -> None:
    """Steady training before the next fault: a checkpoint committed after the attempt's first step."""
    assert run.wait_for_event(E.EVENT_KIND_CHECKPOINT_COMMIT, first_step.seq, 120) is not None, _tail(run)


@pytest.fixture(scope="module")
def faulted(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[RayRun, list[Injection], dict[str, Any]]]:
    spec = ClusterSpec(
        warm_workers=False, run="rayrun", active=2, spares=1, policy={"kill_stragglers_mid_run": True}
    )
    run = RayRun(tmp_path_factory.mktemp("rayrun"), spec)
    facts: dict[str, Any] = {}
    injections: list[Injection] = []
    try:
        started = time.monotonic()
        run.start()
        first = run.wait_for_event(E.EVENT_KIND_FIRST_STEP, 0, 150)
        assert first is not None, _tail(run)
        facts["first_step_s"] = time.monotonic() - started
        _wait_commit_after(run, first)
        for fault in FAULTS:
            nodes = current_nodes(run)
            mark = last_seq(run)
            at = time.time()
            if fault == "node-lost":
                victim = nodes[1]
                run.lose_ray_node(victim)
            else:
                victim = inject(run, fault, nodes)
            first = run.wait_for_event(E.EVENT_KIND_FIRST_STEP, mark, 90)
            injections.append(
                Injection(fault=fault, node=victim, at=at, after_seq=mark, recovered=first is not None)
            )
            assert first is not None, f"{fault}: no recovery\n{_tail(run)}"
            _wait_commit_after(run, first)
        run.ctl("stop", spec.run, "--reason", "test finished")
        assert run.wait_for_event(E.EVENT_KIND_RUN_END, 0, 90) is not None, _tail(run)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and run.held() != ([], []):
            time.sleep(0.5)
        facts["held_after_end"] = run.held()
        facts["total_s"] = time.monotonic() - started
    finally:
        run.stop()
    facts["leftover"] = leftover_processes(run.root)
    yield run, injections, facts


def test_the_ray_backend_supervises_a_run_through_three_faults(
    faulted: tuple[RayRun, list[Injection], dict[str, Any]],
) -> None:
    run, injections, facts = faulted
    events = run.events()
    launches = [e for e in events if e.kind == E.EVENT_KIND_LAUNCH]
    assert all(n.startswith("ray-127.0.0.6") for e in launches for n in e.launch.nodes)  # Ray's agents
    print(f"first step {facts['first_step_s']:.1f} s after start; whole run {facts['total_s']:.1f} s")
    for r in recoveries(events, injections):
        fault, node = r.injection.fault, r.injection.node
        assert r.detection is not None and r.detection.detection.detector == EXPECTED_DETECTOR[fault], fault
        assert r.attribution is not None and r.attribution.attribution.suspects, fault
        assert r.attribution.attribution.suspects[0].node == node, (fault, r.attribution.message)
        assert r.launch is not None and r.first_step is not None
        assert node not in r.launch.launch.nodes or fault == "crash"
        print(f"{fault:<10} {node:<15} detected {r.detect_s:5.1f} s, training again {r.first_step_s:5.1f} s")
    by_fault = {i.fault: i for i in injections}
    # The lost Ray node's bundle moved to the free worker and its actor started an agent there: a
    # new node joined the pool without a second ask.
    joined = [e.node.node for e in events if e.kind == E.EVENT_KIND_NODE_JOINED]
    assert len(set(joined)) == 4, joined
    # The straggler's node kept its agent under quarantine: it passed its burn-in and came back.
    straggler = by_fault["straggler"]
    assert any(
        e.kind == E.EVENT_KIND_RELEASE and e.release.node == straggler.node and e.seq > straggler.after_seq
        for e in events
    ), "the quarantined straggler node was not burnt in and released"
    assert len(events) < 300, "the event log grew like a loop"


def test_the_run_end_gives_the_ray_allocation_back(
    faulted: tuple[RayRun, list[Injection], dict[str, Any]],
) -> None:
    _, _, facts = faulted
    assert facts["held_after_end"] == ([], [])
    assert facts["leftover"] == []
