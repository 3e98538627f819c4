"""Planned stops on the agent's and the trainer's side (issue 16).

The agent drains (Drain RPC, SIGUSR1, SIGTERM): its node record says DRAINING with the reason and
launches are refused. After a SIGTERM with ranks running and no controller, the agent asks its own
ranks to stop after the hand-over time: real torchrun (gloo on CPU) runs examples/train.py, whose
ranks finish the step, save, commit and exit 0; the exit record carries `planned_stop`, the agent
exits 0 and its lease is gone. A SIGTERM to a rank, and a touched stop file, are stop requests too.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import grpc
import pytest

from nodeagent import trainer
from nodeagent.daemon import progress as progress_table
from nodeagent.daemon.progress import ProgressTable
from nodeagent.trainer.checkpoint import latest_committed
from runwarden.v1 import agent_pb2, common_pb2, store_pb2
from tests.nodeagent.helpers import ROOT, wait_for

TRAIN = str(ROOT / "examples" / "train.py")
DRAINING = common_pb2.NODE_STATE_DRAINING


def _record(store, node: str = "n1") -> store_pb2.NodeRecord | None:
    kv = store.get(store.keys.node(node))
    return store_pb2.NodeRecord.FromString(kv.value) if kv is not None else None


def _exit_record(store, run: str, node: str = "n1") -> store_pb2.NodeProgress | None:
    kv = store.get(store.keys.progress(run, node))
    if kv is None:
        return None
    progress = store_pb2.NodeProgress.FromString(kv.value)
    return progress if progress.HasField("exit") else None


# --- the exit record and the reporter, without processes --------------------------------------------


def test_an_exit_after_a_stop_reason_is_a_planned_stop_and_one_without_is_not():
    table = ProgressTable()
    table.record("r", 1, [common_pb2.RankProgress(rank=0, step=5)])
    status = common_pb2.ExitStatus(exit_code=0)
    table.record_exit("r", 1, status)
    assert status.planned_stop == ""  # the end of training
    table.record(
        "r",
        2,
        [
            common_pb2.RankProgress(rank=1, step=7, stop_reason="SIGTERM"),
            common_pb2.RankProgress(rank=0, step=7, stop_reason="a peer rank's stop request"),
        ],
    )
    status = common_pb2.ExitStatus(exit_code=0)
    table.record_exit("r", 2, status)
    # why the stop began (rank 1's SIGTERM), not rank 0's "a peer asked": which rank notices first is a race
    assert status.planned_stop == "SIGTERM"
    ((_, progress),) = table.take_dirty("n1")
    assert progress.exit.planned_stop == "SIGTERM"
    table.record(
        "r",
        3,
        [
            common_pb2.RankProgress(rank=1, step=9, stop_reason=progress_table.FOLLOWED_STOP_REASON),
            common_pb2.RankProgress(rank=0, step=9, stop_reason=progress_table.FOLLOWED_STOP_REASON),
        ],
    )
    status = common_pb2.ExitStatus(exit_code=0)
    table.record_exit("r", 3, status)
    assert status.planned_stop == "a peer rank's stop request"  # every rank here followed another node's


def test_the_trainer_and_the_agent_use_the_same_words_for_a_followed_stop():
    assert trainer.FOLLOWED_STOP_REASON == progress_table.FOLLOWED_STOP_REASON


def test_sigterm_to_a_rank_is_a_stop_request_with_its_reason(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    r = trainer.ProgressReporter(run="r", attempt=1, rank=0, local_rank=0, world_size=1)
    assert not r.stop_requested() and r.stop_reason == ""
    os.kill(os.getpid(), signal.SIGTERM)  # only a flag: this test process goes on
    assert r.stop_requested() and r.stop_reason == "SIGTERM"
    r.close()
    assert signal.getsignal(signal.SIGTERM) == before  # given back at close

    stop_file = tmp_path / "stop"
    r = trainer.ProgressReporter(
        run="r", attempt=1, rank=0, local_rank=0, world_size=1, stop_file=str(stop_file), handle_sigterm=False
    )
    assert signal.getsignal(signal.SIGTERM) == before  # opted out
    stop_file.touch()
    assert r.stop_requested() and r.stop_reason == f"stop file {stop_file}"
    stop_file.write_text("slurm time limit (USR1)\nmore\n")
    assert r.stop_reason == f"stop file {stop_file}"  # the first reason stays
    r2 = trainer.ProgressReporter(
        run="r", attempt=1, rank=0, local_rank=0, world_size=1, stop_file=str(stop_file), handle_sigterm=False
    )
    assert r2.stop_requested() and r2.stop_reason == f"stop file {stop_file}: slurm time limit (USR1)"


def test_the_reason_reaches_the_agent_at_once(agent_factory):
    agent = agent_factory()
    r = trainer.ProgressReporter(
        run="r",
        attempt=1,
        rank=0,
        local_rank=0,
        world_size=1,
        agent_socket=agent.socket,
        flush_interval_s=60,  # no background flush: the stop's own send is what arrives
        handle_sigterm=False,
    )
    r.report(3)
    r.stopping("a peer rank's stop request")
    ranks = agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest(), timeout=5).ranks
    assert [(x.step, x.stop_reason) for x in ranks] == [(3, "a peer rank's stop request")]
    r.report(4)
    assert r.flush()
    ranks = agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest(), timeout=5).ranks
    assert [(x.step, x.stop_reason) for x in ranks] == [(4, "a peer rank's stop request")]  # kept
    r.close()


# --- drain: the RPC, the record, launches, SIGUSR1, SIGTERM with nothing running --------------------


def test_drain_is_in_the_record_at_once_refuses_launches_and_undoes(agent_factory, etcd, store):
    agent = agent_factory(
        etcd=etcd.endpoint,
        etcd_root=store.keys.root,
        flags=["--allow-exec", "/bin/true", "--progress-interval", "5"],  # the ticker's own period: 5 s
    )
    wait_for(lambda: _record(store), 10, "the node record")
    t0 = time.monotonic()
    reply = agent.stub.Drain(agent_pb2.DrainRequest(reason="maintenance: swap a PSU"), timeout=5)
    assert (reply.draining, reply.reason) == (True, "maintenance: swap a PSU")
    rec = wait_for(
        lambda: (r := _record(store)) is not None and r.state == DRAINING and r, 5, "the draining record"
    )
    assert time.monotonic() - t0 < 2.5  # re-put at once, not at the next tick
    assert rec.drain_reason == "maintenance: swap a PSU"
    assert agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest()).state == DRAINING
    launch = agent_pb2.LaunchWorkersRequest(run="r", attempt=1, argv=["/bin/true"])
    with pytest.raises(grpc.RpcError) as err:
        agent.stub.LaunchWorkers(launch, timeout=5)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details() == "node n1 is draining: maintenance: swap a PSU"
    assert not agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest()).workers

    reply = agent.stub.Drain(agent_pb2.DrainRequest(undo=True), timeout=5)
    assert (reply.draining, reply.reason) == (False, "")
    rec = wait_for(
        lambda: (r := _record(store)) is not None and r.state != DRAINING and r, 5, "the record back"
    )
    assert rec.drain_reason == ""
    assert agent.stub.LaunchWorkers(launch, timeout=5).pid > 0

    agent.proc.send_signal(signal.SIGUSR1)  # Slurm's time-limit notice: drain, keep running
    rec = wait_for(
        lambda: (r := _record(store)) is not None and r.state == DRAINING and r, 5, "the USR1 drain"
    )
    assert rec.drain_reason == "scheduler notice (SIGUSR1): this node leaves soon"
    # it handled the notice and still answers (SIGTERM below must find it in its loop, exit 0)
    assert agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest(), timeout=5).state == DRAINING
    assert agent.proc.poll() is None

    assert agent.terminate(timeout_s=10) == 0  # nothing runs: SIGTERM exits at once
    assert _record(store) is None  # lease revoked with the record


# --- real torchrun ------------------------------------------------------------------------------------


def _torchrun_agent(agent_factory, etcd, store, **env: str):
    agent = agent_factory(
        etcd=etcd.endpoint,
        etcd_root=store.keys.root,
        flags=["--allow-exec", sys.executable, "--local-ranks", "2"],
        env={"RUNWARDEN_AGENT_STOP_GRACE_S": "20", **env},
    )
    rec = wait_for(lambda: _record(store), 10, "the node record")
    return agent, rec


def _launch(agent, rec, tmp_path, run: str, attempt: int, resume_step: int = -1) -> None:
    agent.stub.LaunchWorkers(
        agent_pb2.LaunchWorkersRequest(
            run=run,
            attempt=attempt,
            resume_step=resume_step,
            nnodes=1,
            node_rank=0,
            cwd=str(ROOT),
            torchrun=agent_pb2.TorchrunLaunch(
                command=[
                    TRAIN,
                    "--steps",
                    "100000",
                    "--ckpt-every",
                    "100000",
                    "--step-sleep",
                    "0.02",
                    "--ckpt-dir",
                    str(tmp_path / "ckpt"),
                    "--out",
                    str(tmp_path / "out"),
                ],
                rdzv_endpoint=f"{rec.torch_host}:{rec.rdzv_port}",
                is_host=True,
            ),
        ),
        timeout=10,
    )


def _training(agent, store, run: str, attempt: int) -> list[common_pb2.RankProgress]:
    """Both ranks of `attempt` loaded and three steps past that (the node's progress in etcd)."""

    def both() -> list[common_pb2.RankProgress] | None:
        if agent.proc.poll() is not None:
            raise AssertionError(f"agent exited:\n{agent.log()}")
        status = agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest(), timeout=5)
        if any(not w.running and w.attempt == attempt for w in status.workers):
            raise AssertionError(f"the workers ended early:\n{agent.log()}")
        kv = store.get(store.keys.progress(run, "n1"))
        progress = store_pb2.NodeProgress.FromString(kv.value) if kv is not None else None
        if progress is None or progress.attempt != attempt:
            return None
        ranks = [r for r in progress.ranks if r.HasField("loaded_step") and r.step >= r.loaded_step + 3]
        return ranks if len(ranks) == 2 else None

    return wait_for(both, 120, "two ranks training", interval_s=0.2)  # torch imports on a busy box


