"""Rules for pool-level events, in every state: nodes joining and leaving, evidence, checkpoints,
operators, burn-in. The table (controller/supervisor/machine.py) says which state runs which rule."""

from __future__ import annotations

from typing import TYPE_CHECKING

from controller.supervisor import (
    burn_in,
    detectors,
    failure,
    memory,
    prepare,
    quarantine,
    soak,
    spare_checks,
    stops,
    transitions,
)
from controller.supervisor.actions import PersistCheckpoint
from controller.supervisor.attempt import Failure
from controller.supervisor.events import (
    BandwidthMeasured,
    CheckpointCommitted,
    CheckpointFailed,
    EvidenceObserved,
    NodeClaimed,
    NodeDraining,
    NodeJoined,
    NodeLost,
    OperatorQuarantine,
    OperatorRelease,
    PreflightResult,
    StopRequested,
)
from controller.supervisor.policy import burn_in_passes_text
from controller.supervisor.pool import PoolState
from controller.supervisor.states import RunState
from runwarden.evidence import is_fatal, kind_name
from runwarden.v1 import common_pb2
from runwarden.v1 import events_pb2 as E

if TYPE_CHECKING:
    from controller.supervisor.run import Run


def on_joined(sv: Run, ev: NodeJoined) -> None:
    first_seen = sv.pool.get(ev.node).known_since is None
    node = sv.pool.set_alive(ev.node, True, ev.local_ranks, now=sv.now)
    if first_seen:
        sv.persist(ev.node)  # its known history starts now, across controller restarts
    if sv.queue.outstanding > 0 and node.state is PoolState.SPARE:
        sv.queue.outstanding -= 1
        sv.queue.refusals = 0
        sv.queue.nodes.add(ev.node)
    sv.log(
        E.EVENT_KIND_NODE_JOINED,
        f"node {ev.node} joined ({ev.local_ranks} ranks), pool state {node.state.label}",
        node=E.NodeDetail(node=ev.node, reason="lease registered"),
    )
    if node.state in (PoolState.QUARANTINED, PoolState.BURN_IN):
        # A registration is a new lease (the host restarted): it ends a failed burn-in's wait for repair.
        if not node.elsewhere and sv.pool.awaits_repair(node):
            sv.log(
                E.EVENT_KIND_RELEASE,
                f"{ev.node} registered again after its failed burn-in: counted as its repair; burn-in again",
                release=E.ReleaseDetail(node=ev.node, reason="re-registered after a failed burn-in"),
            )
            sv.pool.start_burn_in(ev.node, repaired=True)
        sv.begin_burn_in(ev.node)
    elif not sv.in_attempt(ev.node) and ev.node not in sv.preparing.slots:
        sv.pool.unassign(ev.node)


def on_joined_preflight(sv: Run, ev: NodeJoined) -> None:
    on_joined(sv, ev)
    prepare.fill_slots(sv)


def on_lost(sv: Run, ev: NodeLost, *, watching: bool = True) -> bool:
    """The bookkeeping of every state; True when it was a mass expiry (the control plane, not nodes).
    `watching`: whether this state looks for a mass expiry (not when blind already, nor once over)."""
    drained = sv.pool.get(ev.node).draining
    sv.pool.set_alive(ev.node, False)
    sv.pool.set_draining(ev.node, "")  # its next registration says its own state
    sv.forget_burn_in(ev.node)
    if drained:
        # A planned departure (the whole allocation at a time limit, say) is not a mass expiry.
        sv.log(
            E.EVENT_KIND_NODE_LOST,
            f"node {ev.node} left after draining ({drained})",
            node=E.NodeDetail(node=ev.node, reason=f"left after draining: {drained}"),
        )
        return False
    sv.loss_times.append(sv.now)
    while sv.loss_times and sv.now - sv.loss_times[0] > sv.cfg.mass_expiry_window_s:
        sv.loss_times.popleft()
    sv.log(
        E.EVENT_KIND_NODE_LOST,
        f"node {ev.node} lost: its lease expired",
        node=E.NodeDetail(node=ev.node, reason="lease expired"),
    )
    if watching and detectors.is_mass_expiry(sv.loss_times, sv.now, len(sv.pool.nodes), sv.cfg):
        transitions.become_blind(
            sv,
            etcd_lost=False,
            reason=(
                f"{len(sv.loss_times)} leases expired within {sv.cfg.mass_expiry_window_s:g}s: a control-plane "
                "fault, not hardware; nothing is quarantined for it"
            ),
        )
        return True
    return False


