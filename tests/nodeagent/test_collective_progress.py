"""The rank side of collective-level hang detection: how many collectives each rank has entered on
the default process group and when it entered the newest (RankProgress.collectives_entered,
collective_entered_at), read by the reporter's flush thread and sent with its reports; and
`evaluating()` (RankProgress.in_eval). The bookkeeping alone (nodeagent.trainer.timing.CollectiveCount),
the reporter with a stand-in count, real gloo ranks, and examples/train.py's evaluation."""

from __future__ import annotations

import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from nodeagent import trainer
from nodeagent.trainer import torch_api
from nodeagent.trainer.timing import CollectiveCount, Entered
from runwarden.v1 import common_pb2
from tests.nodeagent import collective_job
from tests.nodeagent.helpers import PYTHON, ROOT, AgentSocket, run_gloo_ranks, wait_for

CLOCKS_S = 0.005  # time.time() against time.monotonic() converted to it: the same host's clocks


def reports(agent: AgentSocket, rank: int = 0) -> list[common_pb2.RankProgress]:
    """What `rank` sent, in the order the socket got it."""
    return [r for req in list(agent.got) for r in req.reports if r.rank == rank]


def reporter(agent: AgentSocket, flush_interval_s: float) -> trainer.ProgressReporter:
    return trainer.ProgressReporter(
        run="collectives",
        attempt=1,
        rank=0,
        local_rank=0,
        world_size=1,
        agent_socket=agent.path,
        flush_interval_s=flush_interval_s,
        handle_sigterm=False,
    )


# --- the bookkeeping ----------------------------------------------------------------------------


def test_a_change_is_dated_by_the_sample_that_saw_it_and_an_unknown_count_keeps_the_last() -> None:
    count = CollectiveCount()
    assert count.latest is None
    assert not count.observe(None, 1.0) and count.latest is None  # no group yet
    assert count.observe(0, 2.0) and count.latest == Entered(0, 2.0)
    assert not count.observe(0, 3.0) and count.latest == Entered(0, 2.0)  # the same count: not a change
    assert count.observe(4, 3.5) and count.latest == Entered(4, 3.5)
    assert not count.observe(None, 4.0) and count.latest == Entered(4, 3.5)  # the group destroyed
    assert count.observe(1, 5.0) and count.latest == Entered(1, 5.0)  # a new group counts afresh


def test_a_count_is_unsent_until_the_newest_one_reached_the_agent() -> None:
    count = CollectiveCount()
    assert not count.unsent  # nothing known, nothing to send
    count.observe(3, 1.0)
    assert count.unsent
    read_before_the_send = count.latest
    assert read_before_the_send is not None
    count.observe(4, 2.0)  # changed while that send was on its way
    count.sent(read_before_the_send)
    assert count.unsent
    newest = count.latest
    assert newest is not None
    count.sent(newest)
    assert not count.unsent
    count.observe(4, 3.0)
    assert not count.unsent
    count.observe(5, 4.0)
    assert count.unsent


# --- the reporter, with a stand-in for torch's count ---------------------------------------------


class FakeSequence:
    """Stands in for torch_api.default_group_sequence: the count the test sets, and how often read."""

    def __init__(self, value: int | None) -> None:
        self.value = value
        self.reads = 0

    def __call__(self) -> int | None:
        self.reads += 1
        return self.value

    def wait_reads(self, n: int) -> None:
        """Until the flush thread has read it `n` more times (n sample intervals have passed)."""
        target = self.reads + n
        wait_for(lambda: self.reads >= target, 5, f"{n} more samples of the collective count")


