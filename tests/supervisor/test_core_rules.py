"""One test (or a few) per rule of DESIGN.md's supervisor's contract, driven through handle()."""

from __future__ import annotations

import typing

import pytest

from controller.supervisor import machine as core
from controller.supervisor.actions import (
    AllocateFromQueue,
    CollectDumps,
    Launch,
    Page,
    PersistMemory,
    PersistNode,
    Quarantine,
    Release,
    RunPreflight,
    SetTimer,
    StopAttempt,
    TakeSpare,
)
from controller.supervisor.blame import FlightRecorderVerdict, Suspect
from controller.supervisor.events import (
    AttemptExited,
    CheckpointCommitted,
    ControlPlaneLost,
    ControlPlaneRestored,
    DumpsCollected,
    Event,
    EvidenceObserved,
    NodeJoined,
    NodeLost,
    OperatorQuarantine,
    OperatorRelease,
    PreflightResult,
    StopRequested,
    StoreListed,
    Tick,
)
from controller.supervisor.machine import RunState, TransitionError
from controller.supervisor.policy import DAY_S
from controller.supervisor.pool import NodeRecordView, PoolState
from runwarden.v1 import common_pb2, events_pb2
from tests.supervisor.harness import Driver, fast

E = events_pb2


def crash_and_restart(
    d: Driver, node: str, *, step_to: int, code: int = 1, fail: dict[str, tuple[str, ...]] | None = None
) -> None:
    """Run to `step_to`, crash `node`, answer dumps (no suspect) and exits, pass preflight."""
    d.steps(d.sup.job_step + 1, step_to)
    attempt = d.sup.attempt
    d.send(AttemptExited(node=node, attempt=attempt, exit_code=code, ended_at=d.now))
    d.send(DumpsCollected(attempt=attempt, verdict=FlightRecorderVerdict()))
    for n in d.running_nodes():
        if n != node and d.sup.pool.get(n).alive:
            d.send(AttemptExited(node=n, attempt=attempt, exit_code=-15))
    d.advance(d.cfg.backoff_max_s + 1)
    d.answer_preflight(fail)


# --- attempts, rendezvous ids, preflight -----------------------------------------------------


def test_every_attempt_gets_a_new_rendezvous_id_and_a_larger_attempt_number() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.start(3)
    for step in (3, 6, 9):
        crash_and_restart(d, d.running_nodes()[0], step_to=step)
    ids = [lc.rendezvous_id for lc in d.launches]
    assert ids == ["demo-1", "demo-2", "demo-3", "demo-4"]
    assert [lc.attempt for lc in d.launches] == [1, 2, 3, 4]
    assert all(nr.node_rank == i for lc in d.launches for i, nr in enumerate(lc.nodes))


def test_every_node_is_preflighted_before_launch() -> None:
    d = Driver(cfg=fast(), nodes=3)
    d.add_nodes(3)
    assert not d.launches and d.sup.state == RunState.PREFLIGHT
    req = d.of(RunPreflight)[0]
    assert sorted(req.nodes) == ["n1", "n2", "n3"] and req.mode == "quick" and req.purpose == "attempt"
    d.send(PreflightResult(node="n1", passed=True))
    d.send(PreflightResult(node="n2", passed=True))
    assert not d.launches
    d.send(PreflightResult(node="n3", passed=True))
    assert len(d.launches) == 1


def test_preflight_rejection_quarantines_replaces_and_does_not_consume_an_attempt() -> None:
    d = Driver(cfg=fast(), nodes=3)
    d.add_nodes(4)
    out = d.answer_preflight(fail={"n2": ("compute.matmul",)})
    q = d.of(Quarantine, out)
    assert {x.node for x in q} == {"n2"} and "compute.matmul" in q[0].reason
    assert d.sup.pool.get("n2").state in (
        PoolState.QUARANTINED,
        PoolState.BURN_IN,
        PoolState.HELD,
    )  # PoolState.HELD: its burn-in failed too
    assert [a.node for a in d.of(TakeSpare, out)] == ["n4"]
    d.answer_preflight()
    launch = d.launches[-1]
    assert launch.attempt == 1, "a preflight rejection must not consume an attempt"
    assert [nr.node for nr in launch.nodes] == ["n1", "n4", "n3"], "the spare takes the rejected node's rank"
    rejected = d.events(E.EVENT_KIND_PREFLIGHT_RESULT)[0]
    assert "not consumed" in rejected.message and rejected.preflight.node == "n2"


def test_preflight_that_never_answers_is_left_out_without_a_strike() -> None:
    """No answer within the preflight timeout may be the controller's own lateness (a busy pool, a
    slow network): the node is left out of this attempt and a spare takes its rank, but it is not
    quarantined and gets no strike; once no spare is left it is asked again."""
    d = Driver(cfg=fast(preflight_timeout_s=120.0), nodes=2)
    d.add_nodes(3)
    d.send(PreflightResult(node="n1", passed=True))
    out = d.advance(121)
    assert not d.of(Quarantine, out)
    left = [e for e in d.events(E.EVENT_KIND_PREFLIGHT_RESULT, out) if "left out" in e.message]
    assert [e.preflight.node for e in left] == ["n2"] and "no strike" in left[0].message
    n2 = d.sup.pool.get("n2")
    assert n2.state is PoolState.SPARE and n2.failure_times == [] and n2.preflight_rejections == 0
    out = d.advance(121)  # n3 (the spare that took its rank) does not answer either: no spare is left
    out += d.advance(121)  # a preflight timeout later, the left-out nodes are asked again
    assert [n for p in d.of(RunPreflight, out) for n in p.nodes] == ["n2"]  # one rank is empty
    assert not d.of(Quarantine, out)


def test_spares_first_then_the_queue() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.start(3)  # n1, n2 active; n3 spare
    out = d.send(NodeLost(node="n1"))
    out += d.send(DumpsCollected(attempt=1, verdict=FlightRecorderVerdict()))
    out += d.send(AttemptExited(node="n2", attempt=1, exit_code=-15))
    out += d.advance(10)
    assert [(t.node, t.replaces) for t in d.of(TakeSpare, out)] == [("n3", "n1")]
    assert not d.of(AllocateFromQueue, out)
    d.answer_preflight()
    # no spare left: the next loss goes to the queue, and the queue's node is taken when it joins
    out = d.send(NodeLost(node="n3"))
    out += d.send(DumpsCollected(attempt=2, verdict=FlightRecorderVerdict()))
    out += d.send(AttemptExited(node="n2", attempt=2, exit_code=-15))
    out += d.advance(10)
    alloc = d.of(AllocateFromQueue, out)
    assert [a.count for a in alloc] == [1] and not d.launches[2:]
    out = d.send(NodeJoined(node="q1"))
    spare = d.events(E.EVENT_KIND_SPARE_TAKEN, out)
    assert spare and spare[0].spare.source == "queue" and spare[0].spare.node == "q1"
    d.answer_preflight()
    assert [nr.node for nr in d.launches[-1].nodes] == ["q1", "n2"]


def test_first_attempt_waits_for_nodes_before_asking_the_queue() -> None:
    d = Driver(cfg=fast(queue_wait_s=30.0), nodes=4)
    d.add_nodes(2)
    assert not d.of(AllocateFromQueue)
    out = d.advance(31)
    assert [a.count for a in d.of(AllocateFromQueue, out)] == [2]


# --- resume ----------------------------------------------------------------------------------


