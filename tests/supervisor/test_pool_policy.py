"""Pool rules (burn-in, hold, reputation) and the policy's validation."""

from __future__ import annotations

import pytest

from controller.supervisor.policy import DAY_S, RunPlan, SupervisorConfig
from controller.supervisor.pool import IllegalPoolMove, Pool, PoolState, needs_repair
from runwarden.config import ConfigError, load_section
from runwarden.v1 import common_pb2, store_pb2


def _pool(**kw: object) -> Pool:
    p = Pool(SupervisorConfig(**kw))  # test knobs only
    for n in ("a", "b", "c"):
        p.set_alive(n, True)
    return p


def test_burn_in_needs_n_consecutive_passes_and_a_failure_resets() -> None:
    p = _pool(burn_in_passes=3)
    p.quarantine("a", 0.0, "xid")
    assert p.start_burn_in("a") and p.get("a").state == PoolState.BURN_IN
    assert p.burn_in_result("a", True) == "again"
    assert p.burn_in_result("a", False) == "failed" and p.get("a").burn_in_passes == 0
    assert p.get("a").state == PoolState.QUARANTINED  # waits for a repair before it burns in again
    assert not p.start_burn_in("a") and p.awaits_repair(p.get("a"))  # a relist, a new leader: no
    assert p.start_burn_in("a", repaired=True)  # it registered anew (a restart)
    assert [p.burn_in_result("a", True) for _ in range(3)] == ["again", "again", "released"]
    assert p.get("a").state == PoolState.SPARE and "a" in p.pick_spares(3, 0.0)


def test_second_failure_within_seven_days_holds_the_node() -> None:
    p = _pool()
    assert p.quarantine("a", 0.0, "first").state == PoolState.QUARANTINED
    assert p.quarantine("a", 6.9 * DAY_S, "second").state == PoolState.HELD
    assert not p.start_burn_in("a")
    p2 = _pool()
    p2.quarantine("b", 0.0, "first")
    assert p2.quarantine("b", 7.5 * DAY_S, "second, a week later").state == PoolState.QUARANTINED


def test_operator_release_of_held_node_goes_through_burn_in_and_keeps_its_record() -> None:
    p = _pool()
    p.quarantine("a", 0.0, "x")
    p.quarantine("a", 1.0, "y")
    node = p.operator_release("a", 3600.0)
    assert node.state == PoolState.BURN_IN and not node.operator_hold
    assert node.failure_times == [0.0, 1.0] and node.repaired_at == 3600.0  # the record survives repair
    assert p.recent_failures(node, 7200.0) == 0  # only failures after the repair count toward a hold
    p.burn_in_result("a", True)
    assert not p.golden(node, 7200.0), "a repaired node is not golden until clean again for golden_after_s"
    assert p.record_note("a", 3600.0 + 2 * 3600.0).endswith("repaired 2.0 h ago")
    assert p.quarantine("a", 8000.0, "one more").state == PoolState.QUARANTINED  # one strike since repair


def test_spares_picked_best_reputation_first() -> None:
    p = _pool()
    p.get("a").failure_times = [10.0]
    p.get("b").straggler_flags = 1
    assert p.pick_spares(3, 100.0) == ["c", "b", "a"]
    p.quarantine("c", 100.0, "bad")
    assert p.pick_spares(3, 100.0) == ["b", "a"]
    p.set_alive("b", False)
    assert p.pick_spares(3, 100.0) == ["a"]


def test_the_choice_of_a_spare_says_why_in_its_record_note() -> None:
    p = _pool()
    p.get("a").failure_times = [10.0]
    p.get("b").straggler_flags = 1
    assert p.record_note("c", 100.0) == "clean record"
    assert p.record_note("b", 100.0) == "best left: 1 straggler flag(s)"
    assert p.record_note("a", 100.0) == "best left: 1 failure(s) within 7 days"
    assert p.record_note("a", 10.0 + 8 * DAY_S) == "best left: 1 older failure(s)"


