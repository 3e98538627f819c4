"""SlurmScheduler against a real 4-node Slurm cluster on loopback and a real etcd: the allocation's
batch script (deploy/slurm/agents.sbatch) starts one real node agent per node with srun, and the
agents register in etcd under the Slurm node names.

One Slurm cluster and one etcd for the module; every test uses its own job name, etcd key root
and agent run directory, and finishes what it allocated, so the tests stay independent."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.backends.base import BackendError, RunOutcome, Scheduler
from controller.backends.slurm import SlurmScheduler
from runwarden.store import Store, StoreConfig
from runwarden.v1 import common_pb2, store_pb2
from testbed.etcd_server import EtcdServer
from tests.backends.slurm_cluster import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

NODEAGENT = str(Path(sys.executable).parent / "nodeagent")


@pytest.fixture(scope="module")
def etcd_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path_factory.mktemp("etcd") / "data", fast=True).start()
    yield server
    server.discard()


class Run:
    """One test's run: its scheduler (job name rw-<name>), its etcd root, its agents' directories."""

    def __init__(self, name: str, cluster: SlurmCluster, etcd: EtcdServer, tmp: Path):
        self.name = name
        self.cluster = cluster
        self.tmp = tmp
        self.root = f"/rw-{name}"
        self.agent_run_dir = tmp / "agents"
        agent_toml = tmp / "nodeagent.toml"
        # What every agent shares; the batch script adds --node, --run-dir and --unix-socket.
        # Port 0: all four slurmds (and so all agents) live on 127.0.0.1.
        agent_toml.write_text(
            'listen = "127.0.0.1:0"\nmetrics_listen = ""\nkernel_log = "none"\nnvml_interval_s = 0.0\n'
            "lease_ttl_s = 2.0\nprogress_interval_s = 0.5\nlocal_ranks = 1\nstop_grace_s = 2.0\n"
            "warm_workers = false\n"
        )
        self.section = {
            "job_name": f"rw-{name}",
            "agent_config": str(agent_toml),
            "etcd_endpoints": [etcd.endpoint],
            "etcd_root": self.root,
            "agent_run_dir": str(self.agent_run_dir),
            "nodeagent": [NODEAGENT],
            "output": str(tmp / "%x-%j.out"),
            "slurm_conf": str(cluster.conf),
            "command_timeout_s": 20,
            "allocate_timeout_s": 30,
        }
        self.store = Store.connect(StoreConfig(endpoints=(etcd.endpoint,), root=self.root, timeout_s=5.0))

    def scheduler(self) -> SlurmScheduler:
        """A fresh scheduler, as a newly elected leader builds it from its config."""
        return SlurmScheduler.from_section(dict(self.section), "[slurm]")

    def records(self) -> dict[str, store_pb2.NodeRecord]:
        kvs, _ = self.store.get_prefix(self.store.keys.nodes_prefix())
        out = {}
        for kv in kvs:
            record = store_pb2.NodeRecord.FromString(kv.value)
            out[record.node] = record
        return out

    def wait_registered(self, nodes: set[str], timeout_s: float = 45.0) -> dict[str, store_pb2.NodeRecord]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            records = self.records()
            if nodes <= set(records):
                return records
            time.sleep(0.2)
        raise AssertionError(
            f"agents of {sorted(nodes)} not registered after {timeout_s}s: {sorted(records)}"
        )

    def agent_pids(self) -> list[int]:
        """Processes whose command line names this run's agent directory (the agents)."""
        mark = str(self.agent_run_dir).encode()
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if mark in f.read():
                        pids.append(int(entry))
            except OSError:
                continue
        return pids

    def jobs(self) -> list[tuple[str, str, str]]:
        """(id, name, state) of every job Slurm lists under this run's names."""
        out = self.cluster.cmd(
            "squeue", "--noheader", f"--name=rw-{self.name},rw-{self.name}-more", "--format=%i|%j|%T"
        )
        return [tuple(line.split("|")) for line in out.split()]

    def close(self) -> None:
        # Leave nothing behind even when the test failed before its own finish().
        ids = [job for job, _, _ in self.jobs()]
        if ids:
            self.cluster.cmd("scancel", *ids)
        self.store.close()