def test_resume_only_from_the_latest_committed_checkpoint() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.start(2)
    d.steps(1, 25)
    d.send(CheckpointCommitted(step=10))
    d.send(CheckpointCommitted(step=20))
    d.steps(26, 29)  # progress beyond the last commit is not resumable
    crash_and_restart(d, "n1", step_to=29)
    assert d.launches[-1].resume_step == 20
    assert d.launches[0].resume_step == -1
    first = d.events(E.EVENT_KIND_FIRST_STEP)
    d.steps(21, 21)
    first = d.events(E.EVENT_KIND_FIRST_STEP)
    assert first[-1].attempt == 2 and first[-1].step == 21 and "resumed from 20" in first[-1].message


def test_load_done_logged_when_every_node_has_loaded_and_load_marks_are_not_steps() -> None:
    d = Driver(cfg=fast(startup_timeout_s=120.0), nodes=2)
    d.start(2)
    out = d.progress(0, nodes=["n1"], loaded=-1)  # n1's ranks loaded (scratch): a mark, not a step
    assert not d.events(E.EVENT_KIND_LOAD_DONE, out)
    out = d.progress(0, nodes=["n2"], loaded=-1)
    (done,) = d.events(E.EVENT_KIND_LOAD_DONE, out)
    assert done.attempt == 1 and done.step == -1 and "all 2 nodes loaded no checkpoint" in done.message
    assert d.sup.job_step == -1 and not d.events(E.EVENT_KIND_FIRST_STEP)
    # The startup timeout (not the short per-step one) still covers launch -> first step.
    out = d.advance(60)
    assert not d.events(E.EVENT_KIND_DETECTION, out)
    out = d.steps(1, 1, loaded=-1)
    assert [e.kind for e in d.events(None, out)] == [E.EVENT_KIND_FIRST_STEP]
    d.send(CheckpointCommitted(step=10))
    crash_and_restart(d, "n1", step_to=12)
    assert d.launches[-1].resume_step == 10
    # n1's load mark was overwritten before its agent flushed: a node that stepped with
    # `loaded_step` set has loaded, and LOAD_DONE comes before FIRST_STEP.
    d.progress(10, nodes=["n2"], loaded=10)
    out = d.progress(11, nodes=[n for n in d.running_nodes() if n != "n2"], loaded=10)
    kinds = [e.kind for e in d.events(None, out)]
    assert kinds == [E.EVENT_KIND_LOAD_DONE], kinds
    assert "loaded checkpoint step 10" in d.events(E.EVENT_KIND_LOAD_DONE)[-1].message
    out = d.steps(11, 11, loaded=10)
    assert [e.kind for e in d.events(None, out)] == [E.EVENT_KIND_FIRST_STEP]
    assert len(d.events(E.EVENT_KIND_LOAD_DONE)) == 2


def test_a_stalled_checkpoint_load_is_blamed_on_its_node_long_before_the_startup_timeout() -> None:
    d = Driver(cfg=fast(load_stall_s=60.0, burn_in_passes=1), nodes=4)
    d.start(5)  # n1..n4 active, n5 spare
    d.progress(0, nodes=["n1", "n2", "n3"], loaded=-1)  # three loaded; n4's load hangs
    out = d.advance(58)
    assert not d.events(E.EVENT_KIND_DETECTION, out)
    out = d.advance(3)
    (det,) = d.events(E.EVENT_KIND_DETECTION, out)
    assert det.detection.detector == E.DETECTOR_HANG and "checkpoint load stalled on n4" in det.message
    assert "3 of 4 nodes loaded" in det.message and det.detection.latency_s == pytest.approx(60.0, abs=1.5)
    d.send(DumpsCollected(attempt=1, verdict=FlightRecorderVerdict()))
    out = d.exit_all(code=-15) + d.advance(5)
    att = d.events(E.EVENT_KIND_ATTRIBUTION)[-1].attribution
    assert att.blame_method == E.BLAME_METHOD_HEARTBEAT and [s.node for s in att.suspects] == ["n4"]
    assert [q.node for q in d.of(Quarantine, out)] == ["n4"]
    assert [(t.node, t.replaces) for t in d.of(TakeSpare, out)] == [("n5", "n4")]


def test_a_load_that_stalls_on_most_nodes_is_the_storage_not_a_node() -> None:
    d = Driver(cfg=fast(load_stall_s=60.0), nodes=4)
    d.start(4)
    d.progress(0, nodes=["n1"], loaded=-1)
    d.advance(61)
    d.send(DumpsCollected(attempt=1, verdict=FlightRecorderVerdict()))
    out = d.exit_all(code=-15)
    att = d.events(E.EVENT_KIND_ATTRIBUTION, out)[-1].attribution
    assert not att.suspects and not d.of(Quarantine, out)


def test_no_load_done_from_a_trainer_that_sends_no_load_marks() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.start(2)
    d.steps(1, 3)
    assert d.events(E.EVENT_KIND_FIRST_STEP) and not d.events(E.EVENT_KIND_LOAD_DONE)


# --- detection -------------------------------------------------------------------------------


def test_hang_detected_after_the_derived_timeout_with_latency() -> None:
    d = Driver(cfg=fast(), nodes=4)
    d.start()
    d.steps(1, 20, dt=2.0)  # median step 2 s -> timeout max(10, 6) = 10 s
    out = d.advance(9.5)
    assert not d.events(E.EVENT_KIND_DETECTION, out)
    out = d.advance(1.0)
    det = d.events(E.EVENT_KIND_DETECTION, out)
    assert len(det) == 1 and det[0].detection.detector == E.DETECTOR_HANG
    assert det[0].detection.latency_s == pytest.approx(10.0, abs=0.01)
    assert d.of(CollectDumps, out) and d.sup.state == RunState.COLLECTING


def test_hang_timeout_follows_slow_steps() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.start(2)
    d.steps(1, 10, dt=6.0)  # 3 x 6 s = 18 s
    assert not d.events(E.EVENT_KIND_DETECTION, d.advance(17.0))
    assert d.events(E.EVENT_KIND_DETECTION, d.advance(1.5))


def test_no_hang_while_a_rank_is_inside_a_checkpoint_save() -> None:
    d = Driver(cfg=fast(checkpoint_barrier_s=60.0), nodes=2)
    d.start(2)
    d.steps(1, 10)
    d.progress(10, in_checkpoint=("n1",))  # n1 saving; n2 waits in the barrier
    assert not d.events(E.EVENT_KIND_DETECTION, d.advance(50.0))
    det = d.events(E.EVENT_KIND_DETECTION, d.advance(12.0))
    assert det and "in a checkpoint" in det[0].message


def test_a_stale_saving_flag_after_the_commit_does_not_delay_hang_detection() -> None:
    # n1's rank stopped right after its part of the save of step 10: its last report still says
    # "saving". The commit of step 10 proves every rank finished that save, so the ordinary hang
    # timeout applies, not the checkpoint barrier's.
    d = Driver(cfg=fast(checkpoint_barrier_s=120.0), nodes=2)
    d.start(2)
    d.steps(1, 10)
    d.progress(10, in_checkpoint=("n1", "n2"))
    d.progress(10, nodes=["n2"])  # n2 done saving; n1 says nothing more
    d.send(CheckpointCommitted(step=10))
    det = d.events(E.EVENT_KIND_DETECTION, d.advance(11.0))
    assert det and det[0].detection.detector == E.DETECTOR_HANG and "in a checkpoint" not in det[0].message
    # ... and a later report from a rank still flagged "saving" a committed step is not a save either
    d2 = Driver(cfg=fast(checkpoint_barrier_s=120.0), nodes=2)
    d2.start(2)
    d2.steps(1, 10)
    d2.send(CheckpointCommitted(step=10))
    d2.progress(10, in_checkpoint=("n1",))
    assert d2.events(E.EVENT_KIND_DETECTION, d2.advance(11.0))


