"""Fault injection through the real agent, the Xid monitor's evidence in etcd, NVML with a fake NVML."""

from __future__ import annotations

import signal
import sys

import pytest

from nodeagent.daemon import proctree
from nodeagent.daemon.monitors import NvmlPoller, XidMonitor
from preflight.nvml import GpuLost, RemappedRows
from runwarden.v1 import agent_pb2, common_pb2, store_pb2
from tests.nodeagent.helpers import ROOT, wait_for

XID79 = "[ 1234.5] NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus."


def _launch_reporting_rank(agent, run="r1"):
    agent.stub.LaunchWorkers(
        agent_pb2.LaunchWorkersRequest(
            run=run,
            attempt=1,
            argv=[sys.executable, str(ROOT / "tests/nodeagent/rank_progress.py"), "120", "10000000"],
            env={"PYTHONPATH": str(ROOT), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"},
        )
    )

    def reported():
        ranks = agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest()).ranks
        return ranks[0].pid if ranks else 0

    return wait_for(reported, 20, "the rank's first report")


def _worker(agent):
    return agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest()).workers[0]


def test_kill_rank_and_stop_rank(agent_factory):
    agent = agent_factory(flags=["--chaos", "--allow-exec", sys.executable])
    pid = _launch_reporting_rank(agent)
    agent.stub.InjectFault(agent_pb2.InjectFaultRequest(kind=agent_pb2.FAULT_KIND_STOP_RANK, local_rank=0))
    wait_for(
        lambda: (info := proctree.read_proc(pid)) and info.state in ("T", "t"), 5, "the rank to be stopped"
    )
    assert _worker(agent).running
    agent.stub.InjectFault(agent_pb2.InjectFaultRequest(kind=agent_pb2.FAULT_KIND_KILL_RANK, local_rank=0))
    wait_for(lambda: not _worker(agent).running, 10, "the worker to end")
    assert _worker(agent).exit.signal == signal.SIGKILL


@pytest.mark.slow
def test_xid_injection_publishes_evidence_and_kill_agent_leaves_the_lease_to_expire(
    etcd, store, agent_factory
):
    agent = agent_factory(
        etcd=etcd.endpoint, etcd_root=store.keys.root, flags=["--chaos", "--lease-ttl", "2"]
    )
    node_key = store.keys.node("n1")
    wait_for(lambda: store.get(node_key), 10, "registration")
    reply = agent.stub.InjectFault(agent_pb2.InjectFaultRequest(kind=agent_pb2.FAULT_KIND_XID, line=XID79))
    assert "79" in reply.detail
    kvs = wait_for(lambda: store.get_prefix(store.keys.evidence_prefix("n1"))[0], 5, "evidence in etcd")
    evidence = store_pb2.EvidenceRecord.FromString(kvs[0].value).evidence
    assert (evidence.xid, evidence.kind, evidence.severity) == (
        79,
        common_pb2.EVIDENCE_KIND_XID,
        common_pb2.SEVERITY_FATAL,
    )
    assert evidence.source == "chaos" and evidence.pci_bus_id == "0000:3b:00" and evidence.observed_at > 0
    # fatal evidence makes the node UNHEALTHY in its record and its status
    status = agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest())
    assert status.state == common_pb2.NODE_STATE_UNHEALTHY and status.recent_evidence[0].xid == 79
    wait_for(
        lambda: (
            store_pb2.NodeRecord.FromString(store.get(node_key).value).state
            == common_pb2.NODE_STATE_UNHEALTHY
        ),
        5,
        "the node record to say UNHEALTHY",
    )
    # its preflight fails while it holds the evidence, whatever the checks find: the controller must
    # not take back into the pool a node whose agent refuses every launch (a repair restarts it)
    items = list(agent.stub.RunPreflight(agent_pb2.RunPreflightRequest(mode="quick"), timeout=120))
    summary = items[-1].summary
    assert not summary.passed and "agent.fatal_evidence" in summary.failed_checks, summary
    [latched] = [i.result for i in items[:-1] if i.result.name == "agent.fatal_evidence"]
    assert "79" in latched.message and "restart the node agent" in latched.remedy, latched

    agent.stub.InjectFault(agent_pb2.InjectFaultRequest(kind=agent_pb2.FAULT_KIND_KILL_AGENT))
    agent.proc.wait(timeout=5)
    assert agent.proc.returncode == 137
    assert store.get(node_key) is not None  # not revoked: it must expire like a crash
    wait_for(lambda: store.get(node_key) is None, 4, "the lease to expire")


def test_xid_monitor_feed_parses_and_ignores_noise():
    seen: list[common_pb2.Evidence] = []
    mon = XidMonitor(
        node="n1", publish=seen.append, gpu_index_of=lambda pci: 3 if pci == "0000:3b:00" else None
    )
    assert mon.feed(b"6,1234,5678,-;usb 1-1: new device", "kmsg") is None
    assert mon.feed("NVRM: Xid (PCI:0000:3b:00): garbage", "kmsg") is None
    ev = mon.feed(b"4,1023,1234567890,-;NVRM: Xid (PCI:0000:3b:00): 13, pid=7, Graphics Exception", "kmsg")
    assert ev is not None and ev.severity == common_pb2.SEVERITY_APPLICATION and ev.gpu_index == 3
    assert [e.xid for e in seen] == [13]


class FakeNvml:
    """The narrow NVML boundary (preflight.nvml.Nvml), scripted per poll."""

    def __init__(self) -> None:
        self.ecc = 0
        self.rows = RemappedRows(correctable=0, uncorrectable=0, pending=False, failure=False)
        self.reasons = 0
        self.lost = False

    def init(self) -> None: ...
    def device_count(self) -> int:
        return 1

    def ecc_uncorrected(self, index: int, *, volatile: bool) -> int:
        if self.lost:
            raise GpuLost("NVML_ERROR_GPU_IS_LOST")
        return self.ecc

    def remapped_rows(self, index: int) -> RemappedRows:
        return self.rows

    def retired_pages_pending(self, index: int) -> bool:
        return False

    def throttle_reasons(self, index: int) -> int:
        return self.reasons

    def recovery_action(self, index: int) -> int:
        return 0


def test_nvml_poller_reports_changes_only_fake_nvml():
    nv = FakeNvml()
    seen: list[common_pb2.Evidence] = []
    poller = NvmlPoller(node="n1", nvml=nv, publish=seen.append)
    nv.ecc = 2
    assert poller.poll_once() == []  # the first reading is the baseline
    nv.ecc, nv.reasons = 3, 0x8 | 0x1  # one more uncorrectable error; HW slowdown (and idle, ignored)
    kinds = [(e.kind, e.severity) for e in poller.poll_once()]
    assert kinds == [
        (common_pb2.EVIDENCE_KIND_ECC_UNCORRECTABLE, common_pb2.SEVERITY_FATAL),
        (common_pb2.EVIDENCE_KIND_THROTTLE, common_pb2.SEVERITY_WARNING),
    ]
    assert poller.poll_once() == []  # nothing new: nothing published
    nv.rows = RemappedRows(correctable=0, uncorrectable=1, pending=True, failure=True)
    assert {e.kind for e in poller.poll_once()} == {
        common_pb2.EVIDENCE_KIND_ROW_REMAP_FAILURE,
        common_pb2.EVIDENCE_KIND_ROW_REMAP_PENDING,
    }
    nv.lost = True
    (lost,) = poller.poll_once()
    assert lost.kind == common_pb2.EVIDENCE_KIND_GPU_LOST and lost.gpu_index == 0 and lost.source == "nvml"
    assert len(seen) == 5