def _lost_tail(sv: Run, node: str) -> None:
    if not sv.in_attempt(node) and node not in sv.preparing.slots:
        sv.pool.unassign(node)


def on_lost_idle(sv: Run, ev: NodeLost) -> None:
    """WAITING_NODES, BACKOFF: bookkeeping, and a mass expiry makes the run blind."""
    on_lost(sv, ev)
    _lost_tail(sv, ev.node)


def on_lost_unwatched(sv: Run, ev: NodeLost) -> None:
    """CONTROL_PLANE and the terminal states: bookkeeping only."""
    on_lost(sv, ev, watching=False)
    _lost_tail(sv, ev.node)


def on_lost_preflight(sv: Run, ev: NodeLost) -> None:
    if on_lost(sv, ev):
        return
    if ev.node in sv.preparing.slots:
        prepare.drop_from_slots(sv, ev.node, f"node {ev.node} lost during preflight")
    _lost_tail(sv, ev.node)


def on_lost_running(sv: Run, ev: NodeLost) -> None:
    if on_lost(sv, ev):
        return
    a = sv.cur
    if ev.node in a.node_step:
        last = a.node_seen_at.get(ev.node, a.launched_at)
        failure.begin(
            sv,
            Failure(
                detector=E.DETECTOR_NODE_LOST,
                nodes=[ev.node],
                step=sv.job_step,
                label="node_lost",
                reason=f"node {ev.node} lost its lease (last progress report {sv.now - last:.1f}s ago)",
                # The lease is the blame (the ladder's heartbeat rung, above the flight recorder):
                # the survivors' dumps could not change it, and collecting them from every rank
                # before the stop cost 4.3 s of the relaunch at 2,048 hosts (BENCHMARKS.md).
                dumps=False,
                hold_s=sv.cfg.lost_node_hold_s,
            ),
            latency=sv.now - last,
        )
    _lost_tail(sv, ev.node)


def on_lost_collecting(sv: Run, ev: NodeLost) -> None:
    """COLLECTING: a lost node of the attempt counts as exited (see `_lost_ending`)."""
    if _lost_ending(sv, ev) is not None:
        _lost_tail(sv, ev.node)


def on_lost_stopping(sv: Run, ev: NodeLost) -> None:
    """STOPPING: a lost node of the attempt counts as exited; the last one decides."""
    counted = _lost_ending(sv, ev)
    if counted is None:
        return
    if counted:
        failure.maybe_stopped(sv, ev.node)
    _lost_tail(sv, ev.node)


def _lost_ending(sv: Run, ev: NodeLost) -> bool | None:
    """An ending attempt lost a node: True when it was one of the attempt's (counted as exited),
    None when it was a mass expiry (the run went blind).

    A crash is blamed on a node of the attempt that then loses its lease before its ranks exited:
    when a host dies its peers' collectives fail at once (the connections close), so a survivor's
    exit often comes before the dead host's lease expires; the first exit is a victim."""
    drained = bool(sv.pool.get(ev.node).draining)
    if on_lost(sv, ev):
        return None
    a = sv.cur
    if ev.node in a.node_step:
        f = sv.failure
        if (
            f is not None
            and f.detector == E.DETECTOR_CRASH
            and not (f.planned or f.control_plane or drained)
            and ev.node not in a.exited
        ):
            last = a.node_seen_at.get(ev.node, a.launched_at)
            f.detector, f.nodes, f.ranks, f.label = E.DETECTOR_NODE_LOST, [ev.node], [], "node_lost"
            f.reason = f"node {ev.node} lost its lease (last progress report {sv.now - last:.1f}s ago)"
        a.exited.setdefault(ev.node, "lost")
        return True
    return False


