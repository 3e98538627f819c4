"""Progress aggregation: ranks report often; etcd gets one write per node per interval.

`ProgressTable` keeps the newest report of every rank of every run on this node. `flush()` puts
one NodeProgress per run that changed since the last flush, under keys.progress(run, node). A rank
that stops reporting keeps its last `reported_at`, which is how the controller sees it stale.
A report for a newer attempt replaces the run's table; reports for older attempts are dropped.
When the node's workers of an attempt end, `record_exit` adds their exit status to the run's
NodeProgress (the controller's only source of worker exits); the agent flushes it at once, and
likewise the first report in which a rank says its checkpoint is loaded (`loaded_step`), so the
restart's load phase ends in the event log when it ends on the node, not up to an interval later,
and the first report of a step after that load (the restart's first new step: the controller's
FIRST_STEP, the end of the restart's downtime, is then as late as one etcd write, not an interval),
and a rank's report of a newer committed checkpoint (CHECKPOINT_COMMIT's time ends its save in the
goodput timeline: a planned stop's save is labelled from there back by its stall).
A rank's `collective_entered_at` (its host's clock, which is this agent's) goes out as
`collective_age_s`, its age at the write.
An exit after which any rank of that attempt had reported a `stop_reason` carries it as
`planned_stop`: how the controller tells a planned stop (save, commit, exit 0) from the end of
training, which also exits 0.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

from runwarden.v1 import common_pb2, store_pb2

# What a rank reports when it stops only because a peer asked (the trainer's `stop_agreed`; the
# same words as nodeagent.trainer.FOLLOWED_STOP_REASON, which runs in the training process).
FOLLOWED_STOP_REASON = "a peer rank's stop request"

MAX_RECENT_LOSSES = 64  # per rank per write (RankProgress.recent_losses); the oldest beyond: dropped


class ProgressTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._attempt: dict[str, int] = {}
        self._ranks: dict[str, dict[int, common_pb2.RankProgress]] = {}
        self._dirty: set[str] = set()
        self._exit: dict[str, common_pb2.ExitStatus] = {}
        self._urgent_reports = 0

    def _switch(self, run: str, attempt: int) -> bool:
        """Make `attempt` the run's current one (a newer one starts an empty table); False if older."""
        current = self._attempt.get(run)
        if current is not None and attempt < current:
            return False
        if current is None or attempt > current:
            self._attempt[run] = attempt
            self._ranks[run] = {}
            self._exit.pop(run, None)
        return True

    def record(self, run: str, attempt: int, reports: Iterable[common_pb2.RankProgress]) -> bool:
        """False if the reports are for an older attempt than the newest seen (dropped)."""
        with self._lock:
            if not self._switch(run, attempt):
                return False
            table = self._ranks[run]
            for report in reports:
                old = table.get(report.rank)
                if old is None or report.step >= old.step or report.reported_at >= old.reported_at:
                    if _urgent(old, report):
                        self._urgent_reports += 1
                    if old is not None and (old.recent_losses or old.losses_dropped):
                        _merge_losses(report, old, keep_first=False)  # not written yet: kept
                    table[report.rank] = report
                elif report.recent_losses or report.losses_dropped:
                    _merge_losses(old, report, keep_first=True)  # an older report's losses still count
            self._dirty.add(run)
            return True

    def take_urgent_reports(self) -> int:
        """How many ranks first said "loaded", or first reported a step after their load, since the
        last call (the agent flushes those at once)."""
        with self._lock:
            marks, self._urgent_reports = self._urgent_reports, 0
            return marks

    def record_exit(self, run: str, attempt: int, status: common_pb2.ExitStatus) -> bool:
        """The node's workers of `attempt` ended; False if a newer attempt is already reported.

        Sets `status.planned_stop` (unless given) to the stop reason of the lowest rank that
        reported why the stop began (a signal, the stop file, ...); a rank that only followed its
        peers (`FOLLOWED_STOP_REASON`) says why only when no rank of this node says more. Which
        rank notices a stop file first is a race; the record says the same either way."""
        with self._lock:
            if not self._switch(run, attempt):
                return False
            if not status.planned_stop:
                reasons = [r.stop_reason for _, r in sorted(self._ranks[run].items()) if r.stop_reason]
                origins = [why for why in reasons if why != FOLLOWED_STOP_REASON]
                if reasons:
                    status.planned_stop = (origins or reasons)[0]
            self._exit[run] = status
            self._dirty.add(run)
            return True

    def runs(self) -> set[str]:
        with self._lock:
            return set(self._attempt)

    def attempt(self, run: str) -> int | None:
        with self._lock:
            return self._attempt.get(run)

    def ranks(self, run: str | None = None) -> list[common_pb2.RankProgress]:
        with self._lock:
            tables = [self._ranks.get(run, {})] if run is not None else list(self._ranks.values())
            return [r for t in tables for _, r in sorted(t.items())]

    def pid_of_local_rank(self, local_rank: int) -> int | None:
        """The pid reported most recently by this local rank (any run)."""
        best: common_pb2.RankProgress | None = None
        for r in self.ranks():
            if (
                r.local_rank == local_rank
                and r.pid > 0
                and (best is None or r.reported_at > best.reported_at)
            ):
                best = r
        return best.pid if best is not None else None

    def forget(self, run: str) -> None:
        with self._lock:
            self._attempt.pop(run, None)
            self._ranks.pop(run, None)
            self._exit.pop(run, None)
            self._dirty.discard(run)

    def take_dirty(self, node: str) -> list[tuple[str, store_pb2.NodeProgress]]:
        with self._lock:
            dirty, self._dirty = self._dirty, set()
            now = time.time()
            out = [
                (
                    run,
                    store_pb2.NodeProgress(
                        node=node,
                        run=run,
                        attempt=self._attempt[run],
                        ranks=[r for _, r in sorted(self._ranks[run].items())],
                        written_at=now,
                        exit=self._exit.get(run),
                    ),
                )
                for run in sorted(dirty)
                if run in self._attempt
            ]
            for _, value in out:
                for r in value.ranks:
                    if r.HasField("collectives_entered"):
                        # the rank's entry time, on this host's clock, as an age at this write: the
                        # controller places it on its own clock (received - age), not by comparing clocks
                        r.collective_age_s = max(0.0, now - r.collective_entered_at)
            for run in dirty:  # each loss is written once (a failed put loses them: training goes on)
                for r in self._ranks.get(run, {}).values():
                    if r.recent_losses or r.losses_dropped:
                        del r.recent_losses[:]
                        r.losses_dropped = 0
            return out

    def mark_dirty(self, run: str) -> None:
        with self._lock:
            self._dirty.add(run)


