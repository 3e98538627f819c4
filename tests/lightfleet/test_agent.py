"""lightfleet.agent without I/O: the shared step clock, hangs the controller's real analysis blames on
the culprit's node, planned stops, the progress cadence, the real agent's launch refusals, and the
control channel's language."""

from __future__ import annotations

import pytest

from controller.live.translate import Translator
from controller.supervisor import flight_recorder
from controller.supervisor.events import AttemptExited, CheckpointCommitted, ProgressObserved
from lightfleet.agent import LightAgent, Refused
from lightfleet.faults import FaultError, parse
from lightfleet.settings import AgentSettings, Latency, SettingsError
from runwarden.keys import KeySchema
from runwarden.store import EventType, WatchEvent
from runwarden.v1 import agent_pb2, store_pb2

RUN = "r"
LAUNCHED = 1_000_000.0  # the controller's attempt record: launched_at
S = AgentSettings(step_s=1.0, startup_s=2.0, save_s=0.5, ckpt_every=0, progress_interval_s=1.0)


def agent(node: str, settings: AgentSettings = S) -> LightAgent:
    a = LightAgent(node, port=50000 + int(node[1:]), settings=settings, rdzv_port=29500, pid=4242)
    a.registered(lease_id=7, ttl_s=5.0, now=LAUNCHED - 10, mono=0.0)
    return a


def launch(
    a: LightAgent, node_rank: int, nodes: tuple[str, ...], *, at: float, attempt: int = 1, resume: int = -1
):
    request = agent_pb2.LaunchWorkersRequest(
        run=RUN,
        attempt=attempt,
        rendezvous_id=f"{RUN}-{attempt}",
        node_rank=node_rank,
        nnodes=len(nodes),
        resume_step=resume,
        leader_fence=3,
        torchrun=agent_pb2.TorchrunLaunch(
            command=["train.py"], rdzv_endpoint="127.0.0.1:29500", is_host=node_rank == 0
        ),
    )
    record = store_pb2.AttemptRecord(run=RUN, attempt=attempt, nodes=list(nodes), launched_at=LAUNCHED)
    a.check_launch(request)
    return a.start_attempt(request, at, record)


def fleet(n: int) -> tuple[list[LightAgent], tuple[str, ...]]:
    names = tuple(f"n{i}" for i in range(n))
    agents = [agent(name) for name in names]
    for rank, a in enumerate(agents):
        launch(a, rank, names, at=LAUNCHED + 0.05 * rank)  # each launch answered at its own time
    return agents, names


def put(message: store_pb2.NodeProgress) -> WatchEvent:
    keys = KeySchema()
    return WatchEvent(
        type=EventType.PUT,
        key=keys.progress(message.run, message.node),
        value=message.SerializeToString(),
        mod_revision=1,
        create_revision=1,
    )


def test_every_node_of_an_attempt_runs_one_step_clock_and_torchruns_rank_numbers() -> None:
    agents, _ = fleet(3)
    t0 = LAUNCHED + S.startup_s
    for t, step in ((t0 - 0.01, None), (t0, 0), (t0 + 0.99, 0), (t0 + 1.0, 1), (t0 + 7.5, 7)):
        assert {a.attempts[RUN].step_at(t) for a in agents} == {step}
    ranks = agents[2].attempts[RUN].ranks(t0 + 3.2, pid=1)
    assert [r.rank for r in ranks] == list(range(16, 24)) and [r.local_rank for r in ranks] == list(range(8))
    assert {(r.world_size, r.step, r.loaded_step) for r in ranks} == {(24, 3, -1)}


def test_a_hang_freezes_every_node_at_one_step_and_the_real_analysis_blames_the_culprits_node() -> None:
    agents, names = fleet(3)
    t0 = LAUNCHED + S.startup_s
    hung_at = t0 + 4.3
    for a in agents:  # the fleet sends a hang to every process: each freezes its nodes of the attempt
        a.hang("n1", culprit=5, at=hung_at, stopped=False)
    later = hung_at + 30
    assert {a.attempts[RUN].step_at(later) for a in agents} == {4}
    translator = Translator(KeySchema(), RUN)
    for a in agents:
        for message in a.progress_due(later):
            translator.watch_event(put(message))
    dumps = [d for a in agents for d in a.dumps(RUN, later).dumps]
    verdict = flight_recorder.verdict_from_rank_dumps(dumps, translator.ranks())
    assert [(s.node, s.ranks) for s in verdict.suspects] == [("n1", (13,))]
    assert verdict.suspects[0].confidence == flight_recorder.CONFIDENCE_LAGGING
    # stopped (SIGSTOP): no dump, its agent reads state T -- the controller's strongest flight-recorder rung
    agents[1].hang("n1", culprit=5, at=hung_at, stopped=True)
    dumps = [d for a in agents for d in a.dumps(RUN, later).dumps]
    (culprit,) = [d for d in dumps if not d.ok]
    assert (culprit.rank, culprit.process_state) == (13, "T")
    verdict = flight_recorder.verdict_from_rank_dumps(dumps, translator.ranks())
    assert verdict.suspects[0].node == "n1" and verdict.suspects[0].ranks == (13,)
    assert verdict.suspects[0].confidence == flight_recorder.CONFIDENCE_STOPPED
    assert names[1] == "n1"


