"""A checkpoint save that fails mid-run (the step's directory cannot be created: a file squats on
its path, as a full or broken filesystem would refuse it): no commit marker is written for that
step, the event log says why (CHECKPOINT_FAILED with the rank's error), the attempt ends, and the
relaunch resumes from the previous committed step. And a committed step whose shards rot on disk
afterwards: the load refuses it, and the run resumes from the commit before it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from nodeagent.trainer.checkpoint import latest_committed, read_commit, step_dir
from testbed.wait import wait_until
from tests.e2e.test_planned_stops import _rank_pids

from .helpers import E, assert_log_whole, last_seq, names, since, tail, wait_commit_after

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_failed_save_writes_no_marker_and_the_run_resumes_from_the_previous_commit(make_cluster) -> None:
    cluster = make_cluster(active=2, spares=1, ckpt_every=5)
    assert cluster.wait_for_event(E.EVENT_KIND_FIRST_STEP, 0, 150) is not None, tail(cluster)
    assert wait_commit_after(cluster, 0.0, 60) is not None, tail(cluster)  # the first commit
    latest = latest_committed(cluster.ckpt_dir)
    assert latest is not None
    doomed = (latest.step // 5 + 12) * 5  # a save a few seconds ahead
    blocker = step_dir(cluster.ckpt_dir, doomed)
    blocker.write_text("squatter: this step's directory cannot be created\n")
    mark = last_seq(cluster)
    ended = cluster.wait_for_event(E.EVENT_KIND_EXIT, mark, 90)
    assert ended is not None, f"the failed save did not end the attempt\n{tail(cluster)}"
    # The event log says why: the rank's save error, and that no marker was written.
    failed = [e for e in since(cluster, mark) if e.kind == E.EVENT_KIND_CHECKPOINT_FAILED]
    assert failed and failed[0].step == doomed, names(since(cluster, mark))
    assert "no commit marker" in failed[0].message and failed[0].checkpoint.error, failed[0].message
    blocker.unlink()  # the "disk" recovers; the relaunch can save again
    launch = cluster.wait_for_event(E.EVENT_KIND_LAUNCH, mark, 90)
    assert launch is not None, tail(cluster)
    assert read_commit(step_dir(cluster.ckpt_dir, doomed)) is None, "a commit marker for the failed save"
    commits = [
        e.step for e in cluster.events() if e.kind == E.EVENT_KIND_CHECKPOINT_COMMIT and e.seq < launch.seq
    ]
    assert commits and max(commits) < doomed
    # the newest commit the controller had recorded (it learns commits from progress reports, so a
    # commit made in the last report interval before the failure may not be among them)
    assert launch.launch.resume_step == max(commits), names(since(cluster, mark))
    assert read_commit(step_dir(cluster.ckpt_dir, launch.launch.resume_step)) is not None
    assert cluster.wait_for_event(E.EVENT_KIND_FIRST_STEP, launch.seq, 120) is not None, tail(cluster)
    assert_log_whole(cluster)


def _flip_a_byte_of_each_shard(step: int, root: Path) -> list[str]:
    d = step_dir(root, step)
    flipped = []
    for shard in sorted(d.glob("*.distcp")):
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))  # the same size: only the recorded checksum can tell
        flipped.append(shard.name)
    return flipped


def test_a_resume_point_with_corrupt_shards_is_dropped_and_the_run_resumes_from_the_commit_before(
    make_cluster,
) -> None:
    """The relaunch's resume point rots on disk (a byte of each shard flipped, sizes unchanged)
    after its commit: the ranks' load refuses it (its shards' checksums recorded at the commit),
    the controller logs CHECKPOINT_INVALID, drops it as a resume point, blames no node, and the
    next attempt resumes from the commit before it and trains on; it never loops on the bad step."""
    cluster = make_cluster(active=2, spares=1, ckpt_every=5)
    assert cluster.wait_for_event(E.EVENT_KIND_FIRST_STEP, 0, 150) is not None, tail(cluster)
    first = wait_commit_after(cluster, 0.0, 60)
    assert first is not None, tail(cluster)
    assert wait_commit_after(cluster, first.ts, 60) is not None, tail(
        cluster
    )  # two commits: one to fall back to
    mark = last_seq(cluster)
    current = max((e for e in cluster.events() if e.kind == E.EVENT_KIND_LAUNCH), key=lambda e: e.seq)
    victim = current.launch.nodes[1]
    pids = wait_until(
        lambda: _rank_pids(victim, current.attempt, cluster.root), 30, "the victim's ranks", 0.2
    )
    os.kill(pids[0], signal.SIGKILL)
    launch = cluster.wait_for_event(E.EVENT_KIND_LAUNCH, mark, 90)
    assert launch is not None, tail(cluster)
    bad = launch.launch.resume_step
    assert bad >= 0 and _flip_a_byte_of_each_shard(bad, cluster.ckpt_dir), (
        bad
    )  # before the cold ranks load it
    invalid = cluster.wait_for_event(E.EVENT_KIND_CHECKPOINT_INVALID, launch.seq, 120)
    assert invalid is not None, f"no CHECKPOINT_INVALID\n{tail(cluster)}"
    assert invalid.step == bad and ".distcp" in invalid.checkpoint.error, invalid.message
    relaunch = cluster.wait_for_event(E.EVENT_KIND_LAUNCH, invalid.seq, 120)
    assert relaunch is not None, tail(cluster)
    assert 0 <= relaunch.launch.resume_step < bad, relaunch.message
    assert read_commit(step_dir(cluster.ckpt_dir, relaunch.launch.resume_step)) is not None
    assert cluster.wait_for_event(E.EVENT_KIND_FIRST_STEP, relaunch.seq, 120) is not None, tail(cluster)
    after = since(cluster, mark)
    assert not [e for e in after if e.kind == E.EVENT_KIND_QUARANTINE], names(after)  # the files, not a host
    assert not [e for e in after if e.kind == E.EVENT_KIND_RUN_END], names(after)
    assert_log_whole(cluster)