def test_a_new_count_alone_repeats_the_last_report_but_only_once_the_rank_reported_something(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sequence = FakeSequence(5)
    monkeypatch.setattr(torch_api, "default_group_sequence", sequence)
    agent = AgentSocket(tmp_path)
    rep = reporter(agent, flush_interval_s=0.02)
    try:
        sequence.wait_reads(3)  # 0.2 s: flushes with a new count, and no report to carry it
        rep.loaded(-1)  # sent at once
        wait_for(lambda: reports(agent), 5, "the load mark")
        first = reports(agent)[0]
        assert first.HasField("loaded_step") and first.step == 0  # nothing was sent before: no invented step
        assert first.collectives_entered == 5

        changed = time.time()
        sequence.value = 6
        wait_for(lambda: reports(agent)[-1].collectives_entered == 6, 5, "count 6")
        got = reports(agent)[-1]
        assert got.step == 0 and got.loaded_step == -1  # the load mark again, with the new count
        assert changed - CLOCKS_S <= got.collective_entered_at <= changed + 1.0

        rep.report(3, step_time_s=0.25, loss=2.0)
        wait_for(lambda: reports(agent)[-1].step == 3, 5, "step 3")
        step3 = reports(agent)[-1]
        assert step3.loss == 2.0 and step3.collectives_entered == 6

        changed = time.time()
        sequence.value = 7
        wait_for(lambda: reports(agent)[-1].collectives_entered == 7, 5, "count 7")
        repeat = reports(agent)[-1]
        assert repeat.step == 3 and repeat.step_time_s == 0.25
        assert not repeat.HasField("loss") and not repeat.recent_losses  # step 3's loss is not sent twice
        assert repeat.reported_at > step3.reported_at  # dated now
        assert changed - CLOCKS_S <= repeat.collective_entered_at <= changed + 1.0

        sent = len(reports(agent))
        sequence.wait_reads(3)  # flushes with the count unchanged
        rep.report(4, step_time_s=0.25)
        wait_for(lambda: reports(agent)[-1].step == 4, 5, "step 4")
        assert len(reports(agent)) == sent + 1  # nothing between: an unchanged count is not sent again
        assert reports(agent)[-1].collective_entered_at == pytest.approx(
            repeat.collective_entered_at, abs=0.01
        )
    finally:
        rep.close()
        agent.stop()


def test_without_torch_distributed_no_count_is_sent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_api, "default_group_sequence", FakeSequence(None))
    agent = AgentSocket(tmp_path)
    rep = reporter(agent, flush_interval_s=30.0)
    try:
        rep.report(1, step_time_s=0.1)
        assert rep.flush() and agent.seen.wait(5)
        (got,) = reports(agent)
        assert not got.HasField("collectives_entered") and got.collective_entered_at == 0.0
    finally:
        rep.close()
        agent.stop()


# --- evaluating() --------------------------------------------------------------------------------


def test_an_evaluations_time_is_no_steps_time(tmp_path: Path) -> None:
    """The rank that evaluates would look like a straggler (the slowest step, the least wait) and its
    healthy node be flagged, if its evaluation counted as the next step's compute."""
    agent = AgentSocket(tmp_path)
    rep = reporter(agent, flush_interval_s=30.0)
    try:
        rep.report(1)  # measured: since the reporter began
        with rep.evaluating():
            time.sleep(1.0)  # the evaluation's work (what is measured, not a wait for an event)
        rep.report(2)
        assert rep.flush()
        wait_for(lambda: any(r.step == 2 for r in reports(agent)), 5, "step 2")
        (two,) = [r for r in reports(agent) if r.step == 2 and not r.in_eval]
        assert two.step_time_s < 0.5, (
            f"the evaluation's 1 s counted as step 2's time ({two.step_time_s:.2f} s)"
        )
    finally:
        rep.close()
        agent.stop()


def test_an_evaluation_is_sent_at_once_when_it_starts_and_when_it_ends(tmp_path: Path) -> None:
    agent = AgentSocket(tmp_path)
    # no periodic flush within the test: what arrives was sent at once
    rep = reporter(agent, flush_interval_s=30.0)
    try:
        with rep.evaluating():
            pass  # nothing reported yet: no step to send it with, nothing sent
        rep.report(5, step_time_s=0.2, loss=1.5)  # pending
        with rep.evaluating():
            wait_for(lambda: reports(agent), 5, "the evaluation's start")
            (start,) = reports(agent)
            assert start.in_eval and start.step == 5
            assert [(x.step, x.loss) for x in start.recent_losses] == [(5, 1.5)]  # the pending report's
            with rep.evaluating():  # nested: the same evaluation
                pass
        wait_for(lambda: not reports(agent)[-1].in_eval, 5, "the evaluation's end")
        assert len(reports(agent)) == 2 and reports(agent)[-1].step == 5  # the nested block sent nothing
        rep.report(6, step_time_s=0.2)
        assert rep.flush()
        wait_for(lambda: reports(agent)[-1].step == 6, 5, "step 6")
        assert not reports(agent)[-1].in_eval
    finally:
        rep.close()
        agent.stop()


# --- real ranks ----------------------------------------------------------------------------------


