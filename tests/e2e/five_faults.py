"""The five-fault supervised run's checks, shared by every layout it runs on (the fleet of
network-namespace hosts, one host, a real Slurm cluster): each fault detected by the right
detector, blamed on the node it was injected into and recovered from; resumes only from committed
checkpoints with a fresh rendezvous; an event log that is whole; losses equal to an uninterrupted
run of the same seed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Protocol

import pytest

from controller.goodput.report import compute_goodput
from examples.cluster import REPO, ClusterSpec
from examples.demo import FAULTS, Recovery
from runwarden.eventlog import LogEntry
from runwarden.v1 import events_pb2

E = events_pb2

EXPECTED_DETECTOR = {
    "crash": E.DETECTOR_CRASH,
    "hang": E.DETECTOR_HANG,
    "node-lost": E.DETECTOR_NODE_LOST,
    "straggler": E.DETECTOR_STRAGGLER,
    "xid": E.DETECTOR_EVIDENCE,
}


class TrainedRun(Protocol):
    """What the loss check needs of a run: its spec and where rank 0 logged its losses."""

    @property
    def spec(self) -> ClusterSpec: ...

    @property
    def loss_dir(self) -> Path: ...


def rank0_losses(loss_dir: Path) -> dict[int, list[float]]:
    """step -> every loss rank 0 logged for it (a step replayed after a resume appears twice)."""
    out: dict[int, list[float]] = defaultdict(list)
    for line in (loss_dir / "loss-rank0.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[int(rec["step"])].append(float(rec["loss"]))
    return out


def check_every_fault_recovered(
    recoveries: list[Recovery], events: list[LogEntry], *, host_dies: bool = False
) -> None:
    """host_dies: the node-lost fault kills the whole host (its ranks and the c10d store with it,
    when it is node rank 0), so the other ranks may exit before its lease expires: the first
    detector is then a crash, and the blame must still be the lost node's heartbeat."""
    assert [r.injection.fault for r in recoveries] == list(FAULTS)
    for r in recoveries:
        fault, node = r.injection.fault, r.injection.node
        assert r.injection.recovered, f"{fault}: no first step after the fault"
        assert r.detection is not None, f"{fault}: not detected"
        detectors = {EXPECTED_DETECTOR[fault]}
        if fault == "node-lost" and host_dies:
            detectors.add(E.DETECTOR_CRASH)
        assert r.detection.detection.detector in detectors, (fault, r.detection.message)
        if fault == "node-lost":
            blame = r.attribution.attribution.blame_method if r.attribution else None
            assert blame == E.BLAME_METHOD_HEARTBEAT, (
                r.attribution.message if r.attribution else "no attribution"
            )
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
                for e in events
            )
            assert node not in r.launch.launch.nodes or released
            if fault == "xid":  # a GPU off the bus is held for repair: no burn-in brings it back
                assert not released and not any(
                    e.kind == E.EVENT_KIND_RELEASE
                    and e.release.node == node
                    and e.seq > r.injection.after_seq
                    for e in events
                ), f"the Xid node {node} came back without a repair"


def check_resumes_only_from_commits(events: list[LogEntry]) -> list[LogEntry]:
    """Every launch resumes from the newest commit, or from an in-memory snapshot newer than it that
    its message names (controller/supervisor/snapshots.py); those launches, in order."""
    committed: set[int] = set()
    from_snapshots: list[LogEntry] = []
    quarantined: set[str] = set()
    rdzv: list[str] = []
    for ev in events:
        if ev.kind == E.EVENT_KIND_CHECKPOINT_COMMIT:
            committed.add(ev.step)
        elif ev.kind == E.EVENT_KIND_QUARANTINE:
            quarantined.add(ev.quarantine.node)
        elif ev.kind == E.EVENT_KIND_RELEASE:
            quarantined.discard(ev.release.node)
        elif ev.kind == E.EVENT_KIND_LAUNCH:
            rdzv.append(ev.launch.rendezvous_id)
            assert ev.launch.rendezvous_id == f"{ev.run}-{ev.attempt}"
            newest = max(committed) if committed else -1
            if ev.launch.resume_snapshot_attempt:
                assert 0 < ev.launch.resume_snapshot_attempt < ev.attempt and ev.launch.resume_step > newest
                assert f"in-memory snapshot of step {ev.launch.resume_step}" in ev.message, ev.message
                from_snapshots.append(ev)
            else:
                assert ev.launch.resume_step == newest, ev.message
            assert not quarantined & set(ev.launch.nodes), (
                f"launched quarantined {quarantined & set(ev.launch.nodes)}"
            )
    assert len(rdzv) == len(set(rdzv)) >= 1 + len(FAULTS)
    assert committed, "no checkpoint was ever committed"
    return from_snapshots


KILLED_IN_COLLECTIVES = "did not leave their collectives"  # the agent's launch detail for a group made new


