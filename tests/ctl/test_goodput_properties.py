"""Property: for any event sequence, every microsecond of allocated time has exactly one label."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from controller.goodput.report import compute_goodput

from .logbuild import LogBuilder

ACTIONS = [
    "preflight",
    "launch",
    "load_done",
    "first_step",
    "commit",
    "detect",
    "attribute",
    "attribute_none",
    "spare",
    "quarantine",
    "stop",
    "exit",
    "end",
    "start",
]


@st.composite
def event_logs(draw: st.DrawFn) -> LogBuilder:
    b = LogBuilder()
    t = 1_764_547_200.0 + draw(st.floats(min_value=0, max_value=1e6))
    b.start(t)
    for _ in range(draw(st.integers(min_value=0, max_value=40))):
        t += draw(st.floats(min_value=0, max_value=5000, allow_nan=False))
        action = draw(st.sampled_from(ACTIONS))
        if action == "commit":
            b.commit(t, step=b.step + 10, save_s=draw(st.floats(min_value=0, max_value=200)))
        elif action == "detect":
            b.detect(t, latency_s=draw(st.floats(min_value=0, max_value=300)))
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
