"""Never more harm than the fault: the core's rules that keep healthy nodes in service.

* A software fault at one step whose victim rotates is a crash loop whoever was blamed; the nodes it
  quarantined return without a strike or a burn-in.
* The blast radius stops automatic quarantine and pages once.
* The supervisor's memory (budget, crash-loop count, offences, quarantines) survives a new core.
"""

from __future__ import annotations

from controller.supervisor.actions import Page, PersistMemory, Quarantine, Release, RunPreflight
from controller.supervisor.blame import FlightRecorderVerdict, Suspect
from controller.supervisor.events import (
    CheckpointCommitted,
    DumpsCollected,
    EvidenceObserved,
    OperatorQuarantine,
    PreflightResult,
    StopRequested,
    StoreListed,
)
from controller.supervisor.machine import RunState
from controller.supervisor.pool import PoolState
from runwarden.v1 import common_pb2, events_pb2, store_pb2
from tests.supervisor.harness import Driver, Item, fast

E = events_pb2


def answer_attempt_preflights(d: Driver) -> None:
    """Pass every outstanding attempt preflight; burn-ins stay unanswered (they take an hour)."""
    while d.preflight_out:
        req = d.preflight_out.pop(0)
        if req.purpose != "attempt":
            continue
        for n in req.nodes:
            d.send(PreflightResult(node=n, passed=True, mode=req.mode))


def hang_at(d: Driver, step: int, culprit_rank: int, *, fr_record: bool = False) -> list[Item]:
    """Train to `step` - 1, then the rank `culprit_rank` never arrives (a data loader deadlocked on
    a bad shard): the hang is detected, the flight recorder names that rank's node. fr_record: the
    suspect carries the FLIGHT_RECORDER evidence record the live verdict attaches
    (flight_recorder.verdict)."""
    d.steps(d.sup.job_step + 1, step - 1)
    d.advance(d.cfg.hang_timeout_floor_s + 1)
    assert d.sup.state is RunState.COLLECTING, d.sup.state
    node = d.running_nodes()[culprit_rank]
    record = common_pb2.Evidence(
        node=node,
        kind=common_pb2.EVIDENCE_KIND_FLIGHT_RECORDER,
        severity=common_pb2.SEVERITY_WARNING,
        detail=f"rank {culprit_rank} never called collective #18",
    )
    verdict = FlightRecorderVerdict(
        suspects=(
            Suspect(
                node=node,
                ranks=(culprit_rank,),
                confidence=0.95,
                reason="never arrived",
                evidence=(record,) if fr_record else (),
            ),
        )
    )
    out = d.send(DumpsCollected(attempt=d.sup.attempt, verdict=verdict))
    out += d.exit_all(code=-15)
    return out


def rotating_hang_run(d: Driver, failures: int, *, fr_record: bool = False) -> list[str]:
    """A run with a commit at 40 and a bug at step 45 whose victim rotates per attempt."""
    d.start(6)  # 4 active + 2 spares
    blamed = []
    for i in range(failures):
        if d.sup.state is not RunState.RUNNING:
            break
        if i == 0:
            d.steps(1, 40)
            d.send(CheckpointCommitted(step=30))
            d.send(CheckpointCommitted(step=40))
        else:
            d.steps(41, 41)
        blamed.append(d.running_nodes()[i % 4])
        hang_at(d, 45, i % 4, fr_record=fr_record)
        if d.sup.state is RunState.BACKOFF:
            d.advance(d.cfg.backoff_max_s + 1)
        answer_attempt_preflights(d)
    return blamed


def test_a_software_hang_at_one_step_with_a_rotating_victim_ends_as_a_crash_loop() -> None:
    d = Driver(cfg=fast(), nodes=4)
    blamed = rotating_hang_run(d, failures=5)
    assert d.sup.state is RunState.CRASH_LOOP
    assert len(blamed) == 3, "a crash loop within 3 failures"
    pages = d.of(Page)
    assert len(pages) == 1, [p.reason for p in pages]
    page = pages[0].reason
    assert "crash loop: hang at step 44, 3 times, the run never past it" in page
    assert (
        f"suspected {', '.join(sorted(blamed))}; their strikes struck off, back in service: {blamed[0]}, {blamed[1]}"
        in page
    )
    # every node is back in service: no strike, no hold, no burn-in owed
    for name, node in d.sup.pool.nodes.items():
        assert node.state is PoolState.SPARE, (name, node.state)
        assert node.failure_times == [], (name, node.failure_times)
    released = {r.node for r in d.of(Release)}
    assert released == set(blamed[:2]), "the first two failures' suspects were quarantined, then given back"
    end = d.events(E.EVENT_KIND_RUN_END)[-1]
    assert end.run_detail.outcome == "crash_loop" and "blamed on 2 different node(s)" in end.message


