"""The simulated world around the real core: its event log is the live format and obeys the contract."""

from pathlib import Path

import pytest

from controller.goodput.report import compute_goodput
from controller.sim.draws import draw
from controller.sim.engine import World, simulate
from controller.sim.scenario import load_scenario
from controller.supervisor.machine import Supervisor
from runwarden.eventlog import encode_entry, read_events
from runwarden.v1 import events_pb2 as E
from tests.sim.helpers import tiny

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def small():
    return load_scenario(ROOT / "scenarios" / "small.toml")


def test_the_world_drives_the_real_core(small) -> None:
    world = World(small, small.policy("defaults"), draw(small, 3))
    assert type(world.core) is Supervisor
    result = world.run()
    assert result.handle_calls > 1000
    kinds = {e.kind for e in result.events}
    for k in (
        E.EVENT_KIND_LAUNCH,
        E.EVENT_KIND_DETECTION,
        E.EVENT_KIND_ATTRIBUTION,
        E.EVENT_KIND_QUARANTINE,
        E.EVENT_KIND_SPARE_TAKEN,
        E.EVENT_KIND_CHECKPOINT_COMMIT,
        E.EVENT_KIND_FIRST_STEP,
    ):
        assert k in kinds, E.EventKind.Name(k)


def test_event_log_round_trips_and_gives_the_same_goodput(small, tmp_path) -> None:
    result = simulate(small, small.policy("defaults"), draw(small, 4))
    path = tmp_path / "events.jsonl"
    with open(path, "wb") as f:
        for ev in result.events:
            f.write(encode_entry(ev))
    read = read_events(path)
    assert read.errors == [] and read.torn_tail is None
    assert len(read.entries) == len(result.events)
    direct = compute_goodput(result.events, until=result.end_ts)
    from_file = compute_goodput(read.entries, until=result.end_ts)
    assert from_file.productive_us == direct.productive_us
    assert 0.5 < direct.goodput < 1.0
    assert direct.productive_us + direct.lost_us == direct.allocated_us


def test_supervisor_contract_holds_in_the_log(small) -> None:
    """Attempts increase, resume steps are committed, quarantined nodes are not launched."""
    for policy in ("naive", "defaults"):
        result = simulate(small, small.policy(policy), draw(small, 5))
        committed = {-1}
        out: set[str] = set()
        last_attempt = 0
        for ev in result.events:
            if ev.kind == E.EVENT_KIND_CHECKPOINT_COMMIT:
                committed.add(ev.step)
            elif ev.kind == E.EVENT_KIND_QUARANTINE:
                out.add(ev.quarantine.node)
            elif ev.kind == E.EVENT_KIND_RELEASE:
                out.discard(ev.release.node)
            elif ev.kind == E.EVENT_KIND_LAUNCH:
                assert ev.attempt > last_attempt
                last_attempt = ev.attempt
                assert ev.launch.resume_step in committed
                assert ev.launch.resume_step == max(committed)
                assert not out & set(ev.launch.nodes)
                assert ev.launch.rendezvous_id == f"small-{ev.attempt}"


def test_same_seed_same_log_and_draws_shared_across_policies(small) -> None:
    d = draw(small, 6)
    a = simulate(small, small.policy("defaults"), d)
    b = simulate(small, small.policy("defaults"), draw(small, 6))
    assert [encode_entry(e) for e in a.events] == [encode_entry(e) for e in b.events]
    naive = simulate(small, small.policy("naive"), d)
    # Every drawn fault reaches both worlds at the same instant (refails are the policy's own doing).
    assert (
        [i.t for i in a.interruptions if i.outcome != "refail"]
        == [i.t for i in naive.interruptions if i.outcome != "refail"]
        == [f.t for f in d.faults]
    )


def test_hang_is_detected_one_timeout_after_the_fault() -> None:
    sc = tiny(
        causes=[{"name": "h", "share": 1, "symptom": "hang", "hardware": True}],
        supervisor={"hang_timeout_s": 45.0},
    )
    result = simulate(sc, sc.policy("p"), draw(sc, 1))
    hangs = [
        e
        for e in result.events
        if e.kind == E.EVENT_KIND_DETECTION and e.detection.detector == E.DETECTOR_HANG
    ]
    faults = [i for i in result.interruptions if i.outcome in ("interrupted", "refail")]
    assert len(hangs) == len(faults) > 20
    in_save = 0
    commits = [e.ts for e in result.events if e.kind == E.EVENT_KIND_CHECKPOINT_COMMIT]
    for ev, fault in zip(hangs, faults, strict=True):
        # Inside a checkpoint save the core waits the save allowance: the 120 s barrier until it has
        # seen 3 saves, then 3 x the longest recent save (30 s each here) = 90 s.
        timeout = 45.0
        if "in a checkpoint" in ev.message:
            in_save += 1
            timeout = 90.0 if sum(ts < ev.ts for ts in commits) >= 3 else 120.0
        # Measured from the last step *advance*: up to one step time (2 s) before the fault instant,
        # or, inside a save (the steps stand still), up to the save (30 s) before it: the spares' sweep
        # may have read the ranks' progress during the save, before the fault.
        after_fault = ev.ts - result.start_ts - fault.t
        slack = 2.0 + (30.0 if timeout > 45.0 else 0.0)
        assert timeout - slack - 1e-5 <= after_fault <= timeout + 1e-5
        assert ev.detection.latency_s == pytest.approx(timeout, abs=1e-5)
    assert in_save < len(hangs) / 4


def test_node_loss_is_detected_after_the_lease_ttl() -> None:
    sc = tiny(causes=[{"name": "host", "share": 1, "symptom": "node_lost"}], lease_ttl_s=7.0)
    result = simulate(sc, sc.policy("p"), draw(sc, 2))
    lost = [
        e
        for e in result.events
        if e.kind == E.EVENT_KIND_DETECTION and e.detection.detector == E.DETECTOR_NODE_LOST
    ]
    assert len(lost) > 20
    deaths = [i.t for i in result.interruptions if i.outcome in ("interrupted", "node_down")]
    for ev in lost:
        t = ev.ts - result.start_ts
        # TTL after the death, plus up to one lease-expiry check (0.5 s).
        assert any(7.0 - 1e-5 <= t - d <= 7.5 + 1e-5 for d in deaths), t
        assert ev.detection.latency_s >= 7.0 - 1e-5


def test_startup_timeout_below_launch_time_is_refused() -> None:
    sc = tiny(supervisor={"startup_timeout_s": 60.0})
    with pytest.raises(ValueError, match="startup_timeout_s"):
        World(sc, sc.policy("p"), draw(sc, 1))


def test_a_run_the_core_ends_early_loses_the_rest_of_the_window() -> None:
    from controller.sim.report import run_one

    sc = tiny(supervisor={"restart_budget": 2, "restart_budget_window_s": 0.0})
    out = run_one(sc, sc.policy("p"), 1)
    assert out.final_state == "budget_exhausted"
    assert out.lost_by_lever["ended_early"] > 0.5
    assert out.ettr < 0.5
    assert abs(out.ettr + sum(out.lost_by_lever.values()) - 1.0) < 1e-6
