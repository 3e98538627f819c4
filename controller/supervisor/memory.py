"""The supervisor's memory of a run, as the store keeps it (runs/<run>/memory).

What outlives an attempt and must outlive the controller too: the restart budget's window, the
storm and crash-loop history (restart.RestartHistory), the first-to-exit offences and the automatic
quarantines the blast radius counts. The core writes it after every change (`PersistMemory`); a
fresh core (a new leader, a core rebuilt after a poison event or an etcd blip) gets it back in its
`StoreListed` and continues where the old one stopped. The record comes from outside: every value is
checked and a bad one dropped alone (logged in the reconcile message), never trusted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

from controller.supervisor.actions import PersistMemory
from controller.supervisor.restart import MAX_LOOP_CANDIDATES, LoopCandidate, Signature
from runwarden.v1 import store_pb2

if TYPE_CHECKING:
    from controller.supervisor.run import Run

MAX_TIMES = 256  # restart and quarantine times kept (the budget and blast radius need far fewer)
MAX_OFFENCE_STEPS = 16


def record(sv: Run) -> store_pb2.SupervisorMemory:
    h = sv.history
    rec = store_pb2.SupervisorMemory(
        run=sv.plan.run,
        restart_times=h.restart_times[-MAX_TIMES:],
        restart_budget=sv.cfg.restart_budget,
        restart_budget_window_s=sv.cfg.restart_budget_window_s,
        storm=h.storm,
        last_label=h.last_label,
        quarantine_times=sv.quarantine_times[-MAX_TIMES:],
        launch_failures=h.launch_failures,
        written_at=sv.now,
        attempt=sv.attempt,
        decided_attempt=sv.decided_attempt,
    )
    for c in h.loops:
        s = c.signature
        rec.loops.add(
            label=s.label,
            resume_step=s.resume_step,
            step=s.step,
            slack=s.slack,
            count=c.count,
            suspects=[store_pb2.Strike(node=n, at=t) for n, t in c.suspects[-MAX_TIMES:]],
            last_first_exit=c.last_first_exit,
        )
    for node, steps in sorted(sv.offences.items()):
        rec.offences.add(node=node, steps=sorted(steps)[-MAX_OFFENCE_STEPS:])
    return rec


def persist(sv: Run) -> None:
    sv.emit(PersistMemory(record=record(sv)))


def _times(values: Iterable[float], now: float) -> list[float]:
    """Times from the store: finite, not in the future (a bad one is dropped alone)."""
    return sorted(float(t) for t in values if math.isfinite(t) and t <= now + 1)


def restore(sv: Run, rec: store_pb2.SupervisorMemory) -> str:
    """Continue from a predecessor's memory (a fresh core only); returns what was restored, in words."""
    if rec.run and rec.run != sv.plan.run:
        return f"memory of run {rec.run!r} ignored"
    h = sv.history
    h.restart_times = _times(rec.restart_times, sv.now)[-MAX_TIMES:]
    sv.quarantine_times = _times(rec.quarantine_times, sv.now)[-MAX_TIMES:]
    h.storm = max(0, rec.storm)
    h.last_label = rec.last_label[:128]
    h.launch_failures = max(0, rec.launch_failures)
    sv.decided_attempt = max(0, rec.decided_attempt)
    h.loops = []
    for loop in rec.loops[-MAX_LOOP_CANDIDATES:]:
        if loop.count <= 0 or loop.step < -1 or loop.slack < 0:
            continue  # not a failure anyone saw: dropped alone
        sig = Signature(
            label=loop.label[:128], resume_step=loop.resume_step, step=loop.step, slack=loop.slack
        )
        suspects = [
            (s.node, s.at) for s in loop.suspects if s.node and len(s.node) <= 253 and math.isfinite(s.at)
        ]
        last = loop.last_first_exit if len(loop.last_first_exit) <= 253 else ""
        h.loops.append(
            LoopCandidate(signature=sig, count=loop.count, suspects=suspects, last_first_exit=last)
        )
    sv.offences = {
        o.node: {s for s in o.steps if s >= 0} for o in rec.offences if o.node and len(o.node) <= 253
    }
    used = h.used(sv.cfg, sv.now)
    loop_text = "".join(f", crash-loop candidate {c.count}x ({c.signature.label})" for c in h.loops)
    return f"memory restored: {used} restart(s) in the budget window{loop_text}"
