"""Issue 6: the main job, proven. A real supervised DDP run survives five injected faults and
computes exactly what an uninterrupted run of the same seed computes.

One faulted run (etcd, 6 agents, the controller, torchrun + gloo on CPU) is shared by the
assertions below; a reference run of the same script without faults (torchrun --standalone, same
world size and seed) gives the losses to compare with. It runs across a fleet of network-namespace
hosts (issue 15: etcd, the controller and each agent on its own host, mTLS, the collectives on each
host's eth0), where the node-lost fault hits node rank 0, so the rendezvous host moves to another
node; where the kernel gives no network namespaces it runs on one host (every "node" a process on
127.0.0.1, the demo's layout). Once, not both: the suite's 25 min budget; the one-host layout runs
in the planned-stop, live-controller and reliability tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from controller.goodput.report import compute_goodput
from examples.cluster import REPO, ClusterSpec, LocalCluster, leftover_processes
from examples.demo import FAULTS, Recovery, recoveries, run_faults
from runwarden.eventlog import read_events
from runwarden.testing.fleet import Fleet, default_prefix, sweep_orphans
from runwarden.testing.fleet import available as fleet_available
from runwarden.testing.fleet_cluster import FleetCluster
from runwarden.v1 import events_pb2

E = events_pb2
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

EXPECTED_DETECTOR = {
    "crash": E.DETECTOR_CRASH,
    "hang": E.DETECTOR_HANG,
    "node-lost": E.DETECTOR_NODE_LOST,
    "straggler": E.DETECTOR_STRAGGLER,
    "xid": E.DETECTOR_EVIDENCE,
}


@dataclass
class FaultedRun:
    cluster: LocalCluster | FleetCluster
    events: list[events_pb2.Event]
    recoveries: list[Recovery]
    torn_tail: str | None
    log_errors: int


@pytest.fixture(scope="module")
def faulted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultedRun]:
    root = tmp_path_factory.mktemp("supervised")
    spec = ClusterSpec(policy={"kill_stragglers_mid_run": True})
    with contextlib.ExitStack() as stack:
        cluster: LocalCluster | FleetCluster
        victims: dict[str, int] = {}
        ok, reason = fleet_available()
        if ok:
            sweep_orphans()
            fleet = stack.enter_context(Fleet(default_prefix()))
            cluster = FleetCluster(fleet, root / "cluster", spec)
            victims = {"node-lost": 0}  # node rank 0 hosts the rendezvous: it moves to another node
        else:
            print(f"no network namespaces ({reason}): the five faults on one host instead")
            cluster = LocalCluster(root / "cluster", spec)
        try:
            cluster.start()
            assert cluster.wait_for_event(E.EVENT_KIND_FIRST_STEP, 0, 150) is not None, _tail(cluster)
            time.sleep(1)
            injections = run_faults(cluster, list(FAULTS), timeout_s=90, victim_ranks=victims)
            cluster.ctl("stop", cluster.spec.run, "--reason", "test finished")
            assert cluster.wait_for_event(E.EVENT_KIND_RUN_END, 0, 90) is not None, _tail(cluster)
        finally:
            cluster.stop()
        read = read_events(cluster.event_log)
        yield FaultedRun(
            cluster=cluster,
            events=read.events,
            recoveries=recoveries(read.events, injections),
            torn_tail=read.torn_tail,
            log_errors=len(read.errors),
        )
    if isinstance(cluster, LocalCluster):
        assert leftover_processes(cluster.root) == []


def _tail(cluster: LocalCluster | FleetCluster) -> str:
    if isinstance(cluster, FleetCluster):
        return cluster.controller_log()[-4000:]
    return (cluster.run_dir / "controller.log").read_text()[-4000:]


def _losses(loss_dir: Path) -> dict[int, list[float]]:
    """step -> every loss rank 0 logged for it (a step replayed after a resume appears twice)."""
    out: dict[int, list[float]] = defaultdict(list)
    for line in (loss_dir / "loss-rank0.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[int(rec["step"])].append(float(rec["loss"]))
    return out


def test_every_fault_was_detected_attributed_and_recovered(faulted: FaultedRun) -> None:
    assert [r.injection.fault for r in faulted.recoveries] == list(FAULTS)
    for r in faulted.recoveries:
        fault, node = r.injection.fault, r.injection.node
        assert r.injection.recovered, f"{fault}: no first step after the fault"
        assert r.detection is not None, f"{fault}: not detected"
        assert r.detection.detection.detector == EXPECTED_DETECTOR[fault], (fault, r.detection.message)
        assert r.attribution is not None and r.attribution.attribution.suspects, f"{fault}: no suspect"
        blamed = r.attribution.attribution.suspects[0].node
        # The hung rank is blamed, not the ranks that wait for it in the collective.
        assert blamed == node, f"{fault}: blamed {blamed}, injected into {node}: {r.attribution.message}"
        assert r.launch is not None and r.first_step is not None
        if fault == "crash":
            # No hardware evidence: first to exit, but on a first offence not quarantined.
            assert r.attribution.attribution.method == "first_exit"
            assert not r.quarantined
        else:
            assert r.quarantined, f"{fault}: {node} was not quarantined"
            # Back in the next attempt only if it passed its burn-in (and was released) first.
            released = any(
                e.kind == E.EVENT_KIND_RELEASE
                and e.release.node == node
                and r.injection.after_seq < e.seq < r.launch.seq
                for e in faulted.events
            )
            assert node not in r.launch.launch.nodes or released


def test_detection_latency_goals(faulted: FaultedRun) -> None:
    by_fault = {r.injection.fault: r for r in faulted.recoveries}
    lost = by_fault["node-lost"]
    # The agent exits 0.2 s after the chaos RPC; the lease (TTL 2 s) expires within TTL + 0.5 s.
    assert lost.detect_s <= 0.2 + faulted.cluster.spec.lease_ttl_s + 1.0 + 0.5
    hang = by_fault["hang"]
    assert hang.detection is not None
    assert hang.detection.detection.latency_s <= 10.0 + 2.0  # hang timeout max(10 s, 3 x median step) + 2 s
    for r in faulted.recoveries:
        assert r.first_step is not None and r.detection is not None
        assert r.first_step.ts - r.detection.ts <= 30.0 + 15.0, f"{r.injection.fault}: slow recovery"


def test_resumes_only_from_committed_checkpoints_with_fresh_rendezvous(faulted: FaultedRun) -> None:
    committed: set[int] = set()
    quarantined: set[str] = set()
    rdzv: list[str] = []
    for ev in faulted.events:
        if ev.kind == E.EVENT_KIND_CHECKPOINT_COMMIT:
            committed.add(ev.step)
        elif ev.kind == E.EVENT_KIND_QUARANTINE:
            quarantined.add(ev.quarantine.node)
        elif ev.kind == E.EVENT_KIND_RELEASE:
            quarantined.discard(ev.release.node)
        elif ev.kind == E.EVENT_KIND_LAUNCH:
            rdzv.append(ev.launch.rendezvous_id)
            assert ev.launch.rendezvous_id == f"{ev.run}-{ev.attempt}"
            assert ev.launch.resume_step == (max(committed) if committed else -1), ev.message
            assert not quarantined & set(ev.launch.nodes), (
                f"launched quarantined {quarantined & set(ev.launch.nodes)}"
            )
    assert len(rdzv) == len(set(rdzv)) >= 1 + len(FAULTS)
    assert committed, "no checkpoint was ever committed"


def test_event_log_is_whole_and_goodput_adds_up(faulted: FaultedRun) -> None:
    assert faulted.torn_tail is None and faulted.log_errors == 0
    seqs = [e.seq for e in faulted.events]
    assert seqs == list(range(1, len(seqs) + 1))
    report = compute_goodput(faulted.events, run=faulted.cluster.spec.run).to_proto()
    assert report.allocated_s > 0
    assert abs(report.productive_s + report.lost_s - report.allocated_s) < 1e-6
    assert sum(c.seconds for c in report.lost_by_cause) == pytest.approx(report.lost_s, abs=1e-6)
    assert report.failures == len(FAULTS)


def test_losses_equal_an_uninterrupted_run_of_the_same_seed(faulted: FaultedRun, tmp_path: Path) -> None:
    assert_losses_equal_an_uninterrupted_run(faulted.cluster, tmp_path)


def assert_losses_equal_an_uninterrupted_run(cluster: LocalCluster | FleetCluster, tmp_path: Path) -> None:
    """Rank 0's loss at every step (replays after a resume included) equals a reference run's."""
    got = _losses(cluster.loss_dir)
    last = max(got)
    assert last > 100
    spec = cluster.spec
    ref_dir = tmp_path / "reference"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for k in [k for k in env if k.startswith("RUNWARDEN_")]:
        del env[k]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={spec.active}",
            "--max-restarts=0",
            str(REPO / "examples" / "train.py"),
            "--steps",
            str(last + 1),
            "--ckpt-dir",
            str(tmp_path / "ckpt"),
            "--ckpt-every",
            str(spec.ckpt_every),
            "--out",
            str(ref_dir),
            "--seed",
            str(spec.seed),
            "--step-sleep",
            "0",
        ],
        check=True,
        env=env,
        timeout=300,
        capture_output=True,
    )
    want = _losses(ref_dir)
    replayed = 0
    for step, values in got.items():
        replayed += len(values) > 1
        for value in values:
            # gloo's reduction order can differ between process layouts: within 1e-6, else bitwise.
            assert value == pytest.approx(want[step][0], rel=1e-6, abs=1e-6), (
                f"step {step}: {value} vs {want[step]}"
            )
    assert replayed > 0, "no step was ever replayed after a resume: the faults did not roll anything back"