def test_a_live_flight_recorder_verdict_makes_its_suspects_loop_victims_not_faulty_nodes() -> None:
    """The live verdict attaches a FLIGHT_RECORDER evidence record to every suspect; that record says
    which rank never arrived, nothing about its node. Found by tests/e2e/test_crash_loops.py: the
    core took it for evidence about the node, so the loop's suspects kept their strikes and the
    third failure quarantined its suspect too."""
    d = Driver(cfg=fast(), nodes=4)
    blamed = rotating_hang_run(d, failures=5, fr_record=True)
    assert d.sup.state is RunState.CRASH_LOOP and len(blamed) == 3
    assert [q.node for q in d.of(Quarantine)] == blamed[:2], (
        "the failure completing the loop quarantines nobody"
    )
    for name, node in d.sup.pool.nodes.items():
        assert node.state is PoolState.SPARE and node.failure_times == [], (
            name,
            node.state,
            node.failure_times,
        )
    end = d.events(E.EVENT_KIND_RUN_END)[-1]
    assert "blamed on 2 different node(s)" in end.message, end.message
    (page,) = d.of(Page)
    assert f"their strikes struck off, back in service: {blamed[0]}, {blamed[1]}" in page.reason, page.reason


def test_hardware_evidence_is_not_part_of_a_crash_loop() -> None:
    """Three FR-blamed hangs at the same step are a loop; one of them blamed on a fatal Xid is the
    node's own fault and starts the count again."""
    d = Driver(cfg=fast(), nodes=2)
    d.start(5)
    d.steps(1, 10)
    d.send(CheckpointCommitted(step=10))
    for i in range(3):
        d.steps(d.sup.job_step + 1, 14)
        d.advance(d.cfg.hang_timeout_floor_s + 1)
        node = d.running_nodes()[i % 2]
        if i == 1:
            d.send(
                EvidenceObserved(
                    evidence=common_pb2.Evidence(
                        node=node,
                        kind=common_pb2.EVIDENCE_KIND_XID,
                        severity=common_pb2.SEVERITY_FATAL,
                        detail="Xid 79",
                        xid=79,
                    )
                )
            )
        if d.sup.state is RunState.COLLECTING:
            d.send(DumpsCollected(attempt=d.sup.attempt, verdict=FlightRecorderVerdict()))
        d.exit_all(code=-15)
        d.advance(d.cfg.backoff_max_s + 1)
        answer_attempt_preflights(d)
    assert d.sup.state is RunState.RUNNING, "the Xid's failure reset the loop: two in a row, not three"


def test_the_blast_radius_stops_automatic_quarantine_and_pages_once() -> None:
    d = Driver(cfg=fast(blast_radius_nodes=2, blast_radius_window_s=3600.0, crash_loop_count=99), nodes=2)
    d.start(8)
    held_back = []
    for step in (5, 10, 15, 20):  # four different hangs, each blamed on a node
        d.steps(d.sup.job_step + 1, step)
        d.advance(d.cfg.hang_timeout_floor_s + 1)
        node = d.running_nodes()[0]
        verdict = FlightRecorderVerdict(suspects=(Suspect(node=node, ranks=(0,), reason="never arrived"),))
        out = d.send(DumpsCollected(attempt=d.sup.attempt, verdict=verdict))
        out += d.exit_all(code=-15)
        held_back += d.events(E.EVENT_KIND_QUARANTINE_HELD_BACK, out)
        d.advance(d.cfg.backoff_max_s + 1)
        answer_attempt_preflights(d)
    assert len(d.of(Quarantine)) == 2, "no more than the blast radius"
    assert len(held_back) == 2 and "automatic quarantine stopped" in held_back[0].message
    pages = d.of(Page)
    assert len(pages) == 1 and "blast radius" in pages[0].reason
    # an operator is not limited
    d.send(OperatorQuarantine(node=held_back[0].node.node, reason="checked by hand"))
    assert d.sup.pool.get(held_back[0].node.node).state is PoolState.HELD


