"""Properties over random event logs: every microsecond of allocated time has exactly one label;
lost time is charged only from a failure to its recovery (and the rollback before it); a detection
after which the attempt went on (a flag) changes nothing."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from controller.goodput.report import GoodputReport, Span, compute_goodput, to_us

from .logbuild import E, LogBuilder

ACTIONS = [
    "preflight",
    "launch",
    "load_done",
    "first_step",
    "commit",
    "detect",
    "flag",
    "legacy_flag",
    "evidence_flag",
    "control_plane",
    "attribute",
    "attribute_none",
    "spare",
    "quarantine",
    "stop",
    "exit",
    "end",
    "start",
]
NOT_INCIDENT = ("startup:", "planned", "checkpoint_stall", "productive")


@st.composite
def event_logs(draw: st.DrawFn) -> LogBuilder:
    b = LogBuilder()
    t = 1_764_547_200.0 + draw(st.floats(min_value=0, max_value=1e6))
    b.start(t)
    for _ in range(draw(st.integers(min_value=0, max_value=40))):
        t += draw(st.floats(min_value=0, max_value=5000, allow_nan=False))
        action = draw(st.sampled_from(ACTIONS))
        latency = draw(st.floats(min_value=0, max_value=300))
        if action == "commit":
            b.commit(t, step=b.step + 10, save_s=draw(st.floats(min_value=0, max_value=200)))
        elif action == "detect":
            b.detect(t, latency_s=latency)
        elif action in ("flag", "legacy_flag"):
            b.flag(t, latency_s=latency, legacy=action == "legacy_flag")
        elif action == "evidence_flag":
            b.evidence_flag(t, latency_s=latency)
        elif action == "attribute_none":
            b.attribute(t, node=None)
        elif action == "end":
            b.end(t, outcome=draw(st.sampled_from(["completed", "crash_loop", "stopped"])))
        else:
            getattr(b, action)(t)
    return b


@given(event_logs(), st.floats(min_value=0, max_value=1.0), st.booleans())
@settings(max_examples=300, deadline=None)
def test_productive_plus_lost_is_allocated_exactly(b: LogBuilder, since_frac: float, clip: bool) -> None:
    r = compute_goodput(b.events)
    assert r.productive_us + r.lost_us == r.allocated_us
    assert 0.0 <= r.goodput <= 1.0
    assert all(us >= 0 for us in r.lost_by_cause_us.values())
    assert 0 <= r.uncommitted_us <= r.productive_us
    # spans never overlap and run forward
    for a, c in zip(r.spans, r.spans[1:], strict=False):
        assert a.start_us < a.end_us <= c.start_us
    assert sum(w.allocated_us for w in r.weeks) == r.allocated_us
    assert sum(w.productive_us for w in r.weeks) == r.productive_us
    for inc in r.incidents:
        assert inc.fault_ts <= inc.detected_ts
        assert inc.lost_us >= 0
    if clip and r.spans:
        since = r.start_ts + since_frac * (r.end_ts - r.start_ts)
        c2 = compute_goodput(b.events, since=since)
        assert c2.productive_us + c2.lost_us == c2.allocated_us <= r.allocated_us


def _overlap(sp: Span, lo: int, hi: int) -> int:
    return max(0, min(sp.end_us, hi) - max(sp.start_us, lo))


def _recoveries(r: GoodputReport, ends: list[int] | None = None) -> list[tuple[int, int]]:
    """Each incident's [fault, recovery): to its first new step, the next fault, the report's end or,
    given ``ends`` (RUN_END times), the first run end at or after its detection."""
    faults = [to_us(i.fault_ts) for i in r.incidents]
    end = to_us(r.end_ts)
    out = []
    for k, inc in enumerate(r.incidents):
        stop = to_us(inc.first_step_ts) if inc.first_step_ts is not None else end
        if k + 1 < len(faults):
            stop = min(stop, faults[k + 1])
        stop = min([stop, end, *(t for t in ends or () if t >= to_us(inc.detected_ts))])
        out.append((faults[k], stop))
    return out


@given(event_logs())
@settings(max_examples=300, deadline=None)
def test_lost_time_is_charged_only_between_a_failure_and_its_recovery(b: LogBuilder) -> None:
    r = compute_goodput(b.events)
    # every incident is a failure of the log: a detection after which the attempt did not go on
    failures = {to_us(e.ts) for e in b.events if e.HasField("detection") and e.seq not in b.flags}
    assert all(to_us(i.detected_ts) in failures for i in r.incidents)
    windows = _recoveries(r)
    # (a run end, equal times aside, ends a recovery too: the run is no longer allocated)
    ended = _recoveries(r, [to_us(e.ts) for e in b.events if e.kind == E.EVENT_KIND_RUN_END])
    for inc, (lo, hi), (_, hi_ended) in zip(r.incidents, windows, ended, strict=True):
        # all of the restart overhead charged to an incident lies in its own recovery window ...
        inside = sum(_overlap(sp, lo, hi) for sp in r.spans if sp.label.startswith("restart:"))
        assert sum(inc.phases_us.values()) == inside <= hi - lo
        # ... and nothing in that window counts as training, a stall or a planned stop
        for sp in r.spans:
            if _overlap(sp, lo, hi_ended):
                assert sp.label.startswith("restart:"), (sp, inc)
    for sp in r.spans:
        if sp.label.startswith("restart:"):  # no restart overhead outside every recovery window
            assert any(lo <= sp.start_us and sp.end_us <= hi for lo, hi in windows), sp
        elif not sp.label.startswith(NOT_INCIDENT):  # a rollback: work before its incident's fault
            assert any(i.cause == sp.label and sp.end_us <= to_us(i.fault_ts) for i in r.incidents), sp
    rolled: dict[str, int] = {}
    for i in r.incidents:
        rolled[i.cause] = rolled.get(i.cause, 0) + i.rollback_us
    for cause, us in r.lost_by_cause_us.items():
        if not cause.startswith(("restart:", "startup:", "planned", "checkpoint_stall")):
            assert us == rolled.get(cause, 0), cause
    assert sum(i.lost_us for i in r.incidents) == sum(
        us for c, us in r.lost_by_cause_us.items() if not c.startswith(("startup:", "planned", "checkpoint"))
    )


@given(event_logs())
@settings(max_examples=300, deadline=None)
def test_a_detection_after_which_the_attempt_went_on_changes_nothing(b: LogBuilder) -> None:
    until = b.events[-1].ts
    with_flags = compute_goodput(b.events, until=until)
    without = compute_goodput([e for e in b.events if e.seq not in b.flags], until=until)
    assert with_flags.spans == without.spans
    assert with_flags.incidents == without.incidents
    assert with_flags.lost_by_cause_us == without.lost_by_cause_us
    assert with_flags.markers == without.markers
    assert with_flags.node_seconds == without.node_seconds
    assert (
        with_flags.allocated_us == without.allocated_us and with_flags.productive_us == without.productive_us
    )


def test_a_detection_at_the_instant_a_run_started_again_is_inside_the_report() -> None:
    """Found by the property above in a full suite run: a run ended, started again and a failure was
    detected at that same instant; no span follows, and the report ended before the incident."""
    b = LogBuilder()
    t = 1_764_547_200.0
    b.start(t)
    b.end(t)
    b.start(t + 1)
    b.detect(t + 1, latency_s=0)
    r = compute_goodput(b.events)
    (inc,) = r.incidents
    assert r.start_ts <= inc.fault_ts <= inc.detected_ts <= r.end_ts
    assert _recoveries(r) == [(to_us(inc.fault_ts), to_us(r.end_ts))]
