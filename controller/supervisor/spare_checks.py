"""Pre-validated spares: while the run trains, the idle spares are preflighted in the background in one
sweep every `spare_check_interval_s`, so the spare that replaces a failed node is one whose passing
preflight is recent (`prepare.vouched_for`) and the relaunch does not wait for it. A sweep asks every
idle spare not checked within the last half interval (one checked meanwhile another way, at its burn-in
or an attempt's preflight, waits for the next sweep), so no spare's last check is older than 1.5
intervals plus the check's own time. A spare that fails its check is quarantined like a node that
fails its attempt preflight; one that cannot tell, or cannot be reached, is asked again at the next
sweep (no strike)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from controller.supervisor import prepare, quarantine
from controller.supervisor.actions import RunPreflight, SetTimer
from controller.supervisor.events import PreflightResult
from controller.supervisor.pool import PoolState
from runwarden.v1 import events_pb2 as E

if TYPE_CHECKING:
    from controller.supervisor.run import Run


def due(sv: Run) -> None:
    """RUNNING (a tick, and the attempt's first step): the sweep, once it is due. Not before the
    attempt's first step: its launch and load have the hosts first (the first step sweeps if a sweep
    fell due meanwhile). One wake-up and one fan-out per interval, whatever each spare's phase: a
    world whose ticks come only from timers (the simulator) ticks once per interval."""
    interval = sv.cfg.spare_check_interval_s
    checks = sv.spare_checks
    if interval <= 0 or not sv.cur.first_step_logged or sv.now < checks.next_sweep:
        return
    for n, asked in list(checks.asked.items()):  # an answer that never came: asked again
        if sv.now - asked > sv.cfg.preflight_timeout_s + 60.0:
            del checks.asked[n]
    checks.next_sweep = sv.now + interval
    sv.emit(SetTimer(key="spare_check", at=checks.next_sweep))
    nodes = []
    for name in sv.pool.free_names():
        if name in checks.asked or name in sv.burn_in:
            continue
        last = max(sv.pool.get(name).checked_at or 0.0, checks.last_asked.get(name, 0.0))
        if last and sv.now - last < interval / 2:
            continue
        nodes.append(name)
    if not nodes:
        return
    nodes.sort()
    for n in nodes:
        checks.asked[n] = checks.last_asked[n] = sv.now
    sv.emit(
        RunPreflight(
            nodes=tuple(nodes),
            mode=sv.cfg.preflight_mode,
            purpose="spare",
            timeout_s=sv.cfg.preflight_timeout_s,
        )
    )


def on_result(sv: Run, ev: PreflightResult) -> bool:
    """A spare check's answer; False when it is not one (or the attempt being prepared waits for it
    too: then the attempt's rules judge it)."""
    if sv.spare_checks.asked.pop(ev.node, None) is None:
        return False
    node = sv.pool.get(ev.node)
    if ev.passed:
        node.checked_at = sv.now
        return ev.node not in sv.preparing.pending_preflight
    if ev.node in sv.preparing.pending_preflight:
        return False
    if ev.inconclusive:
        sv.log(
            E.EVENT_KIND_PREFLIGHT_RESULT,
            f"spare {ev.node}: background preflight ({ev.mode}) inconclusive "
            f"({', '.join(ev.inconclusive_checks)}); no strike, asked again in {sv.cfg.spare_check_interval_s:g}s",
            preflight=prepare.detail(ev),
        )
        return True
    node.checked_at = None
    reason = f"background preflight ({ev.mode}) failed: {', '.join(ev.failed_checks) or 'no check named'}"
    if node.state is not PoolState.SPARE:  # taken into an attempt meanwhile: checked before the next
        sv.log(
            E.EVENT_KIND_PREFLIGHT_RESULT,
            f"{ev.node}: {reason}, after it was taken into attempt {sv.attempt}; it is preflighted "
            "before the next attempt",
            preflight=prepare.detail(ev),
        )
        return True
    sv.log(
        E.EVENT_KIND_PREFLIGHT_RESULT, f"spare {ev.node}: {reason}; quarantined", preflight=prepare.detail(ev)
    )
    node.preflight_rejections += 1
    quarantine.quarantine(sv, ev.node, reason)
    return True


def on_result_blind(sv: Run, ev: PreflightResult) -> bool:
    """CONTROL_PLANE: a pass still vouches for the spare; a failure decides nothing while the core
    cannot write (checked again at the next interval)."""
    if sv.spare_checks.asked.pop(ev.node, None) is None:
        return False
    if ev.passed:
        sv.pool.get(ev.node).checked_at = sv.now
    return ev.node not in sv.preparing.pending_preflight


def unanswered(sv: Run, act: RunPreflight, node: str) -> None:
    """The check could not run or reach the node: no verdict; asked again at the next interval."""
    for n in (node,) if node else act.nodes:
        sv.spare_checks.asked.pop(n, None)