@pytest.fixture
def run_factory(
    slurm_cluster_module: SlurmCluster, etcd_module: EtcdServer, tmp_path: Path
) -> Iterator[type[Run]]:
    made: list[Run] = []

    def make(name: str) -> Run:
        (tmp_path / name).mkdir()
        run = Run(name, slurm_cluster_module, etcd_module, tmp_path / name)
        made.append(run)
        return run

    yield make
    for run in made:
        run.close()


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def test_allocate_starts_one_agent_per_node_adopts_on_a_second_call_and_finish_leaves_nothing(
    run_factory, slurm_cluster_module: SlurmCluster
) -> None:
    run = run_factory("alloc")
    scheduler = run.scheduler()
    assert isinstance(scheduler, Scheduler)
    t0 = time.monotonic()
    alloc = scheduler.allocate(2, 1)
    print(f"allocation {alloc.id} running after {time.monotonic() - t0:.1f}s: {alloc.nodes}")
    assert len(alloc.nodes) == 3 and set(alloc.nodes) <= set(slurm_cluster_module.node_names)
    fields = slurm_cluster_module.job_fields(alloc.id)
    assert fields["JobState"] == "RUNNING" and fields["JobName"] == "rw-alloc"
    records = run.wait_registered(set(alloc.nodes))
    print(f"three agents registered {time.monotonic() - t0:.1f}s after the submit")
    assert set(records) == set(alloc.nodes)  # one agent per node, under the Slurm node name
    ports = {r.address for r in records.values()}
    assert len(ports) == 3  # each agent on its own port of 127.0.0.1
    # Its own run directory and socket per node.
    assert sorted(p.name for p in run.agent_run_dir.iterdir()) == sorted(alloc.nodes)
    assert all((run.agent_run_dir / n / "agent.sock").exists() for n in alloc.nodes)

    # A new leader (a fresh scheduler from the same config) adopts the allocation, submits nothing.
    again = run.scheduler().allocate(2, 1)
    assert again == alloc
    assert [(job, state) for job, _, state in run.jobs()] == [(alloc.id, "RUNNING")]

    scheduler.finish(RunOutcome.COMPLETED)
    assert run.jobs() == [] or all(state not in ("RUNNING", "PENDING") for _, _, state in run.jobs())
    wait_for(lambda: not run.agent_pids(), 15, "the agents to exit")
    # SIGTERM: each agent revoked its lease on the way out, so its record is gone at once.
    assert run.records() == {}
    scheduler.finish(RunOutcome.COMPLETED)  # nothing left: a no-op


def test_request_nodes_brings_a_second_allocation_whose_agent_registers(run_factory) -> None:
    run = run_factory("more")
    scheduler = run.scheduler()
    try:
        (first,) = scheduler.allocate(1, 0).nodes
        run.wait_registered({first})
        # The core asks for one more node, never the failed one nor the ones it holds.
        excluded = (first, "node2" if first != "node2" else "node1")
        request = scheduler.request_nodes(1, exclude=excluded, reason="node lost: replace node2")
        assert request.count == 1 and request.id.startswith("slurm:")
        job = request.id.removeprefix("slurm:")
        records = wait_for(lambda: len(r := run.records()) == 2 and r, 45, "the requested node's agent")
        (added,) = set(records) - {first}
        assert added not in excluded
        fields = run.cluster.job_fields(job)
        assert fields["JobName"] == "rw-more-more" and fields["NodeList"] == added
        # A new leader adopts the first allocation, not the request.
        assert run.scheduler().allocate(1, 0).nodes == (first,)
    finally:
        scheduler.finish(RunOutcome.FAILED)
    assert run.jobs() == [] or all(state not in ("RUNNING", "PENDING") for _, _, state in run.jobs())
    wait_for(lambda: not run.agent_pids(), 15, "the agents to exit")


def test_quarantine_drains_with_runwarden_reason_and_release_refuses_an_operator_drain(
    run_factory, slurm_cluster_module: SlurmCluster
) -> None:
    cluster = slurm_cluster_module
    scheduler = run_factory("drain").scheduler()
    cluster.cmd("scontrol", "update", "NodeName=node4", "State=DRAIN", "Reason=fan replaced, ticket 4711")
    try:
        scheduler.quarantine("node3", "xid 79 (GPU fell off the bus)\nat step 1200")
        scheduler.quarantine("node4", "straggler")  # must not overwrite the operator's reason
        states = cluster.wait_states({"node3": "drained", "node4": "drained"})
        assert states["node3"][1] == "runwarden: xid 79 (GPU fell off the bus) at step 1200"
        assert states["node4"][1] == "fan replaced, ticket 4711"

        assert scheduler.release("node4") is False
        assert scheduler.release("node3") is True
        states = cluster.wait_states({"node3": "idle", "node4": "drained"})
        assert states["node4"][1] == "fan replaced, ticket 4711"
        assert scheduler.release("node2") is True  # not drained: nothing to do
        with pytest.raises(BackendError, match="does not know node"):
            scheduler.quarantine("node9", "x")
    finally:
        for node, (state, _) in cluster.node_states().items():
            if "drain" in state:  # RESUME of a node that is not drained is an error
                cluster.cmd("scontrol", "update", f"NodeName={node}", "State=RESUME")
        cluster.wait_states({"node3": "idle", "node4": "idle"})


