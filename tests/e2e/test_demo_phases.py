"""The demo's phase table (examples/demo.py `recoveries`): each phase from the event log, measured
from the attempt that trained again, with the launch path of its nodes. No cluster: an event log."""

from __future__ import annotations

import math

from examples.demo import Injection, recoveries
from runwarden.v1 import events_pb2 as E


def _ev(
    seq: int,
    ts: float,
    kind: E.EventKind.ValueType,
    attempt: int = 1,
    nodes: list[E.NodeLaunchPath] | None = None,
) -> E.Event:
    ev = E.Event(seq=seq, ts=ts, run="demo", attempt=attempt, kind=kind)
    if nodes is not None:
        ev.workers_started.nodes.extend(nodes)
    return ev


def test_phases_follow_the_attempt_that_trained_again() -> None:
    paths = [E.NodeLaunchPath(node=n, path="warm") for n in ("n1", "n2")]
    events = [
        _ev(10, 100.5, E.EVENT_KIND_DETECTION),
        _ev(11, 101.0, E.EVENT_KIND_ATTRIBUTION),
        _ev(12, 101.5, E.EVENT_KIND_RESTART),
        _ev(13, 103.0, E.EVENT_KIND_LAUNCH, attempt=2),  # failed to start: not the one that trained
        _ev(14, 106.0, E.EVENT_KIND_LAUNCH, attempt=3),
        _ev(15, 106.1, E.EVENT_KIND_WORKERS_STARTED, attempt=3, nodes=paths),
        _ev(16, 106.5, E.EVENT_KIND_LOAD_DONE, attempt=3),
        _ev(17, 106.75, E.EVENT_KIND_FIRST_STEP, attempt=3),
    ]
    inj = Injection(fault="crash", node="n2", at=100.0, after_seq=9, recovered=True)
    (r,) = recoveries(events, [inj])
    ph = r.phases()
    assert ph == {
        "detect": 0.5,
        "verdict": 1.0,
        "launch": 4.5,
        "load": 0.5,
        "first step": 0.25,
        "total": 6.75,
    }
    assert r.launch is not None and r.launch.attempt == 2  # the first launch, as before
    assert r.trained_launch is not None and r.trained_launch.attempt == 3
    assert r.launch_path == "warm"


def test_a_recovery_without_a_first_step_has_no_phases_past_the_verdict() -> None:
    events = [_ev(10, 100.5, E.EVENT_KIND_DETECTION), _ev(11, 101.0, E.EVENT_KIND_ATTRIBUTION)]
    inj = Injection(fault="hang", node="n2", at=100.0, after_seq=9, recovered=False)
    (r,) = recoveries(events, [inj])
    ph = r.phases()
    assert ph["detect"] == 0.5 and ph["verdict"] == 0.5  # no RESTART: the blame is the verdict
    assert all(math.isnan(ph[k]) for k in ("launch", "load", "first step", "total"))
    assert r.launch_path == "-"
