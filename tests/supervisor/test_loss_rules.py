"""The training-loss rules (controller/supervisor/loss.py): NaN / loss spike, divergence after resume."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from controller.goodput.causes import cause_from_attribution
from controller.supervisor import loss as loss_rules
from controller.supervisor.actions import CollectDumps, Page, PersistCheckpoint, Quarantine, StopAttempt
from controller.supervisor.blame import FlightRecorderVerdict
from controller.supervisor.events import (
    AttemptExited,
    CheckpointCommitted,
    DumpsCollected,
    PolicyChanged,
    ProgressObserved,
    RankSample,
)
from controller.supervisor.machine import RunState
from controller.supervisor.policy import SupervisorConfig
from runwarden.v1 import events_pb2 as E
from tests.supervisor.harness import Driver, fast


def curve(step: int, rank: int) -> float:
    """A deterministic loss curve; ranks differ a little, as DDP ranks' local losses do."""
    return 2.0 / (1.0 + 0.05 * step) + 0.001 * rank


def crash_and_restart(d: Driver, node: str = "n1") -> None:
    attempt = d.sup.attempt
    d.send(AttemptExited(node=node, attempt=attempt, exit_code=1, ended_at=d.now))
    if d.sup.state is RunState.COLLECTING:
        d.send(DumpsCollected(attempt=attempt, verdict=FlightRecorderVerdict()))
    stop_all(d, attempt)


def stop_all(d: Driver, attempt: int) -> None:
    for n in d.running_nodes():
        if d.sup.pool.get(n).alive and n not in d.sup.cur.exited:
            d.send(AttemptExited(node=n, attempt=attempt, exit_code=-15))
    d.advance(d.cfg.backoff_max_s + 1)
    d.answer_preflight()
    assert d.sup.state is RunState.RUNNING and d.sup.attempt == attempt + 1


# --- NaN / loss spike --------------------------------------------------------------------------


def test_a_nan_loss_is_caught_in_the_report_that_carries_it_and_pages_once() -> None:
    d = Driver(cfg=fast(), nodes=2, ranks_per_node=2)
    d.start()
    d.steps(1, 10, loss=curve)
    out = d.progress(11, loss=lambda s, r: math.nan if r == 3 else curve(s, r))
    (ev,) = d.events(E.EVENT_KIND_LOSS_ANOMALY, out)
    assert ev.step == 11 and ev.attempt == 1
    assert ev.loss.rule == "non_finite" and ev.loss.action == "page"
    (p,) = ev.loss.points
    assert (p.step, p.rank, p.node) == (11, 3, "n2") and math.isnan(p.loss)
    assert "non-finite loss at step 11: rank 3 on n2" in ev.message
    assert len(d.of(Page, out)) == 1 and d.sup.state is RunState.RUNNING
    out = d.steps(12, 14, loss=lambda s, r: math.inf)
    assert not d.events(E.EVENT_KIND_LOSS_ANOMALY, out) and not d.of(Page, out)  # once per attempt
    assert d.sup.job_step == 14  # the attempt goes on


def test_a_nan_with_stop_rolls_back_to_the_commit_before_it_not_a_commit_at_or_after_it() -> None:
    d = Driver(cfg=fast(on_loss_anomaly="stop"), nodes=2)
    d.start()
    d.steps(1, 19, loss=curve)
    d.send(CheckpointCommitted(step=10))
    d.send(CheckpointCommitted(step=20))  # rank 0's commit arrives in the same put, before the loss
    out = d.progress(20, loss=lambda s, r: math.nan if r == 1 else curve(s, r))
    (ev,) = d.events(E.EVENT_KIND_LOSS_ANOMALY, out)
    assert ev.loss.action == "stop" and ev.loss.resume_step == 10
    assert "relaunching from committed step 10" in ev.message and "commits [20]" in ev.message
    (det,) = d.events(E.EVENT_KIND_DETECTION, out)
    assert det.detection.detector == E.DETECTOR_LOSS and not det.detection.nodes
    assert not d.of(CollectDumps, out) and d.of(StopAttempt, out)  # nothing to dump: straight to stop
    stop_all(d, 1)
    (attr,) = d.events(E.EVENT_KIND_ATTRIBUTION)
    assert attr.attribution.blame_method == E.BLAME_METHOD_NONE and not attr.attribution.suspects
    assert cause_from_attribution(attr.attribution) == "software"  # the model or data, not hardware
    assert not d.of(Quarantine)
    assert d.launches[-1].resume_step == 10
    assert d.sup.latest_committed == 10 and d.sup.committed == {10}
    d.steps(11, 20, loss=curve)
    out = d.send(CheckpointCommitted(step=20, attempt=2))  # the new attempt's step 20 is a resume point
    assert d.events(E.EVENT_KIND_CHECKPOINT_COMMIT, out) and d.sup.latest_committed == 20


