"""The detectors are pure functions: each rule with its edge."""

from __future__ import annotations

import signal
from collections import deque

import pytest

from controller.supervisor import detectors as d
from controller.supervisor.blame import heartbeat_suspect
from controller.supervisor.policy import SupervisorConfig
from controller.supervisor.stats import median
from runwarden.evidence import is_fatal
from runwarden.v1 import common_pb2

CFG = SupervisorConfig()


@pytest.mark.parametrize(
    ("code", "sig", "kind", "label"),
    [
        (0, None, "clean", "clean"),
        (1, None, "crash", "exit:1"),
        (None, signal.SIGKILL, "signal", "signal:SIGKILL"),
        (137, None, "signal", "signal:SIGKILL"),
        (-11, None, "signal", "signal:SIGSEGV"),
        (None, None, "crash", "exit:unknown"),
    ],
)
def test_classify_exit(code: int | None, sig: int | None, kind: str, label: str) -> None:
    c = d.classify_exit(code, sig, stopping=False)
    assert (c.kind, c.label) == (kind, label)


def test_classify_exit_while_stopping_is_a_stop() -> None:
    assert d.classify_exit(None, signal.SIGKILL, stopping=True).kind == "stop"


def test_hang_timeout_is_max_of_floor_and_three_median_steps() -> None:
    assert d.hang_timeout(CFG, 1.0, in_checkpoint=False) == 10.0
    assert d.hang_timeout(CFG, 7.0, in_checkpoint=False) == pytest.approx(21.0)
    assert d.hang_timeout(CFG, None, in_checkpoint=False) == 10.0


def test_save_allowance_learned_from_recent_saves_and_capped_at_the_barrier() -> None:
    cfg = SupervisorConfig(checkpoint_barrier_s=120.0)  # x3, learned after 3 saves
    assert d.hang_timeout(cfg, 1.0, in_checkpoint=True, recent_saves_s=[0.5, 0.4]) == 120.0
    assert d.hang_timeout(cfg, 1.0, in_checkpoint=True, recent_saves_s=[0.5, 0.4, 0.6]) == 10.0
    assert d.hang_timeout(cfg, 1.0, in_checkpoint=True, recent_saves_s=[5.0, 20.0, 8.0]) == 60.0
    assert d.hang_timeout(cfg, 1.0, in_checkpoint=True, recent_saves_s=[5.0, 60.0, 8.0]) == 120.0
    assert d.hang_timeout(cfg, 1.0, in_checkpoint=False, recent_saves_s=[60.0] * 3) == 10.0
    with pytest.raises(ValueError, match="checkpoint_save_multiple"):
        SupervisorConfig(checkpoint_save_multiple=0.5)
    with pytest.raises(ValueError, match="checkpoint_saves_to_learn"):
        SupervisorConfig(checkpoint_saves_to_learn=0)


def test_hang_timeout_never_below_longest_collective_or_checkpoint_barrier() -> None:
    cfg = SupervisorConfig(longest_collective_s=45.0, checkpoint_barrier_s=90.0, hang_timeout_s=5.0)
    assert d.hang_timeout(cfg, 1.0, in_checkpoint=False) == 45.0
    assert d.hang_timeout(cfg, 1.0, in_checkpoint=True) == 90.0


def _loads(compute: list[float], wait: list[float]) -> dict[int, tuple[str, float, float]]:
    return {i: (f"n{i}", c, w) for i, (c, w) in enumerate(zip(compute, wait, strict=True))}


def test_straggler_is_high_compute_low_wait_while_others_wait() -> None:
    cand = d.straggler_candidate(_loads([1.0, 1.0, 1.1, 1.0], [0.1, 0.1, 0.0, 0.1]), CFG)
    assert cand is not None and cand.rank == 2 and "rank 2" in cand.reason