def _planned_exit(store, run: str, attempt: int) -> store_pb2.NodeProgress:
    progress = wait_for(lambda: _exit_record(store, run), 90, "the exit record", interval_s=0.1)
    assert progress.attempt == attempt
    assert (progress.exit.HasField("exit_code"), progress.exit.exit_code) == (True, 0), progress.exit
    return progress


@pytest.mark.slow
def test_agent_sigterm_without_a_controller_hands_over_then_commits_and_exits(
    agent_factory, etcd, store, tmp_path
):
    agent, rec = _torchrun_agent(agent_factory, etcd, store, RUNWARDEN_AGENT_DRAIN_HANDOFF_S="1")
    _launch(agent, rec, tmp_path, "r", 1)
    _training(agent, store, "r", 1)
    t0 = time.monotonic()
    agent.proc.send_signal(signal.SIGTERM)
    rec = wait_for(
        lambda: (r := _record(store)) is not None and r.state == DRAINING and r, 5, "the SIGTERM drain"
    )
    assert rec.drain_reason == "agent stopping (SIGTERM)"
    assert agent.proc.wait(timeout=90) == 0
    took = time.monotonic() - t0
    progress = _planned_exit(store, "r", 1)
    stop_file = tmp_path / "agent0" / "run" / "runs" / "r" / "stop"
    reason = (
        f"stop file {stop_file}: agent stopping (SIGTERM): no stop request from the controller within 1 s"
    )
    assert progress.exit.planned_stop == reason
    # every rank reads the stop file; one may hear of the stop from its peer first (the ranks agree on
    # stopping in a collective), but the file's reason reaches the supervisor
    reasons = sorted((r.rank, r.stop_reason) for r in progress.ranks)
    assert [r for r, _ in reasons] == [0, 1] and reason in {why for _, why in reasons}, reasons
    assert {why for _, why in reasons} <= {reason, "a peer rank's stop request"}, reasons
    committed = latest_committed(tmp_path / "ckpt")
    assert committed is not None and committed.step == max(r.step for r in progress.ranks)
    assert [r.committed_step for r in progress.ranks if r.rank == 0] == [committed.step]
    assert _record(store) is None  # the lease is revoked: the node record is gone
    assert took >= 1.0  # the hand-over time was waited for
    log = agent.log()
    assert "no stop request within 1 s" in log and "stopping the workers hard" not in log