def on_evidence(sv: Run, ev: EvidenceObserved) -> None:
    """WAITING_NODES, COLLECTING, STOPPING, BACKOFF, terminal: fatal evidence is noted (see `_note`)."""
    if (fatal := _fatal(sv, ev)) is not None:
        _note(sv, ev.evidence, *fatal)


def on_evidence_blind(sv: Run, ev: EvidenceObserved) -> None:
    """CONTROL_PLANE: noted; a node of the paused attempt is judged when the attempt's fate is."""
    if (fatal := _fatal(sv, ev)) is not None:
        _note(sv, ev.evidence, *fatal, paused_attempt=True)


def on_evidence_preflight(sv: Run, ev: EvidenceObserved) -> None:
    """PREFLIGHT: noted; a quarantined node of the attempt being prepared is replaced."""
    if (
        (fatal := _fatal(sv, ev)) is not None
        and _note(sv, ev.evidence, *fatal)
        and ev.evidence.node in sv.preparing.slots
    ):
        prepare.drop_from_slots(sv, ev.evidence.node, fatal[0], logged=True)


def on_evidence_running(sv: Run, ev: EvidenceObserved) -> None:
    """RUNNING: fatal evidence on a node of the attempt is its failure; elsewhere it is noted."""
    if (fatal := _fatal(sv, ev)) is None:
        return
    e = ev.evidence
    reason, latency = fatal
    if e.node in sv.cur.node_step:
        failure.begin(
            sv,
            Failure(
                detector=E.DETECTOR_EVIDENCE,
                nodes=[e.node],
                step=sv.job_step,
                label="evidence",
                reason=reason,
            ),
            latency=latency,
        )
        return
    _note(sv, e, reason, latency)


def _fatal(sv: Run, ev: EvidenceObserved) -> tuple[str, float] | None:
    """Records the evidence; for fatal evidence this run answers for, its reason and latency."""
    e = ev.evidence
    sv.pool.add_evidence(e.node, e, sv.now)
    if not is_fatal(e):
        return None
    if sv.pool.get(e.node).elsewhere and e.node not in sv.cur.node_step:
        # Another run holds it: that run detects, quarantines and writes its record. A detection
        # logged here would be a fault of this run (goodput: an incident, and lost time until a
        # relaunch that nothing calls for).
        return None
    latency = max(0.0, sv.now - e.observed_at) if e.observed_at > 0 else 0.0
    return f"fatal {kind_name(e.kind)} on {e.node}: {e.detail}".rstrip(": "), latency


def _note(
    sv: Run, e: common_pb2.Evidence, reason: str, latency: float, *, paused_attempt: bool = False
) -> bool:
    """Fatal evidence, logged; a node out of the attempt is quarantined (True when it was)."""
    sv.log(
        E.EVENT_KIND_DETECTION,
        reason,
        # Noted, not acted on: the attempt (if any) goes on, and a failure it causes is detected then.
        detection=E.DetectionDetail(
            detector=E.DETECTOR_EVIDENCE, nodes=[e.node], latency_s=latency, reason=reason, flag_only=True
        ),
    )
    if sv.in_attempt(e.node) or (paused_attempt and e.node in sv.cur.node_step):
        return False  # blamed by hardware evidence when the attempt's failure is decided
    state = sv.pool.get(e.node).state
    if state in (PoolState.SPARE, PoolState.BURN_IN) or (
        state is PoolState.ASSIGNED and e.node in sv.preparing.slots
    ):
        sv.forget_burn_in(e.node)  # quarantined again: its soak and retry decide nothing now
        if not quarantine.quarantine(sv, e.node, reason, evidence=[e]):
            sv.preparing.unreachable.add(e.node)  # kept in service by the blast radius: not in this attempt
        return True
    return False


