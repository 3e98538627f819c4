"""The burn-in's link stage: a node that passed its node-local burn-in soaks an all-reduce with idle
neighbours before it returns to the spare pool (no node can burn in its NIC, cable and switch port
alone). burn_in.py starts it after the last node-local pass and passes `burn_in.record` as the
verdict's callback; the node stays in BURN_IN until the verdict.

The core asks the shell to measure (`MeasureBandwidth(purpose="burn_in")`) the node with
`burn_in_soak_neighbours` idle spares, best reputation first, `burn_in_soak_iterations` all-reduces
per group: the set, then the ring pairs. The node passes when its best pair reaches
`bandwidth_gate_ratio` x the floor: the configured `bandwidth_floor_gbps`, or the neighbours' own
median (with one neighbour there is no reference and only a pair that could not carry the
all-reduce fails). No idle neighbour, no answer within `burn_in_soak_timeout_s`, or a shell that
cannot measure: released on its node-local stages, and the log says which.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from controller.supervisor.actions import MeasureBandwidth, SetTimer
from controller.supervisor.events import BandwidthMeasured
from controller.supervisor.records import Soak
from runwarden.v1 import common_pb2
from runwarden.v1 import events_pb2 as E

if TYPE_CHECKING:
    from controller.supervisor.run import Run

FAILED_CHECK = "burn_in.neighbour_soak"
# Called with (node, passed, failed checks, why): the burn-in's result, recorded by the caller's rules.
Finish = Callable[["Run", str, bool, tuple[str, ...], str], None]


def start(sv: Run, node: str, local: E.PreflightDetail) -> bool:
    """Ask for the soak of `node` (its node-local result `local` is logged with it); False when it
    cannot run (off, or no idle neighbour): the node-local result then decides alone."""
    want = sv.cfg.burn_in_soak_neighbours
    if want <= 0:
        return False
    busy = {n for s in sv.soaks.values() for n in s.nodes}
    neighbours = sv.pool.pick_spares(want, sv.now, exclude={node, *busy, *sv.preparing.unreachable})
    if not neighbours:
        sv.log(
            E.EVENT_KIND_PREFLIGHT_RESULT,
            f"burn-in of {node}: no idle spare to soak an all-reduce with; released on its node-local stages",
        )
        return False
    soak = Soak(nodes=(node, *neighbours), deadline=sv.now + sv.cfg.burn_in_soak_timeout_s)
    sv.soaks[node] = soak
    sv.log(
        E.EVENT_KIND_PREFLIGHT_RESULT,
        f"burn-in of {node}: node-local stages passed; all-reduce soak with {', '.join(neighbours)} "
        f"({sv.cfg.burn_in_soak_iterations} all-reduces per group)",
        preflight=local,
    )
    sv.emit(
        MeasureBandwidth(
            nodes=soak.nodes,
            timeout_s=sv.cfg.burn_in_soak_timeout_s,
            purpose="burn_in",
            iterations=sv.cfg.burn_in_soak_iterations,
        )
    )
    sv.emit(SetTimer(key=f"soak:{node}", at=soak.deadline))
    return True


def on_measured(sv: Run, ev: BandwidthMeasured, finish: Finish) -> bool:
    """The soak's answer; False when `ev` answers no soak (a gate's, or a stale one)."""
    node = next((n for n, s in sv.soaks.items() if s.nodes == ev.nodes), None)
    if node is None:
        return False
    del sv.soaks[node]
    figures = dict(ev.per_node_gbps)
    mine = figures.get(node)
    others = sorted(figures[n] for n in ev.nodes[1:] if n in figures)
    floor = sv.cfg.bandwidth_floor_gbps or (others[len(others) // 2] if len(others) > 1 else 0.0)
    limit = sv.cfg.bandwidth_gate_ratio * floor
    shown = ", ".join(f"{n} {figures[n]:.3g}" for n in ev.nodes if n in figures)
    if mine is None:  # its agent refused (busy, older): no figure says nothing about its link
        finish(sv, node, True, (), f"soak gave {node} no figure ({ev.detail or 'refused'}): not judged")
        return True
    passed = mine > 0 and mine >= limit
    basis = (
        f"floor {floor:.3g} GB/s ({'configured' if sv.cfg.bandwidth_floor_gbps else 'median of the neighbours'})"
        f" x {sv.cfg.bandwidth_gate_ratio:g}"
        if floor
        else "no floor (one neighbour): it must carry the all-reduce"
    )
    verdict = (
        "passed"
        if passed
        else f"failed: {mine:.3g} GB/s below {limit:.3g} GB/s"
        if mine
        else "failed: no all-reduce ran"
    )
    sv.log(
        E.EVENT_KIND_PREFLIGHT_RESULT,
        f"burn-in of {node}: all-reduce soak {verdict}; best pair per node: {shown}; {basis} "
        f"({ev.duration_s:.1f}s{'; ' + ev.detail if ev.detail else ''})",
        preflight=E.PreflightDetail(
            node=node,
            summary=common_pb2.PreflightSummary(
                mode="burn_in",
                passed=passed,
                fail_count=0 if passed else 1,
                duration_s=ev.duration_s,
                failed_checks=[] if passed else [FAILED_CHECK],
            ),
        ),
    )
    finish(sv, node, passed, () if passed else (FAILED_CHECK,), "")
    return True


def unanswered(sv: Run, nodes: tuple[str, ...], why: str, finish: Finish) -> bool:
    """The shell could not measure (ActionFailed): released on the node-local stages."""
    node = next((n for n, s in sv.soaks.items() if s.nodes == nodes), None)
    if node is None:
        return False
    del sv.soaks[node]
    finish(sv, node, True, (), f"all-reduce soak could not run ({why}): released on its node-local stages")
    return True


def expire(sv: Run, finish: Finish) -> None:
    """Every tick: a soak with no answer by its deadline releases its node on the node-local stages."""
    for node, soak in sorted(sv.soaks.items()):
        if sv.now >= soak.deadline:
            del sv.soaks[node]
            finish(
                sv,
                node,
                True,
                (),
                f"no soak answer within {sv.cfg.burn_in_soak_timeout_s:g}s: released on its node-local stages",
            )


def forget(sv: Run, node: str) -> None:
    """The node left (lost, quarantined again): its soak no longer decides anything."""
    sv.soaks.pop(node, None)