def test_a_nan_with_stop_and_no_commit_before_it_restarts_from_scratch() -> None:
    d = Driver(cfg=fast(on_loss_anomaly="stop"), nodes=2)
    d.start()
    d.steps(1, 4, loss=curve)
    d.send(CheckpointCommitted(step=5))
    out = d.progress(5, loss=lambda s, r: math.nan)
    assert "relaunching from scratch" in d.events(E.EVENT_KIND_LOSS_ANOMALY, out)[0].message
    stop_all(d, 1)
    assert d.launches[-1].resume_step == -1


def test_the_same_anomaly_at_the_same_step_after_each_rollback_is_a_crash_loop() -> None:
    d = Driver(cfg=fast(on_loss_anomaly="stop", crash_loop_count=3), nodes=2)
    d.start()
    d.steps(1, 10, loss=curve)
    d.send(CheckpointCommitted(step=10))
    for attempt in (1, 2, 3):
        d.steps(11, 14, loss=curve)
        d.progress(15, loss=lambda s, r: math.nan)
        if attempt < 3:
            stop_all(d, attempt)
    for n in d.running_nodes():
        d.send(AttemptExited(node=n, attempt=3, exit_code=-15))
    assert d.sup.state is RunState.CRASH_LOOP


def spiky(at: int, value: float = 50.0) -> Callable[[int, int], float]:
    return lambda s, r: value if s == at else 1.0 + 0.01 * (s % 3)


def test_a_spike_counts_only_past_the_warm_up() -> None:
    cfg = fast(loss_spike_factor=5.0, loss_spike_window=10, loss_spike_warmup_steps=30)
    d = Driver(cfg=cfg, nodes=2)
    d.start()
    out = d.steps(1, 30, loss=spiky(20))  # step 20: a spike in the warm-up (early training): not judged
    assert not d.events(E.EVENT_KIND_LOSS_ANOMALY, out)
    out = d.steps(31, 40, loss=spiky(35))
    (ev,) = d.events(E.EVENT_KIND_LOSS_ANOMALY, out)
    assert ev.step == 35 and ev.loss.rule == "spike" and ev.loss.threshold == 5.0
    assert ev.loss.median == pytest.approx(1.01)
    assert "above 5 x its running median 1.01" in ev.message


def test_a_spike_needs_a_full_window_and_stays_out_of_it() -> None:
    cfg = fast(loss_spike_factor=5.0, loss_spike_window=10, loss_spike_warmup_steps=0)
    d = Driver(cfg=cfg, nodes=1)
    d.start()
    out = d.steps(1, 8, loss=spiky(6))  # only 5 losses in the window: no median to judge by
    assert not d.events(E.EVENT_KIND_LOSS_ANOMALY, out)
    d.steps(9, 20, loss=spiky(0))
    window = d.sup.losses.windows[0]
    assert len(window) == 10 and max(v for _, v in window) < 2  # step 6's 50.0 is long gone
    out = d.steps(21, 21, loss=lambda s, r: 4.9)  # below 5 x the median: fine
    assert not d.events(E.EVENT_KIND_LOSS_ANOMALY, out)
    out = d.steps(22, 22, loss=lambda s, r: 5.2)
    assert [e.loss.rule for e in d.events(E.EVENT_KIND_LOSS_ANOMALY, out)] == ["spike"]