@pytest.mark.slow
def test_a_relaunching_stop_older_than_the_launch_is_not_applied_a_newer_one_and_a_final_one_are(
    agent_factory, etcd, store
):
    """The controller deletes a relaunching stop before it launches; where that delete failed, the
    stop the launch follows must not stop the attempt it started. Both stamps are the controller's
    clock. A stop that ends the run is applied however old it is."""
    agent = agent_factory(etcd=etcd.endpoint, etcd_root=store.keys.root, flags=["--allow-exec", "/bin/sleep"])
    wait_for(lambda: _record(store), 10, "the node record")
    key, stop_file = store.keys.stop("r"), agent.tmp / "run" / "runs" / "r" / "stop"

    def put_stop(reason: str, requested_at: float, relaunch: bool) -> None:
        req = store_pb2.StopRequest(run="r", reason=reason, requested_at=requested_at, relaunch=relaunch)
        store.put(key, req.SerializeToString())

    put_stop("operator: restart", 1000.0, relaunch=True)
    launch = agent_pb2.LaunchWorkersRequest(run="r", attempt=1, argv=["/bin/sleep", "60"], launched_at=2000.0)
    assert agent.stub.LaunchWorkers(launch, timeout=5).pid > 0
    wait_for(lambda: "a relaunching stop from before this launch" in agent.log(), 10, "the stale stop read")
    assert not stop_file.exists()

    put_stop("operator: restart again", 3000.0, relaunch=True)
    wait_for(lambda: stop_file.exists(), 10, "the newer relaunching stop applied")
    assert stop_file.read_text() == "operator: restart again\n"
    store.delete(key)
    wait_for(lambda: not stop_file.exists(), 10, "the stop withdrawn")

    put_stop("operator: end the run", 1500.0, relaunch=False)
    wait_for(lambda: stop_file.exists(), 10, "the final stop applied")
    assert stop_file.read_text() == "operator: end the run\n"