def test_fatal_evidence_holds_for_repair_and_only_a_release_starts_burn_in() -> None:
    p = _pool()
    off_the_bus = common_pb2.Evidence(node="a", kind=common_pb2.EVIDENCE_KIND_GPU_LOST)
    assert needs_repair([off_the_bus]) and not needs_repair([])
    assert p.quarantine("a", 0.0, "GPU lost", evidence=[off_the_bus]).state == PoolState.HELD
    assert not p.start_burn_in("a")
    app = common_pb2.Evidence(
        node="b", kind=common_pb2.EVIDENCE_KIND_XID, severity=common_pb2.SEVERITY_APPLICATION
    )
    assert p.quarantine("b", 0.0, "Xid 13", evidence=[app]).state == PoolState.QUARANTINED  # the job's fault
    assert p.operator_release("a", 10.0).state == PoolState.BURN_IN


def test_config_validation_names_the_key() -> None:
    with pytest.raises(ValueError, match="burn_in_passes"):
        SupervisorConfig(burn_in_passes=0)
    with pytest.raises(ValueError, match="backoff_max_s"):
        SupervisorConfig(backoff_base_s=10.0, backoff_max_s=1.0)
    with pytest.raises(ValueError, match="straggler_persistence"):
        SupervisorConfig(straggler_persistence=1.5)
    with pytest.raises(ValueError, match=r"RunPlan\.nodes"):
        RunPlan(run="r", nodes=0)


def test_config_loads_from_a_toml_section_and_rejects_unknown_keys() -> None:
    cfg = load_section(
        SupervisorConfig, {"restart_budget": 5, "hang_timeout_s": 30.0}, "controller.supervisor.policy"
    )
    assert cfg.restart_budget == 5 and cfg.hang_timeout_s == 30.0
    with pytest.raises(ConfigError, match="restart_budgett"):
        load_section(SupervisorConfig, {"restart_budgett": 5}, "controller.supervisor.policy")


def test_run_plan_from_proto() -> None:
    assert RunPlan.from_proto(store_pb2.RunSpec(run="llama", nodes=8)) == RunPlan(run="llama", nodes=8)


def test_pool_moves_outside_the_graph_are_refused() -> None:
    p = _pool()
    p.quarantine("a", 0.0, "x")
    p.quarantine("a", 1.0, "y")  # a second failure within the window: held
    assert p.get("a").state == PoolState.HELD
    with pytest.raises(IllegalPoolMove, match="held -> assigned"):
        p.assign("a")
    assert p.burn_in_result("a", passed=True) == "stale" and p.get("a").state == PoolState.HELD
    assert not p.unassign("b")  # not assigned: nothing to undo


def test_golden_hosts_come_first_among_the_clean_and_a_recent_failure_stays_last() -> None:
    p = Pool(SupervisorConfig())  # the default: golden after 7 days clean
    now = 30 * DAY_S
    for name, since in (("a", now - DAY_S), ("b", now - 9 * DAY_S), ("c", now - 20 * DAY_S), ("d", 1.0)):
        p.set_alive(name, True, now=since)
    p.get("c").failure_times = [now - 2 * DAY_S]  # known long, but failed two days ago
    p.get("d").straggler_flags = 1  # known longest, but flagged: never golden (flags carry no time)
    assert p.golden(p.get("b"), now) and not p.golden(p.get("a"), now)
    assert not p.golden(p.get("c"), now) and not p.golden(p.get("d"), now)
    assert p.pick_spares(4, now) == ["b", "a", "d", "c"]
    assert p.record_note("b", now) == "golden host: clean for 9.0 days"
    assert p.record_note("a", now) == "clean record"
    assert p.get("c").failure_times == [now - 2 * DAY_S]
    p.get("c").failure_times = [now - 8 * DAY_S]  # clean again for 8 days since that failure
    assert p.golden(p.get("c"), now) and p.pick_spares(2, now) == ["b", "c"]
    off = Pool(SupervisorConfig(golden_after_s=0.0))
    off.set_alive("z", True, now=1.0)
    assert not off.golden(off.get("z"), now)


def test_known_history_starts_at_the_first_registration_and_survives_a_reload() -> None:
    p = Pool(SupervisorConfig())
    p.set_alive("a", True, now=100.0)
    p.set_alive("a", False)
    p.set_alive("a", True, now=500.0)  # a re-registration does not restart its history
    assert p.get("a").known_since == 100.0
    fresh = Pool(SupervisorConfig())
    fresh.load([p.get("a").view()])
    fresh.set_alive("a", True, now=900.0)
    assert fresh.get("a").known_since == 100.0
    with pytest.raises(ValueError, match="golden_after_s"):
        SupervisorConfig(golden_after_s=-1.0)