def test_spikes_are_off_with_factor_zero_but_a_nan_is_still_caught() -> None:
    d = Driver(cfg=fast(loss_spike_factor=0.0, loss_spike_warmup_steps=0, loss_spike_window=2), nodes=1)
    d.start()
    out = d.steps(1, 10, loss=spiky(8, 1e6))
    assert not d.events(E.EVENT_KIND_LOSS_ANOMALY, out)
    out = d.steps(11, 11, loss=lambda s, r: -math.inf)
    assert [e.loss.rule for e in d.events(E.EVENT_KIND_LOSS_ANOMALY, out)] == ["non_finite"]


# --- divergence after resume -------------------------------------------------------------------

# What a job run with deterministic algorithms sets: a 0.1 % replay difference is then a divergence.
DETERMINISTIC = 1e-6


def gpu_noise(scale: float = 1.0, rel: float = 1e-2) -> Callable[[int, int], float]:
    """The curve (times `scale`) as a GPU replay with non-deterministic kernels sees it: every
    (step, rank) off by up to `rel`, relative, in either direction (fixed pseudo-random draws)."""
    return lambda s, r: scale * curve(s, r) * (1 + rel * math.sin(12.9898 * s + 78.233 * r))


def run_and_crash(d: Driver, *, to: int = 30, commit: int = 20) -> None:
    d.start()
    d.steps(1, to, loss=curve)
    d.send(CheckpointCommitted(step=commit))
    crash_and_restart(d)
    assert d.launches[-1].resume_step == commit


def test_an_identical_replay_is_silent_and_logged_as_a_comparison() -> None:
    d = Driver(cfg=fast(), nodes=2, ranks_per_node=2)
    run_and_crash(d)
    out = d.steps(21, 35, loss=curve)
    assert not d.events(E.EVENT_KIND_DIVERGENCE, out) and not d.of(Page, out)
    (rep,) = d.events(E.EVENT_KIND_LOSS_REPLAY, out)
    assert rep.attempt == 2 and rep.loss.resume_step == 20 and rep.loss.max_rel_diff == 0.0
    assert [p.step for p in rep.loss.points] == list(range(21, 31))  # 31..35 are new, not replays
    assert all(p.ranks_compared == 4 and p.earlier_attempt == 1 for p in rep.loss.points)
    assert "replayed steps 21-30 of attempt 2 (resumed from 20)" in rep.message


def test_a_replay_with_a_different_loss_is_divergence_and_pages() -> None:
    d = Driver(cfg=fast(divergence_tolerance=DETERMINISTIC), nodes=2, ranks_per_node=2)
    run_and_crash(d)
    bad = lambda s, r: curve(s, r) * (1.001 if s >= 24 and r == 2 else 1.0)  # noqa: E731
    out = d.steps(21, 30, loss=bad)
    (div,) = d.events(E.EVENT_KIND_DIVERGENCE, out)
    assert div.step == 24 and div.attempt == 2 and div.loss.action == "page"
    (p,) = div.loss.points
    assert (p.step, p.rank, p.node, p.earlier_attempt) == (24, 2, "n2", 1)
    assert p.earlier_loss == curve(24, 2) and p.loss == bad(24, 2)
    assert p.rel_diff == pytest.approx(1e-3)
    assert "divergence after resume: step 24 rank 2 on n2" in div.message
    assert len(d.of(Page, out)) == 1 and d.sup.state is RunState.RUNNING
    reps = d.events(E.EVENT_KIND_LOSS_REPLAY)
    assert [p.step for r in reps for p in r.loss.points] == list(range(21, 31))
    assert max(r.loss.max_rel_diff for r in reps) == pytest.approx(1e-3)
    assert d.sup.losses.diverged == 7  # steps 24..30 of rank 2, one event


