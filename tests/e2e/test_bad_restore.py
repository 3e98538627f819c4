"""A restore that passes its checksums yet yields a NaN ends in one rollback, never a loop (issue 30;
Megatron-LM #5281: a replica restored without validation gave NaN after load, and every relaunch
loaded it again).

Rank 0's in-memory snapshots from step 65 on are taken of its model with one weight NaN (silent
corruption before the copy: the checksums are the corrupted copy's, so every load check passes);
its training itself stays clean. A rank is killed past step 70: the relaunch resumes from the
newest snapshot, its first step reports a NaN loss, the controller drops the snapshot and relaunches
from the commit of step 60, and that attempt trains on: its losses equal the first attempt's at the
same steps. Real agents, controller and etcd on loopback, real ranks (gloo)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from examples.cluster import ClusterSpec, LocalCluster, leftover_processes
from examples.demo import current_nodes
from runwarden.v1 import events_pb2
from testbed.wait import wait_until

E = events_pb2
pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

COMMIT_EVERY = 60
POISON_FROM = 65
KILL_PAST = 72  # snapshots of 65 and 70 taken (and reported) by then; the next commit at 120


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    spec = ClusterSpec(
        active=2,
        spares=0,
        ckpt_every=COMMIT_EVERY,
        train_args=("--snapshot-every", "5", "--test-poison-snapshots-from", str(POISON_FROM)),
    )
    c = LocalCluster(tmp_path / "cluster", spec)
    try:
        yield c.start()
    finally:
        c.stop()
    assert leftover_processes(c.root) == []


def _losses(cluster: LocalCluster) -> dict[tuple[int, int], float]:
    """(attempt, step) -> rank 0's loss."""
    path = cluster.loss_dir / "loss-rank0.jsonl"
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        if line.endswith("}"):  # a line being written is not whole yet
            rec = json.loads(line)
            out[(rec["attempt"], rec["step"])] = rec["loss"]
    return out


def test_a_snapshot_that_loads_as_nan_is_dropped_once_and_the_run_goes_on_from_the_commit(
    cluster: LocalCluster,
) -> None:
    def tail() -> str:
        return "\n".join(
            f"{e.seq} {E.EventKind.Name(e.kind)} a{e.attempt}: {e.message}" for e in cluster.events()[-40:]
        )

    wait_until(
        lambda: any(a == 1 and s >= KILL_PAST for a, s in _losses(cluster)),
        300,
        f"step {KILL_PAST}",
        detail=tail,
    )
    nodes = current_nodes(cluster)
    killed = cluster.ctl("chaos", nodes[1], "kill-rank")
    assert killed.returncode == 0, killed.stderr

    relaunch = cluster.wait_for_event(E.EVENT_KIND_LAUNCH, 0, 120, pred=lambda e: e.attempt == 2)
    assert relaunch is not None, tail()
    snapshot_step = relaunch.launch.resume_step
    assert relaunch.launch.resume_snapshot_attempt == 1 and snapshot_step >= POISON_FROM, relaunch.message

    anomaly = cluster.wait_for_event(E.EVENT_KIND_LOSS_ANOMALY, relaunch.seq, 120)
    assert anomaly is not None, tail()
    assert anomaly.attempt == 2 and anomaly.loss.rule == "non_finite_after_load", anomaly.message
    assert anomaly.step == snapshot_step + 1 and anomaly.loss.resume_step == COMMIT_EVERY, anomaly.message
    assert f"in-memory snapshot of step {snapshot_step}: dropped" in anomaly.message, anomaly.message

    rollback = cluster.wait_for_event(E.EVENT_KIND_LAUNCH, anomaly.seq, 120, pred=lambda e: e.attempt == 3)
    assert rollback is not None, tail()
    assert rollback.launch.resume_step == COMMIT_EVERY and not rollback.launch.resume_snapshot_attempt, tail()

    # attempt 3 trains past the snapshot's step, exactly as attempt 1 did from the same commit
    past = snapshot_step + 3
    wait_until(lambda: (3, past) in _losses(cluster), 180, f"attempt 3's step {past}", detail=tail)
    losses = _losses(cluster)
    for step in range(COMMIT_EVERY, past + 1):
        assert math.isfinite(losses[(3, step)]), (step, losses[(3, step)])
        if (1, step) in losses:
            assert losses[(3, step)] == losses[(1, step)], step
    events = cluster.events()
    assert [e.attempt for e in events if e.kind == E.EVENT_KIND_LOSS_ANOMALY] == [2], tail()
    assert not [e for e in events if e.kind == E.EVENT_KIND_QUARANTINE], tail()
    assert not [e for e in events if e.kind == E.EVENT_KIND_LAUNCH and e.attempt > 3], tail()
