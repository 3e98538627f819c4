"""sd_notify on a real unix datagram socket, and the Prometheus endpoint of a real agent."""

from __future__ import annotations

import itertools
import socket
import time
import urllib.request

from runwarden.net import free_port as _free_port
from runwarden.sdnotify import Notifier, watchdog_interval_s
from runwarden.v1 import agent_pb2, common_pb2


def test_agent_sends_ready_and_watchdog_on_notify_socket(agent_factory, tmp_path):
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(20)
    try:
        agent_factory(
            env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"}
        )  # WatchdogSec=0.4 -> ping every 0.2 s
        messages: list[tuple[float, str]] = []
        while sum(1 for _, m in messages if m == "WATCHDOG=1") < 3:
            messages.append((time.monotonic(), sock.recv(4096).decode()))
    finally:
        sock.close()
    first = messages[0][1].splitlines()
    assert first[0] == "READY=1" and first[1].startswith("STATUS=")
    pings = [t for t, m in messages if m == "WATCHDOG=1"]
    assert max(b - a for a, b in itertools.pairwise(pings)) < 0.4 * 2  # within WatchdogSec (tolerant)


def test_notifier_abstract_socket_and_absent_socket():
    name = f"runwarden-test-{time.monotonic_ns()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(5)
    try:
        assert Notifier("@" + name).watchdog()
        assert sock.recv(100) == b"WATCHDOG=1"
    finally:
        sock.close()
    assert Notifier("").ready() is False  # not under systemd: a no-op
    assert Notifier("/nonexistent/sock").ready() is False  # an error is swallowed, never raised
    assert watchdog_interval_s({"WATCHDOG_USEC": "10000000"}) == 5.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval_s({}) is None


def test_metrics_endpoint_counts_rpcs_and_evidence(agent_factory):
    port = _free_port()
    agent = agent_factory(flags=["--metrics-listen", f"127.0.0.1:{port}", "--chaos"])
    agent.stub.ReportProgress(
        agent_pb2.ReportProgressRequest(
            run="r1", attempt=1, reports=[common_pb2.RankProgress(rank=0, step=1)]
        )
    )
    agent.stub.InjectFault(
        agent_pb2.InjectFaultRequest(
            kind=agent_pb2.FAULT_KIND_XID,
            line="NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.",
        )
    )
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    assert 'runwarden_agent_rpc_seconds_count{code="OK",method="ReportProgress"} 1.0' in text
    assert 'runwarden_agent_evidence_total{kind="EVIDENCE_KIND_XID"} 1.0' in text
    assert "runwarden_agent_lease_held 0.0" in text  # standalone: no etcd, no lease
    assert "runwarden_agent_last_heartbeat_age_seconds" in text