def test_a_rank_that_has_not_entered_its_peers_collective_is_one_count_behind(tmp_path: Path) -> None:
    """Rank 0 enters an all_reduce; rank 1 only 1.5 s after the test saw their counts apart. Meanwhile rank 0 reports k+1 dated when
    it entered and rank 1 reports k; once both are past it, both report k+1, each dated by its own entry."""
    k = collective_job.ENTERED_TOGETHER
    agent = AgentSocket(tmp_path)
    job = Path(collective_job.__file__)
    try:
        with ThreadPoolExecutor(1) as pool:
            ranks = pool.submit(
                run_gloo_ranks, job, 2, agent.path, str(tmp_path), run="collectives", timeout_s=60
            )

            def apart() -> bool:
                if ranks.done():
                    ranks.result()  # a rank failed: its output, not a timeout
                r0, r1 = reports(agent, 0), reports(agent, 1)
                return bool(r0 and r1) and (r0[-1].collectives_entered, r1[-1].collectives_entered) == (
                    k + 1,
                    k,
                )

            try:
                wait_for(apart, 30, f"rank 0 to report {k + 1} collectives entered and rank 1 {k}")
                seen_apart = time.time()
            finally:
                (tmp_path / "go").touch()  # rank 1 goes on (it never waits past its own deadline)
            ranks.result(timeout=60)
    finally:
        agent.stop()
    entered = [float((tmp_path / f"entered{r}").read_text()) for r in (0, 1)]
    r0, r1 = reports(agent, 0), reports(agent, 1)

    ahead = next(r for r in r0 if r.collectives_entered == k + 1)
    # dated by the first sample after rank 0 entered (every COLLECTIVE_SAMPLE_S), long before rank 1 did
    assert entered[0] - CLOCKS_S <= ahead.collective_entered_at <= entered[0] + 1.0
    assert ahead.collective_entered_at < entered[1] - 1.0
    assert ahead.reported_at <= seen_apart < entered[1]  # sent while rank 1 was still out
    assert all(r.collectives_entered <= k for r in r1 if r.reported_at < entered[1])
    assert all(r.collective_entered_at >= entered[1] - CLOCKS_S for r in r1 if r.collectives_entered == k + 1)
    # past it: the same count on both ranks (close() sends the last one)
    assert r0[-1].step == r1[-1].step == 2
    assert r0[-1].collectives_entered == r1[-1].collectives_entered == k + 1


def test_the_examples_evaluation_runs_on_rank_0_while_rank_1_waits_in_the_next_step(tmp_path: Path) -> None:
    """examples/train.py --eval-every 2: after step 2, rank 0 alone evaluates inside `evaluating()`;
    rank 1 goes on into step 3's all-reduce and reports a count rank 0 has not reached, during it."""
    from testbed.etcd_server import free_port
    from testbed.gloo_ranks import gloo_rank_env

    agent = AgentSocket(tmp_path)
    port = free_port()
    args = [
        "--steps",
        "4",
        "--ckpt-dir",
        str(tmp_path / "ck"),
        "--ckpt-every",
        "100",
        "--ckpt-format",
        "torch",
    ]
    args += ["--out", str(tmp_path / "out"), "--step-sleep", "0", "--backend", "gloo"]
    args += ["--eval-every", "2", "--eval-seconds", "1.5"]
    procs = []
    for rank in range(2):
        env = gloo_rank_env(rank, 2, port, run="eval", root=ROOT)
        env["RUNWARDEN_NODEAGENT_SOCKET"] = agent.path
        procs.append(
            subprocess.Popen(
                [PYTHON, str(ROOT / "examples" / "train.py"), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        logs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        agent.stop()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    assert "rank 0: eval loss" in logs[0] and "eval loss" not in logs[1]
    r0, r1 = reports(agent, 0), reports(agent, 1)
    assert not any(r.in_eval for r in r1)
    starts = [i for i, r in enumerate(r0) if r.in_eval]
    assert starts and all(r0[i].step == 2 for i in starts)
    end = next(r for r in r0[starts[-1] + 1 :] if not r.in_eval)  # sent as the evaluation ended
    start = r0[starts[0]]
    assert end.step == 2 and end.reported_at - start.reported_at >= 1.5
    assert start.collectives_entered <= end.collectives_entered  # the evaluation enters none
    # before it ended, rank 1 entered a collective rank 0 had not: it waited in step 3's all-reduce
    assert any(
        r.collectives_entered > end.collectives_entered and r.collective_entered_at < end.reported_at
        for r in r1
    ), (
        end.collectives_entered,
        end.reported_at,
        [(r.collectives_entered, r.collective_entered_at) for r in r1],
    )
