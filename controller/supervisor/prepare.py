"""Rules for preparing an attempt: WAITING_NODES -> PREFLIGHT -> launch.

The slots (node per node rank) are filled with the previous attempt's usable nodes first, then
spares by reputation, then the queue; every new node is preflighted; a rejection quarantines it and
does not consume an attempt; the launch gate admits only nodes that are alive and assigned now.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

from controller.supervisor import loss, quarantine, snapshots, stats, stops, transitions
from controller.supervisor.actions import (
    AllocateFromQueue,
    Launch,
    MeasureBandwidth,
    NodeRank,
    RunPreflight,
    SetTimer,
    TakeSpare,
)
from controller.supervisor.attempt import Attempt
from controller.supervisor.events import BandwidthMeasured, PreflightResult
from controller.supervisor.pool import PoolState
from controller.supervisor.states import RunState
from runwarden.evidence import kind_name
from runwarden.v1 import common_pb2, events_pb2
from runwarden.v1 import events_pb2 as E

if TYPE_CHECKING:
    from controller.supervisor.run import Run


def detail(ev: PreflightResult) -> events_pb2.PreflightDetail:
    return E.PreflightDetail(
        node=ev.node,
        summary=common_pb2.PreflightSummary(
            mode=ev.mode,
            passed=ev.passed,
            fail_count=len(ev.failed_checks),
            duration_s=ev.duration_s,
            failed_checks=list(ev.failed_checks),
            inconclusive_count=len(ev.inconclusive_checks),
            inconclusive_checks=list(ev.inconclusive_checks),
        ),
    )


def try_start(sv: Run) -> None:
    """WAITING_NODES (state-triggered): pick nodes (previous attempt's first, then spares); else ask the queue."""
    need = sv.plan.nodes
    free = sv.pool.free_count()
    if free < need:
        if sv.waiting_since is None:
            sv.waiting_since = sv.now
            sv.waiting_paged = False
            if sv.attempt == 0 and sv.cfg.queue_wait_s > 0:  # the first nodes are still joining
                sv.emit(SetTimer(key="queue", at=sv.now + sv.cfg.queue_wait_s))
            if sv.cfg.waiting_page_s > 0:
                sv.emit(SetTimer(key="waiting", at=sv.now + sv.cfg.waiting_page_s))
        if sv.attempt == 0 and sv.now < sv.waiting_since + sv.cfg.queue_wait_s:
            return
        ask = need - free - sv.queue.outstanding
        if ask > 0:
            _ask_queue(sv, ask, f"need {need} nodes, {free} usable spares: asking the queue for {ask}")
        return
    sv.waiting_since = None
    prev = sv.preparing.prev_slots[:need]
    sv.preparing.slots = [None] * need
    sv.preparing.empty_slots = need
    sv.preparing.unreachable = set()
    sv.preparing.preflight_retried = set()
    sv.preparing.vouched = set()
    sv.preparing.preflight_resend = set()
    sv.preparing.gate_pending = sv.preparing.gate_passed = None
    for rank, n in enumerate(prev):
        if sv.pool.usable(n) and sv.pool.get(n).state is PoolState.SPARE:
            sv.preparing.slots[rank] = n
            sv.preparing.empty_slots -= 1
            sv.pool.assign(n)
    sv.preparing.vacated = {r: n for r, n in enumerate(prev) if sv.preparing.slots[r] != n}
    transitions.become_preflight(sv)
    fill_slots(sv, also=[n for n in sv.preparing.slots if n is not None])


def _ask_queue(sv: Run, count: int, reason: str) -> None:
    if sv.now < sv.queue.retry_at:
        return  # the queue refused the last ask: asked again at the retry timer, not at every event
    sv.queue.outstanding += count
    sv.log(E.EVENT_KIND_ALLOCATE, reason)
    sv.emit(AllocateFromQueue(count=count, reason=reason))


def fill_slots(sv: Run, also: Iterable[str] = ()) -> None:
    """Fill empty slots from spares (queue as fallback), preflight new nodes; launch when done."""
    empty = [r for r, n in enumerate(sv.preparing.slots) if n is None] if sv.preparing.empty_slots else []
    picked = sv.pool.pick_spares(len(empty), sv.now, exclude=sv.preparing.unreachable)
    new = list(also)
    for rank, n in zip(empty, picked, strict=False):
        sv.preparing.slots[rank] = n
        sv.preparing.empty_slots -= 1
        sv.pool.assign(n)
        new.append(n)
        replaces = sv.preparing.vacated.get(rank, "")
        if replaces:
            source = "queue" if n in sv.queue.nodes else "spare"
            sv.log(
                E.EVENT_KIND_SPARE_TAKEN,
                f"{n} ({source}, {sv.pool.record_note(n, sv.now)}) replaces {replaces} as node rank {rank}",
                spare=E.SpareDetail(node=n, replaces=replaces, source=source),
            )
            sv.emit(TakeSpare(node=n, replaces=replaces))
        sv.queue.nodes.discard(n)
    still_empty = len(empty) - len(picked)
    if still_empty > sv.queue.outstanding:
        ask = still_empty - sv.queue.outstanding
        _ask_queue(sv, ask, f"no spare left for {still_empty} node ranks: asking the queue for {ask}")
    checked = _sort_by_preflight(sv, new) if new else []
    if checked:
        sv.preparing.pending_preflight.update(checked)
        sv.emit(
            RunPreflight(
                nodes=tuple(checked),
                mode=sv.cfg.preflight_mode,
                purpose="attempt",
                timeout_s=sv.cfg.preflight_timeout_s,
            )
        )
        sv.preparing.preflight_deadline = sv.now + sv.cfg.preflight_timeout_s
        sv.emit(SetTimer(key="preflight", at=sv.preparing.preflight_deadline))
    maybe_launch(sv)


def vouched_for(sv: Run, name: str) -> tuple[bool, str]:
    """Whether `name` joins the attempt being prepared without a preflight, and why (the log's words):
    a passing preflight (or burn-in) or healthy training in the attempt before, within
    `preflight_max_age_s`, on its current lease, with no evidence about it since."""
    max_age = sv.cfg.preflight_max_age_s
    if max_age <= 0:
        return False, "preflight_max_age_s = 0: every node before every attempt"
    node = sv.pool.get(name)
    seen: list[tuple[float, str]] = []
    if node.checked_at is not None:
        seen.append((node.checked_at, "passed its preflight"))
    trained = sv.cur.node_advanced_at.get(name)  # sv.cur is the attempt before, until the launch
    if trained is not None:
        seen.append((trained, "trained healthily"))
    if not seen:
        return False, "no passing preflight on record"
    at, what = max(seen)
    if node.registered_at is not None and node.registered_at > at:
        return False, f"registered a new lease since it {what.split(' ')[0]}"
    age = sv.now - at
    if age > max_age:
        return False, f"{what} {age:.0f}s ago, longer than preflight_max_age_s ({max_age:g}s)"
    if node.evidence_at is not None and node.evidence_at >= at:
        kinds = ", ".join(sorted({kind_name(e.kind) for e in sv.pool.evidence_since(name, at)})) or "?"
        return False, f"evidence since it {what.split(' ')[0]}: {kinds}"
    return True, f"{what} {age:.1f}s ago, no evidence since"


def _sort_by_preflight(sv: Run, nodes: list[str]) -> list[str]:
    """The nodes to preflight now; the others are vouched for. The event log says which and why."""
    checked: list[E.NodeReason] = []
    vouched: list[E.NodeReason] = []
    for n in nodes:
        skip, why = vouched_for(sv, n)
        (vouched if skip else checked).append(E.NodeReason(node=n, reason=why))
        if skip:
            sv.preparing.vouched.add(n)
    parts = []
    if checked:
        parts.append("preflight " + _reasons(sv, checked))
    if vouched:
        parts.append("no preflight for " + _reasons(sv, vouched))
    sv.log(
        E.EVENT_KIND_PREFLIGHT_PLAN,
        f"before attempt {sv.next_attempt}: " + "; ".join(parts),
        preflight_plan=E.PreflightPlanDetail(checked=checked, vouched=vouched),
    )
    return [r.node for r in checked]


# A preflight plan's message names each node with its reason up to this many nodes.
NAMED = 16


def _reasons(sv: Run, rows: list[E.NodeReason]) -> str:
    """Each node with its reason; beyond NAMED nodes, one line per kind of reason (its numbers
    aside): how many, one example and the first names. The event's detail keeps every node's: at
    16,384 hosts the full text doubled a 1 MB entry before every relaunch."""
    if len(rows) <= NAMED:
        return "; ".join(f"{r.node} ({r.reason})" for r in rows)
    kinds: dict[str, list[E.NodeReason]] = {}
    for r in rows:
        kinds.setdefault(re.sub(r"[0-9]+(\.[0-9]+)?", "#", r.reason), []).append(r)
    return "; ".join(
        f"{len(rs)} nodes like {rs[0].node} ({rs[0].reason}): {sv.names([r.node for r in rs])}"
        if len(rs) > 1
        else f"{rs[0].node} ({rs[0].reason})"
        for rs in kinds.values()
    )


def drop_from_slots(sv: Run, node: str, reason: str, *, logged: bool = False) -> None:
    """Take `node` out of the attempt being prepared and refill its slot; `reason` reaches the log
    here unless the caller's own entry already said it (`logged`)."""
    rank = sv.preparing.slots.index(node)
    sv.preparing.slots[rank] = None
    sv.preparing.empty_slots += 1
    sv.preparing.vacated.setdefault(rank, node)
    sv.preparing.pending_preflight.discard(node)
    sv.preparing.gate_pending = None  # the set changed: the gate measures the new one
    sv.pool.unassign(node)
    if not logged:
        sv.log(
            E.EVENT_KIND_PREFLIGHT_RESULT,
            f"{node} leaves node rank {rank} of attempt {sv.next_attempt}: {reason}",
            preflight=E.PreflightDetail(node=node),
        )
    fill_slots(sv)


def on_attempt_preflight(sv: Run, ev: PreflightResult) -> None:
    sv.preparing.pending_preflight.discard(ev.node)
    if ev.passed:
        sv.pool.get(ev.node).checked_at = sv.now
        maybe_launch(sv)
        return
    if ev.inconclusive:
        # A check that could not tell (it measured the host's load, or ran past its budget) is no
        # verdict on the node: asked once more, then left out of this attempt, never quarantined.
        checks = ", ".join(ev.inconclusive_checks)
        if ev.node in sv.preparing.preflight_retried:
            leave_out(sv, ev.node, f"preflight ({ev.mode}) inconclusive twice: {checks}")
            return
        sv.preparing.preflight_retried.add(ev.node)
        sv.preparing.pending_preflight.add(ev.node)
        sv.log(
            E.EVENT_KIND_PREFLIGHT_RESULT,
            f"{ev.node}: preflight ({ev.mode}) inconclusive ({checks}); asking once more",
            preflight=detail(ev),
        )
        sv.emit(
            RunPreflight(
                nodes=(ev.node,), mode=ev.mode, purpose="attempt", timeout_s=sv.cfg.preflight_timeout_s
            )
        )
        sv.preparing.preflight_deadline = max(
            sv.preparing.preflight_deadline, sv.now + sv.cfg.preflight_timeout_s
        )
        sv.emit(SetTimer(key="preflight", at=sv.preparing.preflight_deadline))
        return
    reason = f"preflight ({ev.mode}) failed: {', '.join(ev.failed_checks) or 'no check named'}"
    reject(sv, ev.node, reason, f"{ev.node} rejected before attempt {sv.next_attempt}: {reason}", detail(ev))


def reject(
    sv: Run,
    node: str,
    reason: str,
    message: str,
    preflight: events_pb2.PreflightDetail,
    *,
    counted: bool = True,
) -> None:
    """Quarantine a node that failed its attempt preflight; the attempt is not consumed. A node the
    blast radius keeps in service is only left out of this attempt."""
    sv.preparing.pending_preflight.discard(node)
    sv.log(
        E.EVENT_KIND_PREFLIGHT_RESULT,
        f"{message}; quarantined, the attempt is not consumed",
        preflight=preflight,
    )
    if counted:
        sv.pool.get(node).preflight_rejections += 1
    if not quarantine.quarantine(sv, node, reason):
        sv.preparing.unreachable.add(node)
    drop_from_slots(sv, node, reason, logged=True)


def leave_out(sv: Run, node: str, reason: str) -> None:
    """Leave `node` out of the attempt being prepared without a judgement of it (no quarantine, no
    strike): the answer that did not come may be the controller's or the network's fault."""
    sv.preparing.pending_preflight.discard(node)
    sv.preparing.unreachable.add(node)
    sv.log(
        E.EVENT_KIND_PREFLIGHT_RESULT,
        f"{node} left out of attempt {sv.next_attempt}: {reason}; inconclusive, so no quarantine and no "
        "strike (it stays a spare)",
        preflight=E.PreflightDetail(node=node),
    )
    drop_from_slots(sv, node, reason, logged=True)


def on_tick(sv: Run) -> None:
    """PREFLIGHT: requests that never left are sent again; a node that did not answer within the
    preflight timeout is rejected."""
    if sv.preparing.empty_slots > sv.queue.outstanding and sv.queue.retry_at and sv.now >= sv.queue.retry_at:
        fill_slots(sv)  # the queue refused an earlier ask: ask again (after its backoff)
    resend = sorted(n for n in sv.preparing.preflight_resend if n in sv.preparing.pending_preflight)
    sv.preparing.preflight_resend.clear()
    if resend:
        sv.emit(
            RunPreflight(
                nodes=tuple(resend),
                mode=sv.cfg.preflight_mode,
                purpose="attempt",
                timeout_s=sv.cfg.preflight_timeout_s,
            )
        )
        sv.emit(SetTimer(key="preflight", at=sv.preparing.preflight_deadline))
    if sv.preparing.gate_pending is not None and sv.now >= sv.preparing.gate_deadline:
        gate_unanswered(sv, f"no answer within its budget of {sv.cfg.bandwidth_gate_timeout_s:g}s")
        return
    if sv.now < sv.preparing.preflight_deadline:
        return
    if not sv.preparing.pending_preflight:
        if sv.preparing.empty_slots and sv.preparing.unreachable:
            # No spare came meanwhile: the nodes left out get another chance (a late answer or a
            # one-off RPC failure is no reason to keep a node out of the run for good).
            sv.log(
                E.EVENT_KIND_PREFLIGHT_RESULT,
                f"{sv.preparing.empty_slots} node rank(s) still empty: asking {sv.names(sorted(sv.preparing.unreachable))} again",
                preflight=E.PreflightDetail(),
            )
            sv.preparing.unreachable = set()
            fill_slots(sv)
        return
    reason = f"no preflight answer within {sv.cfg.preflight_timeout_s:g}s"
    for n in sorted(sv.preparing.pending_preflight):
        if n in sv.preparing.pending_preflight:  # (a refill below never adds a node that is already due)
            leave_out(sv, n, reason)
    if (
        sv.preparing.empty_slots and not sv.preparing.pending_preflight
    ):  # nobody to ask now: ask the left-out ones later
        sv.preparing.preflight_deadline = sv.now + sv.cfg.preflight_timeout_s
        sv.emit(SetTimer(key="preflight", at=sv.preparing.preflight_deadline))


def maybe_launch(sv: Run) -> None:
    if sv.state is not RunState.PREFLIGHT or sv.preparing.pending_preflight or sv.preparing.empty_slots:
        return
    for n in sv.preparing.slots:  # the gate: no launch ever includes a node that is not usable now
        p = sv.pool.get(n) if n is not None else None
        if p is not None and not (p.alive and p.state is PoolState.ASSIGNED):
            drop_from_slots(sv, p.name, f"{p.name} is no longer usable ({p.state.label})")
            return
    nodes = tuple(n for n in sv.preparing.slots if n is not None)
    if sv.cfg.bandwidth_gate and len(nodes) > 1 and sv.preparing.gate_passed != nodes:
        if (
            sv.preparing.gate_pending != nodes
        ):  # every node passed: measure the set before it pays for a launch
            sv.preparing.gate_pending = nodes
            sv.preparing.gate_deadline = sv.now + sv.cfg.bandwidth_gate_timeout_s
            sv.emit(MeasureBandwidth(nodes=nodes, timeout_s=sv.cfg.bandwidth_gate_timeout_s))
            sv.emit(SetTimer(key="bandwidth", at=sv.preparing.gate_deadline))
        return
    vouched = sum(1 for n in nodes if n in sv.preparing.vouched)
    sv.log(
        E.EVENT_KIND_PREFLIGHT_RESULT,
        f"all {len(nodes)} nodes passed {sv.cfg.preflight_mode} preflight"
        if not vouched
        else f"all {len(nodes)} nodes cleared: {len(nodes) - vouched} passed {sv.cfg.preflight_mode} "
        f"preflight now, {vouched} vouched for (a recent pass or healthy training, no evidence since)",
        preflight=E.PreflightDetail(
            summary=common_pb2.PreflightSummary(
                mode=sv.cfg.preflight_mode, passed=True, pass_count=len(nodes)
            )
        ),
    )
    launch(sv, nodes)


def on_bandwidth(sv: Run, ev: BandwidthMeasured) -> None:
    """PREFLIGHT: the gate's answer. A node well below the floor is quarantined and replaced."""
    if ev.nodes != sv.preparing.gate_pending:
        return  # for a node set no longer in play
    sv.preparing.gate_pending = None
    figures = dict(ev.per_node_gbps)
    values = sorted(figures.values())
    floor = sv.cfg.bandwidth_floor_gbps or (stats.median(values) if len(values) > 2 else 0.0)
    limit = sv.cfg.bandwidth_gate_ratio * floor
    slow = [n for n in ev.nodes if n in figures and figures[n] < limit]
    shown = ", ".join(f"{n} {figures[n]:.3g}" for n in ev.nodes if n in figures)
    basis = f"floor {floor:.3g} GB/s ({'configured' if sv.cfg.bandwidth_floor_gbps else 'median of the set'})"
    verdict = f"{', '.join(slow)} below {limit:.3g} GB/s" if slow else "every node above the limit"
    sv.log(
        E.EVENT_KIND_PREFLIGHT_RESULT,
        f"bandwidth gate on {len(ev.nodes)} nodes: set {ev.set_gbps:.3g} GB/s; best pair per node: {shown}; "
        f"{basis} x {sv.cfg.bandwidth_gate_ratio:g}: {verdict} ({ev.duration_s:.1f}s{'; ' + ev.detail if ev.detail else ''})",
        preflight=E.PreflightDetail(
            summary=common_pb2.PreflightSummary(
                mode="bandwidth",
                passed=not slow,
                fail_count=len(slow),
                duration_s=ev.duration_s,
                failed_checks=[f"bandwidth:{n}" for n in slow],
            )
        ),
    )
    if not slow:
        sv.preparing.gate_passed = ev.nodes
        maybe_launch(sv)
        return
    for n in slow:
        if n in sv.preparing.slots:
            reason = f"bandwidth gate: best pair {figures[n]:.3g} GB/s, below {limit:.3g} GB/s"
            if not quarantine.quarantine(sv, n, reason):
                sv.preparing.unreachable.add(n)
            drop_from_slots(sv, n, reason, logged=True)


def gate_unanswered(sv: Run, why: str) -> None:
    """The gate could not run (its budget ran out, the shell could not do it): launch without it."""
    nodes = sv.preparing.gate_pending
    if nodes is None:
        return
    sv.preparing.gate_pending = None
    sv.preparing.gate_passed = nodes
    sv.log(
        E.EVENT_KIND_PREFLIGHT_RESULT,
        f"bandwidth gate skipped: {why}; launching without it",
        preflight=E.PreflightDetail(summary=common_pb2.PreflightSummary(mode="bandwidth", passed=True)),
    )
    maybe_launch(sv)


def launch(sv: Run, nodes: tuple[str, ...]) -> None:
    sv.attempt = sv.next_attempt
    trained = (
        sv.cur.node_advanced_at
    )  # a node's last healthy training outlives an attempt it never stepped in
    cut = sv.losses.rollback_before
    commit = loss.resume_step(sv)  # applies a loss rollback's cut
    cold = not sv.went_cold.keys().isdisjoint(nodes) or sv.losses.reloaded_from_storage == commit
    candidates = [(sv.cur.number, sv.cur.snapshots)] if sv.cur.number else []
    if sv.cur.resume_snapshot and sv.resumed_snapshot is not None:
        candidates.append(sv.resumed_snapshot)  # its processes still hold the one it resumed from
    point = snapshots.choose(candidates, nodes, commit, cut=cut, cold=cold, went_cold=sv.went_cold.keys())
    sv.resumed_snapshot = next((c for c in candidates if c[0] == point.snapshot_attempt), None)
    sv.cur = Attempt.launched(
        sv.attempt,
        nodes,
        resume_step=point.step,
        now=sv.now,
        straggler_window=sv.cfg.straggler_window,
    )
    sv.cur.resume_snapshot = point.snapshot_attempt
    sv.cur.node_advanced_at.update((n, t) for n, t in trained.items() if n in sv.cur.node_step)
    sv.failure = None
    sv.preparing.prev_slots = list(nodes)
    sv.job_step = sv.cur.resume_step
    rdzv = f"{sv.plan.run}-{sv.attempt}"
    if point.snapshot_attempt:
        resume = f"in-memory snapshot of step {point.step}"
    else:
        resume = f"committed step {point.step}" if point.step >= 0 else "scratch"
    sv.log(
        E.EVENT_KIND_LAUNCH,
        f"attempt {sv.attempt} ({rdzv}) on {len(nodes)} nodes from {resume}"
        + (f" ({point.reason})" if point.reason else ""),
        launch=E.LaunchDetail(
            rendezvous_id=rdzv,
            nodes=nodes,
            resume_step=sv.cur.resume_step,
            resume_snapshot_attempt=point.snapshot_attempt,
            snapshot_reason=point.reason,
        ),
    )
    transitions.become_running(
        sv,
        hang_after_s=sv.cfg.startup_timeout_s,
        launch=Launch(
            run=sv.plan.run,
            attempt=sv.attempt,
            rendezvous_id=rdzv,
            nodes=tuple(NodeRank(node=n, node_rank=r) for r, n in enumerate(nodes)),
            resume_step=sv.cur.resume_step,
            cold=cold,
            resume_snapshot=point.snapshot_attempt,
            snapshot_interval_s=sv.cfg.snapshot_interval_s,
        ),
    )
    stops.deliver_pending_stop(sv)


def on_tick_waiting(sv: Run) -> None:
    """WAITING_NODES: a wait longer than `waiting_page_s` pages, once, and says so in the log."""
    since = sv.waiting_since
    if since is None or sv.waiting_paged or sv.cfg.waiting_page_s <= 0:
        return
    waited = sv.now - since
    if waited < sv.cfg.waiting_page_s:
        return
    sv.waiting_paged = True
    missing = max(0, sv.plan.nodes - sv.pool.free_count())
    asked = f"; {sv.queue.outstanding} asked of the queue" if sv.queue.outstanding else "; no queue to ask"
    sv.page(
        f"waiting for {missing} node{'s' if missing != 1 else ''} for {waited / 60:.0f} min "
        f"(need {sv.plan.nodes}, {sv.pool.free_count()} usable{asked})"
    )
