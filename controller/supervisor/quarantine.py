"""Taking a node out of service for the run's sake: an operator's quarantine always, an automatic
one only within the blast radius (so a fleet-wide fault cannot quarantine the fleet). Logs the
decision, persists the node, emits `Quarantine`, and starts the burn-in that may return it."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

from controller.supervisor import memory
from controller.supervisor.actions import Quarantine
from controller.supervisor.policy import burn_in_passes_text
from controller.supervisor.pool import PoolState, needs_repair
from runwarden.v1 import common_pb2
from runwarden.v1 import events_pb2 as E

if TYPE_CHECKING:
    from controller.supervisor.run import Run


def quarantine(
    sv: Run, node: str, reason: str, evidence: Iterable[common_pb2.Evidence] = (), operator: bool = False
) -> bool:
    """Quarantine `node` (an operator's always; an automatic one only within the blast radius).
    Returns whether it was quarantined."""
    evs = list(evidence)
    if not operator and not _within_blast_radius(sv, node, reason):
        return False
    p = sv.pool.quarantine(node, sv.now, reason, count_failure=not operator, operator=operator, evidence=evs)
    held = p.state is PoolState.HELD
    if held and not operator and needs_repair(evs):
        why = (
            f"{reason}; needs repair: no burn-in until an operator marks it repaired "
            f"(controllerctl repaired {node} --note ...), then burn-in"
        )
    elif held and not operator:
        why = (
            f"{reason}; held: {sv.pool.recent_failures(p, sv.now)} failures within "
            f"{sv.cfg.hold_window_s / 86400:g} days, out until an operator releases it"
        )
    elif held:
        why = f"{reason}; held until an operator releases it"
    else:
        why = f"{reason}; returns after {burn_in_passes_text(sv.cfg.burn_in_passes)}"
    sv.log(
        E.EVENT_KIND_QUARANTINE,
        f"quarantined {node}: {why}",
        quarantine=E.QuarantineDetail(node=node, reason=reason, evidence=evs, operator=operator),
    )
    sv.persist(node)
    sv.emit(Quarantine(node=node, reason=reason, evidence=tuple(evs), held=held))
    if not operator:
        sv.quarantine_times.append(sv.now)
        memory.persist(sv)
    if not held and p.alive:
        sv.begin_burn_in(node)
    return True


def blast_radius(sv: Run) -> int:
    """How many automatic quarantines the window allows (the policy's count, or its fraction of
    the nodes known, whichever is larger)."""
    share = math.ceil(sv.cfg.blast_radius_fraction * len(sv.pool.nodes))
    return max(sv.cfg.blast_radius_nodes, share)


def _within_blast_radius(sv: Run, node: str, reason: str) -> bool:
    window = sv.cfg.blast_radius_window_s
    sv.quarantine_times = [t for t in sv.quarantine_times if sv.now - t < window]
    limit = blast_radius(sv)
    if len(sv.quarantine_times) < limit:
        sv.blast_paged = False
        return True
    message = (
        f"blast radius: {len(sv.quarantine_times)} nodes quarantined within {window:g}s (limit "
        f"{limit}); automatic quarantine stopped: {node} stays in service ({reason}); an operator "
        f"decides (controllerctl quarantine {node})"
    )
    sv.log(
        E.EVENT_KIND_QUARANTINE_HELD_BACK,
        message,
        node=E.NodeDetail(node=node, reason=reason),
    )
    if not sv.blast_paged:
        sv.blast_paged = True
        sv.page(message)
    return False
