"""The training-loss rules: a NaN or spiking loss (`LOSS_ANOMALY`, `_anomaly`) and divergence after
a resume (`DIVERGENCE`, `_compare`). Pure, like every rule. Every step's loss of every rank reaches
the core (`RankSample.losses`); `observe` takes one node's and returns the failure to begin, if a
rule stops the attempt. Neither is blamed on a node: the stop is a `DETECTOR_LOSS` failure with no
node, so the blame ladder finds no suspect (software: the model or data) and the crash-loop rule
sees the same label at the same step if the rollback does not help. The history survives a
controller restart through `LOSS_RECORD` events (`flush_record`, `restore`).
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING

from controller.supervisor import stats
from controller.supervisor.actions import PersistCheckpoint
from controller.supervisor.attempt import Failure
from controller.supervisor.events import LossHistory, ProgressObserved
from controller.supervisor.records import LossBook, ReplayedStep
from runwarden.v1 import events_pb2 as E

if TYPE_CHECKING:
    from controller.supervisor.run import Run

REPLAY_POINTS_PER_EVENT = 64
# The durable copy (LOSS_RECORD): ranks 0..7 only, so its cost is per step, not per rank; one event
# when its oldest value is RECORD_EVERY_S old or it has RECORD_MAX_POINTS (a run of any size at a step
# a second: an event of 80 values every 10 s, ~3 kB, ~27 MB a day).
RECORDED_RANKS = 8
RECORD_EVERY_S = 10.0
RECORD_MAX_POINTS = 1024
_TINY = 1e-12


def rel_diff(new: float, old: float) -> float:
    if math.isfinite(new) and math.isfinite(old):
        return abs(new - old) / max(abs(old), _TINY)
    if new == old or (math.isnan(new) and math.isnan(old)):
        return 0.0
    return math.inf


def _num(x: float) -> str:
    return f"{x:.6g}"


def observe(sv: Run, ev: ProgressObserved) -> Failure | None:
    """RUNNING: one node's progress put of the current attempt. The failure to begin, if a rule
    stops the attempt (the caller begins it); None otherwise."""
    a = sv.cur
    book: LossBook = sv.losses
    if book.attempt != a.number:
        flush_replay(sv)  # an earlier attempt's replay that ended unlogged
        flush_record(sv)  # and its record
        book.new_attempt(a.number, a.resume_step)
    cfg = sv.cfg
    tol = cfg.divergence_tolerance
    factor = cfg.loss_spike_factor
    stop: Failure | None = None
    seen_any = False
    for r in ev.ranks:
        if not r.losses:
            continue
        seen_any = True
        window = book.windows.get(r.rank)
        if window is None or window.maxlen != cfg.loss_spike_window:  # new, or the policy changed live
            window = book.windows[r.rank] = deque(window or (), maxlen=cfg.loss_spike_window)
        for step, value in r.losses:
            at = book.history.get(step)
            prev = at.get(r.rank) if at is not None else None
            if prev is not None and prev[0] >= a.number:
                continue  # already seen in this attempt (a report sent twice)
            # An anomaly is reported as one, and kept out of the history and the rank's window: it is
            # no reference for a replay (a rollback is meant not to repeat it) nor part of the normal.
            if not math.isfinite(value):
                # the first step after the load, and no attempt that trained into this step saw it
                if a.resume_step >= 0 and step == a.resume_step + 1 and step not in book.non_finite_steps:
                    f = _bad_restore(sv, ev.node, r.rank, step, value, r.reported_at)
                else:
                    book.saw_non_finite(step)
                    f = _anomaly(sv, ev.node, r.rank, step, value, "non_finite", 0.0, r.reported_at)
                stop = stop or f
                continue
            if book.reloaded_from_storage is not None and step > book.reloaded_from_storage + 1:
                book.reloaded_from_storage = None  # the reload from storage trained past its first step
            if factor > 0 and len(window) == window.maxlen and step > cfg.loss_spike_warmup_steps:
                med = stats.median([v for _, v in window])
                if med > 0 and value > factor * med:
                    f = _anomaly(sv, ev.node, r.rank, step, value, "spike", med, r.reported_at)
                    stop = stop or f
                    continue
            if at is None:
                at = book.history[step] = {}
            if prev is None:
                book.values += 1
            at[r.rank] = (a.number, value)
            if tol > 0 and r.rank < RECORDED_RANKS:
                if not book.unrecorded:
                    book.unrecorded_since = sv.now
                book.unrecorded.append((step, r.rank, value))
            if step > book.max_step:
                book.max_step = step
            if prev is not None:
                f = _compare(sv, ev.node, r.rank, step, value, prev, tol)
                stop = stop or f
            if window and window[-1][0] >= step:
                continue  # a step out of order (replayed after a resume the window already covers)
            window.append((step, value))
    if not seen_any:
        return stop
    if book.pending and (
        len(book.pending) >= REPLAY_POINTS_PER_EVENT or a.min_step > book.replay_until or _replayed_all(book)
    ):
        flush_replay(sv)
    if book.unrecorded and (
        len(book.unrecorded) >= RECORD_MAX_POINTS or sv.now - book.unrecorded_since >= RECORD_EVERY_S
    ):
        flush_record(sv)
    book.prune(cfg.loss_history_steps)
    return stop


def _replayed_all(book: LossBook) -> bool:
    """Every rank that reported the last step seen before this attempt has reported it again."""
    last = book.pending.get(book.replay_until)
    return last is not None and last.ranks >= len(book.history.get(book.replay_until, ()))


def _compare(
    sv: Run, node: str, rank: int, step: int, value: float, prev: tuple[int, float], tol: float
) -> Failure | None:
    """Divergence: a resumed attempt that replays a (step, rank) an earlier attempt reported is
    compared with it: relative difference |new - old| / max(|old|, 1e-12), inf when one of the
    two is non-finite and the other is not the same value. Beyond `divergence_tolerance` (0:
    off) the first divergence of the attempt is logged with both values and pages, or stops
    (`on_divergence`), relaunching from the latest commit as any failure does. Every replayed
    step is summarised in `LOSS_REPLAY` events (one point per step: its worst rank; at most
    `REPLAY_POINTS_PER_EVENT` points an event; a step's ranks may be split over two events, a
    reader merges them), which `controllerctl compare-loss` reads offline."""
    book: LossBook = sv.losses
    old_attempt, old = prev
    rel = rel_diff(value, old)
    p = book.pending.get(step)
    if p is None:
        book.pending[step] = ReplayedStep(rank, node, value, old, old_attempt, rel)
    else:
        p.ranks += 1
        if rel > p.rel or (rel == p.rel and rank < p.rank):
            p.rank, p.node, p.loss, p.earlier, p.earlier_attempt, p.rel = (
                rank,
                node,
                value,
                old,
                old_attempt,
                rel,
            )
    if tol <= 0 or rel <= tol:
        return None
    book.diverged += 1
    if "divergence" in book.logged:
        return None
    book.logged.add("divergence")
    action = sv.cfg.on_divergence
    what = "stopping the attempt; relaunching from the latest commit" if action == "stop" else "paging"
    reason = (
        f"divergence after resume: step {step} rank {rank} on {node}: loss {_num(value)} in attempt "
        f"{sv.attempt} vs {_num(old)} in attempt {old_attempt} (relative difference {_num(rel)} > "
        f"tolerance {_num(tol)}; resumed from step {book.resume_step}); {what}"
    )
    sv.log(
        E.EVENT_KIND_DIVERGENCE,
        reason,
        step=step,
        loss=E.LossDetail(
            rule="divergence",
            points=[_point(step, rank, node, value, old, old_attempt, rel)],
            threshold=tol,
            action=action,
            resume_step=book.resume_step,
        ),
    )
    if action != "stop":
        sv.page(reason)
        return None
    book.stop_since = sv.now
    return Failure(
        detector=E.DETECTOR_LOSS,
        nodes=[],
        ranks=[rank],
        step=step,
        label="loss:divergence",
        reason=reason,
        dumps=False,
    )


def _anomaly(
    sv: Run, node: str, rank: int, step: int, value: float, rule: str, med: float, reported_at: float
) -> Failure | None:
    """An anomaly: a non-finite loss, always; or, with `loss_spike_factor` k > 0, a loss above k x
    the rank's running median (the median of its last `loss_spike_window` finite, non-anomalous
    losses), once the rank is past `loss_spike_warmup_steps` and its window is full, and only
    while that median is > 0 (k x a median <= 0 means nothing). Logged once per rule per attempt
    with the step, rank, node and values. `on_loss_anomaly = "page"` pages; `"stop"` stops the
    attempt and relaunches from the newest commit *before* the anomaly's step: commits at or
    after it hold the state that produced it and stop being resume points (older commits stay on
    disk: the trainer never prunes them, nodeagent/trainer/checkpoint.py). If no commit is
    older, the relaunch is from scratch. An anomalous loss is kept out of the history and the
    rank's window (no reference for a replay, not part of the normal), and a rollback forgets
    the losses from the anomaly's step on."""
    book: LossBook = sv.losses
    if rule in book.logged:
        return None
    book.logged.add(rule)
    cfg = sv.cfg
    action = cfg.on_loss_anomaly
    if rule == "spike":
        what = (
            f"loss spike at step {step}: rank {rank} on {node} reported {_num(value)}, above "
            f"{cfg.loss_spike_factor:g} x its running median {_num(med)} (last {cfg.loss_spike_window} steps)"
        )
    else:
        what = f"non-finite loss at step {step}: rank {rank} on {node} reported {value}"
    rollback = -1
    if action == "stop":
        before = [c for c in sv.committed if c < step]
        rollback = max(before) if before else -1
        later = sorted(c for c in sv.committed if c >= step)
        undone = f"; commits {later} hold its state and are no longer resume points" if later else ""
        where = f"committed step {rollback}" if rollback >= 0 else "scratch (no commit before it)"
        reason = f"{what}; stopping the attempt, relaunching from {where}, before the anomaly{undone}"
    else:
        reason = f"{what}; paging (on_loss_anomaly = page): the attempt goes on"
    sv.log(
        E.EVENT_KIND_LOSS_ANOMALY,
        reason,
        step=step,
        loss=E.LossDetail(
            rule=rule,
            points=[E.LossPoint(step=step, rank=rank, node=node, loss=value)],
            median=med,
            threshold=cfg.loss_spike_factor if rule == "spike" else 0.0,
            action=action,
            resume_step=rollback,
        ),
    )
    if action != "stop":
        sv.page(reason)
        return None
    return _stop(book, step, rank, rule, reason, cut=step, reported_at=reported_at, now=sv.now)