def _merge_losses(into: common_pb2.RankProgress, other: common_pb2.RankProgress, *, keep_first: bool) -> None:
    """Put `other`'s unwritten losses into `into` (before its own unless keep_first), at most
    MAX_RECENT_LOSSES, the oldest dropped and counted: each step's loss reaches etcd once."""
    first, then = (into, other) if keep_first else (other, into)
    merged = [(x.step, x.loss) for x in (*first.recent_losses, *then.recent_losses)]
    dropped = into.losses_dropped + other.losses_dropped
    if len(merged) > MAX_RECENT_LOSSES:
        merged.sort(key=lambda x: x[0])
        dropped += len(merged) - MAX_RECENT_LOSSES
        merged = merged[-MAX_RECENT_LOSSES:]
    del into.recent_losses[:]
    into.recent_losses.extend(common_pb2.StepLoss(step=s, loss=v) for s, v in merged)
    into.losses_dropped = dropped


def flush(table: ProgressTable, store: Any, node: str) -> int:
    """One put per changed run; a failed put leaves its run dirty for the next interval."""
    written = 0
    error: Exception | None = None
    for run, value in table.take_dirty(node):
        try:
            store.put(store.keys.progress(run, node), value.SerializeToString())
            written += 1
        except Exception as exc:
            table.mark_dirty(run)
            error = exc
    if error is not None:
        raise error
    return written


def _urgent(old: common_pb2.RankProgress | None, new: common_pb2.RankProgress) -> bool:
    """`new` first says the rank loaded its checkpoint, or is its first step after that load, or
    reports a commit newer than `old`'s, or that its load refused a step (each written to etcd at
    once: the refusal before the rank's exit, so that the controller blames the files, not a node)."""
    if new.load_error and (old is None or old.load_error != new.load_error):
        return True
    if new.HasField("loaded_step") and (
        old is None or not old.HasField("loaded_step") or _first_step_after_load(old, new)
    ):
        return True
    return new.HasField("committed_step") and (
        old is None or not old.HasField("committed_step") or new.committed_step != old.committed_step
    )


def _first_step_after_load(old: common_pb2.RankProgress, new: common_pb2.RankProgress) -> bool:
    """`new` is the rank's first report of a step after the checkpoint it loaded (the load mark
    reports the loaded step, or 0 from scratch, as the step)."""
    loaded = max(0, new.loaded_step)
    return old.step <= loaded < new.step
