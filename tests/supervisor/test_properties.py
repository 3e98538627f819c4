"""Property tests: random event sequences never break the supervisor's invariants.

Invariants (issue 5): attempts never exceed the restart budget; no launch includes a quarantined
node; the resume step is always a committed one (the latest); attempt numbers strictly increase;
a stop request never quarantines. Also: handle() accepts every event in every state, every launched
node passed preflight since the previous launch, and every Launch/Quarantine is logged first.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.supervisor.actions import CollectDumps, Launch, Quarantine, Release
from controller.supervisor.blame import FlightRecorderVerdict, Suspect
from controller.supervisor.events import (
    ActionFailed,
    AttemptExited,
    CheckpointCommitted,
    ControlPlaneLost,
    ControlPlaneRestored,
    DumpsCollected,
    EvidenceObserved,
    NodeJoined,
    NodeLaunchPath,
    NodeLost,
    OperatorQuarantine,
    OperatorRelease,
    PreflightResult,
    StopRequested,
    StoreListed,
    Tick,
    WorkersStarted,
)
from controller.supervisor.policy import SupervisorConfig
from runwarden.v1 import common_pb2, events_pb2
from runwarden.v1 import events_pb2 as E
from tests.supervisor.harness import Driver

NODES = [f"n{i}" for i in range(7)]
BUDGET = 3
node = st.sampled_from(NODES)

ops = st.one_of(
    st.tuples(st.just("join"), node),
    st.tuples(st.just("lose"), node),
    st.tuples(st.just("steps"), st.integers(1, 6)),
    st.tuples(st.just("crash"), node, st.sampled_from([1, 3, -9, 137])),
    st.tuples(st.just("exit_all"), st.sampled_from([0, 1, -15])),
    st.tuples(st.just("commit")),
    st.tuples(st.just("stop"), st.booleans()),
    st.tuples(st.just("dumps"), st.one_of(st.none(), node)),
    st.tuples(st.just("preflight_all"), st.one_of(st.none(), node)),
    st.tuples(st.just("advance"), st.sampled_from([0.5, 3.0, 11.0, 40.0, 130.0])),
    st.tuples(st.just("evidence"), node),
    st.tuples(st.just("op_quarantine"), node),
    st.tuples(st.just("op_release"), node),
    st.tuples(st.just("cp_lost")),
    st.tuples(st.just("cp_restored")),
    st.tuples(st.just("stale_exit"), node),
    st.tuples(st.just("fail_launch"), st.one_of(st.none(), node), st.booleans()),
    st.tuples(st.just("fail_preflight"), node, st.booleans()),
    st.tuples(st.just("fail_dumps")),
    st.tuples(st.just("started"), st.booleans()),
)


def cfg() -> SupervisorConfig:
    return SupervisorConfig(
        restart_budget=BUDGET,
        restart_budget_window_s=0.0,
        backoff_base_s=1.0,
        backoff_max_s=4.0,
        dump_timeout_s=5.0,
        stop_grace_s=5.0,
        stop_margin_s=1.0,
        queue_wait_s=0.0,
        burn_in_passes=2,
        mass_expiry_min_nodes=3,
    )


def apply(d: Driver, op: tuple[Any, ...], committed: list[int]) -> None:
    kind = op[0]
    sup = d.sup
    if kind == "join":
        if not sup.pool.get(op[1]).alive:
            d.send(NodeJoined(node=op[1]))
    elif kind == "lose":
        if sup.pool.get(op[1]).alive:
            d.send(NodeLost(node=op[1]))
    elif kind == "steps":
        if sup.current_nodes:
            d.steps(sup.job_step + 1, sup.job_step + op[1])
    elif kind == "crash":
        d.send(AttemptExited(node=op[1], attempt=sup.attempt, exit_code=op[2], ended_at=d.now))
    elif kind == "exit_all":
        if sup.current_nodes:
            d.exit_all(code=op[1])
    elif kind == "commit":
        step = max(sup.job_step, 0)
        committed.append(step)
        d.send(CheckpointCommitted(step=step))
    elif kind == "stop":
        d.send(StopRequested(reason="test", relaunch=op[1]))
    elif kind == "dumps":
        suspects = (Suspect(node=op[1], confidence=0.9, reason="never reached"),) if op[1] else ()
        d.send(DumpsCollected(attempt=sup.attempt, verdict=FlightRecorderVerdict(suspects=suspects)))
    elif kind == "preflight_all":
        d.answer_preflight({op[1]: ("gpu.count",)} if op[1] else None)
    elif kind == "advance":
        d.advance(op[1])
    elif kind == "evidence":
        d.send(
            EvidenceObserved(
                evidence=common_pb2.Evidence(
                    node=op[1], kind=common_pb2.EVIDENCE_KIND_XID, xid=79, severity=common_pb2.SEVERITY_FATAL
                )
            )
        )
    elif kind == "op_quarantine":
        d.send(OperatorQuarantine(node=op[1], reason="test"))
    elif kind == "op_release":
        d.send(OperatorRelease(node=op[1], reason="test"))
    elif kind == "cp_lost":
        d.send(ControlPlaneLost())
    elif kind == "cp_restored":
        d.send(ControlPlaneRestored())
        alive = {n: 1 for n, p in sup.pool.nodes.items() if p.alive}
        d.send(
            StoreListed(
                alive=alive,
                attempt=sup.attempt,
                attempt_nodes=sup.current_nodes,
                committed_steps=tuple(committed),
            )
        )
    elif kind == "crash_running":
        if sup.current_nodes:
            victim = sup.current_nodes[op[1] % len(sup.current_nodes)]
            d.send(AttemptExited(node=victim, attempt=sup.attempt, exit_code=op[2], ended_at=d.now))
    elif kind == "stale_exit":
        d.send(AttemptExited(node=op[1], attempt=max(0, sup.attempt - 1), exit_code=1))
    elif kind == "started":
        if d.launches:  # the shell's answer to the last launch (late, for an older attempt, or now)
            last = d.launches[-1]
            paths = tuple(
                NodeLaunchPath(
                    node=nr.node, path="warm" if op[1] else "cold", detail="" if op[1] else "no parked group"
                )
                for nr in last.nodes
            )
            d.send(WorkersStarted(attempt=last.attempt, nodes=paths))
    elif kind == "fail_launch":
        if d.launches:  # the shell could not carry out the last launch (on one node, or at all)
            d.send(ActionFailed(action=d.launches[-1], node=op[1] or "", temporary=op[2], reason="test"))
    elif kind == "fail_preflight":
        req = next((r for r in reversed(d.preflight_out) if op[1] in r.nodes), None)
        if req is not None:
            d.preflight_out.remove(req)
            d.send(ActionFailed(action=req, node=op[1], temporary=op[2], reason="UNAVAILABLE"))
    elif kind == "fail_dumps":
        collects = d.of(CollectDumps)
        if collects:
            d.send(ActionFailed(action=collects[-1], temporary=True, reason="agent unreachable"))
    d.send(Tick())


class Recorder(Driver):
    """A Driver that also records, in action order, which nodes passed an attempt preflight (and
    when) and which got evidence about them."""

    def send(self, event: Any, now: float | None = None) -> list[Any]:
        out = super().send(event, now)
        at = len(self.actions) - len(out)
        if (
            isinstance(event, PreflightResult) and event.passed and event.mode == "quick"
        ):  # attempt or spare check, not burn-in
            self.actions.insert(at, _Passed(event.node, self.now))  # test marker
        elif isinstance(event, EvidenceObserved):
            self.actions.insert(at, _Evidence(event.evidence.node))  # test marker
        return out


class _Passed:
    __slots__ = ("at", "node")

    def __init__(self, node: str, at: float) -> None:
        self.node, self.at = node, at


class _Evidence:
    __slots__ = ("node",)

    def __init__(self, node: str) -> None:
        self.node = node


def check_preflight_before_launch(d: Driver) -> None:
    """Every launched node passed a preflight since the launch before, or was vouched for: it ran
    in the launch before or passed a preflight (or a whole burn-in: a superset of it, whose end is
    the node's release to the spare pool) within preflight_max_age_s, with no evidence since."""
    max_age = d.cfg.preflight_max_age_s
    passed_now: set[str] = set()  # since the last launch
    passed_at: dict[str, float] = {}
    evidence: set[str] = set()  # nodes with evidence since their last pass or launch
    before: set[str] = set()
    now = 0.0
    for a in d.actions:
        if isinstance(a, _Passed):
            passed_now.add(a.node)
            passed_at[a.node] = now = a.at
            evidence.discard(a.node)
        elif isinstance(a, Release) and "burn-in" in a.reason:
            passed_at[a.node] = now
            evidence.discard(a.node)
        elif isinstance(a, _Evidence):
            evidence.add(a.node)
        elif isinstance(a, E.Event):
            now = max(now, a.ts)
        elif isinstance(a, Launch):
            nodes = {nr.node for nr in a.nodes}
            for n in nodes - passed_now:
                fresh = n in before or (n in passed_at and now - passed_at[n] <= max_age)
                assert max_age > 0 and fresh and n not in evidence, (
                    f"attempt {a.attempt} launched {n} without a passed preflight or a vouch "
                    f"(ran before: {n in before}, evidence since: {n in evidence})"
                )
            evidence -= nodes
            passed_now = set()
            before = nodes


def check_all(d: Driver, committed: list[int]) -> None:
    actions = d.actions
    d.actions = [a for a in actions if not isinstance(a, _Passed)]
    try:
        check_core_invariants(d, committed)
    finally:
        d.actions = actions
    check_preflight_before_launch(d)


def check_core_invariants(d: Driver, committed: list[int]) -> None:
    out_quarantined: set[str] = set()
    last_attempt = 0
    failure_restarts = 0
    prev_end: str | None = None
    commits: list[int] = []
    for i, a in enumerate(d.actions):
        if isinstance(a, Quarantine):
            out_quarantined.add(a.node)
            prior = d.actions[:i]
            assert any(
                isinstance(b, events_pb2.Event)
                and b.kind == events_pb2.EVENT_KIND_QUARANTINE
                and b.quarantine.node == a.node
                for b in prior
            ), "quarantine not logged first"
        elif isinstance(a, Release):
            out_quarantined.discard(a.node)
        elif isinstance(a, events_pb2.Event):
            ev = a
            if ev.kind == events_pb2.EVENT_KIND_EXIT and ev.exit.classification in (
                "stopped",
                "planned_stop",
                "control_plane",
            ):
                prev_end = ev.exit.classification
            elif ev.kind == events_pb2.EVENT_KIND_CHECKPOINT_COMMIT:
                commits.append(ev.step)
        elif isinstance(a, Launch):
            nodes = {nr.node for nr in a.nodes}
            assert not nodes & out_quarantined, (
                f"launch {a.attempt} includes quarantined {nodes & out_quarantined}"
            )
            assert a.attempt > last_attempt, "attempt numbers must strictly increase"
            assert a.rendezvous_id == f"demo-{a.attempt}"
            assert any(
                isinstance(b, events_pb2.Event)
                and b.kind == events_pb2.EVENT_KIND_LAUNCH
                and b.launch.rendezvous_id == a.rendezvous_id
                for b in d.actions[:i]
            ), "launch not logged first"
            last_attempt = a.attempt
            assert a.resume_step == (max(commits) if commits else -1), "resume from the latest committed step"
            assert a.resume_step == -1 or a.resume_step in committed
            if prev_end == "stopped":
                failure_restarts += 1
            assert failure_restarts <= BUDGET, "restart budget exceeded"
            prev_end = None


# Failures are more frequent than anything else, so that budgets, crash loops and relaunches are reached.
busy_ops = st.one_of(
    ops,
    st.tuples(st.just("crash"), node, st.just(1)),
    st.tuples(st.just("advance"), st.just(11.0)),
    st.tuples(st.just("steps"), st.integers(1, 3)),
    st.tuples(st.just("lose"), node),
    st.tuples(st.just("join"), node),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(busy_ops, min_size=1, max_size=60), st.booleans())
def test_random_event_sequences_keep_the_invariants(seq: list[tuple[Any, ...]], auto_preflight: bool) -> None:
    d = Recorder(cfg=cfg(), nodes=3)
    d.add_nodes(4, start=0)
    committed: list[int] = []
    for op in seq:
        apply(d, op, committed)
        if auto_preflight:  # the agents answer at once (burn-in too), as on a healthy fleet
            d.answer_preflight()
    check_all(d, committed)


planned_ops = st.one_of(
    st.tuples(st.just("join"), node),
    st.tuples(st.just("steps"), st.integers(1, 4)),
    st.tuples(st.just("commit")),
    st.tuples(st.just("stop"), st.booleans()),
    st.tuples(st.just("exit_all"), st.just(0)),
    st.tuples(st.just("preflight_all"), st.none()),
    st.tuples(st.just("advance"), st.sampled_from([0.5, 3.0])),
)


@settings(max_examples=100, deadline=None)
@given(st.lists(planned_ops, min_size=1, max_size=30))
def test_stop_requests_never_quarantine(seq: list[tuple[Any, ...]]) -> None:
    d = Recorder(cfg=cfg(), nodes=3)
    d.add_nodes(5, start=0)
    d.answer_preflight()
    committed: list[int] = []
    for op in seq:
        apply(d, op, committed)
    assert not d.of(Quarantine)
    assert not d.events(events_pb2.EVENT_KIND_QUARANTINE)
    check_all(d, committed)


storm_ops = st.one_of(
    st.tuples(st.just("crash_running"), st.integers(0, 3), st.sampled_from([1, -9])),
    st.tuples(st.just("crash_running"), st.integers(0, 3), st.sampled_from([1, -9])),
    st.tuples(st.just("crash"), node, st.sampled_from([1, -9])),
    st.tuples(st.just("advance"), st.sampled_from([3.0, 11.0])),
    st.tuples(st.just("steps"), st.integers(1, 5)),
    st.tuples(st.just("commit")),
    st.tuples(st.just("lose"), node),
    st.tuples(st.just("join"), node),
    st.tuples(st.just("dumps"), st.one_of(st.none(), node)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(storm_ops, min_size=10, max_size=80))
def test_failure_storms_stay_within_the_budget(seq: list[tuple[Any, ...]]) -> None:
    """Many failures, agents answering preflight at once: relaunches happen, the budget holds."""
    d = Recorder(cfg=cfg(), nodes=2)
    d.add_nodes(7, start=0)
    committed: list[int] = []
    for op in seq:
        apply(d, op, committed)
        d.answer_preflight()
    check_all(d, committed)
    assert len(d.of(Launch)) <= 1 + BUDGET + sum(  # planned stops and control-plane faults are free
        1
        for e in d.events(events_pb2.EVENT_KIND_EXIT)
        if e.exit.classification in ("planned_stop", "control_plane")
    )