def _run_with_saves(d: Driver, save_s: float, saves: int) -> int:
    """Train on `d` with `saves` checkpoints of `save_s` each (every 10 steps); returns the last step."""
    step = 0
    for _ in range(saves):
        d.steps(step + 1, step + 10)
        step += 10
        d.progress(step, in_checkpoint=tuple(d.running_nodes()), dt=0.1)
        d.advance(save_s)
        d.send(CheckpointCommitted(step=step))
    d.steps(step + 1, step + 10)
    return step + 10


@pytest.mark.parametrize(
    ("save_s", "saves", "quiet_s", "fires_by_s"),
    [
        (0.5, 3, 9.5, 10.5),  # learned: 3 x 0.5 s is below the ordinary 10 s hang timeout
        (0.5, 2, 100.0, 121.0),  # fewer than checkpoint_saves_to_learn (3) saves: the 120 s barrier
        (25.0, 3, 70.0, 76.0),  # slow saves: 3 x 25 = 75 s
        (50.0, 3, 115.0, 121.0),  # 3 x 50 = 150 s, capped at the 120 s barrier
    ],
)
def test_the_save_allowance_is_learned_from_the_run_s_own_saves(
    save_s: float, saves: int, quiet_s: float, fires_by_s: float
) -> None:
    # A rank stops inside the next save: no hang is called for `quiet_s`, one is by `fires_by_s`.
    # The 25 s and 50 s cases also prove that a commit credits its save to the hang clock (without
    # that, a 25 s save tripped the 10 s timeout the moment it committed).
    d = Driver(cfg=fast(checkpoint_barrier_s=120.0), nodes=2)
    d.start(2)
    last = _run_with_saves(d, save_s, saves=saves)
    d.progress(last, in_checkpoint=("n1", "n2"), dt=0.1)
    assert not d.events(E.EVENT_KIND_DETECTION, d.advance(quiet_s))
    det = d.events(E.EVENT_KIND_DETECTION, d.advance(fires_by_s - quiet_s))
    assert det and det[0].detection.detector == E.DETECTOR_HANG and "in a checkpoint" in det[0].message


def test_startup_timeout_when_a_node_never_reports() -> None:
    d = Driver(cfg=fast(startup_timeout_s=60.0), nodes=2)
    d.start(2)
    d.progress(1, nodes=["n1"])
    det = d.events(E.EVENT_KIND_DETECTION, d.advance(61.0))
    assert det and det[0].detection.nodes == ["n2"] and "no progress from n2" in det[0].message


def test_hung_rank_is_blamed_by_flight_recorder_not_the_rank_that_timed_out() -> None:
    d = Driver(cfg=fast(), nodes=4)
    d.start(5)
    d.steps(1, 20)
    d.advance(11.0)
    attribution = FlightRecorderVerdict(
        suspects=(
            Suspect(node="n3", ranks=(2,), confidence=0.95, reason="rank 2 never entered allreduce seq 41"),
        )
    )
    d.send(DumpsCollected(attempt=1, verdict=attribution))
    out = d.exit_all(code=1)  # rank 0 reports the collective timeout: a victim
    att = d.events(E.EVENT_KIND_ATTRIBUTION, out)[0]
    assert att.attribution.method == "flight_recorder" and [s.node for s in att.attribution.suspects] == [
        "n3"
    ]
    assert [q.node for q in d.of(Quarantine, out)] == ["n3"]
    d.advance(2)
    d.answer_preflight()
    assert "n3" not in [nr.node for nr in d.launches[-1].nodes]
    assert [nr.node for nr in d.launches[-1].nodes] == ["n1", "n2", "n5", "n4"]


def test_hang_without_dumps_falls_back_to_the_heartbeat_node_behind() -> None:
    d = Driver(cfg=fast(), nodes=3)
    d.start(3)
    d.steps(1, 10)
    d.progress(11, nodes=["n1", "n3"])  # n2 stopped first
    d.advance(30.0)  # dumps time out, then the stop's grace: the decision is made without them
    att = d.events(E.EVENT_KIND_ATTRIBUTION)[0]
    assert att.attribution.method == "heartbeat" and att.attribution.suspects[0].node == "n2"


def test_node_lost_detected_attributed_quarantined_and_replaced() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.start(3)
    d.steps(1, 5)
    d.now += 4.0
    out = d.send(NodeLost(node="n2"))
    det = d.events(E.EVENT_KIND_DETECTION, out)[0]
    assert det.detection.detector == E.DETECTOR_NODE_LOST and det.detection.latency_s == pytest.approx(4.0)
    # the lease is the blame: no dumps; the peers are stopped once a mass expiry would have shown
    assert not d.of(CollectDumps, out) and not d.of(StopAttempt, out)
    out = d.advance(d.sup.cfg.lost_node_hold_s)
    assert d.of(StopAttempt, out)[0].nodes == ("n1",)
    # decided as the stop begins (the lease is the blame): the relaunch does not wait for n1's exit
    assert [q.node for q in d.of(Quarantine, out)] == ["n2"]
    out = d.send(AttemptExited(node="n1", attempt=1, exit_code=-15))  # the stop's answer: old news
    assert not d.of(Quarantine, out) and not d.of(StopAttempt, out)
    d.advance(2)
    d.answer_preflight()
    assert [nr.node for nr in d.launches[-1].nodes] == ["n1", "n3"]


def test_hardware_evidence_outranks_the_flight_recorder() -> None:
    d = Driver(cfg=fast(), nodes=3)
    d.start(4)
    d.steps(1, 5)
    xid = common_pb2.Evidence(
        node="n1",
        kind=common_pb2.EVIDENCE_KIND_XID,
        xid=79,
        severity=common_pb2.SEVERITY_FATAL,
        detail="Xid 79: GPU has fallen off the bus",
        observed_at=d.now - 0.5,
    )
    out = d.send(EvidenceObserved(evidence=xid))
    det = d.events(E.EVENT_KIND_DETECTION, out)[0]
    assert det.detection.detector == E.DETECTOR_EVIDENCE and det.detection.latency_s == pytest.approx(0.5)
    d.send(
        DumpsCollected(
            attempt=1,
            verdict=FlightRecorderVerdict(
                suspects=(Suspect(node="n2", confidence=0.9, reason="never reached"),)
            ),
        )
    )
    out = d.exit_all(code=1)
    att = d.events(E.EVENT_KIND_ATTRIBUTION, out)[0]
    assert att.attribution.method == "hardware" and att.attribution.suspects[0].node == "n1"
    assert att.attribution.suspects[0].evidence[0].xid == 79
    assert [q.node for q in d.of(Quarantine, out)] == ["n1"]


def test_fatal_evidence_on_a_spare_quarantines_it_at_once_and_application_xids_do_not() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.start(3)
    app = common_pb2.Evidence(
        node="n3", kind=common_pb2.EVIDENCE_KIND_XID, xid=13, severity=common_pb2.SEVERITY_APPLICATION
    )
    assert not d.of(Quarantine, d.send(EvidenceObserved(evidence=app)))
    ecc = common_pb2.Evidence(
        node="n3", kind=common_pb2.EVIDENCE_KIND_ECC_UNCORRECTABLE, severity=common_pb2.SEVERITY_FATAL
    )
    out = d.send(EvidenceObserved(evidence=ecc))
    assert [q.node for q in d.of(Quarantine, out)] == ["n3"] and d.sup.state == RunState.RUNNING


