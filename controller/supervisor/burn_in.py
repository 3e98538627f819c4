"""A node's burn-in, the way back into service after a quarantine: its node-local result (passed,
failed, or inconclusive and tried again after a backoff), the neighbour soak that follows the last
pass (soak.py), and the release, another round, or a wait for a repair that it decides."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from controller.supervisor import prepare, soak
from controller.supervisor.actions import SetTimer
from controller.supervisor.events import PreflightResult
from controller.supervisor.policy import burn_in_passes_text
from controller.supervisor.pool import PoolState
from controller.supervisor.states import RunState
from runwarden.v1 import events_pb2 as E

if TYPE_CHECKING:
    from controller.supervisor.run import Run


def on_result(sv: Run, ev: PreflightResult) -> None:
    sv.burn_in.discard(ev.node)
    if ev.inconclusive:
        inconclusive(sv, ev)
        return
    sv.burn_in_inconclusive.pop(ev.node, None)  # judged: the next inconclusive starts the backoff anew
    node = sv.pool.get(ev.node)
    last_pass = (
        ev.passed and node.state is PoolState.BURN_IN and node.burn_in_passes + 1 >= sv.cfg.burn_in_passes
    )
    if last_pass and ev.node not in sv.soaks and soak.start(sv, ev.node, prepare.detail(ev)):
        return  # the release waits for the soak's verdict (on_bandwidth, or its deadline)
    record(sv, ev.node, ev.passed, ev.failed_checks, "", detail=prepare.detail(ev))


def record(
    sv: Run,
    name: str,
    passed: bool,
    failed_checks: tuple[str, ...],
    why: str,
    detail: E.PreflightDetail | None = None,
) -> None:
    """A burn-in's result (its last stage's: node-local, or the neighbour soak): release, again, or out."""
    outcome = sv.pool.burn_in_result(name, passed, failed_checks, now=sv.now)
    if outcome == "stale":
        return
    node = sv.pool.get(name)
    done = node.burn_in_passes if outcome != "released" else sv.cfg.burn_in_passes
    extra: dict[str, Any] = {} if detail is None else {"preflight": detail}
    sv.log(
        E.EVENT_KIND_PREFLIGHT_RESULT,
        f"burn-in of {name}: {'passed' if passed else 'failed'} "
        f"({done}/{sv.cfg.burn_in_passes} in a row)"
        + (f"; failed {', '.join(failed_checks)}" if failed_checks else "")
        + (f"; {why}" if why else "")
        + (
            f"; it waits for a repair: no burn-in again until it registers anew (a restart) or an "
            f"operator marks it repaired (controllerctl repaired {name})"
            if outcome == "failed"
            else ""
        ),
        **extra,
    )
    sv.persist(name)
    if outcome == "released":
        sv.pool.get(name).checked_at = sv.now  # the burn-in is a superset of the attempt preflight
        reason = f"passed {burn_in_passes_text(sv.cfg.burn_in_passes)} in a row"
        sv.log(
            E.EVENT_KIND_RELEASE,
            f"{name} returns to the spare pool: {reason}",
            release=E.ReleaseDetail(node=name, reason=reason),
        )
        sv.emit_release(name, reason)
        # A released node may fill an attempt being prepared. Not a table column: record is reached
        # from the preflight, bandwidth, tick and failed-action rules of every state (and soak's callback).
        if sv.state is RunState.PREFLIGHT:
            prepare.fill_slots(sv)
    elif outcome == "again" and node.alive:
        sv.begin_burn_in(name)


# An inconclusive burn-in runs again after this, doubling per inconclusive in a row, up to the cap:
# the load it measured (another job on the host) is unlikely gone at once.
RETRY_FIRST_S = 60.0
RETRY_MAX_S = 1800.0


def inconclusive(sv: Run, ev: PreflightResult) -> None:
    """A burn-in that could not tell (a stage measured its host's load, not the node): no strike, no
    pass; the node stays in BURN_IN and runs it again after a backoff (a timer, never at once)."""
    node = sv.pool.get(ev.node)
    if node.state is not PoolState.BURN_IN:
        return  # it left burn-in meanwhile (an operator held it): the result means nothing
    delay = retry_later(sv, ev.node)
    sv.log(
        E.EVENT_KIND_PREFLIGHT_RESULT,
        f"burn-in of {ev.node}: inconclusive ({', '.join(ev.inconclusive_checks)} could not tell: "
        f"it measured its host's load, not the node); no strike; again in {delay:g}s "
        f"({sv.burn_in_inconclusive[ev.node]} in a row without a verdict)",
        preflight=prepare.detail(ev),
    )


def retry_later(sv: Run, node: str) -> float:
    """The node's burn-in runs again after a backoff that doubles per try in a row without a verdict
    (inconclusive, or it could not run); returns the delay."""
    count = sv.burn_in_inconclusive.get(node, 0)
    delay = min(RETRY_MAX_S, RETRY_FIRST_S * 2**count)
    sv.burn_in_inconclusive[node] = count + 1
    sv.burn_in_retry[node] = sv.now + delay
    sv.emit(SetTimer(key=f"burn_in_retry:{node}", at=sv.now + delay))
    return delay


def retry_due(sv: Run) -> None:
    """Every tick: inconclusive burn-ins whose backoff is over run again (a node still in BURN_IN,
    alive, and no other run's)."""
    for name, at in sorted(sv.burn_in_retry.items()):
        if sv.now < at:
            continue
        del sv.burn_in_retry[name]
        node = sv.pool.get(name)
        if node.state is PoolState.BURN_IN and node.alive and name not in sv.burn_in:
            sv.begin_burn_in(name)
