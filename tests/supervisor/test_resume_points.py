"""A resume point the load refused (controller/supervisor/resume_points.py): the ranks' load found
a committed step's shards not what its commit recorded. The step stops being a resume point (in
the store too), the attempt fails on no node, whichever order its exits and the refusal reach the
controller in, and the relaunch resumes from the commit before it."""

from __future__ import annotations

from controller.live.translate import Listing, Translator
from controller.supervisor.actions import PersistCheckpoint, Quarantine
from controller.supervisor.blame import FlightRecorderVerdict
from controller.supervisor.events import (
    AttemptExited,
    CheckpointCommitted,
    CheckpointInvalid,
    DumpsCollected,
)
from controller.supervisor.machine import RunState
from runwarden.keys import KeySchema
from runwarden.store import EventType, KeyValue, WatchEvent
from runwarden.v1 import common_pb2, store_pb2
from runwarden.v1 import events_pb2 as E
from tests.supervisor.harness import Driver, fast

WHY = "/ckpt/step_000000000020: shard(s) ['__0_0.distcp'] differ from the checksum recorded at the commit"


def _relaunched_on_a_refused_resume_point(d: Driver) -> None:
    """Commits 10 and 20, a crash, and the relaunch resuming from 20 (whose shards rotted)."""
    d.start()
    d.steps(1, 22)
    d.send(CheckpointCommitted(step=10))
    d.send(CheckpointCommitted(step=20))
    d.send(AttemptExited(node="n2", attempt=1, exit_code=1, ended_at=d.now))
    if d.sup.state is RunState.COLLECTING:
        d.send(DumpsCollected(attempt=1, verdict=FlightRecorderVerdict()))
    for n in d.running_nodes():
        if n not in d.sup.cur.exited:
            d.send(AttemptExited(node=n, attempt=1, exit_code=-15))
    d.advance(d.cfg.backoff_max_s + 1)
    d.answer_preflight()
    assert d.sup.state is RunState.RUNNING and d.sup.attempt == 2 and d.launches[-1].resume_step == 20


def _exits(d: Driver, attempt: int, first: str) -> None:
    d.send(AttemptExited(node=first, attempt=attempt, exit_code=1, ended_at=d.now))
    for n in d.running_nodes():
        if n not in d.sup.cur.exited:
            d.send(AttemptExited(node=n, attempt=attempt, exit_code=1, ended_at=d.now))


def _assert_refused_then_resumed_from_10(d: Driver, out: list[object]) -> None:
    (ev,) = d.events(E.EVENT_KIND_CHECKPOINT_INVALID)
    assert ev.step == 20 and ev.checkpoint.error == WHY
    assert "the next attempt resumes from committed step 10" in ev.message
    (persist,) = [a for a in d.of(PersistCheckpoint, out) if a.invalid]
    assert persist.step == 20 and persist.invalid == WHY  # a rebuilt core lists it as no resume point
    assert d.sup.committed == {10} and d.sup.latest_committed == 10
    attr = d.events(E.EVENT_KIND_ATTRIBUTION)[-1]
    assert attr.attribution.blame_method == E.BLAME_METHOD_NONE and not attr.attribution.suspects
    assert not d.of(Quarantine), "the files are at fault, not a node"
    d.advance(d.cfg.backoff_max_s + 1)
    d.answer_preflight()
    assert d.sup.state is RunState.RUNNING and d.launches[-1].resume_step == 10


def test_the_refusal_before_the_exits_fails_the_attempt_on_no_node() -> None:
    # repeat_offender_count 2: n2 was first to exit once already, a second first exit would quarantine it
    d = Driver(cfg=fast(repeat_offender_count=2), nodes=2)
    _relaunched_on_a_refused_resume_point(d)
    out = d.send(CheckpointInvalid(step=20, error=WHY, node="n2", attempt=2))
    (det,) = [e for e in d.events(E.EVENT_KIND_DETECTION, out)]
    assert det.detection.detector == E.DETECTOR_CHECKPOINT and not det.detection.nodes
    assert d.sup.state is RunState.STOPPING
    out += d.send(CheckpointInvalid(step=20, error=WHY, node="n1", attempt=2))  # the other host's: once
    _exits(d, 2, first="n2")
    _assert_refused_then_resumed_from_10(d, out)