# --- crash, crash loop, budget, backoff -------------------------------------------------------


def test_killed_rank_is_first_to_exit_but_not_quarantined_on_a_first_offence() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.start(3)
    d.steps(1, 7)
    out = d.send(AttemptExited(node="n2", attempt=1, signal=9, rank=1, ended_at=d.now - 0.2))
    det = d.events(E.EVENT_KIND_DETECTION, out)[0]
    assert det.detection.detector == E.DETECTOR_CRASH and "signal:SIGKILL" in det.message
    assert det.detection.latency_s == pytest.approx(0.2)
    d.send(DumpsCollected(attempt=1, verdict=FlightRecorderVerdict()))
    out = d.send(AttemptExited(node="n1", attempt=1, exit_code=1))
    att = d.events(E.EVENT_KIND_ATTRIBUTION, out)[0]
    assert att.attribution.method == "first_exit" and att.attribution.suspects[0].node == "n2"
    assert "not quarantined on a first offence" in att.message
    assert not d.of(Quarantine)
    d.advance(2)
    d.answer_preflight()
    assert [nr.node for nr in d.launches[-1].nodes] == ["n1", "n2"]


def test_same_node_first_to_exit_at_different_steps_is_quarantined() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.start(3)
    crash_and_restart(d, "n2", step_to=5)
    assert not d.of(Quarantine)
    crash_and_restart(d, "n2", step_to=9)
    q = d.of(Quarantine)
    assert [x.node for x in q] == ["n2"] and "different steps" in q[0].reason


def test_crash_loop_same_failure_same_step_three_times_stops_and_pages() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.start(5)
    d.steps(1, 10)
    for i, node in enumerate(["n1", "n2", "n1"]):
        attempt = d.sup.attempt
        d.send(AttemptExited(node=node, attempt=attempt, exit_code=3))
        d.send(DumpsCollected(attempt=attempt, verdict=FlightRecorderVerdict()))
        d.exit_all(code=-15)
        if i < 2:
            d.advance(10)
            d.answer_preflight()
            d.steps(1, 10)  # deterministic: fails at step 10 again (resumed from scratch)
    assert d.sup.state == RunState.CRASH_LOOP
    pages = d.of(Page)
    assert len(pages) == 1 and "crash loop" in pages[0].reason and "step 10" in pages[0].reason
    end = d.events(E.EVENT_KIND_RUN_END)[-1]
    assert end.run_detail.outcome == "crash_loop"
    assert len(d.launches) == 3
    assert not d.of(Quarantine), "n1 first at the same step twice is the crash-loop rule's, not a quarantine"


@pytest.mark.parametrize("gap_s", [0.005, 3.0])
def test_a_peers_error_exit_just_before_a_killed_ranks_death_is_its_collateral(gap_s: float) -> None:
    """Two agents race to report: a rank SIGKILLed and its peer failing on the reset connection. The
    peer's exit:1 arrived first (5 ms earlier by the agents' clocks, seen in a full suite run); the
    killed rank is the cause. Seconds apart, the first exit stands."""
    d = Driver(cfg=fast(), nodes=2)
    d.start(2)
    d.steps(1, 5)
    peer, killed = d.running_nodes()
    attempt = d.sup.attempt
    d.send(AttemptExited(node=peer, attempt=attempt, exit_code=1, ended_at=d.now))
    d.send(AttemptExited(node=killed, attempt=attempt, signal=9, ended_at=d.now + gap_s))
    d.send(DumpsCollected(attempt=attempt, verdict=FlightRecorderVerdict()))
    (blame,) = d.events(events_pb2.EVENT_KIND_ATTRIBUTION)
    expected = killed if gap_s < 1.0 else peer
    assert blame.attribution.suspects[0].node == expected, blame.message


def _fail_at_step_10(d: Driver, first: str) -> None:
    attempt = d.sup.attempt
    d.send(AttemptExited(node=first, attempt=attempt, exit_code=3))
    d.send(DumpsCollected(attempt=attempt, verdict=FlightRecorderVerdict()))
    d.exit_all(code=-15)


@pytest.mark.parametrize("recurs", [False, True], ids=["a relapsing node", "the job on that rank"])
def test_the_same_node_first_out_at_the_same_step_twice_is_moved_out_to_tell_node_from_job(
    recurs: bool,
) -> None:
    """A node that relapses at one step (the fleet simulator's Llama-3 replay ended a run as a crash
    loop on one) and the job failing on that node's ranks look alike; the second time, the node is
    moved out. Not recurring on the spare: it was the node, the run trains on. Recurring on the
    spare (the same node rank first out): the crash loop, and the node is back without the strike."""
    d = Driver(cfg=fast(), nodes=2)
    d.start(3)  # n1 and n2 train, n3 is the spare
    first = d.running_nodes()[0]
    d.steps(1, 10)
    _fail_at_step_10(d, first)
    d.advance(10)
    d.answer_preflight()
    assert not d.of(Quarantine)  # a first offence
    d.steps(1, 10)
    _fail_at_step_10(d, first)
    (q,) = d.of(Quarantine)
    assert q.node == first and "first to exit at step 10 again" in q.reason, q.reason
    d.advance(10)
    d.answer_preflight()
    assert first not in d.running_nodes() and d.sup.state is RunState.RUNNING
    if not recurs:
        d.steps(1, 30)
        assert d.sup.state is RunState.RUNNING
        assert d.sup.pool.get(first).failure_times  # its strike stays (a burn-in decides its return)
        return
    d.steps(1, 10)
    _fail_at_step_10(d, d.running_nodes()[0])  # the spare, in the moved node's node rank
    assert d.sup.state is RunState.CRASH_LOOP
    node = d.sup.pool.get(first)
    assert node.state is PoolState.SPARE and not node.failure_times, node


def test_a_relapse_that_would_be_the_third_hit_is_moved_out_before_the_loop_is_declared() -> None:
    """Two nodes fail a few steps after the resume (the fleet simulator at 16,384 hosts: relapsing nodes
    without evidence): n1, then n2 twice in a row. n2's second is the third hit of the step; n2 is moved
    out instead of ending the run, and the next hit at the step, on its spare, is the loop (n2 back
    without its strike). A victim that comes back later (n1, n2, n1) is no relapse: the loop, as before
    (test_crash_loop_same_failure_same_step_three_times_stops_and_pages)."""
    d = Driver(cfg=fast(), nodes=2)
    d.start(4)  # n1 and n2 train, n3 and n4 are spares
    for i, node in enumerate(("n1", "n2", "n2")):
        d.steps(1, 10)
        _fail_at_step_10(d, node)
        assert f"{node}: first to exit" in d.events(E.EVENT_KIND_ATTRIBUTION)[-1].message
        if i < 2:
            d.advance(10)
            d.answer_preflight()
    (q,) = d.of(Quarantine)
    assert q.node == "n2" and "first to exit at step 10 again" in q.reason, q.reason
    assert d.sup.state is not RunState.CRASH_LOOP and not d.of(Page)
    memory = [a for a in d.actions if isinstance(a, PersistMemory)][-1].record
    assert [(c.count, c.last_first_exit) for c in memory.loops] == [(3, "n2")]  # a new leader knows it
    fresh = Driver(cfg=d.cfg, nodes=2, now=d.now)
    fresh.send(StoreListed(alive={}, memory=memory))
    assert [(c.count, c.last_first_exit) for c in fresh.sup.history.loops] == [(3, "n2")]
    d.advance(30)
    d.answer_preflight()
    assert "n2" not in d.running_nodes() and d.sup.state is RunState.RUNNING
    d.steps(1, 10)
    spare = d.running_nodes()[1]
    _fail_at_step_10(d, spare)  # n2's node rank fails at the step on its spare too: the job's
    assert d.sup.state is RunState.CRASH_LOOP
    assert not d.sup.pool.get("n2").failure_times