def on_checkpoint(sv: Run, ev: CheckpointCommitted) -> None:
    if ev.step in sv.committed:
        return
    if sv.cur.resume_snapshot and ev.step == sv.cur.resume_step and ev.attempt in (0, sv.attempt):
        # a script that says the step it loaded is committed (right after resuming from a commit) said
        # it of the in-memory snapshot this attempt resumed from: never saved, no resume point
        sv.log(
            E.EVENT_KIND_CHECKPOINT_FAILED,
            f"checkpoint at step {ev.step} ignored: it is the in-memory snapshot attempt {sv.attempt} "
            "resumed from, never saved to storage",
            step=ev.step,
            checkpoint=E.CheckpointDetail(path=ev.path, error="an in-memory snapshot, not a commit"),
        )
        return
    if ev.attempt and ev.attempt != sv.attempt:
        # A superseded attempt (a partitioned host's ranks before they fenced themselves) is not a
        # resume point: the attempt that replaced it may already have moved on from older state.
        sv.log(
            E.EVENT_KIND_CHECKPOINT_FAILED,
            f"checkpoint at step {ev.step} of attempt {ev.attempt} ignored: "
            f"that attempt was superseded by attempt {sv.attempt} (fenced); not a resume point",
            step=ev.step,
            checkpoint=E.CheckpointDetail(path=ev.path, error="fenced: superseded attempt"),
        )
        return
    sv.committed.add(ev.step)
    loops = len(sv.history.loops)
    sv.history.got_past(ev.step)  # a commit past a failure's step: the run got past it, no loop
    if len(sv.history.loops) != loops:
        memory.persist(sv)
    sv.latest_committed = max(sv.latest_committed, ev.step)
    a = sv.cur
    started = a.save_started.get(ev.step)
    if started is not None:
        # The hang allowance learns the save as seen, first "saving" report to commit: a rank that
        # waits for its async save (the last one) sits through the upload, which save_duration_s
        # (the stall: an async save's staging only) leaves out.
        sv.save_times.append(max(sv.now - started, ev.save_duration_s))
    elif ev.save_duration_s > 0:
        sv.save_times.append(ev.save_duration_s)
    if a.save_started:
        a.save_started = {s: t for s, t in a.save_started.items() if s > ev.step}
    sv.emit(
        PersistCheckpoint(step=ev.step, path=ev.path, attempt=ev.attempt, save_duration_s=ev.save_duration_s)
    )
    sv.log(
        E.EVENT_KIND_CHECKPOINT_COMMIT,
        f"checkpoint at step {ev.step} committed",
        step=ev.step,
        checkpoint=E.CheckpointDetail(path=ev.path, save_duration_s=ev.save_duration_s),
    )


def on_checkpoint_failed(sv: Run, ev: CheckpointFailed) -> None:
    where = f" on {ev.node}" if ev.node else ""
    sv.log(
        E.EVENT_KIND_CHECKPOINT_FAILED,
        f"checkpoint at step {ev.step} failed{where}: {ev.error}; no commit marker, the latest "
        f"committed step stays {sv.latest_committed}",
        step=ev.step,
        checkpoint=E.CheckpointDetail(error=ev.error),
    )


def on_operator_quarantine(sv: Run, ev: OperatorQuarantine) -> None:
    """Every state but RUNNING and PREFLIGHT: the node is quarantined; nothing of an attempt changes."""
    quarantine.quarantine(sv, ev.node, f"operator: {ev.reason}", operator=True)


def on_operator_quarantine_preflight(sv: Run, ev: OperatorQuarantine) -> None:
    """PREFLIGHT: quarantined, and replaced in the attempt being prepared."""
    on_operator_quarantine(sv, ev)
    if ev.node in sv.preparing.slots:
        prepare.drop_from_slots(sv, ev.node, f"operator: {ev.reason}", logged=True)