def test_divergence_compares_the_same_rank_only_and_respects_the_tolerance() -> None:
    d = Driver(cfg=fast(divergence_tolerance=1e-2), nodes=2, ranks_per_node=2)
    run_and_crash(d)
    out = d.steps(21, 30, loss=lambda s, r: curve(s, r) * 1.005)  # 0.5 % off: within 1 %
    assert not d.events(E.EVENT_KIND_DIVERGENCE, out)
    assert d.events(E.EVENT_KIND_LOSS_REPLAY, out)


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_the_default_tolerance_is_relative_and_quiet_on_gpu_nondeterminism(scale: float) -> None:
    """The shipped default on a GPU job: a replay up to 1 % off (non-deterministic kernels) pages
    nobody at any loss scale; a resume that lost state (the loss 30 % up, as with fresh optimizer
    moments) is a DIVERGENCE. An absolute 1e-6 would page on every GPU replay."""
    cfg = fast()
    assert cfg.divergence_tolerance == SupervisorConfig().divergence_tolerance == 0.05
    d = Driver(cfg=cfg, nodes=2, ranks_per_node=2)
    d.start()
    d.steps(1, 30, loss=lambda s, r: scale * curve(s, r))
    d.send(CheckpointCommitted(step=20))
    crash_and_restart(d)
    out = d.steps(21, 40, loss=gpu_noise(scale))
    assert not d.events(E.EVENT_KIND_DIVERGENCE, out) and not d.of(Page, out)
    (rep,) = d.events(E.EVENT_KIND_LOSS_REPLAY, out)
    assert 5e-3 < rep.loss.max_rel_diff <= 1e-2 and "within tolerance 0.05" in rep.message
    d.send(CheckpointCommitted(step=30))
    crash_and_restart(d)
    out = d.steps(31, 35, loss=lambda s, r: 1.3 * scale * curve(s, r))
    (div,) = d.events(E.EVENT_KIND_DIVERGENCE, out)
    # compared with the noisy replay's values: about 30 %
    assert div.step == 31 and div.loss.points[0].rel_diff == pytest.approx(0.3, abs=0.02)
    assert len(d.of(Page, out)) == 1


def test_a_deterministic_job_with_a_tight_tolerance_is_paged_for_what_gpu_noise_would_hide() -> None:
    """The other side of the default: the same 1 % replay difference is a DIVERGENCE for a job that
    runs deterministic algorithms and sets its tolerance to 1e-6 (a lost RNG state looks like this)."""
    d = Driver(cfg=fast(divergence_tolerance=DETERMINISTIC), nodes=2, ranks_per_node=2)
    run_and_crash(d)
    out = d.steps(21, 30, loss=gpu_noise())
    assert d.events(E.EVENT_KIND_DIVERGENCE, out) and len(d.of(Page, out)) == 1


def test_divergence_off_with_tolerance_zero() -> None:
    d = Driver(cfg=fast(divergence_tolerance=0.0), nodes=2)
    run_and_crash(d)
    out = d.steps(21, 30, loss=lambda s, r: 7.0)
    assert not d.events(E.EVENT_KIND_DIVERGENCE, out)
    assert "no tolerance set" in d.events(E.EVENT_KIND_LOSS_REPLAY, out)[0].message


def test_divergence_with_stop_relaunches_from_the_latest_commit() -> None:
    d = Driver(cfg=fast(on_divergence="stop"), nodes=2)
    run_and_crash(d)
    out = d.steps(21, 22, loss=lambda s, r: curve(s, r) + 0.5)
    assert d.events(E.EVENT_KIND_DIVERGENCE, out) and d.of(StopAttempt, out)
    stop_all(d, 2)
    assert d.launches[-1].resume_step == 20


def test_a_replay_cut_short_by_a_failure_is_logged_before_the_detection() -> None:
    d = Driver(cfg=fast(), nodes=2)
    run_and_crash(d)
    d.steps(21, 25, loss=curve)
    assert not d.events(E.EVENT_KIND_LOSS_REPLAY)
    out = d.send(AttemptExited(node="n2", attempt=2, exit_code=1, ended_at=d.now))
    kinds = [e.kind for e in d.events(None, out)]
    assert kinds.index(E.EVENT_KIND_LOSS_REPLAY) < kinds.index(E.EVENT_KIND_DETECTION)
    (rep,) = d.events(E.EVENT_KIND_LOSS_REPLAY, out)
    assert [p.step for p in rep.loss.points] == [21, 22, 23, 24, 25]


def test_a_report_seen_twice_is_compared_once() -> None:
    d = Driver(cfg=fast(), nodes=1)
    run_and_crash(d)
    sample = RankSample(rank=0, step=21, losses=((21, 9.0),), reported_at=d.now)
    d.send(ProgressObserved(node="n1", attempt=2, ranks=(sample,)))
    d.send(ProgressObserved(node="n1", attempt=2, ranks=(sample,)))
    assert len(d.events(E.EVENT_KIND_DIVERGENCE)) == 1 and d.sup.losses.diverged == 1