def test_different_steps_are_not_a_crash_loop() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.start(2)
    for step in (5, 9, 14, 20):
        crash_and_restart(d, d.running_nodes()[step % 2], step_to=step)
    assert d.sup.state == RunState.RUNNING


def test_backoff_doubles_up_to_the_cap_and_budget_ends_the_run_with_a_page() -> None:
    d = Driver(
        cfg=fast(
            restart_budget=4,
            backoff_base_s=1.0,
            backoff_max_s=4.0,
            crash_loop_count=99,
            repeat_offender_count=99,
        ),
        nodes=1,
    )
    d.start(1)
    delays = []
    for i in range(5):
        d.steps(d.sup.job_step + 1, d.sup.job_step + 1)
        attempt = d.sup.attempt
        d.send(AttemptExited(node="n1", attempt=attempt, exit_code=1))
        d.send(DumpsCollected(attempt=attempt, verdict=FlightRecorderVerdict()))
        if i == 4:
            break
        t0 = d.now
        at = d.timers.get("backoff")  # no timer: a zero backoff waits for nodes at once
        delays.append(at - t0 if at is not None and at >= t0 else 0.0)
        d.advance(10)
        d.answer_preflight()
    assert delays == [0.0, 1.0, 2.0, 4.0]  # the first failure waits for nothing
    assert d.sup.state == RunState.BUDGET_EXHAUSTED
    assert "budget" in d.of(Page)[0].reason
    assert len(d.launches) == 5  # 1 + 4 restarts


# --- planned stops, control plane ------------------------------------------------------------


def test_stop_request_stops_gracefully_and_relaunches_without_quarantine_or_budget() -> None:
    d = Driver(cfg=fast(restart_budget=0), nodes=2)
    d.start(2)
    d.steps(1, 10)
    out = d.send(StopRequested(reason="time limit", requested_by="slurm"))
    stop = d.of(StopAttempt, out)[0]
    # A planned stop gets the save barrier's time (checkpoint_barrier_s), not the failure grace.
    assert stop.planned and stop.grace_s == max(d.cfg.stop_grace_s, d.cfg.checkpoint_barrier_s)
    assert stop.grace_s > d.cfg.stop_grace_s and not d.of(CollectDumps, out)
    d.send(CheckpointCommitted(step=10))
    out = d.exit_all(code=0)
    assert not d.of(Quarantine) and not d.events(E.EVENT_KIND_DETECTION)
    d.answer_preflight()
    assert d.launches[-1].attempt == 2 and d.launches[-1].resume_step == 10


def test_stop_request_without_relaunch_ends_the_run() -> None:
    d = Driver(cfg=fast(), nodes=1)
    d.start(1)
    d.send(StopRequested(reason="drain", relaunch=False))
    d.exit_all(code=0)
    assert d.sup.state == RunState.STOPPED and len(d.launches) == 1


def test_mass_lease_expiry_quarantines_nothing_and_keeps_a_healthy_attempt() -> None:
    d = Driver(cfg=fast(mass_expiry_min_nodes=3), nodes=4)
    d.start(6)
    d.steps(1, 5)
    for n in ("n1", "n2", "n3"):
        out = d.send(NodeLost(node=n), d.now + 0.2)
    cp = d.events(E.EVENT_KIND_CONTROL_PLANE, out)
    assert cp and "control-plane fault" in cp[0].message and d.sup.state == RunState.CONTROL_PLANE
    for n in ("n1", "n2", "n3"):
        out = d.send(NodeJoined(node=n), d.now + 1.0)
    assert d.sup.state == RunState.RUNNING and len(d.launches) == 1
    assert "not relaunched" in d.events(E.EVENT_KIND_CONTROL_PLANE, out)[-1].message
    assert not d.of(Quarantine) and not d.of(StopAttempt)
    d.steps(6, 8)
    assert d.sup.state == RunState.RUNNING


def test_mass_expiry_where_nodes_do_not_return_relaunches_without_quarantine_or_budget() -> None:
    d = Driver(cfg=fast(mass_expiry_min_nodes=3, control_plane_grace_s=30.0, restart_budget=0), nodes=2)
    d.start(6)
    for n in ("n1", "n3", "n4"):
        d.send(NodeLost(node=n), d.now + 0.1)
    d.advance(31)
    d.exit_all(code=-15)
    d.advance(5)
    d.answer_preflight()
    assert not d.of(Quarantine) and d.sup.state == RunState.RUNNING and d.launches[-1].attempt == 2


def test_lost_etcd_pauses_and_reconciles_without_quarantine() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.start(3)
    d.steps(1, 5)
    d.send(ControlPlaneLost())
    assert d.sup.state == RunState.CONTROL_PLANE
    d.advance(100)  # nothing happens while blind: no hang, no quarantine
    assert not d.events(E.EVENT_KIND_DETECTION)
    d.send(ControlPlaneRestored())
    out = d.send(StoreListed(alive={"n1": 1, "n2": 1, "n3": 1}, attempt=1, attempt_nodes=("n1", "n2")))
    assert d.sup.state == RunState.RUNNING and not d.of(Launch, out) and not d.of(Quarantine)


def test_reconcile_after_controller_restart_adopts_a_healthy_attempt() -> None:
    d = Driver(cfg=fast(), nodes=2)
    snap = StoreListed(
        alive={"n1": 1, "n2": 1, "n3": 1},
        attempt=7,
        attempt_nodes=("n1", "n2"),
        resume_step=40,
        committed_steps=(20, 40),
        records=(NodeRecordView(node="n3", pool_state=PoolState.HELD.value, reason="xid"),),
    )
    out = d.send(snap)
    assert d.sup.state == RunState.RUNNING and d.sup.attempt == 7 and not d.of(Launch, out)
    assert d.sup.pool.get("n3").state == PoolState.HELD
    assert not d.of(RunPreflight, out), "a held node gets no burn-in"
    d.steps(41, 43)
    assert d.sup.state == RunState.RUNNING
    # the next failure relaunches with attempt 8 from committed step 40
    crash_and_restart(d, "n1", step_to=45)
    assert d.launches[-1].attempt == 8 and d.launches[-1].resume_step == 40


def test_an_adopted_attempt_that_hung_before_the_takeover_is_a_hang_at_its_step() -> None:
    # The ranks stopped at step 43 while no controller watched: no later progress put comes. The
    # shell feeds the stored progress after the StoreListed; the hang rule (not the startup timeout,
    # startup_timeout_s) finds it, at step 43, so a crash loop's count sees the same failure.
    d = Driver(cfg=fast(hang_timeout_s=10.0, startup_timeout_s=120.0), nodes=2)
    d.send(
        StoreListed(alive={"n1": 1, "n2": 1, "n3": 1}, attempt=7, attempt_nodes=("n1", "n2"), resume_step=40)
    )
    d.progress(43, dt=0.0)
    assert not d.events(E.EVENT_KIND_DETECTION, d.advance(9.0))
    [det] = d.events(E.EVENT_KIND_DETECTION, d.advance(2.0))
    assert det.detection.detector == E.DETECTOR_HANG and det.step == 43, det.message


