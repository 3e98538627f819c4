"""The policy changed live (`PolicyChanged`, a `StoreListed`'s stored policy): the next decision uses it,
the log says what changed (only that), and nothing happens when nothing changed."""

from __future__ import annotations

import dataclasses

import pytest

from controller.supervisor import reconfigure, table
from controller.supervisor.actions import SetTimer
from controller.supervisor.events import PolicyChanged, StoreListed
from controller.supervisor.policy import SupervisorConfig
from controller.supervisor.states import RunState
from runwarden.v1 import common_pb2
from runwarden.v1 import events_pb2 as E
from tests.supervisor.harness import Driver, fast


def _changed(d: Driver, out: list) -> list[E.Event]:
    return d.events(E.EVENT_KIND_POLICY_CHANGED, out)


def test_a_shorter_hang_floor_applies_to_the_hang_already_under_way() -> None:
    d = Driver(cfg=fast(hang_timeout_floor_s=30.0), nodes=2)
    d.start(2)
    d.steps(1, 5, dt=1.0)  # median step 1 s: timeout = the floor, 30 s
    assert not d.events(E.EVENT_KIND_DETECTION, d.advance(4.0))
    out = d.send(
        PolicyChanged(config=dataclasses.replace(d.cfg, hang_timeout_floor_s=5.0), changed_by="alice")
    )
    (entry,) = _changed(d, out)
    assert entry.message == "policy changed by alice: hang_timeout_floor_s 30 -> 5"
    assert [(c.key, c.old.number, c.new.number) for c in entry.policy.changes] == [
        ("hang_timeout_floor_s", 30.0, 5.0)
    ]
    assert SetTimer(key="policy", at=d.now) in d.of(SetTimer, out)  # the next decision comes at once
    det = d.events(E.EVENT_KIND_DETECTION, d.advance(1.5))  # 5.5 s stalled: past the new 5 s floor
    assert len(det) == 1 and det[0].detection.detector == E.DETECTOR_HANG
    assert "timeout 5s" in det[0].message and d.sup.state is RunState.COLLECTING


def test_a_longer_hang_floor_keeps_a_slow_step_from_being_a_hang() -> None:
    d = Driver(cfg=fast(hang_timeout_floor_s=10.0), nodes=2)
    d.start(2)
    d.steps(1, 5, dt=1.0)
    d.send(PolicyChanged(config=dataclasses.replace(d.cfg, hang_timeout_floor_s=60.0)))
    assert not d.events(E.EVENT_KIND_DETECTION, d.advance(30.0))
    assert d.sup.state is RunState.RUNNING


def test_the_same_values_again_change_nothing_and_log_nothing() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.start(2)
    out = d.send(PolicyChanged(config=fast(), changed_by="controller (seed)"))
    assert out == []


def test_a_snapshot_applies_the_stored_policy_before_anything_else() -> None:
    d = Driver(cfg=fast(burn_in_passes=3), nodes=2)
    stored = fast(burn_in_passes=1, restart_budget=7)
    out = d.send(StoreListed(alive={"n1": 1, "n2": 1}, policy=PolicyChanged(config=stored, reason="stored")))
    entries = [a for a in out if isinstance(a, E.Event)]
    assert entries[0].kind == E.EVENT_KIND_POLICY_CHANGED  # first: the rest was decided under it
    assert {c.key for c in entries[0].policy.changes} == {"burn_in_passes", "restart_budget"}
    assert d.sup.cfg is stored and d.sup.status(d.now).restart_budget == 7
    assert d.sup.pool._cfg is stored  # the pool judges burn-in and holds with it too


def test_every_state_has_a_policy_rule_that_moves_nowhere() -> None:
    for state, row in table.TABLE.items():
        rule = row[PolicyChanged]
        assert rule.handler is reconfigure.on_policy_changed and not rule.to, state


def test_policy_changed_refuses_anything_but_a_config() -> None:
    with pytest.raises(ValueError, match=r"PolicyChanged\.config"):
        PolicyChanged(config={"hang_timeout_floor_s": 5.0})  # a mapping is not a validated policy


@pytest.mark.parametrize("value", [None, True, False, 3, 0, 2.5, "full"])
def test_policy_values_round_trip(value: object) -> None:
    pv = reconfigure.to_value(value)
    back = reconfigure.from_value(pv)
    assert back == value and type(back) is type(value)


def test_every_policy_field_has_a_wire_value() -> None:
    """A field the codec cannot carry (a tuple, a timedelta) would make the policy unstorable: a new
    field of such a type needs `reconfigure.to_value` extended first."""
    cfg = SupervisorConfig(hang_timeout_s=40.0)
    for key, value in reconfigure.values_of(cfg).items():
        assert reconfigure.from_value(reconfigure.to_value(value)) == value, key


def test_an_empty_policy_value_is_an_error_not_a_zero() -> None:
    with pytest.raises(ValueError, match="nothing set"):
        reconfigure.from_value(common_pb2.PolicyValue())
