"""The state machine's contract: the graph is data, illegal moves raise, the core is deterministic and
imports no I/O, and its decisions carry their reasons."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from controller.supervisor import machine, restart, table, transitions
from controller.supervisor.actions import CollectDumps, Launch, PersistCheckpoint, RunPreflight
from controller.supervisor.blame import FlightRecorderVerdict
from controller.supervisor.events import (
    ActionFailed,
    AttemptExited,
    CheckpointCommitted,
    DumpsCollected,
    NodeLost,
)
from controller.supervisor.policy import SupervisorConfig
from controller.supervisor.states import IllegalTransition, RunState, TransitionError
from runwarden.v1 import events_pb2 as E
from tests.supervisor.harness import Driver

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "controller" / "supervisor"


def fast(**kw: object) -> SupervisorConfig:
    return SupervisorConfig(hang_timeout_floor_s=10.0, startup_timeout_s=60.0, **kw)  # test knobs


def test_the_docstring_diagram_is_generated_from_the_table() -> None:
    doc = table.__doc__ or ""
    assert table.diagram() in doc, (
        "controller/supervisor/table.py's diagram drifted from TABLE: paste table.diagram() into the docstring"
    )


def test_every_table_move_is_an_edge_and_every_state_has_a_row() -> None:
    assert set(machine.TABLE) == set(RunState)
    for s, row in machine.TABLE.items():
        for rule in row.values():
            assert all((s, t) in machine.EDGES for t in rule.to if t is not s)


def test_an_unknown_pair_raises_naming_both_before_anything_changes() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.start(2)

    class Bogus:
        pass

    before = (d.sup.state, d.sup.attempt, len(d.actions))
    with pytest.raises(TransitionError, match=r"Bogus.*RUNNING"):
        d.send(Bogus())  # deliberately not an Event
    assert (d.sup.state, d.sup.attempt, len(d.actions)) == before


def test_a_move_the_table_does_not_allow_is_refused() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.start(2)
    with pytest.raises(IllegalTransition, match="RUNNING -> PREFLIGHT"):
        transitions.resume_preflight(d.sup)  # a running attempt is never preflighted again
    with pytest.raises(IllegalTransition, match="RUNNING -> CRASH_LOOP"):
        transitions.finish(
            d.sup, RunState.CRASH_LOOP, "crash_loop", "a test"
        )  # only a stopped attempt's decision ends the run
    assert d.sup.state is RunState.RUNNING


def _script() -> str:
    """A run with every kind of failure, its batches rendered (entries and actions, in order)."""
    d = Driver(cfg=fast(kill_stragglers_mid_run=True), nodes=3)
    d.start(5)
    d.steps(0, 12)
    d.send(AttemptExited(node="n2", attempt=1, exit_code=1))
    d.send(DumpsCollected(attempt=1, verdict=FlightRecorderVerdict()))
    d.exit_all(code=1)
    d.advance(5)
    d.answer_preflight()
    d.steps(0, 8)
    d.send(NodeLost(node=d.running_nodes()[0]))
    d.exit_all(code=-15)
    d.advance(30)
    d.answer_preflight()
    d.steps(0, 30, compute={d.running_nodes()[1]: 3.0})
    d.advance(60)
    return "\n".join(repr(a) for a in d.actions)


def _random_runs(runs: int = 25, length: int = 60) -> str:
    """Random event sequences (the property tests' operations, drawn from fixed seeds), rendered."""
    import random

    from tests.supervisor.test_properties import NODES, apply, cfg

    def op(rng: random.Random) -> tuple[object, ...]:
        node = rng.choice(NODES)
        return rng.choice([
            ("join", node), ("lose", node), ("steps", rng.randint(1, 6)), ("crash", node, rng.choice([1, -9])),
            ("exit_all", rng.choice([0, 1, -15])), ("commit",), ("stop", rng.random() < 0.5),
            ("dumps", rng.choice([None, node])), ("preflight_all", rng.choice([None, node])),
            ("advance", rng.choice([0.5, 3.0, 11.0, 40.0])), ("evidence", node), ("op_quarantine", node),
            ("op_release", node), ("cp_lost",), ("cp_restored",), ("fail_launch", rng.choice([None, node]), True),
            ("fail_preflight", node, rng.random() < 0.5), ("fail_dumps",),
        ])  # fmt: skip

    out = []
    for seed in range(runs):
        rng = random.Random(seed)
        d = Driver(cfg=cfg(), nodes=3)
        d.add_nodes(4, start=0)
        committed: list[int] = []
        for _ in range(length):
            apply(d, op(rng), committed)
        out += [repr(a) for a in d.actions]
    return "\n".join(out)


def test_the_same_events_give_the_same_batches_under_two_hash_seeds() -> None:
    code = "from tests.supervisor.test_machine import _script, _random_runs; print(_script()); print(_random_runs())"
    outs = []
    for seed in ("1", "31337"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.append(
            subprocess.run(
                [sys.executable, "-c", code],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                check=True,
                timeout=120,
            ).stdout
        )
    assert outs[0] == outs[1] and len(outs[0].splitlines()) > 1000


FORBIDDEN_DIRECT = {"grpc", "pyetcd", "threading", "socket", "time", "subprocess", "os", "asyncio", "random"}
FORBIDDEN_PACKAGES = (
    "controller.live",
    "controller.api",
    "controller.ctl",
    "controller.backends",
    "controller.sim",
    "controller.goodput",
    "runwarden.store",
    "nodeagent",
    "preflight",
)


def test_the_supervisor_package_imports_no_io() -> None:
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for name in names:
                assert name.split(".")[0] not in FORBIDDEN_DIRECT, f"{path.name} imports {name}"
                assert not name.startswith(FORBIDDEN_PACKAGES), f"{path.name} imports {name}"
    # and nothing below it pulls a daemon module or a network client in
    code = (
        "import sys, importlib, pkgutil, controller.supervisor as p\n"
        "for m in pkgutil.iter_modules(p.__path__): importlib.import_module('controller.supervisor.' + m.name)\n"
        "print('\\n'.join(sorted(sys.modules)))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    bad = [m for m in loaded if m.split(".")[0] in ("grpc", "pyetcd") or m.startswith(FORBIDDEN_PACKAGES)]
    assert not bad, bad


def _decide(
    cfg: SupervisorConfig,
    h: restart.RestartHistory,
    *,
    now: float,
    label: str,
    step: int,
    quarantined: tuple[str, ...] = (),
    node_evidence: bool = False,
    planned: bool = False,
    ran_s: float = 10.0,
    resume_step: int = -1,
    record: bool = True,
) -> restart.RestartDecision:
    sig = restart.Signature(label=label, resume_step=resume_step, step=step)
    d = restart.restart_decision(
        cfg,
        h,
        now=now,
        signature=sig,
        suspects_quarantined=bool(quarantined),
        node_evidence=node_evidence,
        planned=planned,
        control_plane=False,
        attempt_ran_s=ran_s,
    )
    if record:
        restart.record(
            cfg,
            h,
            d,
            now=now,
            signature=sig,
            suspects_quarantined=bool(quarantined),
            quarantined=[(n, now) for n in quarantined if not node_evidence],
            node_evidence=node_evidence,
            attempt_ran_s=ran_s,
        )
    return d


def test_restart_decisions_carry_their_reason() -> None:
    cfg = SupervisorConfig(restart_budget=2, crash_loop_count=3, backoff_base_s=1.0, backoff_max_s=4.0)
    h = restart.RestartHistory()
    d1 = _decide(cfg, h, now=100.0, label="exit:1", step=7)
    assert d1 == restart.Relaunch(
        delay=0.0,
        counted=True,
        reason="restart 1/2 after exit:1; backoff 0s (a first failure: nothing is learned by waiting)",
    )
    d2 = _decide(cfg, h, now=101.0, label="exit:1", step=7)
    assert isinstance(d2, restart.Relaunch) and d2.reason == "restart 2/2 after exit:1; backoff 1s (storm x2)"
    d3 = _decide(cfg, h, now=102.0, label="exit:1", step=7, record=False)
    assert d3 == restart.CrashLoop(
        reason="crash loop: the same failure (exit:1) at step 7 3 times, the run never past it (resumed from "
        "step -1), with no suspect; stopped and paged"
    )
    d4 = _decide(cfg, h, now=102.0, label="exit:1", step=9, record=False)
    assert (
        isinstance(d4, restart.BudgetExhausted)
        and d4.reason == "restart budget of 2 exhausted; not relaunching"
    )
    assert "2 restarts within 86400s" in d4.page
    planned = _decide(cfg, h, now=102.0, label="exit:1", step=7, planned=True, record=False)
    assert planned == restart.Relaunch(
        delay=0.0, counted=False, reason="planned stop: relaunching without consuming the restart budget"
    )


def test_the_same_failure_is_a_crash_loop_whoever_was_blamed() -> None:
    """A bug at one step rotates its victim: three hangs at step 44/45, each blamed (and quarantined)
    on a different node, are one crash loop, and its suspects are named for release."""
    cfg = SupervisorConfig(crash_loop_count=3)
    h = restart.RestartHistory()
    assert isinstance(
        _decide(cfg, h, now=100.0, label="hang", step=44, quarantined=("n1",)), restart.Relaunch
    )
    assert isinstance(
        _decide(cfg, h, now=200.0, label="hang", step=45, quarantined=("n2",), resume_step=40),
        restart.Relaunch,
    )
    assert [(c.count, c.suspects) for c in h.loops] == [(2, [("n1", 100.0), ("n2", 200.0)])]
    d3 = _decide(cfg, h, now=300.0, label="hang", step=44, quarantined=("n3",), resume_step=40, record=False)
    assert isinstance(d3, restart.CrashLoop) and "blamed on 2 different node(s) (n1, n2)" in d3.reason


def test_what_is_not_the_same_failure() -> None:
    cfg = SupervisorConfig(crash_loop_count=3)
    same = restart.Signature(label="hang", resume_step=40, step=45, slack=10)
    assert same.matches(
        restart.Signature(label="hang", resume_step=-1, step=44)
    )  # the step, give or take one
    assert same.matches(restart.Signature(label="hang", resume_step=40, step=52, slack=10))  # same resume
    assert not same.matches(restart.Signature(label="hang", resume_step=30, step=52, slack=10))
    assert not same.matches(restart.Signature(label="exit:1", resume_step=40, step=45, slack=10))
    # evidence about a node (a fatal Xid, a lost lease) is the node's fault: no hit of the candidate,
    # and no reset either; nor is a failure before the step, or a planned stop
    h = restart.RestartHistory()
    for t in (100.0, 200.0):
        _decide(cfg, h, now=t, label="hang", step=45, quarantined=(f"n{t:.0f}",))
    _decide(cfg, h, now=300.0, label="hang", step=45, quarantined=("n9",), node_evidence=True)
    _decide(cfg, h, now=310.0, label="exit:1", step=41)
    _decide(cfg, h, now=320.0, label="hang", step=45, planned=True)
    assert [(c.signature.label, c.count) for c in h.loops] == [("hang", 2), ("exit:1", 1)]
    assert [n for n, _ in h.loops[0].suspects] == ["n100", "n200"]
    assert isinstance(_decide(cfg, h, now=400.0, label="hang", step=45, record=False), restart.CrashLoop)
    # a failure past the step means the run got past it: that candidate is no loop
    _decide(cfg, h, now=500.0, label="exit:1", step=60)
    assert [(c.signature.label, c.signature.step) for c in h.loops] == [("exit:1", 60)]
    h.got_past(200)  # a commit at 200
    assert h.loops == []


def test_backoff_taxes_storms_not_independent_faults() -> None:
    """Unrelated faults whose nodes were quarantined relaunch at once; a failure with no node out
    of the run, or the same kind of failure again, backs off exponentially; a long attempt ends
    the storm."""
    cfg = SupervisorConfig(backoff_base_s=1.0, backoff_max_s=8.0, backoff_reset_s=300.0, crash_loop_count=99)
    h = restart.RestartHistory()
    now = 100.0

    def fail(label: str, quarantined: bool, ran_s: float = 10.0) -> float:
        nonlocal now
        now += ran_s
        d = _decide(
            cfg,
            h,
            now=now,
            label=label,
            step=int(now),
            quarantined=("x",) if quarantined else (),
            ran_s=ran_s,
        )
        assert isinstance(d, restart.Relaunch), d
        return d.delay

    # The demo's faults, one after another on different nodes, each node quarantined: no waiting.
    assert [fail(f, True) for f in ("hang", "node_lost", "straggler", "evidence")] == [0.0] * 4
    # A crash with nobody to blame starts a storm (its first failure waits for nothing); the same
    # kind again (blamed or not) grows it.
    assert [fail("exit:1", False), fail("exit:1", True), fail("exit:1", False)] == [0.0, 1.0, 2.0]
    assert [fail("hang", False) for _ in range(3)] == [4.0, 8.0, 8.0]  # capped at backoff_max_s
    # A different fault whose node is out ends the storm ...
    assert fail("evidence", True) == 0.0
    # ... and so does an attempt that ran backoff_reset_s.
    assert fail("exit:1", False) == 0.0 and fail("exit:1", False) == 1.0
    assert fail("exit:1", False, ran_s=400.0) == 0.0


def test_a_launch_never_carried_out_is_relaunched_at_once_with_a_new_attempt() -> None:
    d = Driver(cfg=fast(), nodes=2)
    launch = d.start(3)
    out = d.send(ActionFailed(action=launch, temporary=False, reason="attempt record CAS refused"))
    msgs = [e.message for e in d.events(actions=out)]
    assert any("attempt 1 was not launched" in m and "CAS refused" in m for m in msgs), msgs
    assert d.sup.state == RunState.BACKOFF and not d.events(E.EVENT_KIND_QUARANTINE)
    assert d.sup.status(d.now).restarts_used == 0
    d.advance(1.0)
    d.answer_preflight()
    assert d.launches[-1].attempt == 2 and d.launches[-1].rendezvous_id == "demo-2"


def test_an_append_that_failed_before_a_launch_is_the_same_reaction() -> None:
    d = Driver(cfg=fast(), nodes=2)
    launch = d.start(2)
    d.send(ActionFailed(action=launch, temporary=True, reason="event log append failed: ENOSPC"))
    assert d.sup.state == RunState.BACKOFF
    d.advance(1.0)
    d.answer_preflight()
    again = d.launches[-1]
    d.send(ActionFailed(action=again, temporary=True, reason="event log append failed: ENOSPC"))
    assert d.timers.get("backoff") == pytest.approx(d.now + 2.0), (
        "the backoff grows while launches keep failing"
    )


def test_a_node_preflight_cannot_reach_or_run_on_is_replaced_not_quarantined() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.add_nodes(3)
    req = d.preflight_out.pop(0)
    out = d.send(
        ActionFailed(action=req, node="n1", temporary=True, reason="UNAVAILABLE: connection refused")
    )
    assert not d.events(E.EVENT_KIND_QUARANTINE) and d.sup.pool.get("n1").preflight_rejections == 0
    assert "n1" not in d.sup.current_nodes and "n3" in d.sup.current_nodes
    assert any("not quarantined" in e.message for e in d.events(actions=out))
    # a preflight the agent refuses (busy with a burn-in, a certificate it does not accept) says
    # nothing about the node either: left out of the attempt, never quarantined (issue 26)
    permanent = d.preflight_out[-1]
    out = d.send(
        ActionFailed(
            action=permanent, node="n3", temporary=False, reason="ABORTED: a preflight is already running"
        )
    )
    assert not d.events(E.EVENT_KIND_QUARANTINE) and d.sup.pool.get("n3").failure_times == []
    assert any("left out" in e.message and "no strike" in e.message for e in d.events(actions=out))


def test_dumps_that_cannot_be_collected_stop_the_attempt_at_once() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.start(2)
    d.steps(0, 5)
    d.send(AttemptExited(node="n1", attempt=1, exit_code=1))
    collect = d.of(CollectDumps)[-1]
    assert d.sup.state == RunState.COLLECTING
    d.send(ActionFailed(action=collect, temporary=True, reason="agent unreachable"))
    assert d.sup.state == RunState.STOPPING


def test_a_stale_action_failure_is_only_recorded() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.start(2)
    old = Launch(run="demo", attempt=0, rendezvous_id="demo-0", nodes=(), resume_step=-1)
    d.send(ActionFailed(action=old, temporary=False, reason="late"))
    assert d.sup.state == RunState.RUNNING


def test_a_preflight_that_never_left_is_sent_again_not_held_against_the_nodes() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.add_nodes(3)
    req = d.preflight_out.pop(0)
    d.send(ActionFailed(action=req, temporary=True, reason="event log append failed: ENOSPC"))
    assert set(d.sup.current_nodes) == {"n1", "n2"} and not d.events(E.EVENT_KIND_QUARANTINE)
    out = d.advance(1.0)
    again = [a for a in out if isinstance(a, RunPreflight)]
    assert [r.nodes for r in again] == [("n1", "n2")]
    d.answer_preflight()
    assert d.sup.state == RunState.RUNNING and d.launches[-1].attempt == 1


def test_the_core_stays_small_and_controller_holds_only_packages() -> None:
    for path in sorted(PACKAGE.glob("*.py")):
        text = path.read_text()
        assert len(text.splitlines()) <= 600, f"{path.name} is over 600 lines"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                span = (node.end_lineno or node.lineno) - node.lineno + 1
                assert span <= 400, f"{path.name}: class {node.name} is {span} lines"
    controller = ROOT / "controller"
    loose = sorted(p.name for p in controller.iterdir() if p.is_file() and p.name != "__init__.py")
    assert not loose, f"controller/ should hold only package folders: {loose}"
    assert all(
        (p / "__init__.py").exists() for p in controller.iterdir() if p.is_dir() and p.name != "__pycache__"
    )


def test_a_commit_of_a_superseded_attempt_is_never_a_resume_point() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.start(3)
    d.steps(0, 10)
    out = d.send(CheckpointCommitted(step=10, attempt=1, path="/ckpt/step_10"))
    assert [a.step for a in d.of(PersistCheckpoint, out)] == [10] and d.sup.latest_committed == 10
    d.send(NodeLost(node="n1"))  # a partition: attempt 2 replaces attempt 1 without n1
    d.send(DumpsCollected(attempt=1, verdict=FlightRecorderVerdict()))
    d.exit_all(code=-15)
    d.advance(5)
    d.answer_preflight()
    assert d.launches[-1].attempt == 2 and d.launches[-1].resume_step == 10
    # n1's ranks, still running until they fence themselves, commit step 20 of attempt 1
    out = d.send(CheckpointCommitted(step=20, attempt=1, path="/ckpt/step_20"))
    assert not d.of(PersistCheckpoint, out) and d.sup.latest_committed == 10
    assert any("superseded" in e.message for e in d.events(actions=out))
    d.steps(0, 3)
    d.send(AttemptExited(node=d.running_nodes()[0], attempt=2, exit_code=1))
    d.send(DumpsCollected(attempt=2, verdict=FlightRecorderVerdict()))
    d.exit_all(code=1)
    d.advance(5)
    d.answer_preflight()
    assert d.launches[-1].resume_step == 10