def test_reconcile_with_a_missing_node_relaunches_without_quarantine() -> None:
    d = Driver(cfg=fast(), nodes=2)
    out = d.send(
        StoreListed(alive={"n1": 1, "n3": 1}, attempt=3, attempt_nodes=("n1", "n2"), committed_steps=(5,))
    )
    assert d.of(StopAttempt, out) and not d.of(Quarantine, out)
    d.exit_all(code=-15)
    d.answer_preflight()
    assert d.launches[-1].attempt == 4 and [nr.node for nr in d.launches[-1].nodes] == ["n1", "n3"]


# --- stragglers --------------------------------------------------------------------------------


def _straggle(d: Driver, first: int, last: int, slow: str, factor: float = 1.10) -> None:
    for s in range(first, last + 1):
        d.progress(s, dt=1.0, compute={slow: 0.8 * factor})


def test_ten_percent_straggler_flagged_within_50_steps_and_quarantined_at_next_restart() -> None:
    d = Driver(cfg=fast(), nodes=4)
    d.start(5)
    _straggle(d, 1, 50, "n3")
    det = [e for e in d.events(E.EVENT_KIND_DETECTION) if e.detection.detector == E.DETECTOR_STRAGGLER]
    assert len(det) == 1 and det[0].detection.nodes == ["n3"] and "not killed" in det[0].message
    assert det[0].step <= 50 and det[0].detection.latency_s > 0
    assert d.sup.state == RunState.RUNNING and len(d.launches) == 1, "not killed mid-run by default"
    crash_and_restart(d, "n1", step_to=55)
    assert "n3" not in [nr.node for nr in d.launches[-1].nodes]
    assert any(q.node == "n3" and "straggler" in q.reason for q in d.of(Quarantine))


def test_no_straggler_flag_in_a_clean_run() -> None:
    d = Driver(cfg=fast(), nodes=4)
    d.start(4)
    d.steps(1, 200)
    assert not d.events(E.EVENT_KIND_DETECTION)


def test_straggler_killed_mid_run_when_configured() -> None:
    d = Driver(cfg=fast(kill_stragglers_mid_run=True), nodes=4)
    d.start(5)
    _straggle(d, 1, 50, "n2")
    assert d.sup.state == RunState.COLLECTING
    d.send(DumpsCollected(attempt=1, verdict=FlightRecorderVerdict()))
    out = d.exit_all(code=-15)
    assert [q.node for q in d.of(Quarantine, out)] == ["n2"]


# --- burn-in, hold, operator ------------------------------------------------------------------


def test_quarantined_node_returns_only_after_burn_in() -> None:
    d = Driver(cfg=fast(burn_in_passes=2), nodes=2)
    d.start(3)
    d.send(NodeLost(node="n2"))
    d.send(DumpsCollected(attempt=1, verdict=FlightRecorderVerdict()))
    d.exit_all(code=-15)
    assert d.sup.pool.get("n2").state == PoolState.QUARANTINED
    out = d.send(NodeJoined(node="n2"))  # the agent comes back
    burn = d.of(RunPreflight, out)
    assert (
        burn[0].purpose == "burn_in"
        and burn[0].mode == "burn_in"
        and d.sup.pool.get("n2").state == PoolState.BURN_IN
    )
    d.send(PreflightResult(node="n2", passed=True, mode="full"))
    assert d.sup.pool.get("n2").state == PoolState.BURN_IN
    out = d.send(PreflightResult(node="n2", passed=True, mode="full"))
    assert d.sup.pool.get("n2").state == PoolState.SPARE and [r.node for r in d.of(Release, out)] == ["n2"]


def test_node_failing_twice_in_a_week_is_held_until_an_operator_releases_it() -> None:
    d = Driver(cfg=fast(burn_in_passes=1), nodes=1)
    d.start(2)
    d.send(OperatorQuarantine(node="n2", reason="bad cable"))
    assert d.sup.pool.get("n2").state == PoolState.HELD
    out = d.send(PreflightResult(node="n2", passed=True, mode="full"))
    assert d.sup.pool.get("n2").state == PoolState.HELD and not d.of(Release, out)
    out = d.send(OperatorRelease(node="n2", reason="cable replaced"))
    assert d.of(RunPreflight, out)[0].purpose == "burn_in"
    d.send(PreflightResult(node="n2", passed=True, mode="full"))
    assert d.sup.pool.get("n2").state == PoolState.SPARE
    # two failures within 7 days -> held (burn-in passed in between)
    d2 = Driver(cfg=fast(burn_in_passes=1), nodes=2)
    d2.start(2)  # both active, no spare: a lost n2 comes back through burn-in into the next attempt
    for _ in range(2):
        assert "n2" in d2.running_nodes()
        attempt = d2.sup.attempt
        d2.send(NodeLost(node="n2"))
        d2.send(DumpsCollected(attempt=attempt, verdict=FlightRecorderVerdict()))
        d2.send(AttemptExited(node="n1", attempt=attempt, exit_code=-15))
        d2.advance(10)
        d2.send(NodeJoined(node="n2"))
        d2.answer_preflight()
        d2.answer_preflight()
    assert d2.sup.pool.get("n2").state == PoolState.HELD
    held = [q for q in d2.of(Quarantine) if q.held]
    assert held and "2 failures within" in d2.events(E.EVENT_KIND_QUARANTINE)[-1].message


def test_fatal_evidence_holds_the_node_for_repair_with_no_burn_in_and_a_spare_runs_instead() -> None:
    d = Driver(cfg=fast(burn_in_passes=1), nodes=2)
    d.start(3)  # n1, n2 active; n3 spare
    xid = common_pb2.Evidence(
        node="n2", kind=common_pb2.EVIDENCE_KIND_XID, severity=common_pb2.SEVERITY_FATAL, detail="Xid 79"
    )
    out = d.send(EvidenceObserved(evidence=xid))
    out += d.exit_all(code=-9)
    out += d.advance(5)
    assert d.sup.pool.get("n2").state == PoolState.HELD
    (q,) = d.of(Quarantine, out)
    assert q.node == "n2" and q.held
    assert "needs repair" in d.events(E.EVENT_KIND_QUARANTINE)[-1].message
    assert not [r for r in d.of(RunPreflight, out) if r.purpose == "burn_in"], "burnt in before a repair"
    d.answer_preflight()
    assert d.sup.state == RunState.RUNNING and "n2" not in d.running_nodes() and "n3" in d.running_nodes()
    # Its agent coming back (a reboot that re-registers) is not a repair mark: still held, no burn-in.
    out = d.send(NodeLost(node="n2")) + d.send(NodeJoined(node="n2"))
    assert d.sup.pool.get("n2").state == PoolState.HELD and not d.of(RunPreflight, out)
    # `controllerctl repaired n2` (an operator release): burn-in, then a spare again.
    out = d.send(OperatorRelease(node="n2", reason="repaired: GPU reseated"))
    assert [r.purpose for r in d.of(RunPreflight, out)] == ["burn_in"]
    d.send(PreflightResult(node="n2", passed=True, mode="full"))
    assert d.sup.pool.get("n2").state == PoolState.SPARE


