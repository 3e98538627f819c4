"""The trainer's side: reports that never hurt training, stop requests, checkpoints with RNG and data."""

from __future__ import annotations

import random
import time

import grpc
import pytest

from nodeagent import trainer
from runwarden.v1 import agent_pb2
from tests.nodeagent.helpers import wait_for


def test_report_without_an_agent_never_raises_nor_blocks(tmp_path):
    r = trainer.ProgressReporter(
        run="r1",
        attempt=1,
        rank=0,
        local_rank=0,
        world_size=1,
        agent_socket=str(tmp_path / "nobody.sock"),
        flush_interval_s=0.01,
    )
    t0 = time.perf_counter()
    for step in range(20_000):
        r.report(step, step_time_s=0.1)
    elapsed = time.perf_counter() - t0
    assert elapsed / 20_000 < 50e-6, f"{elapsed / 20_000 * 1e6:.1f} us per report"
    time.sleep(0.1)  # several failed flushes happen in the background
    r.report(20_000)
    assert r.flush() is False  # unreachable agent: reported, not raised
    r.close()
    assert not r.stop_requested()


def test_stop_file_and_agent_flag(agent_factory, tmp_path):
    stop_file = tmp_path / "stop"
    r = trainer.ProgressReporter(
        run="r1", attempt=1, rank=0, local_rank=0, world_size=1, stop_file=str(stop_file)
    )
    assert not r.stop_requested()
    stop_file.write_text("x")
    assert r.stop_requested()

    agent = agent_factory()
    r2 = trainer.ProgressReporter(
        run="r1",
        attempt=1,
        rank=0,
        local_rank=0,
        world_size=1,
        agent_socket=agent.socket,
        flush_interval_s=0.05,
    )
    r2.report(1)
    wait_for(lambda: agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest()).ranks, 5, "the report")
    agent.stub.RequestStop(agent_pb2.RequestStopRequest(run="r1", reason="time limit"))
    state = agent.stub.GetStopState(agent_pb2.GetStopStateRequest(run="r1"))
    assert state.stop_requested and state.reason == "time limit"

    def flag() -> bool:
        r2.report(2)
        return r2.stop_requested()

    wait_for(flag, 5, "the agent's stop flag to reach the rank")
    r2.close()


def test_load_mark_reaches_the_agent_at_once_and_rides_on_every_later_report(agent_factory):
    agent = agent_factory()
    r = trainer.ProgressReporter(
        run="r1",
        attempt=3,
        rank=0,
        local_rank=0,
        world_size=1,
        agent_socket=agent.socket,
        flush_interval_s=30.0,
    )  # no background flush
    r.loaded(40)  # sent now, not at the next flush
    (rank,) = agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest()).ranks
    assert rank.loaded_step == 40 and rank.step == 40  # steps completed: the resume point, no step yet
    r.report(41, step_time_s=0.5)  # the first step after the load: sent now as well
    (rank,) = agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest()).ranks
    assert rank.step == 41 and rank.HasField("loaded_step") and rank.loaded_step == 40
    r.report(42, step_time_s=0.5)  # later steps wait for the flush
    (rank,) = agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest()).ranks
    assert rank.step == 41
    assert r.flush()
    (rank,) = agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest()).ranks
    assert rank.step == 42 and rank.loaded_step == 40
    scratch = trainer.ProgressReporter(
        run="r1",
        attempt=3,
        rank=1,
        local_rank=1,
        world_size=2,
        agent_socket=agent.socket,
        flush_interval_s=30.0,
    )
    scratch.loaded(-1)
    by_rank = {p.rank: p for p in agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest()).ranks}
    assert by_rank[1].loaded_step == -1 and by_rank[1].step == 0
    r.close()
    scratch.close()


def test_checkpoint_save_start_and_end_reach_the_agent_at_once(agent_factory):
    # A rank stopped right after its save must not stay "saving" (the long checkpoint timeout) in
    # the supervisor's eyes until a flush that never comes.
    agent = agent_factory()
    r = trainer.ProgressReporter(
        run="r1",
        attempt=1,
        rank=0,
        local_rank=0,
        world_size=1,
        agent_socket=agent.socket,
        flush_interval_s=30.0,
    )  # no background flush

    def seen() -> tuple[int, bool]:
        (rank,) = agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest()).ranks
        return rank.step, rank.in_checkpoint

    r.report(10, step_time_s=0.1, in_checkpoint=True)
    assert seen() == (10, True)
    r.report(10, step_time_s=0.1)
    assert seen() == (10, False)
    r.report(11, step_time_s=0.1)  # an ordinary step waits for the next flush
    assert seen() == (10, False)
    r.close()