def test_a_new_core_continues_the_crash_loop_count_from_the_stored_memory() -> None:
    """The leader dies after two identical failures; the new leader's core starts from the store's
    memory, so the third identical failure is the crash loop (and the budget is the same)."""
    d = Driver(cfg=fast(), nodes=4)
    rotating_hang_run(d, failures=2)
    assert [c.count for c in d.sup.history.loops] == [2] and d.sup.state is RunState.RUNNING
    memory = [a for a in d.actions if isinstance(a, PersistMemory)][-1].record
    assert [c.count for c in memory.loops] == [2] and len(memory.loops[0].suspects) == 2
    assert len(memory.restart_times) == 2 and memory.restart_budget == d.cfg.restart_budget
    # a new core, as a new leader builds it: the store's records, the attempt record, the memory
    fresh = Driver(cfg=d.cfg, nodes=4, now=d.now + 5)
    records = tuple(p.view() for p in d.sup.pool.nodes.values())
    fresh.send(
        StoreListed(
            alive={n: 1 for n in d.sup.pool.nodes},
            records=records,
            attempt=d.sup.attempt,
            attempt_nodes=d.sup.current_nodes,
            resume_step=40,
            committed_steps=(30, 40),
            memory=memory,
        )
    )
    assert fresh.sup.state is RunState.RUNNING  # adopted
    assert fresh.sup.status(fresh.now).restarts_used == 2
    hang_at(fresh, 45, 2)
    assert fresh.sup.state is RunState.CRASH_LOOP
    assert len(fresh.of(Page)) == 1
    for node in fresh.sup.pool.nodes.values():
        assert node.state is PoolState.SPARE and node.failure_times == [], node


def test_bad_memory_from_the_store_is_dropped_value_by_value() -> None:
    d = Driver(cfg=fast(), nodes=2)
    rec = store_pb2.SupervisorMemory(
        run="demo", restart_times=[float("nan"), 900.0, 1e18], quarantine_times=[float("inf"), 950.0]
    )
    rec.loops.add(label="hang", step=-7, count=2)
    d.send(StoreListed(alive={}, memory=rec))
    assert d.sup.history.restart_times == [900.0] and d.sup.quarantine_times == [950.0]
    assert d.sup.history.loops == []  # a step below -1 is no step


def test_a_rebuilt_core_is_quiet_about_memory_of_another_run() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.send(StoreListed(alive={}, memory=store_pb2.SupervisorMemory(run="other", restart_times=[900.0])))
    assert d.sup.history.restart_times == []


def test_a_planned_stop_quarantines_no_flagged_straggler() -> None:
    """A planned stop says "nothing is quarantined": a straggler flagged (not killed) in the attempt
    keeps its flag on record but is not quarantined by the stop's relaunch."""
    d = Driver(cfg=fast(), nodes=4)
    d.start(5)
    for s in range(1, 51):
        d.progress(s, dt=1.0, compute={"n3": 0.88})
    assert d.sup.cur.straggler_nodes == {"n3"}
    out = d.send(StopRequested(reason="maintenance", requested_by="operator", relaunch=True))
    out += d.exit_all(code=0)
    assert "nothing is quarantined" in d.events(E.EVENT_KIND_STOP_REQUEST, out)[0].message
    assert not d.of(Quarantine), "a planned stop quarantined a node"
    assert d.sup.pool.get("n3").straggler_flags == 1


def test_an_inconclusive_attempt_preflight_is_asked_again_once_then_left_out_never_quarantined() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.add_nodes(3)
    d.preflight_out.clear()
    d.send(PreflightResult(node="n1", passed=True))
    out = d.send(PreflightResult(node="n2", passed=False, inconclusive_checks=("compute.budget",)))
    again = [a for a in out if isinstance(a, RunPreflight)]
    assert [a.nodes for a in again] == [("n2",)] and not d.of(Quarantine)
    out = d.send(PreflightResult(node="n2", passed=False, inconclusive_checks=("compute.budget",)))
    assert not d.of(Quarantine), "an inconclusive preflight is never a quarantine"
    left = [e for e in d.events(E.EVENT_KIND_PREFLIGHT_RESULT, out) if "left out" in e.message]
    assert left and "inconclusive twice" in left[0].message
    n2 = d.sup.pool.get("n2")
    assert n2.failure_times == [] and n2.preflight_rejections == 0
    assert "n3" in [n for a in out if isinstance(a, RunPreflight) for n in a.nodes]  # a spare takes its rank