def test_rank_sigterm_and_a_touched_stop_file_are_planned_stops(agent_factory, etcd, store, tmp_path):
    agent, rec = _torchrun_agent(agent_factory, etcd, store)
    _launch(agent, rec, tmp_path, "r", 1)
    ranks = _training(agent, store, "r", 1)
    rank0 = next(r for r in ranks if r.rank == 0)
    os.kill(rank0.pid, signal.SIGTERM)  # Kubernetes' notice, scancel, preemption: to the rank itself
    progress = _planned_exit(store, "r", 1)
    assert progress.exit.planned_stop == "SIGTERM"
    assert sorted((r.rank, r.stop_reason) for r in progress.ranks) == [
        (0, "SIGTERM"),
        (1, "a peer rank's stop request"),
    ]
    first = latest_committed(tmp_path / "ckpt")
    assert first is not None and first.step == max(r.step for r in progress.ranks)
    assert agent.proc.poll() is None  # the agent is not stopping

    # attempt 2 resumes from that commit; a batch script's `touch` on the stop file stops it
    _launch(agent, rec, tmp_path, "r", 2, resume_step=first.step)
    ranks = _training(agent, store, "r", 2)
    assert all(r.loaded_step == first.step for r in ranks)
    stop_file = tmp_path / "agent0" / "run" / "runs" / "r" / "stop"
    stop_file.touch()
    progress = wait_for(
        lambda: (p := _exit_record(store, "r")) is not None and p.attempt == 2 and p, 90, "attempt 2's exit"
    )
    assert (progress.exit.exit_code, progress.exit.planned_stop) == (0, f"stop file {stop_file}")
    second = latest_committed(tmp_path / "ckpt")
    assert second is not None and second.step > first.step


# --- the SIGTERM path with plain ranks (no torch): hand-over, hard stop, hurry ------------------------

STOP_RANK = str(ROOT / "tests" / "nodeagent" / "stop_rank.py")