def _stop(
    book: LossBook, step: int, rank: int, rule: str, reason: str, *, cut: int, reported_at: float, now: float
) -> Failure:
    """The stop of a loss rule, on no node: the commits from `cut` on stop being resume points."""
    book.rollback_before = cut if book.rollback_before is None else min(book.rollback_before, cut)
    book.stop_since = reported_at if 0 < reported_at <= now else now
    return Failure(
        detector=E.DETECTOR_LOSS,
        nodes=[],
        ranks=[rank],
        step=step,
        label=f"loss:{rule}",
        reason=reason,
        dumps=False,
    )


AFTER_LOAD = "non_finite_after_load"


def _bad_restore(
    sv: Run, node: str, rank: int, step: int, value: float, reported_at: float
) -> Failure | None:
    """A non-finite loss on the first step after the attempt loaded its resume point N, at a step no
    attempt that trained into it found non-finite (then it is the job's: `_anomaly`): the state it
    loaded is bad, whatever `on_loss_anomaly` says (Megatron-LM #5281: a replica restored without
    validation gave NaN, and every relaunch loaded it again). The next attempt takes the previous
    source: where some node's state came from memory or a peer (or it did not say), step N again
    from storage, every node cold (fresh ranks hold no copies); where it came from storage (every
    node said so, or this attempt was that reload), the commit before N, and N stops being a resume
    point, in the store too; where it came from an in-memory snapshot, the newest commit (the
    snapshot is dropped). A stop on no node; the restart budget bounds the walk back. What a
    controller restart in between loses: the reload's cold flag (the next load may be warm again,
    and this rule then sends it to storage once more)."""
    book: LossBook = sv.losses
    if AFTER_LOAD in book.logged:
        return None
    book.logged.add(AFTER_LOAD)
    a = sv.cur
    n = a.resume_step
    said = set(a.loaded_from.values()) if len(a.loaded_from) == len(a.node_step) else set()
    what = f"non-finite loss at step {step}, the first after loading step {n}: rank {rank} on {node} reported {value}"
    if a.resume_snapshot:
        rollback = max((c for c in sv.committed if c <= n), default=-1)
        sv.resumed_snapshot = None
        then = f"committed step {rollback}" if rollback >= 0 else "scratch (no commit before it)"
        reason = f"{what}; that state came from the in-memory snapshot of step {n}: dropped, relaunching from {then}"
    elif book.reloaded_from_storage == n or said == {"storage"}:
        rollback = max((c for c in sv.committed if c < n), default=-1)
        book.reloaded_from_storage = None
        then = f"committed step {rollback}" if rollback >= 0 else "scratch (no commit before it)"
        reason = f"{what}; that state came from storage: step {n} is no longer a resume point, relaunching from {then}"
        if n in sv.committed:
            sv.emit(PersistCheckpoint(step=n, path="", attempt=a.number, invalid=reason[:1000]))
    else:
        rollback = n
        book.reloaded_from_storage = n
        sources = ", ".join(f"{s} on {nd}" for nd, s in sorted(a.loaded_from.items())) or "sources not said"
        reason = f"{what}; that state came from {sources}: relaunching from step {n} loaded from storage (every node cold)"
    sv.log(
        E.EVENT_KIND_LOSS_ANOMALY,
        reason,
        step=step,
        loss=E.LossDetail(
            rule=AFTER_LOAD,
            points=[E.LossPoint(step=step, rank=rank, node=node, loss=value)],
            action="stop",
            resume_step=rollback,
        ),
    )
    # the commits after the rollback point stop being resume points
    return _stop(book, step, rank, AFTER_LOAD, reason, cut=rollback + 1, reported_at=reported_at, now=sv.now)