def test_agent_gone_mid_run_training_goes_on(agent_factory):
    agent = agent_factory()
    r = trainer.ProgressReporter(
        run="r1",
        attempt=1,
        rank=0,
        local_rank=0,
        world_size=1,
        agent_socket=agent.socket,
        flush_interval_s=60.0,  # no background send: the last flush below is the one that fails
    )
    r.report(1)
    assert r.flush()
    agent.kill()
    for step in range(2, 200):
        r.report(step)
        time.sleep(0.001)
    assert r.flush() is False
    r.close()


def test_save_and_load_restore_model_optimizer_rng_and_data_position(tmp_path):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    random.seed(5)
    commit = trainer.save_checkpoint(
        tmp_path, 12, model=model, optimizer=opt, data_state={"epoch": 1, "index": 37}, extra={"loss": 0.5}
    )
    assert commit is not None and commit.step == 12
    after_save = (random.random(), torch.rand(3).tolist(), [p.detach().clone() for p in model.parameters()])

    model2 = torch.nn.Linear(4, 2)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    random.seed(99)
    torch.manual_seed(99)
    loaded = trainer.load_checkpoint(tmp_path, model=model2, optimizer=opt2)
    assert (
        loaded.step == 12 and loaded.data_state == {"epoch": 1, "index": 37} and loaded.extra == {"loss": 0.5}
    )
    assert random.random() == after_save[0]
    assert torch.rand(3).tolist() == after_save[1]
    for a, b in zip(model2.parameters(), after_save[2], strict=True):
        assert torch.equal(a, b)
    assert opt2.state_dict()["state"][0]["momentum_buffer"].equal(
        opt.state_dict()["state"][0]["momentum_buffer"]
    )


def test_multi_rank_save_commits_only_when_every_rank_wrote(tmp_path):
    pytest.importorskip("torch")
    # rank 1 writes, then rank 0 commits after the barrier (here: sequential calls, no process group).
    assert (
        trainer.save_checkpoint(tmp_path, 5, data_state={"i": 1}, rank=1, world_size=2, barrier=lambda: None)
        is None
    )
    assert trainer.latest_committed(tmp_path) is None
    commit = trainer.save_checkpoint(
        tmp_path, 5, data_state={"i": 0}, rank=0, world_size=2, barrier=lambda: None
    )
    assert commit is not None and sorted(commit.files) == ["rank0.pt", "rank1.pt"]
    assert trainer.load_checkpoint(tmp_path, rank=1, restore_rng=False).data_state == {"i": 1}


def test_trainer_module_does_not_import_torch_or_grpc():
    import subprocess
    import sys

    code = "import sys, nodeagent.trainer; print('torch' in sys.modules, 'grpc' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_slow_rank_chaos_reaches_the_rank(agent_factory):
    agent = agent_factory(flags=["--chaos"])
    r = trainer.ProgressReporter(
        run="r1",
        attempt=1,
        rank=0,
        local_rank=2,
        world_size=1,
        agent_socket=agent.socket,
        flush_interval_s=0.02,
    )
    r.report(1)
    assert r.flush()
    agent.stub.InjectFault(
        agent_pb2.InjectFaultRequest(kind=agent_pb2.FAULT_KIND_SLOW_RANK, local_rank=2, value=0.2)
    )
    r.report(2)
    assert r.flush() and r.injected_delay_s == pytest.approx(0.2)
    t0 = time.perf_counter()
    r.report(3)
    assert time.perf_counter() - t0 >= 0.2
    agent.stub.InjectFault(
        agent_pb2.InjectFaultRequest(kind=agent_pb2.FAULT_KIND_SLOW_RANK, local_rank=2, value=0)
    )
    r.report(4)
    assert r.flush() and r.injected_delay_s == 0
    r.close()
    with pytest.raises(grpc.RpcError):
        agent.stub.InjectFault(agent_pb2.InjectFaultRequest(kind=agent_pb2.FAULT_KIND_SLOW_RANK, value=-1))


def test_resume_point_is_the_supervisors_step_not_the_newest_on_disk(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setenv("RUNWARDEN_ATTEMPT", "3")
    for step in (10, 20):
        trainer.save_checkpoint(tmp_path, step, data_state={"next_step": step})
    assert trainer.latest_committed(tmp_path).meta["attempt"] == 3  # the commit records its attempt
    # step 20 was committed by a superseded attempt: the supervisor says 10
    assert trainer.resume_point(tmp_path, {"RUNWARDEN_RESUME_STEP": "10"}).step == 10
    assert trainer.resume_point(tmp_path, {"RUNWARDEN_RESUME_STEP": "-1"}) is None  # from scratch
    assert trainer.resume_point(tmp_path, {}).step == 20  # run alone: the newest commit on disk
    with pytest.raises(trainer.ResumeError, match="step 15"):
        trainer.resume_point(tmp_path, {"RUNWARDEN_RESUME_STEP": "15"})  # not committed here: never silent
    with pytest.raises(trainer.ResumeError, match="not a step number"):
        trainer.resume_point(tmp_path, {"RUNWARDEN_RESUME_STEP": "ten"})