def test_no_straggler_when_nobody_waits_or_all_equal() -> None:
    assert d.straggler_candidate(_loads([1.0, 1.0, 1.1, 1.0], [0.0, 0.0, 0.0, 0.0]), CFG) is None
    assert d.straggler_candidate(_loads([1.0, 1.0, 1.0, 1.0], [0.1, 0.1, 0.1, 0.1]), CFG) is None
    # slow but also waiting as much as the others: not a straggler (e.g. the whole job is slow)
    assert d.straggler_candidate(_loads([1.0, 1.0, 1.2, 1.0], [0.1, 0.1, 0.1, 0.1]), CFG) is None


def test_persistent_straggler_needs_a_full_window_and_persistence() -> None:
    cfg = SupervisorConfig(straggler_window=10, straggler_persistence=0.7)
    assert d.persistent_straggler([3] * 9, cfg) is None
    assert d.persistent_straggler([3] * 7 + [None] * 3, cfg) == 3
    assert d.persistent_straggler([3] * 6 + [None] * 4, cfg) is None


def test_mass_expiry_threshold_and_window() -> None:
    cfg = SupervisorConfig(mass_expiry_min_nodes=3, mass_expiry_fraction=0.55, mass_expiry_window_s=2.0)
    assert d.mass_expiry_threshold(cfg, 6) == 3
    assert d.mass_expiry_threshold(cfg, 100) == 3  # the count, not a quarter of the fleet
    assert d.mass_expiry_threshold(cfg, 3) == 2  # too small for three: the fraction, at least two
    assert d.is_mass_expiry(deque([10.0, 10.5, 11.0]), 11.0, 6, cfg)
    assert not d.is_mass_expiry(deque([5.0, 10.5, 11.0]), 11.0, 6, cfg)


def test_fatal_evidence() -> None:
    ev = common_pb2.Evidence
    assert is_fatal(
        ev(node="a", kind=common_pb2.EVIDENCE_KIND_XID, xid=79, severity=common_pb2.SEVERITY_FATAL)
    )
    assert not is_fatal(
        ev(node="a", kind=common_pb2.EVIDENCE_KIND_XID, xid=13, severity=common_pb2.SEVERITY_APPLICATION)
    )
    assert not is_fatal(ev(node="a", kind=common_pb2.EVIDENCE_KIND_XID, severity=common_pb2.SEVERITY_WARNING))
    assert is_fatal(ev(node="a", kind=common_pb2.EVIDENCE_KIND_ECC_UNCORRECTABLE))
    assert is_fatal(ev(node="a", kind=common_pb2.EVIDENCE_KIND_GPU_LOST))
    assert not is_fatal(
        ev(node="a", kind=common_pb2.EVIDENCE_KIND_THROTTLE, severity=common_pb2.SEVERITY_WARNING)
    )


def test_heartbeat_suspect_is_the_single_node_behind() -> None:
    assert heartbeat_suspect({"a": 10, "b": 9, "c": 10}) == "b"
    assert heartbeat_suspect({"a": 10, "b": 10}) is None
    assert heartbeat_suspect({"a": 10}) is None


def test_median() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([1.0, 2.0, 3.0, 4.0]) == 2.5
    with pytest.raises(ValueError):
        median([])


@pytest.mark.parametrize(
    "bad",
    [
        {"rank": -1},
        {"step": -5},
        {"step_time_s": float("nan")},
        {"compute_s": -0.1},
        {"wait_s": float("inf")},
        {"compute_s": "fast"},
    ],
)
def test_rank_sample_rejects_bad_values_with_a_clear_error(bad: dict[str, object]) -> None:
    from controller.supervisor.events import RankSample

    args: dict[str, object] = {"rank": 0, "step": 1, **bad}
    with pytest.raises(ValueError, match="RankSample"):
        RankSample(**args)  # deliberately bad


@pytest.mark.parametrize("name", ["", "a b", "x" * 300, "n\n1"])
def test_event_node_names_are_validated(name: str) -> None:
    from controller.supervisor.events import NodeLost

    with pytest.raises(ValueError, match="bad name"):
        NodeLost(node=name)