def _point(
    step: int,
    rank: int,
    node: str,
    loss: float,
    earlier: float,
    earlier_attempt: int,
    rel: float,
    ranks: int = 1,
) -> E.LossPoint:
    return E.LossPoint(
        step=step,
        rank=rank,
        node=node,
        loss=loss,
        earlier_loss=earlier,
        earlier_attempt=earlier_attempt,
        rel_diff=rel,
        ranks_compared=ranks,
    )


def flush_replay(sv: Run) -> None:
    """Log the attempt's pending replay comparisons (one LOSS_REPLAY event), if any."""
    book: LossBook = sv.losses
    if not book.pending:
        return
    pending, book.pending = book.pending, {}
    points = [
        _point(s, p.rank, p.node, p.loss, p.earlier, p.earlier_attempt, p.rel, p.ranks)
        for s, p in sorted(pending.items())
    ]
    worst = max(p.rel for p in pending.values())
    first, last = points[0].step, points[-1].step
    tol = sv.cfg.divergence_tolerance
    verdict = "within" if tol > 0 and worst <= tol else "beyond" if tol > 0 else "no tolerance set for"
    sv.log(
        E.EVENT_KIND_LOSS_REPLAY,
        f"replayed steps {first}-{last} of attempt {book.attempt} (resumed from {book.resume_step}) "
        f"compared with earlier attempts: max relative difference {_num(worst)}, {verdict} "
        f"tolerance {_num(tol)}",
        step=last,
        attempt=book.attempt,
        loss=E.LossDetail(
            rule="replay", points=points, threshold=tol, max_rel_diff=worst, resume_step=book.resume_step
        ),
    )


