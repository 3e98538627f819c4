"""Rules for the control plane: the blind pause (etcd lost, mass lease expiry), and reconciling
from a store snapshot (level-triggered: list, then watch; adopt a running attempt after a restart)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from controller.supervisor import failure, loss, memory, nodes, prepare, reconfigure, stops, transitions
from controller.supervisor.actions import SetTimer
from controller.supervisor.attempt import Attempt, Failure
from controller.supervisor.events import (
    ControlPlaneLost,
    ControlPlaneRestored,
    NodeClaimed,
    NodeDraining,
    NodeJoined,
    NodeLost,
    StoreListed,
)
from controller.supervisor.pool import PoolState
from controller.supervisor.states import LIVE, RunState
from runwarden.v1 import events_pb2 as E

if TYPE_CHECKING:
    from controller.supervisor.run import Run


def on_lost_etcd(sv: Run, ev: ControlPlaneLost) -> None:
    transitions.become_blind(
        sv,
        etcd_lost=True,
        reason="the controller lost etcd: no observation is evidence about nodes now; nothing is quarantined",
    )


def on_restored(sv: Run, ev: ControlPlaneRestored) -> None:
    sv.blind.etcd_lost = False
    sv.deadline = sv.now + sv.cfg.control_plane_grace_s
    sv.log(E.EVENT_KIND_CONTROL_PLANE, "etcd reachable again: reconciling from a fresh listing")
    sv.emit(SetTimer(key="control_plane", at=sv.deadline))


def on_joined(sv: Run, ev: NodeJoined) -> None:
    """CONTROL_PLANE: a node back; when every node of the attempt is, the pause ends."""
    nodes.on_joined(sv, ev)
    if not sv.blind.etcd_lost and all(sv.pool.nodes[n].alive for n in sv.cur.node_step):
        resolve(sv)


def on_tick(sv: Run) -> None:
    if not sv.blind.etcd_lost and sv.now >= sv.deadline:
        resolve(sv)


def resolve(sv: Run) -> None:
    """Leave CONTROL_PLANE: keep a healthy attempt running; otherwise go on without quarantine."""
    prev = sv.blind.paused
    a = sv.cur
    missing = sorted(n for n in a.node_step if not sv.pool.nodes[n].alive)
    f = sv.failure
    if prev in (RunState.RUNNING, RunState.COLLECTING) and (f is None or f.detector == E.DETECTOR_NODE_LOST):
        sv.failure = None
        crashed = sorted(n for n, label in a.exited.items() if label not in ("clean", "lost"))
        if not missing and not crashed:
            a.exited = {n: label for n, label in a.exited.items() if label != "lost"}
            a.min_advanced_at = sv.now  # hang clock restarts: we were blind, not the job
            sv.log(
                E.EVENT_KIND_CONTROL_PLANE,
                f"control plane recovered: attempt {sv.attempt} kept running on all "
                "its nodes, not relaunched",
            )
            transitions.become_running(sv, hang_after_s=sv.cfg.hang_timeout_floor_s)
        elif missing:
            failure.begin(
                sv,
                Failure(
                    detector=E.DETECTOR_NODE_LOST,
                    nodes=missing,
                    step=sv.job_step,
                    label="control_plane",
                    control_plane=True,
                    reason=f"after the control-plane fault {sv.names(missing)} did not come back: "
                    "relaunching without them, nothing quarantined",
                ),
                latency=0.0,
            )
        else:  # a real crash while we were blind: handled like any crash
            first = crashed[0]
            label = a.exited[first]
            failure.begin(
                sv,
                Failure(
                    detector=E.DETECTOR_CRASH,
                    nodes=[first],
                    step=sv.job_step,
                    label=label,
                    first_exit=first,
                    reason=f"{first} exited ({label}) during the control-plane fault",
                ),
                latency=0.0,
            )
    elif prev is RunState.COLLECTING and f is not None:
        failure.stop(sv)
    elif prev is RunState.STOPPING and f is not None:
        f.control_plane = f.control_plane or f.detector == E.DETECTOR_NODE_LOST
        awaiting = {n for n in a.awaiting_exit if n not in a.exited and sv.pool.nodes[n].alive}
        transitions.become_stopping(sv, awaiting, wait_s=sv.cfg.stop_margin_s)
        if not awaiting:
            failure.decide(sv)
    elif prev is RunState.PREFLIGHT:
        transitions.resume_preflight(sv)
        for n in [n for n in sv.preparing.slots if n is not None and not sv.pool.get(n).alive]:
            prepare.drop_from_slots(sv, n, "lost during the control-plane fault")
        prepare.maybe_launch(sv)
    else:
        transitions.become_waiting(sv)
    # the moves above chose the state the pause ends in: a held stop follows it
    if sv.state is RunState.RUNNING:
        stops.deliver_pending_stop(sv)
    elif sv.pending_stop is not None and sv.state not in (RunState.COLLECTING, RunState.STOPPING):
        held, sv.pending_stop = sv.pending_stop, None
        if not held.relaunch:
            transitions.finish(sv, RunState.STOPPED, "stopped", f"stopped on request: {held.reason}")


def on_store_listed(sv: Run, snap: StoreListed) -> None:
    """A watched state: rebuild the view from the store (level-triggered); a node alive here and
    missing from the listing is lost, one back is joined, as if the watch had said so."""
    _reconcile(sv, snap, quiet=False, fresh=False)
    if sv.state is RunState.CONTROL_PLANE:  # a replayed loss just paused the run (a mass expiry)
        sv.blind.etcd_lost = False
        resolve(sv)
    _follow_up(sv, snap)


def on_store_listed_waiting(sv: Run, snap: StoreListed) -> None:
    """WAITING_NODES: a fresh core (attempt 0) takes the listing as the view it starts from (no
    loss, no join), continues its predecessor's memory and adopts the attempt it finds running;
    after an attempt it is a watched state like any other."""
    if sv.attempt != 0:
        on_store_listed(sv, snap)
        return
    _reconcile(sv, snap, quiet=True, fresh=True)
    if snap.attempt > 0 and snap.attempt_nodes:
        _adopt(sv, snap)
    _follow_up(sv, snap)


def on_store_listed_blind(sv: Run, snap: StoreListed) -> None:
    """CONTROL_PLANE: the listing is the view the pause ends on (no loss, no join); then resolve."""
    _reconcile(sv, snap, quiet=True, fresh=False)
    sv.blind.etcd_lost = False
    resolve(sv)
    _follow_up(sv, snap)


def _reconcile(sv: Run, snap: StoreListed, *, quiet: bool, fresh: bool) -> None:
    """Load the listing: `quiet` takes the nodes as listed, otherwise a difference is replayed as
    the event a watch gap missed; `fresh` (a new core) restores its predecessor's memory."""
    if snap.policy is not None:  # the stored policy first: every decision below is made under it
        reconfigure.apply(sv, snap.policy)
    sv.pool.load(snap.records)
    # claims before any pick below; a change a watch gap missed is told as the watch would have
    for name in sorted({*snap.claimed_elsewhere, *(n for n, p in sv.pool.nodes.items() if p.elsewhere)}):
        holder = snap.claimed_elsewhere.get(name, "")
        if quiet or sv.pool.get(name).elsewhere == holder:
            sv.pool.set_elsewhere(name, holder)
        else:
            sv.apply(NodeClaimed(node=name, run=holder))
    for name in [n for n, p in sv.pool.nodes.items() if p.alive and n not in snap.alive]:
        if quiet:
            sv.pool.set_alive(name, False)
            sv.burn_in.discard(name)
        else:
            sv.apply(NodeLost(node=name))  # a DELETE missed in a watch gap
    for name, ranks in snap.alive.items():
        if quiet or sv.pool.get(name).alive:
            first_seen = sv.pool.get(name).known_since is None
            sv.pool.set_alive(name, True, ranks, now=sv.now)
            if first_seen:
                sv.persist(name)  # its known history starts now, across controller restarts
        else:
            sv.apply(NodeJoined(node=name, local_ranks=ranks))
    for s in snap.committed_steps:
        sv.committed.add(s)
        sv.latest_committed = max(sv.latest_committed, s)
    sv.job_step = max(sv.job_step, sv.latest_committed)
    sv.attempt = max(sv.attempt, snap.attempt)
    sv.logged_attempt = max(sv.logged_attempt, snap.logged_attempt)
    if snap.losses is not None:  # a fresh core: the loss history its predecessor logged
        loss.restore(sv, snap.losses, snap.attempt, snap.resume_step)
    remembered = ""
    if fresh and snap.memory is not None:  # a fresh core continues its predecessor's memory
        remembered = "; " + memory.restore(sv, snap.memory)
    sv.log(
        E.EVENT_KIND_CONTROL_PLANE,
        f"reconciled from the store: {len(snap.alive)} nodes alive"
        + (f" ({len(snap.claimed_elsewhere)} claimed by other runs)" if snap.claimed_elsewhere else "")
        + f", attempt record {snap.attempt}, latest committed step {sv.latest_committed}"
        + remembered,
    )