def test_the_loss_history_is_bounded() -> None:
    d = Driver(cfg=fast(loss_history_steps=50), nodes=2, ranks_per_node=4)
    d.start()
    d.steps(1, 400, loss=curve)
    book = d.sup.losses
    assert len(book.history) <= 50 + 64 and min(book.history) > 400 - 50 - 64
    assert book.values == sum(len(v) for v in book.history.values())


def test_rel_diff() -> None:
    assert loss_rules.rel_diff(1.0, 1.0) == 0.0
    assert loss_rules.rel_diff(1.1, 1.0) == pytest.approx(0.1)
    assert loss_rules.rel_diff(math.nan, math.nan) == 0.0
    assert loss_rules.rel_diff(math.inf, math.inf) == 0.0
    assert loss_rules.rel_diff(math.nan, 1.0) == math.inf
    assert loss_rules.rel_diff(1.0, -math.inf) == math.inf
    assert loss_rules.rel_diff(1e-13, 0.0) == pytest.approx(0.1)


@pytest.mark.parametrize(
    "kw",
    [
        {"loss_spike_factor": 1.0},
        {"loss_spike_factor": -2.0},
        {"loss_spike_factor": math.inf},
        {"on_loss_anomaly": "ignore"},
        {"on_divergence": "kill"},
        {"divergence_tolerance": -1.0},
        {"loss_spike_window": 0},
        {"loss_history_steps": 0},
    ],
)
def test_bad_loss_policy_is_refused(kw: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SupervisorConfig(**kw)  # deliberately bad values


def test_a_bad_loss_pair_is_refused_by_the_event() -> None:
    with pytest.raises(ValueError, match="losses"):
        RankSample(rank=0, step=3, losses=((-1, 1.0),))
    with pytest.raises(ValueError, match="losses_dropped"):
        RankSample(rank=0, step=3, losses_dropped=-1)
    assert math.isnan(RankSample(rank=0, step=3, losses=((3, math.nan),)).losses[0][1])


def script(d: Driver) -> list[bytes]:
    """A run with every loss rule firing: replay, divergence, NaN, spike; every item serialised."""
    d.start()
    d.steps(1, 40, loss=curve)
    d.send(CheckpointCommitted(step=30))
    crash_and_restart(d)
    d.steps(31, 60, loss=lambda s, r: curve(s, r) * (1.1 if s > 35 else 1.0))
    d.progress(61, loss=lambda s, r: math.nan)
    d.progress(62, loss=lambda s, r: 1e6)
    return [a.SerializeToString() if isinstance(a, E.Event) else repr(a).encode() for a in d.actions]


def d_events(cfg: SupervisorConfig) -> list[E.Event]:
    d = Driver(cfg=cfg, nodes=2, ranks_per_node=2)
    script(d)
    return d.events()


def test_the_loss_rules_are_deterministic() -> None:
    cfg = fast(loss_spike_factor=3.0, loss_spike_window=5, loss_spike_warmup_steps=0)
    one, two = (
        script(Driver(cfg=cfg, nodes=2, ranks_per_node=2)),
        script(Driver(cfg=cfg, nodes=2, ranks_per_node=2)),
    )
    assert one == two
    kinds = {e.kind for e in d_events(cfg)}
    assert {E.EVENT_KIND_LOSS_REPLAY, E.EVENT_KIND_DIVERGENCE, E.EVENT_KIND_LOSS_ANOMALY} <= kinds


def test_a_live_policy_change_of_the_window_keeps_the_newest_losses() -> None:
    d = Driver(cfg=fast(loss_spike_factor=3.0, loss_spike_window=10, loss_spike_warmup_steps=0), nodes=1)
    d.start()
    d.steps(1, 12, loss=curve)
    d.send(PolicyChanged(config=fast(loss_spike_factor=3.0, loss_spike_window=4, loss_spike_warmup_steps=0)))
    d.steps(13, 13, loss=curve)
    assert [s for s, _ in d.sup.losses.windows[0]] == [10, 11, 12, 13]
    out = d.steps(14, 14, loss=lambda s, r: 10.0)
    assert [e.loss.rule for e in d.events(E.EVENT_KIND_LOSS_ANOMALY, out)] == ["spike"]


def test_after_a_rollback_the_replay_to_the_anomaly_is_compared_and_nothing_past_it() -> None:
    cfg = fast(on_loss_anomaly="stop", loss_spike_factor=5.0, loss_spike_window=5, loss_spike_warmup_steps=0)
    d = Driver(cfg=cfg, nodes=2)
    d.start()
    d.steps(1, 24, loss=curve)
    d.send(CheckpointCommitted(step=20))
    d.progress(25, nodes=["n1"], loss=curve)  # n1's report of step 25 came first, and then n2's spike
    out = d.progress(25, nodes=["n2"], loss=lambda s, r: 100.0)
    assert [e.loss.rule for e in d.events(E.EVENT_KIND_LOSS_ANOMALY, out)] == ["spike"]
    stop_all(d, 1)
    assert d.launches[-1].resume_step == 20 and max(d.sup.losses.history) == 24
    out = d.steps(21, 30, loss=curve)  # a clean replay: the spike does not come back
    assert not d.events(E.EVENT_KIND_DIVERGENCE, out) and not d.events(E.EVENT_KIND_LOSS_ANOMALY, out)
    (rep,) = d.events(E.EVENT_KIND_LOSS_REPLAY, out)
    assert [p.step for p in rep.loss.points] == [21, 22, 23, 24] and rep.loss.max_rel_diff == 0


def test_a_nan_is_no_reference_for_a_replay() -> None:
    d = Driver(cfg=fast(), nodes=1)
    d.start()
    d.steps(1, 24, loss=curve)
    d.send(CheckpointCommitted(step=20))
    d.progress(25, loss=lambda s, r: math.nan)  # paged, the attempt goes on
    d.steps(26, 27, loss=curve)
    crash_and_restart(d)
    out = d.steps(21, 27, loss=curve)
    assert not d.events(E.EVENT_KIND_DIVERGENCE, out)
    assert [p.step for r in d.events(E.EVENT_KIND_LOSS_REPLAY, out) for p in r.loss.points] == [
        21,
        22,
        23,
        24,
        26,
        27,
    ]


# --- a non-finite loss on the first step after a load: the loaded state is bad ---------------------


def _load_mark(d: Driver, step: int, source: str) -> None:
    """Every node's ranks loaded `step` from `source` (their load mark, before the first step)."""
    for node_rank, node in enumerate(d.running_nodes()):
        ranks = tuple(
            RankSample(rank=node_rank * d.ranks_per_node + i, step=step, loaded_step=step, loaded_from=source)
            for i in range(d.ranks_per_node)
        )
        d.send(ProgressObserved(node=node, attempt=d.sup.attempt, ranks=ranks))


def _relaunched_from_20() -> Driver:
    """Commits 10 and 20, a crash, attempt 2 launched from step 20."""
    d = Driver(cfg=fast(), nodes=2)
    d.start()
    d.steps(1, 21, loss=curve)
    d.send(CheckpointCommitted(step=10))
    d.send(CheckpointCommitted(step=20))
    crash_and_restart(d)
    return d


def _nan_first(d: Driver, resume: int) -> list[object]:
    return d.progress(resume + 1, loaded=resume, loss=lambda s, r: math.nan if r == 0 else curve(s, r))


def test_a_nan_on_the_first_step_after_a_load_from_memory_reloads_the_same_step_from_storage_then_the_one_before() -> (
    None
):
    """Paging is the policy (the default), yet a NaN on the very first step after a load is the
    load's, not the training's: relaunched, never left to train on garbage nor to loop. First the
    previous source (the same step from storage: every node cold), then, if storage's state is bad
    too, the commit before it (and the bad step is no resume point, in the store too)."""
    d = _relaunched_from_20()
    assert d.launches[-1].resume_step == 20 and not d.launches[-1].cold
    _load_mark(d, 20, "memory")
    out = _nan_first(d, 20)
    (ev,) = d.events(E.EVENT_KIND_LOSS_ANOMALY, out)
    assert ev.loss.rule == "non_finite_after_load" and ev.loss.action == "stop" and ev.loss.resume_step == 20
    assert "that state came from memory on n1, memory on n2" in ev.message and "from storage" in ev.message
    assert d.of(StopAttempt, out) and not d.of(Page, out)
    stop_all(d, 2)
    assert d.launches[-1].resume_step == 20 and d.launches[-1].cold, "the same step, from storage"
    _load_mark(d, 20, "storage")
    out = _nan_first(d, 20)
    (ev,) = d.events(E.EVENT_KIND_LOSS_ANOMALY, out)
    assert ev.loss.resume_step == 10 and "step 20 is no longer a resume point" in ev.message
    (persist,) = [a for a in d.of(PersistCheckpoint, out) if a.invalid]
    assert persist.step == 20
    stop_all(d, 3)
    assert d.launches[-1].resume_step == 10 and not d.launches[-1].cold
    assert d.sup.committed == {10}
    _load_mark(d, 10, "memory")
    out = d.steps(11, 13, loaded=10, loss=curve)
    assert not d.events(E.EVENT_KIND_LOSS_ANOMALY, out) and d.sup.state is RunState.RUNNING
    assert not d.of(Quarantine), "the state was bad, not a node"


def test_a_nan_on_the_first_step_after_a_load_from_storage_goes_straight_to_the_commit_before() -> None:
    d = _relaunched_from_20()
    _load_mark(d, 20, "storage")
    out = _nan_first(d, 20)
    (ev,) = d.events(E.EVENT_KIND_LOSS_ANOMALY, out)
    assert ev.loss.rule == "non_finite_after_load" and ev.loss.resume_step == 10
    stop_all(d, 2)
    assert d.launches[-1].resume_step == 10 and not d.launches[-1].cold


def test_a_nan_later_in_an_attempt_is_the_training_s_and_only_pages() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.start()
    d.steps(1, 21, loss=curve)
    d.send(CheckpointCommitted(step=20))
    crash_and_restart(d)
    _load_mark(d, 20, "memory")
    d.steps(21, 24, loaded=20, loss=curve)
    out = d.progress(25, loaded=20, loss=lambda s, r: math.nan)
    (ev,) = d.events(E.EVENT_KIND_LOSS_ANOMALY, out)
    assert ev.loss.rule == "non_finite" and ev.loss.action == "page" and d.sup.state is RunState.RUNNING


def test_a_fresh_core_cuts_after_a_bad_restore_s_rollback_point() -> None:
    from controller.live.loss_history import loss_history

    anomaly = E.Event(
        run="r",
        attempt=3,
        kind=E.EVENT_KIND_LOSS_ANOMALY,
        step=21,
        loss=E.LossDetail(rule="non_finite_after_load", action="stop", resume_step=10),
    )
    assert loss_history([anomaly], "r").rollback_before == 11  # step 20 is dropped, 10 kept


def test_a_nan_the_job_itself_produced_at_that_step_is_not_taken_for_a_bad_load() -> None:
    """The NaN first came in an attempt that trained into the step (the job's own, after a commit at
    the step before it): the relaunch that meets it again right after its load is the same NaN, not
    a bad load: the loss rule's rollback and crash loop, not a walk back through the commits."""
    d = Driver(cfg=fast(on_loss_anomaly="stop"), nodes=2)
    d.start()
    d.steps(1, 20, loss=curve)
    d.send(CheckpointCommitted(step=20))
    out = d.progress(21, loss=lambda s, r: math.nan)
    assert d.events(E.EVENT_KIND_LOSS_ANOMALY, out)[0].loss.rule == "non_finite"
    stop_all(d, 1)
    assert d.launches[-1].resume_step == 20
    _load_mark(d, 20, "memory")
    out = _nan_first(d, 20)
    (ev,) = d.events(E.EVENT_KIND_LOSS_ANOMALY, out)
    assert ev.loss.rule == "non_finite" and ev.loss.resume_step == 20
    stop_all(d, 2)
    assert d.launches[-1].resume_step == 20 and not d.launches[-1].cold