def test_operator_quarantine_of_an_active_node_restarts_without_it_and_no_budget() -> None:
    d = Driver(cfg=fast(restart_budget=0), nodes=2)
    d.start(3)
    d.send(OperatorQuarantine(node="n1", reason="maintenance"))
    d.exit_all(code=0)
    d.answer_preflight()
    assert [nr.node for nr in d.launches[-1].nodes] == ["n3", "n2"] and d.sup.state == RunState.RUNNING


# --- the machine itself ----------------------------------------------------------------------


def test_all_nodes_exiting_zero_completes_the_run() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.start(2)
    d.steps(1, 3)
    d.exit_all(code=0)
    assert d.sup.state == RunState.COMPLETED
    assert d.events(E.EVENT_KIND_RUN_END)[-1].run_detail.outcome == "completed"


def test_unknown_state_event_pair_raises_naming_both() -> None:
    d = Driver(cfg=fast(), nodes=1)

    class Bogus:
        pass

    with pytest.raises(TransitionError, match=r"Bogus.*WAITING_NODES"):
        d.send(Bogus())


def test_transition_table_covers_every_state_and_event_type() -> None:
    events = set(typing.get_args(Event))
    for state in RunState:
        assert set(core.TABLE[state]) == events, state


def test_events_are_appended_before_the_actions_they_explain() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.start(3)
    out = d.send(NodeLost(node="n1")) + d.send(DumpsCollected(attempt=1, verdict=FlightRecorderVerdict()))
    out += d.exit_all(code=-15) + d.advance(3) + d.answer_preflight()
    kinds = [(type(a).__name__, a.kind if isinstance(a, E.Event) else None) for a in out]
    for cls, kind in (
        (Quarantine, E.EVENT_KIND_QUARANTINE),
        (TakeSpare, E.EVENT_KIND_SPARE_TAKEN),
        (Launch, E.EVENT_KIND_LAUNCH),
    ):
        i = next(i for i, (n, _) in enumerate(kinds) if n == cls.__name__)
        assert ("Event", kind) in kinds[:i], cls.__name__


def test_every_detection_event_carries_detector_and_latency() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.start(4)
    d.steps(1, 5)
    d.now += 3
    d.send(NodeLost(node="n1"))
    for ev in d.events(E.EVENT_KIND_DETECTION):
        assert ev.detection.detector != E.DETECTOR_UNSPECIFIED
        assert ev.detection.latency_s == pytest.approx(3.0)


def test_same_events_give_the_same_actions() -> None:
    def run() -> list[str]:
        d = Driver(cfg=fast(), nodes=2)
        d.start(3)
        crash_and_restart(d, "n1", step_to=4)
        d.steps(1, 8)
        return [repr(a) for a in d.actions]

    assert run() == run()


def test_stale_events_from_an_older_attempt_are_ignored() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.start(3)
    crash_and_restart(d, "n1", step_to=3)
    before = d.sup.state
    assert d.send(AttemptExited(node="n2", attempt=1, exit_code=1)) == []
    assert d.send(Tick()) == [] or d.sup.state == before


def _noisy_run(slow: str | None, steps: int, seed: int, noise: float = 0.05) -> list[events_pb2.Event]:
    """4 nodes x 2 ranks; each rank's compute jitters by +-noise; `slow` computes 10% longer."""
    import random

    from controller.supervisor.events import ProgressObserved, RankSample

    rng = random.Random(seed)
    d = Driver(cfg=fast(), nodes=4)
    d.ranks_per_node = 2
    d.start(4)
    base = 0.8
    for s in range(1, steps + 1):
        d.now += 1.0
        computes = {
            (n, i): base * (1.10 if n == slow else 1.0) * (1 + rng.uniform(-noise, noise))
            for n in d.running_nodes()
            for i in range(2)
        }
        slowest = max(computes.values())
        for r, n in enumerate(d.running_nodes()):
            ranks = tuple(
                RankSample(
                    rank=2 * r + i,
                    step=s,
                    step_time_s=slowest + 0.05,
                    compute_s=computes[(n, i)],
                    wait_s=slowest - computes[(n, i)] + 0.0005,
                    reported_at=d.now,
                )
                for i in range(2)
            )
            d.send(ProgressObserved(node=n, attempt=1, ranks=ranks))
    return [e for e in d.events(E.EVENT_KIND_DETECTION) if e.detection.detector == E.DETECTOR_STRAGGLER]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_noisy_ten_percent_straggler_flagged_within_50_steps(seed: int) -> None:
    det = _noisy_run("n2", 50, seed)
    assert len(det) == 1 and det[0].detection.nodes == ["n2"] and det[0].step <= 50


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_noisy_clean_run_has_no_false_straggler_flag(seed: int) -> None:
    assert _noisy_run(None, 500, seed) == []


def test_preflight_answers_during_a_control_plane_pause_launch_after_it() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.add_nodes(3)
    d.send(ControlPlaneLost())
    d.answer_preflight()
    assert not d.launches
    d.send(ControlPlaneRestored())
    out = d.send(StoreListed(alive={"n1": 1, "n2": 1, "n3": 1}))
    assert [lc.attempt for lc in d.of(Launch, out)] == [1] and not d.of(Quarantine)


def test_attribution_module_result_is_accepted_and_its_explanation_logged() -> None:
    d = Driver(cfg=fast(), nodes=3)
    d.start(4)
    d.steps(1, 10)
    d.advance(11.0)
    result = FlightRecorderVerdict(
        explanation="pg 0: ranks 0,2 wait in allreduce #11; rank 1 never entered",
        suspects=(
            Suspect(node="n2", ranks=(1,), confidence=0.9, reason="never entered #11"),
            Suspect(node="", ranks=(7,), confidence=0.9, reason="unknown rank"),
        ),
    )
    d.send(DumpsCollected(attempt=1, verdict=result))
    out = d.exit_all(code=1)
    att = d.events(E.EVENT_KIND_ATTRIBUTION, out)[0].attribution
    assert [s.node for s in att.suspects] == ["n2"] and "never entered" in att.explanation
    assert [q.node for q in d.of(Quarantine, out)] == ["n2"]


def test_evidence_from_before_the_attempt_is_not_blamed_for_a_later_crash() -> None:
    d = Driver(cfg=fast(burn_in_passes=1, hold_after_failures=5), nodes=2)
    d.start(3)
    xid = common_pb2.Evidence(
        node="n3", kind=common_pb2.EVIDENCE_KIND_XID, xid=79, severity=common_pb2.SEVERITY_FATAL
    )
    d.send(EvidenceObserved(evidence=xid))  # n3 is a spare: held for repair ...
    assert d.sup.pool.get("n3").state == PoolState.HELD
    d.send(OperatorRelease(node="n3", reason="repaired"))  # ... repaired, burn-in passes, a spare again
    d.answer_preflight()
    assert d.sup.pool.get("n3").state == PoolState.SPARE
    crash_and_restart(d, "n1", step_to=4)
    d.steps(0, 3)
    d.send(OperatorQuarantine(node="n2", reason="maintenance"))  # n3 replaces n2
    d.exit_all(code=0)
    d.answer_preflight()
    assert "n3" in d.running_nodes()
    d.steps(0, 6)
    d.send(AttemptExited(node="n1", attempt=d.sup.attempt, exit_code=1))
    d.send(DumpsCollected(attempt=d.sup.attempt, verdict=FlightRecorderVerdict()))
    out = d.exit_all(code=-15)
    att = d.events(E.EVENT_KIND_ATTRIBUTION, out)[0].attribution
    assert att.method == "first_exit" and att.suspects[0].node == "n1"


