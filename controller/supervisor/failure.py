"""The failure pipeline: detect -> collect flight-recorder dumps -> stop -> blame -> quarantine ->
restart decision -> backoff -> relaunch; and entering the control-plane pause.

Blame is `controller.supervisor.blame.blame` (the one ladder); whether and when to relaunch is
`controller.supervisor.restart.restart_decision`. Both return their reason, which lands in the log.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from controller.supervisor import loss, restart
from controller.supervisor.actions import CollectDumps, SetTimer, StopAttempt
from controller.supervisor.attempt import Failure
from controller.supervisor.blame import BlameMethod, blame
from controller.supervisor.events import DumpsCollected, StopRequested
from controller.supervisor.pool import OUT_OF_SERVICE
from controller.supervisor.states import RunState
from runwarden.v1 import common_pb2
from runwarden.v1 import events_pb2 as E

if TYPE_CHECKING:
    from controller.supervisor.machine import Supervisor


def begin(sv: Supervisor, f: Failure, *, latency: float) -> None:
    """A failure of the running attempt (or a planned stop) was detected: collect dumps, or stop."""
    sv.failure = f
    loss.flush_replay(sv)  # the attempt's replay comparisons so far, before it ends
    loss.flush_record(sv)  # and its losses' durable copy (a controller restart may follow)
    if not f.planned:
        sv.log(
            E.EVENT_KIND_DETECTION,
            f.reason,
            detection=E.DetectionDetail(
                detector=f.detector,
                nodes=f.nodes,
                ranks=f.ranks,
                latency_s=max(0.0, latency),
                reason=f.reason,
            ),
        )
    live = sv.live_nodes()
    if sv.cfg.collect_dumps and f.dumps and not f.planned and not f.control_plane and live:
        sv.state = RunState.COLLECTING
        sv.deadline = sv.now + sv.cfg.dump_timeout_s
        sv.emit(CollectDumps(attempt=sv.attempt, nodes=tuple(live), timeout_s=sv.cfg.dump_timeout_s))
        sv.emit(SetTimer(key="dumps", at=sv.deadline))
    else:
        stop(sv)


def on_dumps(sv: Supervisor, ev: DumpsCollected) -> None:
    """COLLECTING: the flight recorder answered."""
    if ev.attempt != sv.attempt or sv.failure is None:
        return
    sv.failure.verdict = ev.verdict
    stop(sv)


def on_tick_collecting(sv: Supervisor) -> None:
    if sv.now >= sv.deadline:
        stop(sv)


def on_tick_stopping(sv: Supervisor) -> None:
    if sv.now >= sv.deadline:
        decide(sv)


def on_tick_backoff(sv: Supervisor) -> None:
    if sv.now >= sv.deadline:
        sv.state = RunState.WAITING_NODES


def stop(sv: Supervisor) -> None:
    assert sv.failure is not None
    f = sv.failure
    live = sv.live_nodes()
    sv.state = RunState.STOPPING
    sv.cur.awaiting_exit = set(live)
    if not live:
        decide(sv)
        return
    # A planned stop lets the trainer finish its step, save and commit: as long as the longest
    # legitimate barrier (a synchronous save), not the short grace a failed attempt gets.
    grace = max(sv.cfg.stop_grace_s, sv.cfg.checkpoint_barrier_s) if f.planned else sv.cfg.stop_grace_s
    sv.deadline = sv.now + grace + sv.cfg.stop_margin_s
    sv.emit(
        StopAttempt(attempt=sv.attempt, nodes=tuple(live), grace_s=grace, planned=f.planned, reason=f.reason)
    )
    sv.emit(SetTimer(key="stop", at=sv.deadline))


def maybe_stopped(sv: Supervisor, node: str) -> None:
    sv.cur.awaiting_exit.discard(node)
    if not sv.cur.awaiting_exit:
        decide(sv)


def _exit_summary(sv: Supervisor, f: Failure) -> None:
    a = sv.cur
    labels: dict[str, int] = {}
    for n in a.node_step:
        label = a.exited.get(n, "lost" if not sv.pool.nodes[n].alive else "no exit confirmed")
        labels[label] = labels.get(label, 0) + 1
    summary = ", ".join(f"{k} x{v}" for k, v in sorted(labels.items()))
    sv.log(
        E.EVENT_KIND_EXIT,
        f"attempt {sv.attempt} ended on {len(a.node_step)} nodes: {summary}",
        exit=E.ExitDetail(
            classification="planned_stop" if f.planned else "control_plane" if f.control_plane else "stopped"
        ),
    )


def _to_quarantine(sv: Supervisor, f: Failure) -> list[tuple[str, str, list[common_pb2.Evidence]]]:
    """Blame the stopped attempt (logged), and name who is quarantined for it and why."""
    a = sv.cur
    out: list[tuple[str, str, list[common_pb2.Evidence]]] = []
    if not f.planned and not f.control_plane:
        evidence = {n: sv.pool.evidence_since(n, a.launched_at) for n in a.node_step}
        b = blame(
            f.facts(),
            evidence=evidence,
            verdict=f.verdict,
            node_steps=a.node_step,
            fr_min_confidence=sv.cfg.fr_min_confidence,
        )
        sv.log(E.EVENT_KIND_ATTRIBUTION, b.reason, attribution=b.to_proto())
        if b.method.quarantines:
            out = [(s.node, f"{b.method.label}: {s.reason}", list(s.evidence)) for s in b.suspects]
        elif b.method is BlameMethod.FIRST_EXIT and f.first_exit is not None:
            steps = sv.offences.setdefault(f.first_exit, set())
            steps.add(f.step)
            if len(steps) >= sv.cfg.repeat_offender_count:
                out = [
                    (
                        f.first_exit,
                        f"first to exit at {len(steps)} different steps ({sorted(steps)}) with no "
                        "hardware evidence",
                        [],
                    )
                ]
    if not f.control_plane:
        out += [
            (n, "persistent straggler (quarantined at restart)", [])
            for n in sorted(a.straggler_nodes)
            if n in a.node_step
        ]
    return out


def decide(sv: Supervisor) -> None:
    """The attempt is stopped: blame, quarantine, crash loop, budget, backoff; then relaunch."""
    assert sv.failure is not None
    f = sv.failure
    _exit_summary(sv, f)
    seen: set[str] = set()
    for n, why, evs in _to_quarantine(sv, f):
        if n not in seen and sv.pool.get(n).state not in OUT_OF_SERVICE:
            seen.add(n)
            sv.quarantine(n, why, evidence=evs)
    sv.cur.straggler_nodes.clear()
    sv.release_slots()
    if sv.end_after_stop or not f.relaunch:
        sv.finish(RunState.STOPPED, "stopped", f"stopped on request: {f.reason}")
        return
    ran = sv.now - sv.cur.launched_at
    decision = restart.restart_decision(
        sv.cfg,
        sv.history,
        now=sv.now,
        label=f.label,
        step=f.step,
        suspects_quarantined=bool(seen),
        planned=f.planned,
        control_plane=f.control_plane,
        attempt_ran_s=ran,
    )
    restart.record(
        sv.cfg,
        sv.history,
        decision,
        now=sv.now,
        label=f.label,
        step=f.step,
        suspects_quarantined=bool(seen),
        attempt_ran_s=ran,
    )
    match decision:
        case restart.CrashLoop(reason=reason):
            sv.page(f"crash loop: {f.label} at step {f.step} {sv.history.loop_count} times with no suspect")
            sv.finish(RunState.CRASH_LOOP, "crash_loop", reason)
        case restart.BudgetExhausted(reason=reason, page=page):
            sv.page(page)
            sv.finish(RunState.BUDGET_EXHAUSTED, "budget_exhausted", reason)
        case restart.Relaunch(delay=delay, reason=reason):
            begin_backoff(sv, delay, reason)


def begin_backoff(sv: Supervisor, delay: float, reason: str) -> None:
    sv.log(E.EVENT_KIND_RESTART, reason)
    sv.failure = None
    sv.state = RunState.BACKOFF
    sv.deadline = sv.now + delay
    if delay <= 0:
        sv.state = RunState.WAITING_NODES
    else:
        sv.emit(SetTimer(key="backoff", at=sv.deadline))


def enter_control_plane(sv: Supervisor, *, etcd_lost: bool, reason: str) -> None:
    """Any live state -> CONTROL_PLANE: blind until the store is listed again; nothing is quarantined."""
    if sv.state is RunState.CONTROL_PLANE:
        sv.cp_etcd_lost = sv.cp_etcd_lost or etcd_lost
        return
    sv.cp_prev = sv.state
    sv.cp_etcd_lost = etcd_lost
    if sv.failure is not None:
        sv.failure.control_plane = True
    sv.state = RunState.CONTROL_PLANE
    sv.deadline = sv.now + sv.cfg.control_plane_grace_s
    sv.log(E.EVENT_KIND_CONTROL_PLANE, reason + "; waiting to reconcile")
    if not etcd_lost:
        sv.emit(SetTimer(key="control_plane", at=sv.deadline))


def log_stop_request(sv: Supervisor, ev: StopRequested) -> None:
    what = "stop and relaunch" if ev.relaunch else "stop the run"
    sv.log(
        E.EVENT_KIND_STOP_REQUEST,
        f"planned stop requested ({ev.reason}): {what}; nothing is quarantined",
        stop=E.StopDetail(reason=ev.reason, requested_by=ev.requested_by),
    )


def on_stop_request(sv: Supervisor, ev: StopRequested) -> None:
    """RUNNING: finish the step, save, commit, exit 0 (the planned-stop path of this pipeline)."""
    log_stop_request(sv, ev)
    begin(
        sv,
        Failure(
            detector=E.DETECTOR_UNSPECIFIED,
            nodes=[],
            step=sv.job_step,
            planned=True,
            relaunch=ev.relaunch,
            reason=f"planned stop: {ev.reason}",
        ),
        latency=0.0,
    )


def deliver_pending_stop(sv: Supervisor) -> None:
    """A stop request held during a control-plane pause reaches the attempt once one runs."""
    if sv.pending_stop is not None and sv.state is RunState.RUNNING:
        held, sv.pending_stop = sv.pending_stop, None
        on_stop_request(sv, held)
