"""The failure pipeline: detect -> collect flight-recorder dumps -> stop -> blame -> quarantine ->
restart decision -> backoff -> relaunch (a planned stop enters it through stops.py).

Blame is `controller.supervisor.blame.blame` (the one ladder); whether and when to relaunch is
`controller.supervisor.restart.restart_decision`. Both return their reason, which lands in the log.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from controller.supervisor import loss, memory, quarantine, restart, stats, transitions
from controller.supervisor.actions import StopAttempt
from controller.supervisor.attempt import Failure
from controller.supervisor.blame import BlameMethod, blame
from controller.supervisor.events import DumpsCollected
from controller.supervisor.pool import OUT_OF_SERVICE, PoolState
from controller.supervisor.states import RunState
from runwarden.v1 import common_pb2
from runwarden.v1 import events_pb2 as E

if TYPE_CHECKING:
    from controller.supervisor.run import Run


def begin(sv: Run, f: Failure, *, latency: float) -> None:
    """A failure of the running attempt (or a planned stop) was detected: collect dumps, or stop."""
    sv.failure = f
    loss.flush_replay(sv)  # the attempt's replay comparisons so far, before it ends
    loss.flush_record(sv)  # and its losses' durable copy (a controller restart may follow)
    if not f.planned and not f.no_fault:
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
    unplanned = not f.planned and not f.control_plane and not f.no_fault and live
    if unplanned and sv.cfg.collect_dumps and f.dumps:
        transitions.become_collecting(sv, live)
    elif unplanned and f.hold_s > 0:
        transitions.become_collecting(sv, live, hold_s=f.hold_s)
    else:
        stop(sv)


def begin_no_fault(
    sv: Run, kind: E.EventKind.ValueType, reason: str, *, nodes: list[str], label: str
) -> None:
    """A failure of no one's (launch paths that disagree, a launch that never reached a node):
    logged as `kind`, stopped at once without dumps, relaunched at once with nothing counted."""
    sv.log(kind, reason)
    f = Failure(
        detector=E.DETECTOR_UNSPECIFIED,
        reason=reason,
        nodes=nodes,
        step=sv.job_step,
        label=label,
        no_fault=True,
        dumps=False,
    )
    begin(sv, f, latency=0.0)


def on_dumps(sv: Run, ev: DumpsCollected) -> None:
    """COLLECTING: the flight recorder answered."""
    if ev.attempt != sv.attempt or sv.failure is None:
        return
    sv.failure.verdict = ev.verdict
    stop(sv)


def on_tick_collecting(sv: Run) -> None:
    if sv.now >= sv.deadline:
        stop(sv)


def on_tick_stopping(sv: Run) -> None:
    if sv.now >= sv.deadline:
        decide(sv)


def on_tick_backoff(sv: Run) -> None:
    if sv.now >= sv.deadline:
        transitions.become_waiting(sv)


def stop(sv: Run) -> None:
    assert sv.failure is not None
    f = sv.failure
    live = sv.live_nodes()
    # A planned stop lets the trainer finish its step, save and commit: as long as the longest
    # legitimate barrier (a synchronous save), not the short grace a failed attempt gets.
    grace = max(sv.cfg.stop_grace_s, sv.cfg.checkpoint_barrier_s) if f.planned else sv.cfg.stop_grace_s
    transitions.become_stopping(
        sv,
        set(live),
        wait_s=grace + sv.cfg.stop_margin_s,
        stop=StopAttempt(
            attempt=sv.attempt, nodes=tuple(live), grace_s=grace, planned=f.planned, reason=f.reason
        ),
    )
    if not live or _relaunch_without_exits(f):
        decide(sv)


def _relaunch_without_exits(f: Failure) -> bool:
    """A lost node's failure is decided as the stop begins: its blame is the lease (the ladder's
    heartbeat rung), its signature needs no exit, and the ranks' reports are in. The relaunch does
    not wait for the survivors' exits: the executor launches on each node once that node's stop has
    answered (its old ranks gone, its parked group back), and the attempt record fences the rest. At
    2,048 hosts waiting for the slowest of 2,047 stop answers cost ~2.5 s of the relaunch."""
    return (
        f.detector == E.DETECTOR_NODE_LOST
        and not f.dumps
        and not (f.planned or f.control_plane or f.no_fault)
        and f.relaunch
    )


def maybe_stopped(sv: Run, node: str) -> None:
    sv.cur.awaiting_exit.discard(node)
    if not sv.cur.awaiting_exit:
        decide(sv)


def _exit_summary(sv: Run, f: Failure) -> None:
    a = sv.cur
    labels: dict[str, int] = {}
    pending = "stopping" if a.awaiting_exit else "no exit confirmed"  # decided as the stop begins
    for n in a.node_step:
        label = a.exited.get(n, "lost" if not sv.pool.nodes[n].alive else pending)
        labels[label] = labels.get(label, 0) + 1
    summary = ", ".join(f"{k} x{v}" for k, v in sorted(labels.items()))
    sv.log(
        E.EVENT_KIND_EXIT,
        f"attempt {sv.attempt} ended on {len(a.node_step)} nodes: {summary}",
        exit=E.ExitDetail(
            classification="planned_stop" if f.planned else "control_plane" if f.control_plane else "stopped"
        ),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class _Suspect:
    node: str
    reason: str
    evidence: list[common_pb2.Evidence]
    blamed: bool  # blamed for this failure (else a straggler flagged earlier in the attempt)


def _distinct_steps(steps: set[int], slack: int) -> int:
    """How many different steps: those within `slack` (at least 1) of the one before are the same
    step seen late (a crash's step is the last progress its node wrote)."""
    count, last = 0, None
    for s in sorted(steps):
        if last is None or s - last > max(1, slack):
            count += 1
        last = s
    return count


def _to_quarantine(sv: Run, f: Failure, slack: int) -> tuple[list[_Suspect], bool, bool]:
    """Blame the stopped attempt (logged), and name who is quarantined for it and why; whether the
    blame rests on evidence about a node (hardware evidence, a lost lease); and whether the first
    exit relapsed at this step and is moved out to tell its fault from the job's."""
    a = sv.cur
    out: list[_Suspect] = []
    relapse = False
    node_evidence = f.detector == E.DETECTOR_NODE_LOST
    if not f.planned and not f.control_plane and not f.no_fault:
        evidence = {n: sv.pool.evidence_since(n, a.launched_at) for n in a.node_step}
        b = blame(
            f.facts(),
            evidence=evidence,
            verdict=f.verdict,
            node_steps=a.node_step,
            fr_min_confidence=sv.cfg.fr_min_confidence,
            node_ranks=_node_ranks(sv),
        )
        sv.log(E.EVENT_KIND_ATTRIBUTION, b.reason, attribution=b.to_proto())
        node_evidence = node_evidence or b.method is BlameMethod.HARDWARE
        if b.method.quarantines:
            out = [
                _Suspect(
                    node=s.node,
                    reason=f"{b.method.label}: {s.reason}",
                    evidence=list(s.evidence),
                    blamed=True,
                )
                for s in b.suspects
            ]
        elif b.method is BlameMethod.FIRST_EXIT and f.first_exit is not None:
            steps = sv.offences.setdefault(f.first_exit, set())
            again = any(abs(s - f.step) <= slack for s in steps)
            steps.add(f.step)
            if _distinct_steps(steps, slack) >= sv.cfg.repeat_offender_count:
                out = [
                    _Suspect(
                        node=f.first_exit,
                        reason=f"first to exit at {len(steps)} different steps ({sorted(steps)}) with no "
                        "hardware evidence",
                        evidence=[],
                        blamed=True,
                    )
                ]
            elif again and sv.cfg.repeat_offender_count <= 2:  # its second first exit, at one step
                relapse = True
                # The same node first out at the same step again: a node's fault (a relapse) or the
                # job's on that node's ranks look alike. Moved out, the next attempt tells them apart:
                # a node's fault does not recur; the job's does, on the spare, and completes the crash
                # loop, which gives this node back without the strike (a loop's victim). The fleet
                # simulator's Llama-3 replay ended a run as a crash loop on a relapsing node without it.
                out = [
                    _Suspect(
                        node=f.first_exit,
                        reason=f"first to exit at step {f.step} again, with no hardware evidence: moved "
                        "out, so the next attempt tells its fault from the job's",
                        evidence=[],
                        blamed=True,
                    )
                ]
    if (
        not f.control_plane and not f.planned and not f.no_fault
    ):  # a planned stop quarantines nothing, as it says
        out += [
            _Suspect(
                node=n, reason="persistent straggler (quarantined at restart)", evidence=[], blamed=False
            )
            for n in sorted(a.straggler_nodes)
            if n in a.node_step
        ]
    return out, node_evidence, relapse


# The step a failure is seen at can trail the one it happened at by a progress report (the agents
# write one per interval, 1 s by default): a few seconds of steps, after the same commit, is the
# same step. Never more than the checkpoint interval: a bad node failing at random steps after the
# same commit is not a loop.
REPORT_LAG_S = 5.0


def _node_ranks(sv: Run) -> dict[str, range]:
    """Each node's global ranks in the attempt: node rank order, its local ranks each."""
    out, first = {}, 0
    for n in sv.cur.nodes:
        count = max(1, sv.pool.get(n).local_ranks)
        out[n] = range(first, first + count)
        first += count
    return out


def _signature(sv: Run, f: Failure) -> restart.Signature:
    """This failure as the crash-loop rule compares it (restart.Signature)."""
    newest = sorted(sv.committed)[-2:]
    interval = newest[1] - newest[0] if len(newest) == 2 else 0
    step_s = stats.median(sv.step_times) if sv.step_times else 0.0
    lag = math.ceil(REPORT_LAG_S / step_s) if step_s > 0 else 0
    return restart.Signature(
        label=f.label, resume_step=sv.cur.resume_step, step=f.step, slack=min(interval, lag)
    )


def decide(sv: Run) -> None:
    """The attempt is stopped: blame, quarantine, crash loop, budget, backoff; then relaunch."""
    assert sv.failure is not None
    f = sv.failure
    _exit_summary(sv, f)
    sv.decided_attempt = sv.attempt
    seen: set[str] = set()
    victims: list[tuple[str, float]] = []  # quarantined without evidence about the node
    signature = _signature(sv, f)
    suspects, node_evidence, relapse = _to_quarantine(sv, f, signature.slack)
    # The failure that completes a crash loop quarantines none of its suspects: the verdict would
    # give them back at once. Whether a suspect is a victim is the blame's rung, not whether it
    # carries an Evidence record: the flight recorder's verdict always attaches one (a rank that
    # never arrived says nothing about its node; a software hang rotates it).
    # Nor does a relapse that another node's failure made the loop's hit: the node first out at this
    # step's previous failure, first out again after an earlier hit by someone else, is moved out
    # first (at 16,384 hosts relapsing nodes fail a few steps after each resume: two of them ended the
    # simulator's run as a crash loop). A victim that rotates back later is no relapse, and the same
    # node twice from the start is the loop when `crash_loop_count` is 2; the next hit completes it.
    cand = sv.history.candidate(signature)
    relapse = relapse and cand is not None and cand.count >= 2 and cand.last_first_exit == f.first_exit
    looping = (
        not (f.planned or f.control_plane or node_evidence or relapse)
        and restart.loop_count_with(sv.history, signature) >= sv.cfg.crash_loop_count
    )
    for s in suspects:
        out = s.node in seen or sv.pool.get(s.node).state in OUT_OF_SERVICE
        if looping and s.blamed:
            continue
        if not out and quarantine.quarantine(sv, s.node, s.reason, evidence=s.evidence):
            seen.add(s.node)
            if s.blamed and not node_evidence:
                victims.append((s.node, sv.now))
    sv.cur.straggler_nodes.clear()
    sv.release_slots()
    if sv.end_after_stop or not f.relaunch:
        transitions.finish(sv, RunState.STOPPED, "stopped", f"stopped on request: {f.reason}")
        return
    if f.no_fault:  # no failure of the job or a node: nothing counted, nothing to wait for
        begin_backoff(sv, 0.0, f"{f.reason}: relaunching at once; no restart consumed")
        return
    ran = sv.now - sv.cur.launched_at
    decision = restart.restart_decision(
        sv.cfg,
        sv.history,
        now=sv.now,
        signature=signature,
        suspects_quarantined=bool(seen),
        node_evidence=node_evidence,
        planned=f.planned,
        control_plane=f.control_plane,
        attempt_ran_s=ran,
        relapse=relapse,
    )
    restart.record(
        sv.cfg,
        sv.history,
        decision,
        now=sv.now,
        signature=signature,
        suspects_quarantined=bool(seen),
        quarantined=victims,
        node_evidence=node_evidence,
        attempt_ran_s=ran,
        first_exit=f.first_exit,
    )
    memory.persist(sv)
    match decision:
        case restart.CrashLoop(reason=reason):
            _crash_loop(sv, f, signature, reason, also_suspected=[s.node for s in suspects if s.blamed])
        case restart.BudgetExhausted(reason=reason, page=page):
            sv.page(page)
            transitions.finish(sv, RunState.BUDGET_EXHAUSTED, "budget_exhausted", reason)
        case restart.Relaunch(delay=delay, reason=reason):
            begin_backoff(sv, delay, reason)


def _crash_loop(
    sv: Run, f: Failure, signature: restart.Signature, reason: str, also_suspected: list[str]
) -> None:
    """The run stops and pages once; the nodes quarantined for the loop were its victims: they go
    back to the pool without the strike and without a burn-in."""
    cand = sv.history.candidate(signature)
    suspects = cand.suspects if cand is not None else []
    count = cand.count if cand is not None else sv.cfg.crash_loop_count
    struck = [n for n, at in suspects if release_victim(sv, n, at, f"victim of the crash loop ({f.label})")]
    named = sorted({*(n for n, _ in suspects), *(n for n in also_suspected if n)})
    sv.page(
        f"crash loop: {f.label} at step {f.step}, {count} times, the run never past it (resumed from step "
        f"{sv.cur.resume_step}); "
        + (f"suspected {', '.join(named)}; " if named else "no node was suspected; ")
        + (
            f"their strikes struck off, back in service: {', '.join(struck)}"
            if struck
            else "no node to release"
        )
        + "; a software or data fault: fix the job, then `controller run` resumes from the latest commit"
    )
    if cand is not None:
        sv.history.forget(cand)
    memory.persist(sv)
    transitions.finish(sv, RunState.CRASH_LOOP, "crash_loop", reason)


def release_victim(sv: Run, node: str, strike_at: float, reason: str) -> bool:
    """Give back a node quarantined for a fault that was not its own: its strike is struck off and
    it is a spare again at once (no burn-in: nothing was wrong with it), unless something else keeps
    it out (an operator's hold, fatal evidence, other recent failures). Whether it is back in
    service without the strike."""
    p = sv.pool.get(node)
    was_out = p.state in OUT_OF_SERVICE
    if not sv.pool.strike_off(node, strike_at, sv.now):
        return False
    sv.persist(node)
    if not was_out:
        return True  # its burn-in already returned it: only the strike was left to strike off
    if p.state is not PoolState.SPARE:
        return False
    sv.forget_burn_in(node)  # its burn-in, soak and retry decide nothing now
    sv.log(
        E.EVENT_KIND_RELEASE,
        f"{node} returns to the spare pool without a strike: {reason}",
        release=E.ReleaseDetail(node=node, reason=reason),
    )
    sv.emit_release(node, reason)
    return True


def begin_backoff(sv: Run, delay: float, reason: str) -> None:
    sv.log(E.EVENT_KIND_RESTART, reason)
    sv.failure = None
    transitions.become_backoff(sv, delay)