def test_an_exit_that_reaches_the_controller_before_the_refusal_is_not_blamed_on_its_node() -> None:
    d = Driver(cfg=fast(repeat_offender_count=2), nodes=2)
    _relaunched_on_a_refused_resume_point(d)
    out = d.send(AttemptExited(node="n2", attempt=2, exit_code=1, ended_at=d.now))  # a crash, for now
    assert d.sup.state in (RunState.COLLECTING, RunState.STOPPING)
    out += d.send(CheckpointInvalid(step=20, error=WHY, node="n2", attempt=2))
    if d.sup.state is RunState.COLLECTING:
        out += d.send(DumpsCollected(attempt=2, verdict=FlightRecorderVerdict()))
    _exits(d, 2, first="n2")
    _assert_refused_then_resumed_from_10(d, out)
    assert d.sup.offences.get("n2", set()) == {22}, "only the first crash counts as n2's first exit"


def test_a_late_refusal_of_an_earlier_attempt_changes_nothing() -> None:
    d = Driver(cfg=fast(), nodes=2)
    _relaunched_on_a_refused_resume_point(d)
    out = d.send(CheckpointInvalid(step=20, error=WHY, node="n2", attempt=1))
    assert not d.events(E.EVENT_KIND_CHECKPOINT_INVALID, out) and d.sup.latest_committed == 20
    assert d.sup.state is RunState.RUNNING


KEYS = KeySchema()
RUN = "live"


def test_the_translator_turns_a_rank_s_refusal_into_one_event_and_a_listing_skips_refused_steps() -> None:
    tr = Translator(KEYS, RUN)
    tr.new_attempt(2)

    def report(node: str, rank: int) -> list[object]:
        prog = store_pb2.NodeProgress(
            node=node,
            run=RUN,
            attempt=2,
            ranks=[common_pb2.RankProgress(rank=rank, step=20, invalid_step=20, load_error=WHY)],
        )
        put = WatchEvent(
            type=EventType.PUT,
            key=KEYS.progress(RUN, node),
            value=prog.SerializeToString(),
            mod_revision=1,
            create_revision=1,
        )
        events, _ = tr.watch_event(put)
        return [e for e in events if isinstance(e, CheckpointInvalid)]

    assert report("n2", 1) == [CheckpointInvalid(step=20, error=WHY, node="n2", attempt=2)]
    assert report("n2", 1) == [], "the same refusal carried on a later put is not a new one"

    def record(step: int, invalid: str = "") -> KeyValue:
        rec = store_pb2.CheckpointCommit(run=RUN, step=step, attempt=1, invalid=invalid)
        return KeyValue(
            key=KEYS.checkpoint(RUN, step), value=rec.SerializeToString(), mod_revision=1, create_revision=1
        )

    snap, _, _, _ = tr.snapshot(
        Listing(
            nodes=(),
            pool=(),
            reputation=(),
            attempt=None,
            checkpoints=(record(10), record(20, invalid=WHY)),
            stop=None,
            progress=(),
            now=0.0,
        )
    )
    assert snap.committed_steps == (10,)


def test_the_load_done_event_says_why_a_node_passed_over_a_faster_source() -> None:
    from controller.supervisor.events import ProgressObserved, RankSample

    d = Driver(cfg=fast(), nodes=2)
    _relaunched_on_a_refused_resume_point(d)
    why = "the in-memory copy of step 20 (saved as rank 1) no longer matches the checksum taken when it was kept"
    out: list[object] = []
    for node, rank, source, fallback in (("n1", 0, "memory", ""), ("n2", 1, "peer", why)):
        sample = RankSample(rank=rank, step=20, loaded_step=20, loaded_from=source, load_fallback=fallback)
        out += d.send(ProgressObserved(node=node, attempt=2, ranks=(sample,)))
    (done,) = d.events(E.EVENT_KIND_LOAD_DONE, out)
    assert "state from memory on n1; peer on n2" in done.message
    assert done.message.endswith(f"; passed over: n2: {why}"), done.message