def _plain_agent(agent_factory, etcd, store, **env: str):
    agent = agent_factory(
        etcd=etcd.endpoint, etcd_root=store.keys.root, flags=["--allow-exec", sys.executable], env=env
    )
    wait_for(lambda: _record(store), 10, "the node record")
    return agent


def _launch_plain(agent, store, mode: str) -> None:
    agent.stub.LaunchWorkers(
        agent_pb2.LaunchWorkersRequest(run="r", attempt=1, argv=[sys.executable, STOP_RANK, mode]), timeout=10
    )

    def reporting() -> bool:
        kv = store.get(store.keys.progress("r", "n1"))
        return kv is not None and any(r.step >= 3 for r in store_pb2.NodeProgress.FromString(kv.value).ranks)

    wait_for(reporting, 20, "the rank reporting", interval_s=0.05)


@pytest.mark.slow
def test_a_stop_request_within_the_hand_over_is_the_one_the_ranks_obey(agent_factory, etcd, store, tmp_path):
    agent = _plain_agent(agent_factory, etcd, store, RUNWARDEN_AGENT_DRAIN_HANDOFF_S="60")
    _launch_plain(agent, store, "obedient")
    t0 = time.monotonic()
    agent.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: (r := _record(store)) is not None and r.state == DRAINING, 5, "the drain")
    with pytest.raises(grpc.RpcError) as err:  # a leaving agent cannot be put back
        agent.stub.Drain(agent_pb2.DrainRequest(undo=True), timeout=5)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "leaving" in err.value.details()
    reply = agent.stub.Drain(agent_pb2.DrainRequest(reason="operator: maintenance"), timeout=5)
    assert (reply.draining, reply.reason) == (True, "agent stopping (SIGTERM)")  # it is going away
    # what the controller does for a draining node: a planned stop of the attempt
    agent.stub.RequestStop(agent_pb2.RequestStopRequest(run="r", reason="node n1 draining"), timeout=5)
    assert agent.proc.wait(timeout=20) == 0
    assert time.monotonic() - t0 < 30  # no hand-over wait: the controller's request came first
    progress = _planned_exit(store, "r", 1)
    stop_file = tmp_path / "agent0" / "run" / "runs" / "r" / "stop"
    assert progress.exit.planned_stop == f"stop file {stop_file}: node n1 draining"
    assert _record(store) is None
    assert "no stop request within" not in agent.log()


@pytest.mark.slow
def test_ranks_that_ignore_the_stop_are_stopped_hard_after_the_drain_timeout(agent_factory, etcd, store):
    agent = _plain_agent(
        agent_factory,
        etcd,
        store,
        RUNWARDEN_AGENT_DRAIN_HANDOFF_S="0.2",
        RUNWARDEN_AGENT_DRAIN_TIMEOUT_S="1",
        RUNWARDEN_AGENT_STOP_GRACE_S="0.5",
    )
    _launch_plain(agent, store, "stubborn")
    t0 = time.monotonic()
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(timeout=20) == 0
    assert 1.0 <= time.monotonic() - t0 < 30  # not the 300 s default
    progress = wait_for(lambda: _exit_record(store, "r"), 10, "the exit record")
    assert (
        progress.exit.signal == signal.SIGKILL and progress.exit.planned_stop == ""
    )  # never said "stopping"
    assert "still running 1 s after the drain began" in agent.log()
    assert _record(store) is None


def test_a_second_sigterm_stops_the_workers_at_once(agent_factory, etcd, store):
    agent = _plain_agent(agent_factory, etcd, store, RUNWARDEN_AGENT_STOP_GRACE_S="0.5")  # hand-over 15 s
    _launch_plain(agent, store, "stubborn")
    agent.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: (r := _record(store)) is not None and r.state == DRAINING, 5, "the drain")
    t0 = time.monotonic()
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(timeout=20) == 0
    assert time.monotonic() - t0 < 20  # not the 15 s hand-over plus the 300 s drain timeout
    assert "asked to hurry" in agent.log()
    assert wait_for(lambda: _exit_record(store, "r"), 10, "the exit record").exit.signal == signal.SIGKILL
