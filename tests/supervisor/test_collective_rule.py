"""The collective rule (controller/supervisor/collectives.py): a rank that has not entered a
collective its peers entered collective_hang_s ago is hung, at any step length; a save, a declared
evaluation, a rank without counts and a habitual straggler's lateness hold it off."""

from __future__ import annotations

import math

import pytest

from controller.supervisor.collectives import CollectiveMarks, hang_after_s
from controller.supervisor.events import ProgressObserved, RankSample
from runwarden.v1 import events_pb2 as E
from tests.supervisor.harness import Driver, Item, fast

STEP_S = 20.0  # a large model's step: the step rule's timeout is 3 x 20 s = 60 s


class Job:
    """Two nodes of one rank each; every report carries the rank's collective count and its age."""

    def __init__(self, **cfg: object) -> None:
        self.d = Driver(cfg=fast(**cfg), nodes=2)
        self.d.start(2)
        self.nodes = self.d.running_nodes()
        self.step = 1

    def report(
        self,
        node: int,
        entered: int | None,
        *,
        age: float = 0.0,
        in_eval: bool = False,
        in_checkpoint: bool = False,
    ) -> list[Item]:
        sample = RankSample(
            rank=node,
            step=self.step,
            step_time_s=STEP_S,
            compute_s=STEP_S * 0.9,
            wait_s=STEP_S * 0.1,
            reported_at=self.d.now,
            collectives_entered=entered,
            collective_age_s=age,
            in_eval=in_eval,
            in_checkpoint=in_checkpoint,
        )
        return self.d.send(
            ProgressObserved(node=self.nodes[node], attempt=self.d.sup.attempt, ranks=(sample,))
        )

    def settled(self, entered: int = 10) -> None:
        """Both ranks at `entered`, long step times learned (the step rule's timeout is 60 s)."""
        for _ in range(8):
            self.d.now += 1.0
            self.step += 1
            self.report(0, entered)
            self.report(1, entered)

    def hangs(self, items: list[Item] | None = None) -> list[E.Event]:
        return [
            e
            for e in self.d.events(E.EVENT_KIND_DETECTION, items)
            if e.detection.detector == E.DETECTOR_HANG and not e.detection.flag_only
        ]


def test_a_rank_that_never_enters_its_peers_collective_is_hung_five_seconds_after_they_did() -> None:
    job = Job()
    job.settled()
    # rank 0 entered collective 11 two seconds before its agent's write reached the controller
    job.d.now += 1.0
    entered_at = job.d.now - 2.0
    job.report(0, 11, age=2.0)
    job.report(1, 10, age=5.0)
    assert not job.hangs(job.d.advance(entered_at + 4.9 - job.d.now)), "4.9 s of waiting is not a hang"
    out = job.d.advance(0.2)
    (det,) = job.hangs(out)
    assert det.detection.nodes == [job.nodes[1]] and list(det.detection.ranks) == [1], det
    assert "did not enter collective 11 of the default group" in det.message, det.message
    assert 5.0 <= det.detection.latency_s < 5.2, det.detection.latency_s  # from when rank 0 entered it
    # the step rule alone would have waited max(10 s, 3 x 20 s)
    assert det.detection.latency_s < 60.0


def test_peers_that_all_enter_the_collective_are_not_a_hang_however_long_the_step() -> None:
    job = Job()
    job.settled()
    for k in range(11, 15):  # a collective every 18 s, ranks a fraction of a second apart
        job.d.advance(18.0)
        job.step += 1
        job.report(0, k)
        job.d.advance(0.3)
        job.report(1, k, age=0.1)
    assert not job.hangs()


def test_a_declared_evaluation_holds_both_rules_off_until_its_allowance() -> None:
    job = Job(eval_timeout_s=300.0)
    job.settled()
    job.d.now += 1.0
    job.report(0, 10, in_eval=True)  # rank 0 evaluates alone; rank 1 enters the next step's collective
    job.report(1, 11)
    assert not job.hangs(job.d.advance(120.0)), "a 2-minute evaluation: no collective hang, no step hang"
    job.report(0, 11)  # the evaluation is over and rank 0 enters the collective its peer waits in
    assert not job.hangs(job.d.advance(3.0))
    assert max(job.d.sup.collective_lateness) < 1.0, "an evaluation's wait is not a straggler's lateness"
    job.report(1, 12)
    job.report(0, 12, age=0.2)
    assert not job.hangs(job.d.advance(1.0))


def test_a_rank_just_out_of_its_evaluation_gets_the_bound_to_catch_up() -> None:
    """The soak's false hang: rank 0 left an 8 s evaluation with its count one behind its peers, who
    had entered their collective 8 s before; the wait the evaluation overlapped counts from its end."""
    job = Job()
    job.settled()
    job.d.now += 1.0
    job.report(0, 10, in_eval=True)
    job.report(1, 11)
    job.d.advance(8.0)
    job.report(0, 10)  # out of its evaluation, not yet in the collective its peer waits in
    assert not job.hangs(job.d.advance(4.9))
    (det,) = job.hangs(job.d.advance(0.2))  # 5 s after the evaluation ended, it is late
    assert det.detection.nodes == [job.nodes[0]], det


def test_a_rank_without_counts_leaves_the_step_rule_alone() -> None:
    job = Job()
    job.settled()
    job.d.now += 1.0
    job.report(0, 11)
    job.report(1, None)  # an older trainer: no count
    assert not job.hangs(job.d.advance(30.0))
    assert job.hangs(job.d.advance(40.0)), "the step rule is the backstop"