def test_restart_decision_is_logged_with_budget_and_backoff() -> None:
    d = Driver(cfg=fast(), nodes=1)
    d.start(1)
    crash_and_restart(d, "n1", step_to=3)
    restart = d.events(E.EVENT_KIND_RESTART)
    assert len(restart) == 1 and "restart 1/20" in restart[0].message and "backoff 0s" in restart[0].message


def test_status_view_for_the_api() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.start(3)
    d.steps(1, 5)
    crash_and_restart(d, "n1", step_to=7)
    d.steps(0, 2)
    st = d.sup.status(d.now + 4.0)
    assert st.state == RunState.RUNNING and st.attempt == 2 and st.rendezvous_id == "demo-2"
    assert st.restarts_used == 1 and st.restart_budget == 20 and st.nodes == ("n1", "n2")
    assert st.since_last_progress_s == pytest.approx(4.0) and st.failure == ""


def test_snapshot_after_a_watch_gap_converges_without_relaunching() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.start(3)
    d.steps(1, 4)
    snap = StoreListed(alive={"n1": 1, "n2": 1, "n3": 1}, attempt=1, attempt_nodes=("n1", "n2"))
    for _ in range(2):  # idempotent
        out = d.send(snap)
        assert not d.of(Launch, out) and not d.of(StopAttempt, out) and d.sup.state == RunState.RUNNING
    # a DELETE missed during the gap: the listing lacks n2 -> handled as node lost
    out = d.send(StoreListed(alive={"n1": 1, "n3": 1}, attempt=1, attempt_nodes=("n1", "n2")))
    det = d.events(E.EVENT_KIND_DETECTION, out)
    assert det and det[0].detection.detector == E.DETECTOR_NODE_LOST and det[0].detection.nodes == ["n2"]


def test_crash_while_blind_is_a_crash_not_a_control_plane_fault() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.start(3)
    d.steps(1, 4)
    d.send(ControlPlaneLost())
    d.send(AttemptExited(node="n2", attempt=1, exit_code=1))
    d.send(ControlPlaneRestored())
    out = d.send(StoreListed(alive={"n1": 1, "n2": 1, "n3": 1}, attempt=1, attempt_nodes=("n1", "n2")))
    det = d.events(E.EVENT_KIND_DETECTION, out)
    assert det and det[0].detection.detector == E.DETECTOR_CRASH and "n2 exited" in det[0].message


def test_quarantine_persists_reason_and_evidence_for_the_pool_entry() -> None:
    from controller.supervisor.actions import PersistNode

    d = Driver(cfg=fast(), nodes=1)
    d.start(2)
    ecc = common_pb2.Evidence(
        node="n2", kind=common_pb2.EVIDENCE_KIND_ECC_UNCORRECTABLE, detail="DBE on GPU 3"
    )
    out = d.send(EvidenceObserved(evidence=ecc))
    rec = next(a.record for a in d.of(PersistNode, out) if a.record.node == "n2")
    assert (
        rec.pool_state == PoolState.HELD.value  # fatal evidence: held for repair
        and "ECC" in rec.reason
        and rec.evidence[0].detail == "DBE on GPU 3"
    )
    assert rec.evidence_kinds == (common_pb2.EVIDENCE_KIND_ECC_UNCORRECTABLE,) and len(rec.failure_times) == 1


def test_a_golden_host_takes_node_rank_0_and_a_first_registration_is_persisted() -> None:
    d = Driver(cfg=fast(), nodes=4)
    d.sup.pool.get("n5").known_since = d.now - 10 * DAY_S  # known for 10 days, clean
    joined = d.send(NodeJoined(node="n1", local_ranks=1))
    persisted = [a.record for a in joined if isinstance(a, PersistNode)]
    assert [(r.node, r.known_since) for r in persisted] == [("n1", d.now)]
    again = d.send(NodeJoined(node="n5", local_ranks=1))
    assert not [a for a in again if isinstance(a, PersistNode)]  # its history is already known
    d.add_nodes(2, start=2)  # n2, n3: four nodes, the attempt prepares
    d.answer_preflight()
    assert d.sup.state == core.RunState.RUNNING
    ranks = {r.node_rank: r.node for r in d.launches[-1].nodes}
    assert ranks[0] == "n5"  # the rendezvous store's host is the node with the long clean record


def test_the_spares_are_swept_together_once_an_interval_whatever_their_answers_phase() -> None:
    """One sweep per interval: answers that come seconds after the ask do not shift the next sweep
    (which would add a wake-up per interval: a progress round of every node in the simulator), and
    every idle spare not checked within the last half interval is asked in it."""
    d = Driver(cfg=fast(spare_check_interval_s=300.0, preflight_max_age_s=600.0), nodes=2)
    d.start(4)  # n1, n2 run; n3 and n4 are spares
    swept_at = d.now + 2.0
    asks: list[tuple[float, tuple[str, ...]]] = []
    wakeups: set[float] = set()
    for step in range(0, 500):  # ~16 minutes of 2 s steps
        out = d.progress(step, dt=2.0)
        if d.timers.pop_due(d.now):
            out += d.send(Tick())
        asks += [(d.now, p.nodes) for p in d.of(RunPreflight, out) if p.purpose == "spare"]
        wakeups |= {t.at for t in d.of(SetTimer, out) if t.key == "spare_check"}
        if step % 5 == 4:  # the checks answer ~10 s after they were asked
            d.answer_preflight()
    assert asks == [(swept_at + k * 300.0, ("n3", "n4")) for k in range(4)], asks
    assert sorted(wakeups) == [swept_at + k * 300.0 for k in range(1, 5)]


def test_idle_spares_are_checked_every_interval_and_the_replacement_joins_without_a_preflight() -> None:
    """The spares are asked at the attempt's first step (not before: the launch and load have the
    hosts), and each ask also sets the timer of their next check (a world whose ticks come only from
    timers, as the simulator's, keeps checking them); a hardware fault's replacement then joins
    vouched for by its last check: no preflight on the restart's path."""
    d = Driver(cfg=fast(spare_check_interval_s=300.0, preflight_max_age_s=600.0), nodes=2)
    launched = d.start(3)  # n1, n2 run; n3 is the spare
    assert "n3" not in [nr.node for nr in launched.nodes]
    assert not [p for p in d.of(RunPreflight) if p.purpose == "spare"]
    out = d.progress(0, dt=2.0)  # the first step (from scratch)
    assert [p.nodes for p in d.of(RunPreflight, out) if p.purpose == "spare"] == [("n3",)]
    assert [t.at for t in d.of(SetTimer, out) if t.key == "spare_check"] == [d.now + 300.0]
    d.answer_preflight()
    d.steps(2, 2, dt=2.0)
    asked = 1
    for step in range(3, 500):  # ~16 minutes of 2 s steps
        out = d.progress(step, dt=2.0)
        if d.timers.pop_due(d.now):
            out += d.send(Tick())
        asked += sum(p.purpose == "spare" for p in d.of(RunPreflight, out))
        d.answer_preflight()
    assert asked >= 3
    xid = common_pb2.Evidence(
        node="n1", kind=common_pb2.EVIDENCE_KIND_XID, severity=common_pb2.SEVERITY_FATAL, detail="Xid 79"
    )
    d.send(EvidenceObserved(evidence=xid))
    d.exit_all(code=-9)
    d.advance(5)
    plan = d.events(E.EVENT_KIND_PREFLIGHT_PLAN)[-1]
    assert "n3" in {v.node for v in plan.preflight_plan.vouched}, plan.message
