"""A checkpoint save that fails mid-run (the step's directory cannot be created: a file squats on
its path, as a full or broken filesystem would refuse it): no commit marker is written for that
step, the event log says why (CHECKPOINT_FAILED with the rank's error), the attempt ends, and the
relaunch resumes from the previous committed step."""

from __future__ import annotations

import pytest

from nodeagent.trainer.checkpoint import latest_committed, read_commit, step_dir

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