def on_operator_quarantine_running(sv: Run, ev: OperatorQuarantine) -> None:
    """RUNNING: quarantined; a node of the attempt ends it with a planned stop and a relaunch without it."""
    on_operator_quarantine(sv, ev)
    reason = f"operator: {ev.reason}"
    if ev.node in sv.cur.node_step:
        failure.begin(
            sv,
            Failure(
                detector=E.DETECTOR_UNSPECIFIED,
                nodes=[ev.node],
                step=sv.job_step,
                planned=True,
                reason=f"{reason}: restarting without {ev.node}",
            ),
            latency=0.0,
        )


def on_operator_release(sv: Run, ev: OperatorRelease) -> None:
    node = sv.pool.operator_release(ev.node, sv.now)
    sv.log(
        E.EVENT_KIND_RELEASE,
        f"operator released {ev.node} ({ev.reason}); it returns after "
        f"{burn_in_passes_text(sv.cfg.burn_in_passes)}",
        release=E.ReleaseDetail(node=ev.node, reason=ev.reason, operator=True),
    )
    sv.persist(ev.node)
    if node.alive and node.state is PoolState.BURN_IN:
        sv.begin_burn_in(ev.node)


def on_preflight(sv: Run, ev: PreflightResult) -> None:
    """Outside PREFLIGHT a result is a spare check's or a burn-in's (or late: ignored)."""
    if spare_checks.on_result(sv, ev):
        return
    if ev.node in sv.burn_in:
        burn_in.on_result(sv, ev)


def on_preflight_preparing(sv: Run, ev: PreflightResult) -> None:
    """PREFLIGHT: a spare check's, a burn-in's result, or the attempt's (a spare check the attempt
    waits for answers it too)."""
    if spare_checks.on_result(sv, ev):
        return
    if ev.node in sv.burn_in:
        burn_in.on_result(sv, ev)
    elif ev.node in sv.preparing.pending_preflight:
        prepare.on_attempt_preflight(sv, ev)


def on_preflight_blind(sv: Run, ev: PreflightResult) -> None:
    """CONTROL_PLANE: a burn-in's result; the attempt's when paused in PREFLIGHT (recorded, launched
    after the pause)."""
    if spare_checks.on_result_blind(sv, ev):
        return
    if ev.node in sv.burn_in:
        burn_in.on_result(sv, ev)
    elif ev.node in sv.preparing.pending_preflight and sv.blind.paused is RunState.PREFLIGHT:
        prepare.on_attempt_preflight(sv, ev)


def on_bandwidth(sv: Run, ev: BandwidthMeasured) -> None:
    """Every state but PREFLIGHT: a burn-in soak's answer (a gate's is late: dropped)."""
    soak.on_measured(sv, ev, burn_in.record)


def on_bandwidth_preflight(sv: Run, ev: BandwidthMeasured) -> None:
    """PREFLIGHT: a burn-in soak's answer, or else the bandwidth gate's."""
    if not soak.on_measured(sv, ev, burn_in.record):
        prepare.on_bandwidth(sv, ev)


def on_claimed(sv: Run, ev: NodeClaimed) -> None:
    """Every state but PREFLIGHT (see `_claim_changed`)."""
    _claim_changed(sv, ev)


def on_claimed_preflight(sv: Run, ev: NodeClaimed) -> None:
    """PREFLIGHT: a node taken by another run leaves the attempt being prepared; one given back may fill it."""
    match _claim_changed(sv, ev):
        case "taken" if ev.node in sv.preparing.slots:
            prepare.drop_from_slots(sv, ev.node, f"run {ev.run} holds it now", logged=True)
        case "free":
            prepare.fill_slots(sv)
        case _:
            pass


