"""Issue 26: each checkpoint save's stall, as the trainer measures it and reports it with the commit.

Two real gloo ranks save through a real DcpCheckpointer onto slow storage (tests/nodeagent/
save_stall_job.py says what each rank does). The stall a save reports must be the time the training
thread was blocked by it, as the rank measured from outside around its own save() and wait() calls:
with async_save the staging, not the upload; the wait for a save (in the next save, or the final
wait before exit) is that save's; a synchronous save is blocked whole. Then the reporter's side: a
commit goes to a real agent with its stall, and an old-format `save_checkpoint` is timed too.
"""

from __future__ import annotations

import contextlib
import functools
import math
import queue
import time
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp
from torch import nn

from nodeagent import trainer
from nodeagent.daemon.progress import ProgressTable
from nodeagent.trainer.checkpoint import read_commit, step_dir
from runwarden.v1 import agent_pb2, common_pb2
from tests.nodeagent import save_stall_job
from tests.nodeagent.helpers import wait_for

WORLD = 2
UPLOAD_S = save_stall_job.UPLOAD_S
SLACK_S = 0.1  # a few Python lines between the rank's clock and the saver's, on a loaded host


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("stall")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    args = (WORLD, str(tmp / "store"), str(tmp / "ckpt"), out)
    procs = [ctx.Process(target=save_stall_job.run_rank, args=(r, *args)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + 180
    try:
        while len(results) < WORLD:
            assert time.monotonic() < deadline, "the ranks did not finish in 180 s"
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not failed, f"a rank failed: exit codes {failed}"
            with contextlib.suppress(queue.Empty):
                rank, result = out.get(timeout=0.5)
                results[rank] = result
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return tmp / "ckpt", results


def _took(r: dict[str, Any], call: str) -> float:
    start, end = r["blocked"][call]
    return float(end - start)


def _stalls(r: dict[str, Any]) -> dict[int, float]:
    return {step: stall for step, stall, _ in r["commits"]}


def test_async_stall_is_the_blocked_time_and_the_wait_for_a_save_is_that_saves(
    ranks: tuple[Path, dict[int, dict[str, Any]]],
) -> None:
    _, results = ranks
    r = results[0]
    stalls = _stalls(r)
    assert [s for s, _, _ in r["commits"]] == [1, 2, 3, 4], r["commits"]
    print(f"rank 0: blocked {r['blocked']}, reported {stalls}")
    # save2's call waited for step 1's upload: that wait is step 1's stall, not step 2's
    assert stalls[1] >= 0.9 * UPLOAD_S, stalls
    assert stalls[1] <= _took(r, "save1") + _took(r, "save2") + SLACK_S
    # the final wait(): step 2 blocked training until its commit
    assert stalls[2] >= _took(r, "wait2") - SLACK_S and stalls[2] >= 0.9 * UPLOAD_S, stalls
    # every blocked second is some save's, once
    total = _took(r, "save1") + _took(r, "save2") + _took(r, "wait2")
    assert abs(stalls[1] + stalls[2] - total) <= SLACK_S, (stalls, total)


def test_an_async_upload_training_does_not_wait_for_is_no_stall(
    ranks: tuple[Path, dict[int, dict[str, Any]]],
) -> None:
    _, results = ranks
    r = results[0]
    stall = _stalls(r)[3]
    start, end = r["blocked"]["save3"]
    committed_at = next(at for step, _, at in r["commits"] if step == 3)
    assert committed_at - start >= 0.9 * UPLOAD_S, "the upload was not slow: nothing shown"
    assert abs(stall - (end - start)) <= SLACK_S, (stall, end - start)
    assert stall < committed_at - start - 0.8 * UPLOAD_S  # the upload is not in it
    assert stall == pytest.approx(r["stall3"], abs=1e-3)  # nothing added after the commit


def test_a_synchronous_save_is_blocked_whole(ranks: tuple[Path, dict[int, dict[str, Any]]]) -> None:
    _, results = ranks
    r = results[0]
    stall = _stalls(r)[4]
    assert stall >= 0.9 * UPLOAD_S
    assert stall <= _took(r, "save4") <= stall + SLACK_S  # the marker's own write comes after


def test_every_rank_reports_its_own_stall_and_the_marker_keeps_rank_0s(
    ranks: tuple[Path, dict[int, dict[str, Any]]],
) -> None:
    root, results = ranks
    other = _stalls(results[1])
    assert other, "rank 1 confirmed no commit"
    assert all(math.isfinite(s) and s >= 0 for s in other.values())
    if 1 in other:  # rank 1 waited for its own upload of step 1 in its save of step 2
        assert other[1] >= 0.9 * UPLOAD_S, other
    for step, stall in _stalls(results[0]).items():
        commit = read_commit(step_dir(root / ("sync" if step == 4 else "async"), step))
        assert commit is not None
        assert commit.meta["save_stall_s"] == pytest.approx(stall, abs=1e-5)


def test_the_commit_reaches_the_agent_at_once_with_its_stall(agent_factory: Any, tmp_path: Path) -> None:
    agent = agent_factory()
    # no periodic flush within the test: each commit is sent by set_committed itself
    r = trainer.ProgressReporter(
        run="r1",
        attempt=1,
        rank=0,
        local_rank=0,
        world_size=1,
        agent_socket=agent.socket,
        flush_interval_s=600,
    )

    def reported() -> Any:
        ranks = agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest()).ranks
        return ranks[0] if ranks else None

    def committed(step: int) -> bool:
        p = reported()
        return p is not None and p.committed_step == step

    r.report(5)
    r.set_committed(5, save_stall_s=0.25)
    wait_for(lambda: committed(5), 10, "the commit at the agent")
    assert reported().save_stall_s == pytest.approx(0.25)
    for step, bad in enumerate((float("nan"), float("inf"), -1.0), start=10):  # never sent as a stall
        r.set_committed(step, save_stall_s=bad)
        wait_for(functools.partial(committed, step), 10, f"commit {step} at the agent")
        assert reported().save_stall_s == 0.0
    # the old format: save_checkpoint times itself and set_committed(step) sends it
    model = nn.Linear(256, 256)
    start = time.perf_counter()
    commit = trainer.save_checkpoint(tmp_path / "ckpt", 20, model=model)
    took = time.perf_counter() - start
    assert commit is not None
    r.set_committed(20)
    wait_for(lambda: committed(20), 10, "commit 20 at the agent")
    assert 0 < reported().save_stall_s <= took
    r.set_committed(13)  # resumed from: this process did not save it
    wait_for(lambda: committed(13), 10, "commit 13 at the agent")
    assert reported().save_stall_s == 0.0
    r.close()


def test_a_newer_commit_is_written_to_etcd_at_once() -> None:
    table = ProgressTable()

    def record(step: int, committed: int | None) -> int:
        report = common_pb2.RankProgress(rank=0, step=step, reported_at=float(step))
        if committed is not None:
            report.committed_step, report.save_stall_s = committed, 0.1
        table.record("r1", 1, [report])
        return table.take_urgent_reports()

    assert record(7, None) == 0
    assert record(8, 8) == 1  # the commit: the agent writes at once
    assert record(9, 8) == 0  # the same commit again: the next interval's write
    assert record(16, 16) == 1
