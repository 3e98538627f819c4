"""Goodput on hand-built event logs; every expected figure is worked out by hand in the test."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from controller.goodput.report import US, compute_goodput, percentile
from runwarden.eventlog import EventLog, read_events
from runwarden.v1 import common_pb2, events_pb2

from .logbuild import LogBuilder

E = events_pb2

T0 = 1_764_547_200.0  # 2025-12-01 00:00:00 UTC, a Monday


def secs(report_us: int) -> float:
    return report_us / US


def xid_incident_log() -> LogBuilder:
    """Startup 40 s; commit at +100 (save 5 s); hang fault at +190, detected +200; Xid blamed; relaunch."""
    b = LogBuilder()
    b.startup(T0)
    b.commit(T0 + 100, step=100, save_s=5)
    b.detect(T0 + 200, latency_s=10)
    b.attribute(T0 + 203)
    b.quarantine(T0 + 210)
    b.spare(T0 + 211)
    b.preflight(T0 + 230, node="n4")
    b.launch(T0 + 235, resume_step=100)
    b.load_done(T0 + 250)
    b.first_step(T0 + 260)
    return b


def test_single_hardware_incident_splits_every_second() -> None:
    b = xid_incident_log()
    b.end(T0 + 300)
    r = compute_goodput(b.events, run="llm")
    # productive: [40, 95) before the save, [260, 300) after the relaunch (kept at RUN_END completed)
    assert r.productive_us == (55 + 40) * US
    assert r.allocated_us == 300 * US
    assert r.lost_by_cause_us == {
        "startup:preflight": 10 * US,
        "startup:launch": 10 * US,
        "startup:load": 10 * US,
        "startup:first_step": 10 * US,
        "checkpoint_stall": 5 * US,
        "hardware:xid": 90 * US,  # rolled back: commit at +100 to the fault at +190
        "restart:detect": 10 * US,  # fault +190 -> DETECTION +200
        "restart:attribute": 3 * US,  # -> ATTRIBUTION +203
        "restart:replace": 8 * US,  # -> QUARANTINE +210 -> SPARE_TAKEN +211
        "restart:preflight": 19 * US,  # -> PREFLIGHT_RESULT +230
        "restart:launch": 5 * US,  # -> LAUNCH +235
        "restart:load": 15 * US,  # -> LOAD_DONE +250
        "restart:first_step": 10 * US,  # -> FIRST_STEP +260
    }
    assert r.productive_us + r.lost_us == r.allocated_us
    assert r.goodput == pytest.approx(95 / 300)
    (inc,) = r.incidents
    assert inc.cause == "hardware:xid"
    assert inc.rollback_us == 90 * US
    assert inc.lost_us == (90 + 70) * US
    assert r.detect_minutes == [pytest.approx(10 / 60)]
    assert r.first_step_minutes == [pytest.approx(70 / 60)]
    # 4 nodes x 300 s = 1/3 node-hour, one failure -> 3000 per 1,000 node-hours
    assert r.failures_per_1000_node_hours == pytest.approx(3000.0)
    proto = r.to_proto()
    assert proto.lost_by_cause[0].cause == "hardware:xid" and proto.lost_by_cause[0].seconds == 90.0
    assert proto.detect_p90_min == pytest.approx(10 / 60)
    assert proto.lost_s + proto.productive_s == pytest.approx(proto.allocated_s)


def test_a_fault_on_an_idle_spare_is_not_a_loss_of_the_run() -> None:
    # An Xid on the spare n4 while n0..n3 train: the core logs its DETECTION (and quarantines n4),
    # but the running attempt never stopped, so nothing is rolled back or lost.
    b = LogBuilder()
    b.startup(T0)
    b.commit(T0 + 100, step=100, save_s=5)
    b.detect(T0 + 150, latency_s=0, node="n4", detector=E.DETECTOR_EVIDENCE)
    b.quarantine(T0 + 150, node="n4")
    b.end(T0 + 300)
    r = compute_goodput(b.events, run="llm")
    assert not r.incidents and r.failures_per_1000_node_hours == 0
    assert r.productive_us == (55 + 200) * US  # [40, 95) and [100, 300): the save's 5 s aside
    assert r.productive_us + r.lost_us == r.allocated_us


def flagged_straggler_log(*, legacy: bool) -> LogBuilder:
    """Issue 26's run: 400 s, one straggler flagged at +80 (over the 19 s before) and left running
    (kill_stragglers_mid_run = false), commits every 100 s with a 1 s save, completed at +400."""
    b = LogBuilder()
    b.startup(T0)
    b.flag(T0 + 80, latency_s=19, node="n3", legacy=legacy)
    for k in (1, 2, 3):
        b.commit(T0 + 40 + 100 * k, step=100 * k, save_s=1)
    b.end(T0 + 400)
    return b


@pytest.mark.parametrize("legacy", [False, True], ids=["flag_only", "old_log_wording"])
def test_a_flagged_straggler_left_running_is_no_incident(legacy: bool) -> None:
    # Before issue 26 this scored 40 s of productive time: the flag opened an incident no relaunch
    # closed, and everything after it went to restart:attribute.
    r = compute_goodput(flagged_straggler_log(legacy=legacy).events, run="llm")
    assert not r.incidents and r.failures_per_1000_node_hours == 0
    assert r.productive_us == (360 - 3) * US  # first step at +40 to the end, less three 1 s saves
    assert r.lost_by_cause_us == {
        "startup:preflight": 10 * US,
        "startup:launch": 10 * US,
        "startup:load": 10 * US,
        "startup:first_step": 10 * US,
        "checkpoint_stall": 3 * US,
    }
    assert r.goodput == pytest.approx(357 / 400)
    assert not [m for m in r.markers if m.kind == "fault"]


def test_a_straggler_stopped_mid_run_is_still_an_incident() -> None:
    # kill_stragglers_mid_run = true: the same detector, worded "stopping the attempt now", no flag
    b = LogBuilder()
    b.startup(T0)
    b.commit(T0 + 100, step=100, save_s=0)
    b.detect(
        T0 + 150,
        latency_s=10,
        node="n3",
        detector=E.DETECTOR_STRAGGLER,
        reason="...; stopping the attempt now",
    )
    b.launch(T0 + 170, resume_step=100)
    b.first_step(T0 + 180)
    b.end(T0 + 200)
    r = compute_goodput(b.events, run="llm")
    (inc,) = r.incidents
    assert inc.rollback_us == 40 * US and inc.lost_us == (40 + 40) * US


def test_fatal_evidence_while_the_controller_is_blind_is_no_incident_until_a_failure() -> None:
    # The controller lost etcd; an Xid on attempt node n1 is noted (flag_only). The attempt kept running
    # through one control-plane fault; in a second one n1's rank crashed, found when etcd came back.
    b = LogBuilder()
    b.startup(T0)
    b.commit(T0 + 100, step=100, save_s=0)
    b.control_plane(T0 + 110)
    b.evidence_flag(T0 + 120, latency_s=2, node="n1")
    b.control_plane(T0 + 130)  # recovered: attempt kept running, not relaunched
    b.commit(T0 + 200, step=200, save_s=0)
    b.control_plane(T0 + 210)
    b.evidence_flag(T0 + 220, latency_s=2, node="n1")
    b.detect(T0 + 240, latency_s=0, node="n1", detector=E.DETECTOR_CRASH)  # the crash, at etcd's return
    b.attribute(T0 + 241, node="n1")
    b.launch(T0 + 250, resume_step=200)
    b.first_step(T0 + 260)
    b.end(T0 + 300)
    r = compute_goodput(b.events, run="llm")
    (inc,) = r.incidents
    assert inc.fault_ts == T0 + 240 and inc.rollback_us == 40 * US  # training from the commit at +200
    assert inc.lost_us == (40 + 20) * US and inc.cause == "hardware:xid"
    assert r.productive_us == (160 + 40) * US  # [40, 200) and [260, 300)
    assert r.productive_us + r.lost_us == r.allocated_us == 300 * US


def test_overlapping_faults_are_one_incident() -> None:
    # a second node is lost 5 s after the first detection, before any relaunch: the same interruption
    b2 = LogBuilder()
    b2.startup(T0)
    b2.commit(T0 + 100, step=100, save_s=5)
    b2.detect(T0 + 200, latency_s=10)
    b2.detect(T0 + 205, latency_s=2, node="n3", detector=events_pb2.DETECTOR_NODE_LOST)
    b2.attribute(T0 + 206)
    b2.spare(T0 + 211)
    b2.spare(T0 + 212, node="n5", replaces="n3")
    b2.preflight(T0 + 230, node="n4")
    b2.launch(T0 + 235, resume_step=100)
    b2.load_done(T0 + 250)
    b2.first_step(T0 + 260)
    b2.end(T0 + 300)
    r = compute_goodput(b2.events)
    assert r.failures == 1
    (inc,) = r.incidents
    assert inc.rollback_us == 90 * US and inc.cause == "hardware:xid"
    # detect 10; the second DETECTION does not end a phase: +200 -> ATTRIBUTION +206 is attribute (6)
    assert inc.phases_us == {
        "detect": 10 * US,
        "attribute": 6 * US,
        "replace": 6 * US,
        "preflight": 18 * US,
        "launch": 5 * US,
        "load": 15 * US,
        "first_step": 10 * US,
    }
    assert r.productive_us == 95 * US
    assert r.productive_us + r.lost_us == r.allocated_us == 300 * US


def test_fault_during_restart_opens_a_second_incident_with_no_rollback() -> None:
    b = LogBuilder()
    b.startup(T0)
    b.commit(T0 + 100, step=100, save_s=0)
    b.detect(T0 + 150, latency_s=0)  # fault at +150: 50 s rolled back
    b.attribute(T0 + 152)
    b.spare(T0 + 155)
    b.preflight(T0 + 165, node="n4")
    b.launch(T0 + 170, resume_step=100)
    b.detect(T0 + 185, latency_s=5)  # during loading: fault at +180
    b.attribute(T0 + 186, node=None)  # no suspect: software
    b.preflight(T0 + 196)
    b.launch(T0 + 200, resume_step=100)
    b.load_done(T0 + 210)
    b.first_step(T0 + 220)
    b.end(T0 + 250)
    r = compute_goodput(b.events)
    first, second = r.incidents
    assert first.cause == "hardware:xid" and first.rollback_us == 50 * US
    assert first.phases_us == {
        "detect": 0,
        "attribute": 2 * US,
        "replace": 3 * US,
        "preflight": 10 * US,
        "launch": 5 * US,
        "load": 10 * US,
        "first_step": 0,
    }  # load ends at the second fault (+180)
    assert second.cause == "software" and second.rollback_us == 0
    assert second.phases_us == {
        "detect": 5 * US,
        "attribute": 1 * US,
        "replace": 0,
        "preflight": 10 * US,
        "launch": 4 * US,
        "load": 10 * US,
        "first_step": 10 * US,
    }
    assert "software" not in r.lost_by_cause_us  # nothing was rolled back by the second fault
    assert r.productive_us == (60 + 30) * US
    assert first.first_step_ts == second.first_step_ts == T0 + 220
    assert r.first_step_minutes == [pytest.approx(70 / 60), pytest.approx(40 / 60)]
    assert r.productive_us + r.lost_us == r.allocated_us == 250 * US


def test_planned_stop_is_not_a_failure() -> None:
    b = LogBuilder()
    b.startup(T0)
    b.stop(T0 + 100)
    b.commit(T0 + 110, step=70, save_s=4)  # finish the step, save 4 s, commit
    b.exit(T0 + 112)
    b.launch(T0 + 130, resume_step=70)
    b.load_done(T0 + 140)
    b.first_step(T0 + 150)
    b.end(T0 + 200)
    r = compute_goodput(b.events)
    assert r.failures == 0 and r.planned_stops == 1
    assert r.lost_by_cause_us["planned"] == (150 - 106) * US
    assert r.productive_us == (106 - 40 + 50) * US
    assert "checkpoint_stall" not in r.lost_by_cause_us  # the stop's save is the stop's cost
    assert r.productive_us + r.lost_us == r.allocated_us == 200 * US


def test_torn_last_line_is_skipped(tmp_path: Path) -> None:
    b = xid_incident_log()
    path = tmp_path / "events.jsonl"
    with EventLog(path) as log:
        for ev in b.events:
            log.append(ev)
    with path.open("ab") as f:
        f.write(b'{"seq": 99, "ts": 1764547500.0, "kind": "EVENT_KIND_RUN_E')  # a crash mid-write
    read = read_events(path)
    assert read.torn_tail is not None and not read.errors
    r = compute_goodput(read.entries)
    # no RUN_END: the window ends at the last event (FIRST_STEP +260); nothing after it is invented
    assert r.allocated_us == 260 * US
    assert r.productive_us == 55 * US
    assert r.uncommitted_us == 0
    assert r.productive_us + r.lost_us == r.allocated_us


def test_running_run_counts_uncommitted_work_until_the_window_end() -> None:
    b = xid_incident_log()
    r = compute_goodput(b.events, until=T0 + 280)
    assert r.uncommitted_us == 20 * US
    assert r.productive_us == (55 + 20) * US


def test_since_clips_the_window_and_weeks_split_at_monday() -> None:
    b = LogBuilder()
    sunday_late = T0 - 100  # 2025-11-30 23:58:20 UTC, ISO week 48; Monday 00:00 starts week 49
    b.startup(sunday_late)
    b.end(sunday_late + 200)
    r = compute_goodput(b.events)
    assert [(w.week, secs(w.allocated_us), secs(w.productive_us)) for w in r.weeks] == [
        ("2025-W48", 100.0, 60.0),
        ("2025-W49", 100.0, 100.0),
    ]
    clipped = compute_goodput(b.events, since=T0 + 50)
    assert clipped.allocated_us == 50 * US and clipped.productive_us == 50 * US
    assert dt.datetime.fromtimestamp(T0, tz=dt.UTC).isocalendar()[1] == 49


def test_application_xid_and_network_causes() -> None:
    for kind, severity, cause in [
        (common_pb2.EVIDENCE_KIND_XID, common_pb2.SEVERITY_APPLICATION, "software"),
        (common_pb2.EVIDENCE_KIND_NETWORK, common_pb2.SEVERITY_FATAL, "network"),
        (common_pb2.EVIDENCE_KIND_ECC_UNCORRECTABLE, common_pb2.SEVERITY_FATAL, "hardware:ecc"),
    ]:
        b = LogBuilder()
        b.startup(T0)
        b.detect(T0 + 60, latency_s=0)
        b.attribute(T0 + 61, kind=kind, severity=severity)
        b.end(T0 + 70, outcome="crash_loop")
        r = compute_goodput(b.events)
        assert r.lost_by_cause_us[cause] == 20 * US, cause


def test_node_lost_without_attribution_and_two_runs_summed() -> None:
    a = LogBuilder(run="a")
    a.startup(T0)
    a.detect(T0 + 50, latency_s=4, detector=events_pb2.DETECTOR_NODE_LOST)
    a.end(T0 + 60, outcome="budget_exhausted")
    c = LogBuilder(run="c", nodes=2)
    c.startup(T0)
    c.end(T0 + 100)
    ra = compute_goodput(a.events)
    # training +40..+46 rolled back (no commit yet), detect 4 s, then no attribution until the end
    assert ra.lost_by_cause_us["hardware:node_lost"] == 6 * US
    assert ra.lost_by_cause_us["restart:detect"] == 4 * US
    assert ra.lost_by_cause_us["restart:attribute"] == 10 * US
    assert ra.productive_us == 0
    both = compute_goodput(a.events + c.events)
    assert both.allocated_us == 160 * US
    assert both.productive_us == 60 * US  # run c's first step at +40 to its end at +100
    assert both.failures == 1


def test_percentile_nearest_rank() -> None:
    assert percentile([], 90) == 0.0
    assert percentile([5.0], 90) == 5.0
    assert percentile([float(i) for i in range(1, 11)], 90) == 9.0
    assert percentile([float(i) for i in range(1, 11)], 50) == 5.0


def test_stop_without_commit_and_failed_save() -> None:
    b = LogBuilder()
    b.startup(T0)
    b.commit(T0 + 100, step=50, save_s=10)  # productive 40..90, stall 90..100
    b._add(
        T0 + 130,
        events_pb2.EVENT_KIND_CHECKPOINT_FAILED,
        checkpoint=events_pb2.CheckpointDetail(save_duration_s=6, error="disk full"),
    )  # stall 124..130
    b.stop(T0 + 150)
    b.exit(T0 + 160)  # exited without a commit: 100..124 and 130..160 are lost
    b.launch(T0 + 170, resume_step=50)
    b.first_step(T0 + 180)
    b.end(T0 + 200)
    r = compute_goodput(b.events)
    assert r.lost_by_cause_us["checkpoint_stall"] == (10 + 6) * US
    assert r.lost_by_cause_us["planned"] == (24 + 30 + 20) * US
    assert r.productive_us == (50 + 20) * US
    assert r.failures == 0
    assert r.productive_us + r.lost_us == r.allocated_us == 200 * US
