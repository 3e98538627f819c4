"""What a fresh core takes from the event log (level-triggered): the loss history, and the last
attempt a LAUNCH names.

The core's replay comparison (controller/supervisor/loss.py) needs the losses earlier attempts
reported; they live in its memory, and their durable copy is the LOSS_RECORD events it logs. When
the shell builds a core (it became leader, or rebuilt a broken core), it reads the log's tail and
hands the history over in the StoreListed (`LossHistory`), undoing what the old core undid: after a
stop for a loss anomaly (LOSS_ANOMALY, action "stop"), the relaunch (the next LAUNCH) forgets the
steps from the anomaly's on. A bad value in the log is skipped alone, never a crash.

The last LAUNCH: a leader logs the launch before it writes the attempt record; killed in between,
it leaves a number the store does not know, and its successor launches past it (`last_launch`),
so no attempt number is logged as launched twice.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from pathlib import Path

from controller.supervisor.events import LossHistory
from runwarden.eventlog import read_tail
from runwarden.v1 import events_pb2 as E

log = logging.getLogger(__name__)

# The loss history is the last loss_history_steps steps (1024 by default): at RECORDED_RANKS values a
# step, ~370 kB of LOSS_RECORD lines. The tail read is bounded near 3x that, since decoding is what a
# take-over waits for (measured on the shared 2-core test machine, a log of 6 MiB of records at 8
# ranks: its last 4 MiB, 11,600 steps, read in 1.3 s; its last 1 MiB, 2,870 steps, in 0.5-0.7 s).
TAIL_BYTES = 1 << 20


def loss_history(events: Iterable[E.Event], run: str) -> LossHistory:
    """The history the core had, from its events in log order (any other run's are skipped)."""
    points: list[tuple[int, int, int, float]] = []
    logged: set[tuple[int, str]] = set()
    cut: int | None = None  # an anomaly's stop: its relaunch forgets the steps from it on
    for ev in events:
        if ev.run != run:
            continue
        if ev.kind == E.EVENT_KIND_LOSS_RECORD:
            for p in ev.loss.points:
                if p.step >= 0 and p.rank >= 0 and ev.attempt >= 1 and math.isfinite(p.loss):
                    points.append((p.step, p.rank, ev.attempt, p.loss))
        elif ev.kind in (E.EVENT_KIND_DIVERGENCE, E.EVENT_KIND_LOSS_ANOMALY):
            logged.add((ev.attempt, ev.loss.rule))
            if ev.kind == E.EVENT_KIND_LOSS_ANOMALY and ev.loss.action == "stop":
                # a bad restore (non_finite_after_load) cuts after its rollback point, which may be
                # below the step it was seen at (loss.py's _bad_restore)
                at = ev.loss.resume_step + 1 if ev.loss.rule == "non_finite_after_load" else ev.step
                cut = at if cut is None else min(cut, at)
        elif ev.kind == E.EVENT_KIND_LAUNCH and cut is not None:
            points = [x for x in points if x[0] < cut]
            cut = None
    return LossHistory(points=tuple(points), logged=tuple(sorted(logged)), rollback_before=cut)


def last_launch(events: Iterable[E.Event], run: str) -> int:
    """The highest attempt a LAUNCH of `run` names (0: none)."""
    return max((ev.attempt for ev in events if ev.run == run and ev.kind == E.EVENT_KIND_LAUNCH), default=0)


def read_history(path: Path, run: str, tail_bytes: int = TAIL_BYTES) -> tuple[LossHistory, int]:
    """(`loss_history`, `last_launch`) of the log's tail (a launch whose record was never written
    is among the log's last lines); an unreadable log is an empty history and 0 (logged)."""
    try:
        read = read_tail(path, tail_bytes)
    except OSError as exc:
        log.warning("loss history: cannot read the event log %s: %s; starting without it", path, exc)
        return LossHistory(), 0
    history = loss_history(read.entries, run)
    log.info(
        "loss history from the event log: %d values, %d steps",
        len(history.points),
        len({p[0] for p in history.points}),
    )
    return history, last_launch(read.entries, run)
