"""The live controller shell against a real etcd, real agents and real torchrun workers (gloo, CPU).

Issue 5's shell tests: an agent killed -> node-lost detection, attribution, spare taken, relaunch,
all in the event log; a standby controller takes over when the leader is SIGKILLed, with no double
launch (attempt fencing).
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from examples.cluster import LocalCluster
from runwarden.eventlog import LogEntry
from runwarden.v1 import events_pb2
from testbed.wait import wait_contender

E = events_pb2
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _launches(cluster: LocalCluster) -> list[LogEntry]:
    return [e for e in cluster.events() if e.kind == E.EVENT_KIND_LAUNCH]


def _wait_first_step(cluster: LocalCluster, after_seq: int = 0, timeout_s: float = 120) -> LogEntry:
    ev = cluster.wait_for_event(E.EVENT_KIND_FIRST_STEP, after_seq, timeout_s)
    assert ev is not None, (
        f"no first step; controller log:\n{(cluster.run_dir / 'controller.log').read_text()[-3000:]}"
    )
    return ev


def _wait_commit_after(cluster: LocalCluster, ts: float, log: str = "controller.log") -> LogEntry:
    ev = cluster.wait_for_event(E.EVENT_KIND_CHECKPOINT_COMMIT, 0, 90, pred=lambda e: e.ts > ts)
    assert ev is not None, f"no checkpoint committed; {log}:\n{(cluster.run_dir / log).read_text()[-3000:]}"
    return ev


def test_agent_killed_is_detected_blamed_replaced_and_relaunched(make_cluster) -> None:
    cluster: LocalCluster = make_cluster(active=2, spares=1, ckpt_every=5, warm_workers=None)
    _wait_commit_after(cluster, _wait_first_step(cluster).ts)  # steady training before the fault
    first = _launches(cluster)[-1].launch.nodes
    victim = first[0]
    (spare_node,) = set(cluster.nodes) - set(first)  # the one node the first attempt left as a spare
    mark = cluster.events()[-1].seq
    killed_at = time.time()
    cluster.kill_agent_process(victim)  # SIGKILL: the lease is not revoked, it expires

    relaunch = cluster.wait_for_event(E.EVENT_KIND_LAUNCH, mark, 90)
    assert relaunch is not None, (cluster.run_dir / "controller.log").read_text()[-3000:]
    _wait_first_step(cluster, relaunch.seq, 120)
    after = [e for e in cluster.events() if e.seq > mark]
    detect = next(e for e in after if e.kind == E.EVENT_KIND_DETECTION)
    assert detect.detection.detector == E.DETECTOR_NODE_LOST
    assert victim in detect.detection.nodes
    # Lease TTL 2 s: the DELETE arrives within TTL + 0.5 s of the last keepalive; + 1 s of slack.
    assert detect.ts - killed_at <= cluster.spec.lease_ttl_s + 1.0 + 1.0
    blame = next(e for e in after if e.kind == E.EVENT_KIND_ATTRIBUTION)
    assert blame.attribution.suspects and blame.attribution.suspects[0].node == victim
    spare = next(e for e in after if e.kind == E.EVENT_KIND_SPARE_TAKEN)
    assert spare.spare.replaces == victim and spare.spare.node == spare_node
    assert victim not in relaunch.launch.nodes and spare_node in relaunch.launch.nodes
    assert relaunch.attempt == 2 and relaunch.launch.rendezvous_id == "demo-2"
    committed = [
        e.step for e in cluster.events() if e.kind == E.EVENT_KIND_CHECKPOINT_COMMIT and e.seq < relaunch.seq
    ]
    assert relaunch.launch.resume_step == (max(committed) if committed else -1)
    # What an operator sees: controllerctl against this live controller (tables and --json).
    status = json.loads(cluster.ctl("status", "--json").stdout)["runs"][0]
    assert int(status["attempt"]) == 2 and victim not in status["nodes"]
    nodes = {n["node"]: n for n in json.loads(cluster.ctl("nodes", "--json").stdout)["nodes"]}
    assert nodes[victim].get("alive", False) is False and nodes[spare_node]["alive"] is True
    table = cluster.ctl("nodes")
    assert table.returncode == 0 and victim in table.stdout and spare_node in table.stdout
    events = cluster.ctl("events", "--kind", "detection", "--json")
    assert events.returncode == 0 and "DETECTOR_NODE_LOST" in events.stdout
    # The controller exports the goodput report, computed from the same event log, to Prometheus.
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert 'runwarden_goodput_ratio{run="demo"}' in text
    assert 'runwarden_goodput_failures{run="demo"} 1.0' in text


def test_standby_takes_over_without_a_double_launch(make_cluster) -> None:
    cluster: LocalCluster = make_cluster(active=2, spares=1, ckpt_every=5, warm_workers=None)
    _wait_first_step(cluster)  # controller-a leads this attempt
    cluster.start_standby("controller-b")
    assert cluster.etcd is not None
    wait_contender(cluster.etcd.endpoint, cluster.spec.run, "controller-b")
    before = len(_launches(cluster))
    assert cluster.controller is not None
    os.killpg(cluster.controller.pid, signal.SIGKILL)  # the leader dies mid-run
    killed_at = time.time()
    # The standby wins the election once the leader's election lease (TTL 3 s) expires; it relists,
    # sees a healthy attempt with fresh progress and does NOT relaunch it.
    took_over = cluster.wait_for_event(E.EVENT_KIND_CONTROL_PLANE, 0, 30, pred=lambda e: e.ts > killed_at)
    assert took_over is not None, (cluster.run_dir / "controller-b.log").read_text()[-3000:]
    assert took_over.ts - killed_at <= 3.0 + 2.0
    # a commit logged 5 s on: the new leader has supervised the attempt that long (a relaunch is logged first)
    _wait_commit_after(cluster, time.time() + 5, "controller-b.log")
    assert len(_launches(cluster)) == before, "the new leader relaunched a healthy attempt"
    # The new leader still supervises: a crash is detected and relaunched exactly once.
    nodes = _launches(cluster)[-1].launch.nodes
    mark = cluster.events()[-1].seq
    out = cluster.ctl("--controller", f"127.0.0.1:{_standby_port(cluster)}", "chaos", nodes[0], "kill-rank")
    assert out.returncode == 0, out.stderr
    relaunch = cluster.wait_for_event(E.EVENT_KIND_LAUNCH, mark, 90)
    assert relaunch is not None
    _wait_first_step(cluster, relaunch.seq, 120)
    attempts = [e.attempt for e in _launches(cluster)]
    assert attempts == sorted(attempts) and max(Counter(attempts).values()) == 1, attempts
    seqs = [e.seq for e in cluster.events()]
    assert seqs == list(range(1, len(seqs) + 1)), "the event log has a gap or a duplicate"


def _standby_port(cluster: LocalCluster) -> int:
    proc = cluster.standbys["controller-b"]
    args = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
    return int(args[args.index(b"--api") + 1].decode().rsplit(":", 1)[1])