def snapshot_fallbacks(events: list[LogEntry]) -> dict[int, int]:
    """The attempts that resumed from an in-memory snapshot although one of their nodes came up with
    new processes after all (its ranks did not leave the attempt before within the park timeout and
    were killed, so they hold nothing): the ranks refused the snapshot, and the controller
    relaunched from the newest commit at once (controller/supervisor/resume_points.py), a failure
    on no node. The controller chooses the resume point before the launch's answers say which
    nodes kept their processes. attempt -> the attempt that relaunched it. Each is checked whole:
    the refusal logged for that snapshot, the next launch from a commit."""
    launches = {e.attempt: e for e in events if e.kind == E.EVENT_KIND_LAUNCH}
    out: dict[int, int] = {}
    for attempt, launch in launches.items():
        if not launch.launch.resume_snapshot_attempt:
            continue
        killed = [
            e
            for e in events
            if e.kind == E.EVENT_KIND_WORKERS_STARTED
            and e.attempt == attempt
            and any(
                KILLED_IN_COLLECTIVES in n.detail and "killed" in n.detail for n in e.workers_started.nodes
            )
        ]
        refused = [
            e
            for e in events
            if e.kind == E.EVENT_KIND_CHECKPOINT_INVALID
            and e.attempt == attempt
            and f"in-memory snapshot of step {launch.launch.resume_step} refused" in e.message
        ]
        if killed and refused:
            after = launches.get(attempt + 1)
            assert after is not None and not after.launch.resume_snapshot_attempt, (attempt, after)
            out[attempt] = attempt + 1
    return out


def check_event_log_whole(events: list[LogEntry], run: str, torn_tail: str | None, log_errors: int) -> None:
    assert torn_tail is None and log_errors == 0
    seqs = [e.seq for e in events]
    assert seqs == list(range(1, len(seqs) + 1))
    report = compute_goodput(events, run=run).to_proto()
    assert report.allocated_s > 0
    assert abs(report.productive_s + report.lost_s - report.allocated_s) < 1e-6
    assert sum(c.seconds for c in report.lost_by_cause) == pytest.approx(report.lost_s, abs=1e-6)
    assert report.failures == len(FAULTS) + len(snapshot_fallbacks(events))


# (job, world size, seed) -> (steps run, rank 0's losses) of an uninterrupted reference run. A step's loss
# does not depend on how many steps the run is given, so the modules that check losses (one host,
# the fleet, Slurm) share one reference run per layout instead of paying torch's start-up each.
_REFERENCES: dict[tuple[str, int, int], tuple[int, dict[int, list[float]]]] = {}
REFERENCE_MIN_STEPS = 600


def reference_command(spec: ClusterSpec, steps: int, tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """The uninterrupted run of `spec`'s job: torchrun --standalone, the same world size and seed, no
    step sleep, one save at the end; rank 0's losses go to tmp_path/reference (read them with
    rank0_losses). The command line and its environment, for a caller that runs it alongside a
    cluster instead of after it."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for k in [k for k in env if k.startswith("RUNWARDEN_")]:
        del env[k]
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={spec.active}",
        "--max-restarts=0",
        str(REPO / spec.script),
        "--steps",
        str(steps),
        "--ckpt-dir",
        str(tmp_path / "ckpt"),
        "--ckpt-every",
        str(steps),
        "--out",
        str(tmp_path / "reference"),
        "--seed",
        str(spec.seed),
        "--step-sleep",
        "0",
    ]
    return argv, env


def reference_losses(spec: ClusterSpec, steps: int, tmp_path: Path) -> dict[int, list[float]]:
    """Rank 0's loss per step of an uninterrupted torchrun --standalone run of the same job."""
    key = (spec.script, spec.active, spec.seed)
    cached = _REFERENCES.get(key)
    if cached is not None and cached[0] >= steps:
        return cached[1]
    steps = max(steps, REFERENCE_MIN_STEPS)
    argv, env = reference_command(spec, steps, tmp_path)
    subprocess.run(argv, check=True, env=env, timeout=300, capture_output=True)
    losses = rank0_losses(tmp_path / "reference")
    assert max(losses) == steps - 1, f"the reference run stopped at step {max(losses)} of {steps}"
    _REFERENCES[key] = (steps, losses)
    return losses


def assert_losses_equal_an_uninterrupted_run(cluster: TrainedRun, tmp_path: Path) -> None:
    """Rank 0's loss at every step (replays after a resume included) equals a reference run's."""
    got = rank0_losses(cluster.loss_dir)
    last = max(got)
    assert last > 100
    want = reference_losses(cluster.spec, last + 1, tmp_path)
    replayed = 0
    for step, values in got.items():
        replayed += len(values) > 1
        for value in values:
            # gloo's reduction order can differ between process layouts: within 1e-6, else bitwise.
            assert value == pytest.approx(want[step][0], rel=1e-6, abs=1e-6), (
                f"step {step}: {value} vs {want[step]}"
            )
    assert replayed > 0, "no step was ever replayed after a resume: the faults did not roll anything back"