def test_a_resumed_stopped_run_whose_nodes_are_gone_relaunches_as_planned_not_as_a_fault() -> None:
    """`controller run --resume` after a run-ending stop (a requeued batch job): the old attempt's
    nodes went with the old allocation. A planned relaunch: no DETECTION (goodput counts no
    incident), nothing quarantined, no restart budget used."""
    d = Driver(cfg=fast(), nodes=2)
    d.add_nodes(2, start=5)  # the new allocation: n5, n6
    out = d.send(
        StoreListed(
            alive={"n5": 1, "n6": 1},
            attempt=3,
            attempt_nodes=("n1", "n2"),
            resume_step=40,
            committed_steps=(40,),
            stop_requested=StopRequested(reason="time limit", requested_by="slurm", relaunch=True),
        )
    )
    assert not d.events(E.EVENT_KIND_DETECTION, out)
    d.answer_preflight()
    assert d.sup.state is RunState.RUNNING
    assert d.launches[-1].attempt == 4 and d.launches[-1].resume_step == 40
    assert not d.of(Quarantine) and d.sup.status(d.now).restarts_used == 0


def _new_leader_after_two_hangs(
    logged_attempt: int = 0,
) -> tuple[Driver, list[Item], store_pb2.SupervisorMemory]:
    """A leader decided attempt 2's end (two rotating hangs) and died; a new core lists the store."""
    d = Driver(cfg=fast(), nodes=4)
    rotating_hang_run(d, failures=2)
    memory = [a for a in d.actions if isinstance(a, PersistMemory)][-1].record
    fresh = Driver(cfg=d.cfg, nodes=4, now=d.now + 5)
    out = fresh.send(
        StoreListed(
            alive={n: 1 for n in d.sup.pool.nodes},
            records=tuple(p.view() for p in d.sup.pool.nodes.values()),
            attempt=2,
            attempt_nodes=tuple(d.sup.preparing.prev_slots),
            resume_step=40,
            committed_steps=(30, 40),
            memory=memory,
            logged_attempt=logged_attempt,
        )
    )
    return fresh, out, memory


def test_a_new_leader_does_not_handle_a_decided_failure_twice() -> None:
    """The leader decided attempt 2's end (quarantine, crash-loop count 2) and died before launching
    attempt 3: the new core finds attempt 2 stopped with a quarantined node, relaunches it without a
    second DETECTION, and the third identical failure is the crash loop."""
    fresh, out, memory = _new_leader_after_two_hangs()
    assert memory.decided_attempt == 2
    assert not fresh.events(E.EVENT_KIND_DETECTION, out)
    answer_attempt_preflights(fresh)
    assert fresh.launches[-1].attempt == 3 and fresh.sup.state is RunState.RUNNING
    fresh.steps(41, 41)
    hang_at(fresh, 45, 2)
    assert fresh.sup.state is RunState.CRASH_LOOP and len(fresh.of(Page)) == 1


def test_a_new_leader_launches_past_an_attempt_its_predecessor_only_logged() -> None:
    """The leader logged LAUNCH of attempt 3 and was killed before the attempt record was written:
    the store says attempt 2, the event log's tail says 3 (StoreListed.logged_attempt). The new core
    launches attempt 4, so no attempt number is logged as launched twice."""
    fresh, out, _ = _new_leader_after_two_hangs(logged_attempt=3)
    plans = fresh.events(events_pb2.EVENT_KIND_PREFLIGHT_PLAN, out) + fresh.events(
        events_pb2.EVENT_KIND_RESTART, out
    )
    assert all("attempt 3" not in e.message for e in plans), [e.message for e in plans]
    answer_attempt_preflights(fresh)
    assert fresh.launches[-1].attempt == 4 and fresh.launches[-1].rendezvous_id.endswith("-4")
    launched = [e.attempt for e in fresh.events(events_pb2.EVENT_KIND_LAUNCH)]
    assert launched == [4], launched