def test_the_peers_of_a_crashed_node_wait_where_they_were_and_commit_nothing_more() -> None:
    agents, _ = fleet(3)
    t0 = LAUNCHED + S.startup_s
    crashed_at = t0 + 3.7
    (ended,) = agents[1].crash(crashed_at, code=1, signal=None)
    assert ended.end_step == 3 and ended.exit is not None and ended.exit.detail == "exit code 1"
    for a in agents:  # the fleet's `stall n1 at T` reaches every process
        a.hang("n1", culprit=None, at=crashed_at)
    peers = [agents[0].attempts[RUN], agents[2].attempts[RUN]]
    assert [(p.frozen_at, p.culprit, p.running) for p in peers] == [(3, None, True)] * 2
    assert {p.step_at(t0 + 60) for p in peers} == {3}


def test_a_planned_stop_finishes_the_step_commits_it_and_exits_zero_with_its_reason() -> None:
    (a,), _ = fleet(1)
    t0 = LAUNCHED + S.startup_s
    a.request_stop(RUN, "time limit", t0 + 5.4)
    attempt = a.attempts[RUN]
    assert attempt.stop is not None and attempt.stop.step == 6  # the step under way is finished
    translator = Translator(KeySchema(), RUN)
    seen = []
    for t in (t0 + 5.5, t0 + 6.0, t0 + 6.5, t0 + 6.6, t0 + 9):
        for message in a.progress_due(t):
            seen += translator.watch_event(put(message))[0]
    commits = [e for e in seen if isinstance(e, CheckpointCommitted)]
    exits = [e for e in seen if isinstance(e, AttemptExited)]
    assert [c.step for c in commits] == [6]
    assert [(e.exit_code, e.signal, e.planned_stop) for e in exits] == [(0, None, "time limit")]
    assert max(r.step for e in seen if isinstance(e, ProgressObserved) for r in e.ranks) == 6


def test_progress_is_written_once_per_interval_at_once_when_urgent_and_the_exit_at_once() -> None:
    (a,), _ = fleet(1)
    t0 = LAUNCHED + S.startup_s
    writes = []
    for tick in range(-10, 60):  # the process's ticker: every 0.1 s
        t = t0 + tick / 10 + 1e-6
        writes += [(round(t, 1), m.ranks[0].step if m.ranks else None) for m in a.progress_due(t)]
    # the load mark and the first step at once; then one write per interval while the steps advance
    assert writes[:2] == [(round(t0, 1), 0), (round(t0 + 1, 1), 1)]
    assert len(writes) == 6
    ended = a.crash(t0 + 6.05, code=1, signal=None)
    (message,) = a.progress_due(t0 + 6.05)
    assert ended and message.exit.exit_code == 1 and message.exit.detail == "exit code 1"
    assert a.progress_due(t0 + 9) == []


def test_launches_are_refused_as_the_real_agent_refuses_them() -> None:
    (a,), names = fleet(1)
    with pytest.raises(Refused) as exc:
        launch(a, 0, names, at=LAUNCHED, attempt=2)
    assert exc.value.code == "ALREADY_EXISTS"
    a.crash(LAUNCHED + 5, code=1, signal=None)
    with pytest.raises(Refused, match="older than attempt 1 already launched"):
        launch(a, 0, names, at=LAUNCHED, attempt=0)
    wrong = agent_pb2.LaunchWorkersRequest(
        run=RUN,
        attempt=2,
        nnodes=1,
        leader_fence=3,
        torchrun=agent_pb2.TorchrunLaunch(command=["t.py"], rdzv_endpoint="127.0.0.1:1234", is_host=True),
    )
    with pytest.raises(Refused, match="stale node record") as exc:
        a.check_launch(wrong)
    assert exc.value.code == "FAILED_PRECONDITION"
    a.drain("maintenance")
    with pytest.raises(Refused, match="is draining: maintenance"):
        launch(a, 0, names, at=LAUNCHED, attempt=2)
    lost = agent("n9")
    lost.lease_lost(LAUNCHED)
    with pytest.raises(Refused, match="holds no lease"):
        launch(lost, 0, ("n9",), at=LAUNCHED)


def test_an_xid_goes_through_the_real_parser_and_makes_the_node_unhealthy() -> None:
    a = agent("n0")
    evidence = a.xid(79, gpu=2, now=LAUNCHED)
    assert (evidence.xid, evidence.node, evidence.gpu_index) == (79, "n0", 2)
    assert "fallen off the bus" in evidence.detail
    assert a.node_record().state == a.node_state() and a.unhealthy
    with pytest.raises(Refused, match="unhealthy"):
        launch(a, 0, ("n0",), at=LAUNCHED)


def test_the_control_language_round_trips_and_refuses_what_it_cannot_do() -> None:
    for line in (
        "crash light-0017",
        "crash n1 signal KILL",
        "hang light-0003 culprit-rank 5 stopped",
        "lease-loss light-0009 revoke return 2.5 at 17.25",
        "crash n1 at 3.5",
        "stall n4 at 8.0",
        "xid n code 48 gpu 3",
        "slow-preflight n 5:30 times 2",
        "fail-preflight n check compute.matmul",
        "drain n going away",
    ):
        fault = parse(line)
        assert parse(fault.line()) == fault
    assert parse("hang n").stamped(12.5).at == 12.5
    for bad in (
        "crash",
        "explode n1",
        "crash n1 exit 1 signal 9",
        "slow-preflight n",
        "hang n rank x",
        "crash bad/name",
    ):
        with pytest.raises(FaultError):
            parse(bad)
    assert Latency.parse("5:30") == Latency(5.0, 30.0)
    with pytest.raises(SettingsError):
        Latency.parse("30:5")