def test_a_save_holds_the_rule_off() -> None:
    job = Job()
    job.settled()
    job.d.now += 1.0
    job.report(0, 11)
    job.report(1, 10, in_checkpoint=True)
    assert not job.hangs(job.d.advance(20.0))


def test_a_habitual_stragglers_lateness_raises_the_bound() -> None:
    job = Job()
    job.settled()
    for k in range(11, 17):  # rank 1 enters every collective 3 s after rank 0
        job.d.advance(15.0)
        job.step += 1
        job.report(0, k)
        job.d.advance(3.0)
        job.report(1, k)
    assert not job.hangs()
    assert max(job.d.sup.collective_lateness) == pytest.approx(3.0)
    job.d.advance(15.0)
    job.report(0, 17)
    assert not job.hangs(job.d.advance(8.5)), "9 s (3 x its usual 3 s) is its bound, not 5 s"
    (det,) = job.hangs(job.d.advance(1.0))
    assert "bound 9s" in det.message, det.message


def test_off_at_zero() -> None:
    job = Job(collective_hang_s=0.0)
    job.settled()
    job.d.now += 1.0
    job.report(0, 11)
    job.report(1, 10)
    assert not job.hangs(job.d.advance(30.0))


def test_marks_keep_the_earliest_entry_of_a_count_and_count_ranks_per_count() -> None:
    marks = CollectiveMarks()

    def sample(rank: int, entered: int, age: float) -> RankSample:
        return RankSample(rank=rank, step=1, collectives_entered=entered, collective_age_s=age)

    marks.observe("a", (sample(0, 5, 1.0), sample(1, 5, 0.0)), now=100.0)
    marks.observe("b", (sample(2, 4, 0.0),), now=100.0)
    stall = marks.stall(2)
    assert stall is not None and (stall.entered, stall.since) == (5, 99.0)
    marks.observe("a", (sample(0, 5, 3.0),), now=101.0)  # the same count, re-reported: earliest kept
    assert marks.stall(2) == type(stall)(entered=5, since=98.0)
    assert marks.behind() == [(2, "b", 4)]
    late = marks.observe("b", (sample(2, 5, 0.5),), now=102.0)
    assert late == [pytest.approx(3.5)] and marks.stall(2) is None
    assert marks.stall(3) is None  # a node of the attempt has not reported counts


def test_the_bound_is_the_floor_or_the_multiple_of_the_longest_lateness() -> None:
    assert hang_after_s(5.0, 3.0, []) == 5.0
    assert hang_after_s(5.0, 3.0, [0.2, 1.0]) == 5.0
    assert hang_after_s(5.0, 3.0, [0.2, 4.0]) == 12.0


@pytest.mark.parametrize(
    "bad", [{"collective_age_s": math.nan}, {"collective_age_s": -1.0}, {"collectives_entered": -3}]
)
def test_bad_counts_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        RankSample(**{"rank": 0, "step": 1, "collectives_entered": 1, **bad})


def test_a_stored_progress_carries_its_counts_into_the_core() -> None:
    from runwarden.v1 import common_pb2

    with_counts = RankSample.from_proto(
        common_pb2.RankProgress(rank=3, step=9, collectives_entered=70, collective_age_s=1.5, in_eval=True)
    )
    assert (with_counts.collectives_entered, with_counts.collective_age_s, with_counts.in_eval) == (
        70,
        1.5,
        True,
    )
    older = RankSample.from_proto(common_pb2.RankProgress(rank=3, step=9))  # an older trainer or agent
    assert older.collectives_entered is None and not older.in_eval


def test_a_long_first_step_is_not_a_hang_before_any_step_was_measured() -> None:
    """The step rule's timeout is max(10 s, 3 x median step), and before the run's first step there
    is no median: a 20 s first step must not be a 10 s hang (every such job crash-looped at step 0)."""
    d = Driver(cfg=fast(startup_timeout_s=120.0), nodes=2)
    d.start(2)
    d.progress(0, dt=0.0, loaded=-1)  # the load marks: no step measured
    d.progress(0, dt=0.0, loaded=-1)  # the same, repeated for a new collective count: step 0 is known
    assert d.sup.cur.min_step == 0
    assert not d.events(E.EVENT_KIND_DETECTION, d.advance(60.0)), "a minute into the first step"
    d.progress(1, dt=STEP_S, loaded=-1)  # the first step, 20 s: from now on 3 x 20 s
    assert not d.events(E.EVENT_KIND_DETECTION, d.advance(59.0))
    (det,) = d.events(E.EVENT_KIND_DETECTION, d.advance(2.0))
    assert "3 x median step 20s" in det.message, det.message


def test_a_first_step_that_never_ends_is_a_hang_at_the_startup_timeout() -> None:
    d = Driver(cfg=fast(startup_timeout_s=120.0), nodes=2)
    d.start(2)
    d.progress(0, dt=0.0, loaded=-1)
    d.progress(0, dt=0.0, loaded=-1)
    assert not d.events(E.EVENT_KIND_DETECTION, d.advance(118.0))
    (det,) = d.events(E.EVENT_KIND_DETECTION, d.advance(3.0))
    assert det.detection.detector == E.DETECTOR_HANG and "no step completed" in det.message, det.message