def resume_step(sv: Run) -> int:
    """The step the next launch resumes from: the latest commit, or, after a stop for a loss anomaly,
    the newest commit before its step (the commits at or after it stop being resume points)."""
    book: LossBook = sv.losses
    if book.rollback_before is not None:
        cut, book.rollback_before = book.rollback_before, None
        sv.committed = {c for c in sv.committed if c < cut}
        sv.latest_committed = max(sv.committed, default=-1)
        for s in [s for s in book.history if s >= cut]:  # the state that made the anomaly: no reference
            book.values -= len(book.history.pop(s))
        book.max_step = max(book.history, default=-1)
    return sv.latest_committed


def flush_record(sv: Run) -> None:
    """Log the history's values not yet recorded (one LOSS_RECORD event), if any: the durable copy a
    new leader's core is rebuilt from (`restore`).

    Memory: the losses of the last `loss_history_steps` steps (by step number, from the newest
    seen) and at most `MAX_HISTORY_VALUES` (step, rank) values in all, the oldest steps dropped
    first; plus each rank's spike window (`loss_spike_window` values per rank).

    Durable: the history is the core's memory, and a new leader (or a rebuilt core) starts
    without it, so a replay after a controller restart would compare nothing. With a tolerance
    set, every value the history takes for a rank below `RECORDED_RANKS` (first seen or
    replayed) is also logged, in a `LOSS_RECORD` event at most `RECORD_EVERY_S` after it came
    (sooner when `RECORD_MAX_POINTS` are waiting, or when the attempt fails or changes); the
    shell reads them back from the event log's tail when it builds a fresh core and hands them
    over in the `StoreListed` (`LossHistory`), where `restore` puts them back, rollbacks and the
    current attempt's logged rules included. What a restart loses: the values not yet logged
    (the last `RECORD_EVERY_S` at most), ranks from `RECORDED_RANKS` on (a replay after a
    restart is compared on ranks 0-7 only), and the spike windows (they refill; no spike check
    until then)."""
    book: LossBook = sv.losses
    if not book.unrecorded:
        return
    points, book.unrecorded = book.unrecorded, []
    steps = [s for s, _, _ in points]
    sv.log(
        E.EVENT_KIND_LOSS_RECORD,
        f"loss record: {len(points)} values of steps {min(steps)}-{max(steps)} of attempt {book.attempt} "
        f"(ranks < {RECORDED_RANKS}), kept for the replay comparison",
        step=max(steps),
        attempt=book.attempt,
        loss=E.LossDetail(
            rule="record",
            points=[E.LossPoint(step=s, rank=r, loss=v) for s, r, v in points],
            resume_step=book.resume_step,
        ),
    )


def restore(sv: Run, hist: LossHistory, attempt: int, resume_step: int) -> None:
    """A fresh core (a new leader, or a core rebuilt after a bug): put back the history its
    predecessor logged (`hist`, from the LOSS_RECORD events; the shell undid rollbacks), with
    `attempt` (the store's attempt record, `resume_step` its resume point) as the current one: the
    steps earlier attempts reached are its replays, and the rules it already logged stay logged."""
    book: LossBook = sv.losses
    for step, rank, att, value in hist.points:
        at = book.history.setdefault(step, {})
        prev = at.get(rank)
        if prev is None:
            book.values += 1
        if prev is None or att >= prev[0]:
            at[rank] = (att, value)
        book.max_step = max(book.max_step, step)
    if attempt > 0:
        book.attempt, book.resume_step = attempt, resume_step
        book.replay_until = max((s for s, _, att, _ in hist.points if att < attempt), default=-1)
        book.logged = {rule for att, rule in hist.logged if att == attempt}
    if hist.rollback_before is not None:  # stopped for an anomaly, not relaunched yet
        book.rollback_before = hist.rollback_before
    book.prune(sv.cfg.loss_history_steps)