def test_an_allocation_still_queued_at_the_timeout_stays_queued_and_is_adopted_next_time(run_factory) -> None:
    run = run_factory("big")
    run.section["allocate_timeout_s"] = 1.5
    with pytest.raises(BackendError, match="still PENDING after 2s"):
        run.scheduler().allocate(4, 1)  # five nodes on a four-node cluster: it waits in the queue
    (pending,) = run.jobs()
    assert pending[2] == "PENDING"
    with pytest.raises(BackendError, match=f"allocation {pending[0]} still PENDING"):
        run.scheduler().allocate(4, 1)
    assert run.jobs() == [pending]  # adopted, not submitted twice
    run.scheduler().finish(RunOutcome.STOPPED)
    assert run.jobs() == [] or all(state == "CANCELLED" for _, _, state in run.jobs())


def test_the_time_limit_signal_reaches_the_agents_not_the_batch_shell(run_factory) -> None:
    """--signal=USR1@<lead> without B: is what `scancel --signal=USR1` (no --batch) does now: every
    agent (an srun task) gets it and drains; the batch shell does not, so the job keeps running."""
    run = run_factory("usr1")
    scheduler = run.scheduler()
    try:
        alloc = scheduler.allocate(2, 0)
        run.wait_registered(set(alloc.nodes))
        run.cluster.cmd("scancel", "--signal=USR1", alloc.id)

        def drained() -> dict[str, store_pb2.NodeRecord] | None:
            records = run.records()
            return records if len(records) == 2 and all(x.drain_reason for x in records.values()) else None

        records = wait_for(drained, 15, "both agents to drain")
        assert {x.state for x in records.values()} == {common_pb2.NODE_STATE_DRAINING}
        assert all("SIGUSR1" in x.drain_reason for x in records.values()), records
        assert run.cluster.job_fields(alloc.id)["JobState"] == "RUNNING"
    finally:
        scheduler.finish(RunOutcome.STOPPED)


def test_a_notice_that_comes_before_the_agents_started_does_not_kill_them(run_factory) -> None:
    """Slurm sends --signal up to a minute early: with a 1-minute limit and a 60 s lead, USR1 comes
    as the step starts, before an agent has its handler. The batch script ignores it until then
    (without that, every agent died of SIGUSR1 and the step ended with 138)."""
    run = run_factory("early")
    run.section.update(time_limit="1", signal_lead_s=60)
    scheduler = run.scheduler()
    try:
        alloc = scheduler.allocate(2, 0)
        run.wait_registered(set(alloc.nodes))
        time.sleep(1.0)  # a bounded window: an ignored early notice leaves no trace to wait for
        assert set(run.records()) == set(alloc.nodes)
        assert len(run.agent_pids()) >= 2
        assert run.cluster.job_fields(alloc.id)["JobState"] == "RUNNING"
    finally:
        scheduler.finish(RunOutcome.STOPPED)


def test_a_dead_node_takes_only_its_own_agent_and_the_allocation_lives_on(
    run_factory, slurm_cluster_module: SlurmCluster
) -> None:
    """--no-kill: the host of one agent dies (slurmd, its slurmstepd and the agent SIGKILLed); its
    lease expires, the other agents stay registered, the job keeps running without the node, and a
    new leader's allocate adopts what is left. (Last in the module: it restarts the node after.)"""
    cluster = slurm_cluster_module
    run = run_factory("dead")
    scheduler = run.scheduler()
    alloc = scheduler.allocate(3, 0)
    run.wait_registered(set(alloc.nodes))
    victim = alloc.nodes[1]
    try:
        cluster.kill_node(victim)
        t0 = time.monotonic()
        records = wait_for(
            lambda: victim not in (r := run.records()) and r, 10, f"{victim}'s lease to expire"
        )
        print(f"{victim}'s agent record gone {time.monotonic() - t0:.1f}s after the kill")
        assert set(records) == set(alloc.nodes) - {victim}
        # Slurm notices (SlurmdTimeout=5) and drops the node from the job instead of ending it.
        left = wait_for(
            lambda: (nodes := run.scheduler().allocate(3, 0).nodes) != alloc.nodes and nodes,
            40,
            f"{victim} to leave the allocation",
            1.0,
        )
        print(f"{victim} left allocation {alloc.id} {time.monotonic() - t0:.1f}s after the kill: {left}")
        assert set(left) == set(alloc.nodes) - {victim}
        assert cluster.job_fields(alloc.id)["JobState"] == "RUNNING"
        assert set(run.records()) == set(left)
    finally:
        scheduler.finish(RunOutcome.FAILED)
        cluster.start_node(victim)
        cluster.wait_states({victim: "idle"}, timeout_s=30)