def _follow_up(sv: Run, snap: StoreListed) -> None:
    """What the listing asks of any state: burn-ins to start, drains missed in a gap, a stored stop."""
    for name, p in sv.pool.nodes.items():
        # A failed burn-in waits for a repair (the pool refuses it); an inconclusive one for its backoff.
        if (
            p.alive
            and p.state in (PoolState.QUARANTINED, PoolState.BURN_IN)
            and name not in sv.burn_in
            and name not in sv.burn_in_retry
        ):
            sv.begin_burn_in(name)
    for name in sorted(set(snap.alive) | set(snap.draining)):
        reason = snap.draining.get(name, "")
        if sv.pool.get(name).draining != reason:
            sv.apply(NodeDraining(node=name, reason=reason))  # a drain (or its end) missed in a gap
    # the state the listing led to (an adopted attempt, a resolved pause, a replayed loss) takes the stop
    if snap.stop_requested is not None and sv.state in LIVE:
        sv.apply(snap.stop_requested)


def _adopt(sv: Run, snap: StoreListed) -> None:
    """After a controller restart: keep a healthy running attempt; restart one that lost nodes."""
    attempt_nodes = tuple(snap.attempt_nodes)
    if sv.decided_attempt >= sv.attempt:
        # The previous leader stopped this attempt and decided its end (its memory says so), then
        # died before the relaunch: relaunch, without handling the same failure twice.
        sv.preparing.prev_slots = list(attempt_nodes)
        sv.log(
            E.EVENT_KIND_CONTROL_PLANE,
            f"reconcile: attempt {sv.attempt} ended and its failure was decided by the previous leader; "
            "relaunching",
        )
        return
    sv.preparing.prev_slots = list(attempt_nodes)
    sv.preparing.slots = list(attempt_nodes)
    sv.cur = Attempt.adopted(
        sv.attempt,
        attempt_nodes,
        resume_step=snap.resume_step,
        now=sv.now,
        straggler_window=sv.cfg.straggler_window,
    )
    sv.cur.resume_snapshot = snap.resume_snapshot
    missing = []
    for n in attempt_nodes:
        if sv.pool.get(n).state in (PoolState.SPARE, PoolState.ASSIGNED):
            sv.pool.assign(n)
        if not sv.pool.usable(n):
            missing.append(n)
    stopped = snap.stop_requested is not None and snap.stop_requested.relaunch
    if missing and stopped:
        # A stopped run resumed (`controller run --resume`, a requeued batch job): its attempt ended
        # on the stop and its nodes are gone with the old allocation. A planned relaunch, no fault.
        assert snap.stop_requested is not None
        stops.on_stop_request_running(sv, snap.stop_requested)
        return
    if missing:
        failure.begin(
            sv,
            Failure(
                detector=E.DETECTOR_NODE_LOST,
                nodes=missing,
                step=sv.job_step,
                label="reconcile",
                control_plane=True,
                reason=f"reconcile: attempt {sv.attempt} lost {sv.names(missing)} while no controller watched; "
                "relaunching, nothing quarantined",
            ),
            latency=0.0,
        )
        return
    sv.log(
        E.EVENT_KIND_CONTROL_PLANE,
        f"reconcile: attempt {sv.attempt} is running on all {len(attempt_nodes)} "
        "nodes; adopted, not relaunched",
    )
    transitions.become_running(sv, hang_after_s=sv.cfg.startup_timeout_s)
