"""CollectFlightRecorder through the real agent from real gloo ranks: one hung (dumps anyway), one SIGSTOPped."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from nodeagent.daemon import proctree
from runwarden.flightrec import parse_dump
from runwarden.v1 import agent_pb2
from tests.nodeagent.helpers import ROOT, wait_for

STEPS = 3


@pytest.mark.slow
def test_collect_from_gloo_ranks_one_hung_one_stopped(agent_factory, tmp_path):
    pytest.importorskip("torch")
    agent = agent_factory(flags=["--allow-exec", sys.executable])
    work = _launch_fr_job(agent, tmp_path, "fr")
    try:
        stopped = int((work / "ready2").read_text())
        os.kill(stopped, signal.SIGSTOP)
        # the kernel stops the rank when it next runs: on a busy machine that is not at once, and the
        # agent reads /proc once (a rank it sees running is asked, and times out)
        wait_for(lambda: _proc_state(stopped) in ("T", "t"), 30, "the rank stopped")

        t0 = time.monotonic()
        reply = agent.stub.CollectFlightRecorder(
            agent_pb2.CollectFlightRecorderRequest(run="fr", timeout_s=5), timeout=30
        )
        took = time.monotonic() - t0
        assert reply.node == "n1"
        by_rank = {d.rank: d for d in reply.dumps}
        assert sorted(by_rank) == [0, 1, 2]
        assert by_rank[0].ok and by_rank[1].ok and by_rank[0].format == "json"
        assert not by_rank[2].ok and by_rank[2].error.startswith("no dump") and not by_rank[2].data
        # the agent read the silent rank's /proc state: stopped is a fact, not a timeout's guess
        assert by_rank[2].process_state == "T" and by_rank[0].process_state == ""
        # ... read before asking: a stopped rank cannot answer, so it is not asked (no 5 s wait)
        assert by_rank[2].error == "no dump: its process is stopped" and took < 3.0, (by_rank[2].error, took)
        last = {}
        for r in (0, 1):
            dump = parse_dump(by_rank[r].data, rank=r)
            last[r] = max(e.collective_seq_id for e in dump.entries if not e.is_p2p)
            assert any(pg.ranks == (0, 1, 2) for pg in dump.pg_config)  # the gloo pg_config repair is in
        # the victim (0) entered collective STEPS+1; the hung rank (1) never called it
        assert last == {0: STEPS + 1, 1: STEPS}
    finally:
        reply = agent.stub.StopWorkers(agent_pb2.StopWorkersRequest(run="fr", grace_s=1), timeout=60)
        assert not reply.stopped[0].running


@pytest.mark.slow
def test_ranks_that_could_not_open_a_socket_are_answered_for_with_the_reason_and_their_state(
    agent_factory, tmp_path
):
    # The run's name makes each rank's socket path longer than a unix socket allows: no rank opens
    # one. The agent still answers for every rank of the attempt it knows from their progress, says
    # why, and reads the /proc state: the stopped rank is a fact, the others no evidence.
    pytest.importorskip("torch")
    run = "r" * 63
    agent = agent_factory(flags=["--allow-exec", sys.executable])
    work = _launch_fr_job(agent, tmp_path, run, FR_JOB_NO_SOCKET_OK="1")
    try:
        stopped = int((work / "ready2").read_text())
        os.kill(stopped, signal.SIGSTOP)
        wait_for(lambda: _proc_state(stopped) in ("T", "t"), 30, "the rank stopped")
        reply = agent.stub.CollectFlightRecorder(
            agent_pb2.CollectFlightRecorderRequest(run=run, timeout_s=5), timeout=30
        )
        by_rank = {d.rank: d for d in reply.dumps}
        assert sorted(by_rank) == [0, 1, 2] and not any(d.ok for d in reply.dumps)
        for d in reply.dumps:
            assert "over the 107-byte limit of a unix socket" in d.error and "run_dir" in d.error, d.error
        assert by_rank[2].process_state == "T" and by_rank[0].process_state in ("R", "S")
    finally:
        reply = agent.stub.StopWorkers(agent_pb2.StopWorkersRequest(run=run, grace_s=1), timeout=60)
        assert not reply.stopped[0].running


def _launch_fr_job(agent, tmp_path, run: str, **env: str):
    """fr_job.py's 3 gloo ranks as attempt 1 of `run`, once every rank is past its steps; its workdir."""
    work = tmp_path / "work"
    work.mkdir()
    agent.stub.LaunchWorkers(
        agent_pb2.LaunchWorkersRequest(
            run=run,
            attempt=1,
            argv=[sys.executable, str(ROOT / "tests/nodeagent/fr_job.py"), str(work), str(STEPS)],
            env={"PYTHONPATH": str(ROOT), **env},
        )
    )
    wait_for(lambda: all((work / f"ready{r}").exists() for r in range(3)), 120, "3 ranks past their steps")
    return work


def _proc_state(pid: int) -> str:
    state = proctree.read_proc(pid)
    return state.state if state is not None else ""