def _claim_changed(sv: Run, ev: NodeClaimed) -> str:
    """Another run took a node of the shared fleet (it is no spare here, and its holder
    alone burns it in and writes its record), or gave it back (free again, with the record it brings:
    its strikes, holds and repairs follow it). A node in this run's attempt is never taken from it by
    a run's claim (the claim is taken before a launch); only an operator can, and then the node is
    out of this attempt's preparation like a drained one. Says what became of the node: "taken",
    "free" (back and free for a slot), or "" (nothing new, or back into burn-in)."""
    was = sv.pool.get(ev.node).elsewhere
    if ev.run == was and ev.record is None:
        return ""
    if ev.run:
        sv.pool.set_elsewhere(ev.node, ev.run)
        sv.forget_burn_in(ev.node)
        sv.log(
            E.EVENT_KIND_NODE_CLAIMED,
            f"node {ev.node} is claimed by run {ev.run}: no spare for this run until it is given back",
            node=E.NodeDetail(node=ev.node, reason=f"claimed by run {ev.run}"),
        )
        return "taken"
    if ev.record is not None and not sv.in_attempt(ev.node) and ev.node not in sv.preparing.slots:
        sv.pool.load([ev.record])
    node = sv.pool.set_elsewhere(ev.node, "")
    sv.log(
        E.EVENT_KIND_NODE_CLAIMED,
        f"node {ev.node} is back in the shared pool{f' from run {was}' if was else ''}: "
        f"{node.state.label}, {len(node.failure_times)} failure(s) on record",
        node=E.NodeDetail(node=ev.node, reason="claim given back"),
    )
    if node.alive and node.state in (PoolState.QUARANTINED, PoolState.BURN_IN) and ev.node not in sv.burn_in:
        sv.begin_burn_in(ev.node)  # its holder gave it back before it returned: this run burns it in
        return ""
    return "free"


def on_draining(sv: Run, ev: NodeDraining) -> None:
    """Every state but RUNNING and PREFLIGHT (see `_drains`)."""
    _drains(sv, ev)


def on_draining_preflight(sv: Run, ev: NodeDraining) -> None:
    """PREFLIGHT: a node of the attempt being prepared that drains is replaced at once."""
    if _drains(sv, ev) and ev.node in sv.preparing.slots:
        prepare.drop_from_slots(
            sv, ev.node, f"it drains ({ev.reason}); replaced, not quarantined", logged=True
        )


def on_draining_running(sv: Run, ev: NodeDraining) -> None:
    """RUNNING: a node of the attempt that drains ends it with a planned stop and a relaunch."""
    if _drains(sv, ev) and ev.node in sv.cur.node_step:
        stops.on_stop_request_running(
            sv,
            StopRequested(reason=f"node {ev.node} drains: {ev.reason}", requested_by=ev.node, relaunch=True),
        )


def _drains(sv: Run, ev: NodeDraining) -> bool:
    """A node drains (maintenance, SIGTERM to its agent, a scheduler's notice) or is back.

    Never a failure and never a quarantine: the node takes no new placement; a running attempt it is
    part of ends with a planned stop (finish the step, save, commit, exit 0) and is relaunched from
    that commit with a spare in its node rank; an attempt being prepared replaces it at once. True
    when it now drains (it did not, or for another reason)."""
    was = sv.pool.get(ev.node).draining
    if ev.reason == was:
        return False
    sv.pool.set_draining(ev.node, ev.reason)
    if not ev.reason:
        sv.log(
            E.EVENT_KIND_RELEASE,
            f"node {ev.node} is back in service after draining ({was})",
            node=E.NodeDetail(node=ev.node, reason="drain ended"),
        )
        return False  # in WAITING_NODES the machine tries to start after every event
    sv.log(
        E.EVENT_KIND_STOP_REQUEST,
        f"node {ev.node} drains ({ev.reason}): no new placement; nothing is quarantined",
        node=E.NodeDetail(node=ev.node, reason=f"draining: {ev.reason}"),
    )
    return True
