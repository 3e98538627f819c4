"""Rules for the running attempt: progress, load marks, the first step, hang and straggler
detection, worker exits, checkpoints and planned stops."""

from __future__ import annotations

from typing import TYPE_CHECKING

from controller.supervisor import (
    collectives,
    detectors,
    failure,
    loss,
    nodes,
    spare_checks,
    stats,
    stops,
    transitions,
)
from controller.supervisor.actions import SetTimer
from controller.supervisor.attempt import UNREPORTED, Failure
from controller.supervisor.events import (
    AttemptExited,
    CheckpointCommitted,
    NodeLaunchPath,
    ProgressObserved,
    StopRequested,
    WorkersStarted,
)
from controller.supervisor.states import RunState
from runwarden.v1 import common_pb2
from runwarden.v1 import events_pb2 as E

if TYPE_CHECKING:
    from controller.supervisor.run import Run


def on_progress(sv: Run, ev: ProgressObserved) -> None:
    # the hottest path (one call per node per interval): one pass over the ranks, no generators
    a = sv.cur
    old = a.node_step.get(ev.node)
    if old is None or ev.attempt != a.number or not ev.ranks:
        return
    a.node_seen_at[ev.node] = sv.now
    _on_steps(sv, ev, old)
    sv.collective_lateness.extend(a.collectives.observe(ev.node, ev.ranks, sv.now))
    a.snapshots.observe(ev.node, ev.ranks)
    if sv.state is RunState.RUNNING:  # the step rules may have ended the attempt (a straggler killed)
        stop = loss.observe(sv, ev)  # the losses the put carries, after its steps are counted
        if stop is not None:
            failure.begin(sv, stop, latency=sv.now - sv.losses.stop_since)
    if sv.state is RunState.RUNNING and sv.cfg.collective_hang_s > 0 and a.min_step != UNREPORTED:
        stall = a.collectives.stall(len(a.nodes))
        if stall is not None and (stall.entered, stall.since) != a.collective_armed:
            # a new wait: the hang timer may be due sooner (its tick runs every rule; cheap here,
            # since the ranks' reports arrive node by node and each new collective is one)
            a.collective_armed = (stall.entered, stall.since)
            at = stall.since + _collective_bound(sv)
            if at < a.hang_timer_at:
                a.hang_timer_at = at
                sv.emit(SetTimer(key="hang", at=at))


def on_progress_ending(sv: Run, ev: ProgressObserved) -> None:
    """COLLECTING, STOPPING: the ranks still report the snapshots they take until they stop (a lost
    host's peers train on until its lease expires): the relaunch may resume from the newest."""
    if ev.attempt == sv.cur.number and ev.node in sv.cur.node_step and ev.ranks:
        sv.cur.snapshots.observe(ev.node, ev.ranks)


def _on_steps(sv: Run, ev: ProgressObserved, old: int) -> None:
    a = sv.cur
    if not a.load_logged:
        loaded = True
        stepped = False
        resume = a.resume_step if a.resume_step > 0 else 0
        for r in ev.ranks:
            loaded = loaded and r.loaded_step is not None
            stepped = stepped or r.step > resume
        if loaded:
            sources = sorted({r.loaded_from for r in ev.ranks if r.loaded_from})
            if sources:
                a.loaded_from[ev.node] = "+".join(sources)
            why = next((r.load_fallback for r in ev.ranks if r.load_fallback), "")
            if why:
                a.load_fallbacks[ev.node] = why
            _node_loaded(sv, ev.node)
            if not stepped:
                return  # a load mark: no step was taken yet, so no step accounting
    if ev.node not in a.finished_nodes and all(r.finished for r in ev.ranks):
        a.finished_nodes.add(ev.node)
        a.finished_at = sv.now
    alpha = sv.cfg.straggler_ewma_alpha
    loads = a.loads
    node_step = ev.ranks[0].step
    step_time = 0.0
    saving = False
    evaluating = False
    for r in ev.ranks:
        evaluating = evaluating or r.in_eval
        if r.step < node_step:
            node_step = r.step
        if r.step_time_s > step_time:
            step_time = r.step_time_s
        # "saving step S" after S was committed is stale: every rank finished that save
        if r.in_checkpoint and r.step > sv.latest_committed:
            saving = True
            if r.step not in a.save_started and len(a.save_started) < 64:
                a.save_started[r.step] = sv.now
        prev = loads.get(r.rank)
        if prev is None:
            loads[r.rank] = (ev.node, r.compute_s, r.wait_s)
        else:
            loads[r.rank] = (
                ev.node,
                prev[1] + alpha * (r.compute_s - prev[1]),
                prev[2] + alpha * (r.wait_s - prev[2]),
            )
    if saving:
        a.ckpt_nodes.add(ev.node)
    elif a.ckpt_nodes:
        a.ckpt_nodes.discard(ev.node)
    if evaluating:
        if not a.eval_nodes:
            a.eval_since = sv.now
        a.eval_nodes.add(ev.node)
    elif ev.node in a.eval_nodes:
        a.eval_nodes.discard(ev.node)
        if not a.eval_nodes:  # the evaluation is over: its time is not the step standing still
            a.min_advanced_at = min(
                sv.now, a.min_advanced_at + max(0.0, sv.now - max(a.eval_since, a.min_advanced_at))
            )
    if step_time > 0:  # 0: not measured (a load mark, a report repeated for a new collective count)
        sv.step_times.append(step_time)
    if node_step <= old:
        return
    a.node_step[ev.node] = node_step
    a.node_advanced_at[ev.node] = sv.now
    count = a.step_count
    count[old] -= 1
    if not count[old]:
        del count[old]
    count[node_step] = count.get(node_step, 0) + 1
    new_min = min(count)
    if new_min > a.min_step:
        startup = a.min_step == UNREPORTED
        a.min_step = new_min
        a.min_advanced_at = sv.now
        sv.job_step = new_min
        _on_job_step(sv, first=startup)


def _node_loaded(sv: Run, node: str) -> None:
    a = sv.cur
    if not a.loaded_nodes:
        a.first_loaded_at = sv.now
        if sv.cfg.load_stall_s > 0:
            sv.emit(SetTimer(key="load_stall", at=sv.now + sv.cfg.load_stall_s))
    a.loaded_nodes.add(node)
    if len(a.loaded_nodes) < len(a.node_step):
        return
    a.load_logged = True
    loaded = f"checkpoint step {a.resume_step}" if a.resume_step >= 0 else "no checkpoint (scratch)"
    by_source: dict[str, list[str]] = {}
    for n, source in sorted(a.loaded_from.items()):
        by_source.setdefault(source, []).append(n)
    # where each node's state came from (the trainer's load mark): "state from memory on n1, n2; ..."
    sources = "; ".join(f"{s} on {', '.join(ns)}" for s, ns in sorted(by_source.items()))
    # why a node's ranks took a slower source (a copy or a peer's bytes that failed their checksums)
    fallbacks = "; ".join(f"{n}: {why}" for n, why in sorted(a.load_fallbacks.items()))
    sv.log(
        E.EVENT_KIND_LOAD_DONE,
        f"all {len(a.node_step)} nodes loaded {loaded}, {sv.now - a.launched_at:.1f}s after launch"
        + (f"; state from {sources}" if sources else "")
        + (f"; passed over: {fallbacks}" if fallbacks else ""),
        step=a.resume_step,
    )


def on_workers_started(sv: Run, ev: WorkersStarted) -> None:
    """Which path started each node's ranks (warm: parked processes, no interpreter or torch import
    on the restart path; cold: torchrun), logged once per attempt so recoveries can be compared."""
    if ev.attempt != sv.attempt or not ev.nodes:
        return  # an older attempt's late answer
    by_path: dict[str, list[NodeLaunchPath]] = {}
    for n in ev.nodes:
        by_path.setdefault(n.path or "unreported", []).append(n)
    parts = []
    for path in sorted(by_path):
        named = by_path[path]
        why = sorted({n.detail for n in named if n.detail and path != "warm"})
        parts.append(
            f"{path} on {sv.names([n.node for n in named])}" + (f" ({'; '.join(why)})" if why else "")
        )
    sv.log(
        E.EVENT_KIND_WORKERS_STARTED,
        f"attempt {ev.attempt} started: {'; '.join(parts)}",
        workers_started=E.WorkersStartedDetail(
            nodes=[E.NodeLaunchPath(node=n.node, path=n.path, detail=n.detail[:300]) for n in ev.nodes]
        ),
    )


def on_workers_started_running(sv: Run, ev: WorkersStarted) -> None:
    """RUNNING: logged; and when some nodes went warm and others cold, the attempt cannot meet in
    one rendezvous (the warm nodes would wait out theirs): stopped at once and relaunched cold on
    every node, with no failure counted; the nodes that went cold keep their attempts cold."""
    on_workers_started(sv, ev)
    if ev.attempt != sv.attempt:
        return
    cold = [n for n in ev.nodes if n.path == "cold"]
    if not cold or not any(n.path == "warm" for n in ev.nodes):
        return
    for n in cold:
        sv.went_cold[n.node] = n.detail or "no reason given"
    why = "; ".join(f"{n.node} ({n.detail or 'no reason given'})" for n in cold)
    failure.begin_no_fault(
        sv,
        E.EVENT_KIND_RESTART,
        f"launch paths of attempt {ev.attempt} disagree: cold on {why}, warm on the others, "
        "so every node goes cold",
        nodes=[n.node for n in cold],
        label="launch_paths",
    )


def hang_timeout(sv: Run) -> float:
    med = stats.median(sv.step_times) if sv.step_times else None
    return detectors.hang_timeout(
        sv.cfg,
        med,
        in_checkpoint=bool(sv.cur.ckpt_nodes),
        recent_saves_s=sv.save_times,
        in_eval=bool(sv.cur.eval_nodes),
    )


def _on_job_step(sv: Run, *, first: bool) -> None:
    a = sv.cur
    if first:  # every node reported: hang detection switches from the startup timeout to steps
        sv.history.launch_failures = 0  # (the launch evidently happened)
        a.hang_timer_at = sv.now + hang_timeout(sv)
        sv.emit(SetTimer(key="hang", at=a.hang_timer_at))
    if not a.first_step_logged and a.min_step > a.resume_step:
        a.first_step_logged = True
        sv.log(
            E.EVENT_KIND_FIRST_STEP,
            f"first step after launch: step {a.min_step} "
            f"(resumed from {a.resume_step}), {sv.now - a.launched_at:.1f}s after launch",
        )
        # The spares' checks held off while the launch and load had the hosts: due from now, and
        # re-armed here (their timer may have fired meanwhile, where ticks come only from timers).
        spare_checks.due(sv)
    if len(a.loads) < 2:
        return
    cand = detectors.straggler_candidate(a.loads, sv.cfg)
    a.straggler_hist.append((sv.now, cand.rank if cand else None))
    rank = detectors.persistent_straggler((r for _, r in a.straggler_hist), sv.cfg)
    if rank is None or cand is None or cand.rank != rank or cand.node in a.straggler_nodes:
        return
    node = cand.node
    a.straggler_nodes.add(node)
    flagged_at = next(t for t, r in a.straggler_hist if r == rank)
    sv.pool.get(node).straggler_flags += 1
    sv.persist(node)
    kill = sv.cfg.kill_stragglers_mid_run
    action = (
        "stopping the attempt now" if kill else "quarantine candidate at the next restart; not killed mid-run"
    )
    reason = f"persistent straggler over {sv.cfg.straggler_window} steps: {cand.reason}; {action}"
    if kill:
        failure.begin(
            sv,
            Failure(
                detector=E.DETECTOR_STRAGGLER,
                nodes=[node],
                ranks=[rank],
                step=sv.job_step,
                label="straggler",
                reason=reason,
            ),
            latency=sv.now - flagged_at,
        )
    else:
        sv.log(
            E.EVENT_KIND_DETECTION,
            reason,
            detection=E.DetectionDetail(
                detector=E.DETECTOR_STRAGGLER,
                nodes=[node],
                ranks=[rank],
                latency_s=sv.now - flagged_at,
                reason=reason,
                flag_only=True,  # the attempt goes on: goodput opens no incident
            ),
        )


def on_checkpoint(sv: Run, ev: CheckpointCommitted) -> None:
    """RUNNING: a commit also credits the observed save to the hang clock."""
    a = sv.cur
    fresh = ev.step not in sv.committed
    started = a.save_started.get(ev.step)
    nodes.on_checkpoint(sv, ev)
    if not fresh or a.min_step == UNREPORTED:
        return
    if started is not None:
        # The save, from its first "saving" report to this commit, is not time the step stood still
        # (else a 25 s save trips a 10 s hang timeout the moment it commits). Only the observed save
        # is credited: a commit alone must not postpone a hang that began right after it.
        a.min_advanced_at = min(
            sv.now, a.min_advanced_at + max(0.0, sv.now - max(started, a.min_advanced_at))
        )
    if a.ckpt_nodes:
        # Every rank finished that save. A node still shown "saving" it is stale (a rank stopped right
        # after its save): it must not keep the long checkpoint timeout.
        a.ckpt_nodes = {n for n in a.ckpt_nodes if a.node_step.get(n, UNREPORTED) > ev.step}
        if not a.ckpt_nodes:
            check_hang(sv)  # re-arms the hang timer at the ordinary deadline


def _hang(
    sv: Run,
    label: str,
    nodes: list[str],
    step: int,
    reason: str,
    since: float,
    ranks: list[int] | None = None,
) -> None:
    """Every hang rule ends the same way: a HANG failure of `nodes`, its latency counted from `since`."""
    failure.begin(
        sv,
        Failure(
            detector=E.DETECTOR_HANG, nodes=nodes, ranks=ranks or [], step=step, label=label, reason=reason
        ),
        latency=sv.now - since,
    )


def _collective_bound(sv: Run) -> float:
    return collectives.hang_after_s(
        sv.cfg.collective_hang_s, sv.cfg.collective_lateness_multiple, sv.collective_lateness
    )


def _collective_deadline(sv: Run) -> float | None:
    """The collective rule (controller/supervisor/collectives.py): fires (None) or returns when it
    would; inf while no rank is behind its peers' collective."""
    a = sv.cur
    stall = a.collectives.stall(len(a.nodes)) if sv.cfg.collective_hang_s > 0 else None
    if stall is None:
        return float("inf")
    bound = _collective_bound(sv)
    if sv.now - stall.since < bound:
        return stall.since + bound
    behind = a.collectives.behind()
    ranks = [r for r, _, _ in behind]
    hung = sorted({node for _, node, _ in behind})
    shown = ", ".join(f"{r} (at {c})" for r, _, c in behind[:8]) + (" ..." if len(behind) > 8 else "")
    leaders = len(a.collectives.entered) - len(behind)
    _hang(
        sv,
        "hang:collective",
        hung,
        a.min_step,
        f"hang: rank(s) {shown} on {sv.names(hung)} did not enter collective {stall.entered} of the default "
        f"group, which {leaders} rank(s) entered {sv.now - stall.since:.1f}s ago (bound {bound:.3g}s = "
        f"max(collective_hang_s, {sv.cfg.collective_lateness_multiple:g} x the longest lateness seen))",
        stall.since,
        ranks,
    )
    return None


def on_tick(sv: Run) -> None:
    """RUNNING: the idle spares' background checks, then the hang rules."""
    spare_checks.due(sv)
    check_hang(sv)


def check_hang(sv: Run) -> None:
    """RUNNING's tick: the load-stall and startup timeouts until every node reported, then the hang
    timeout (or, once every node took its last step, the exit timeout)."""
    a = sv.cur
    now = sv.now
    if a.min_step == UNREPORTED:
        stalled = sorted(n for n in a.node_step if n not in a.loaded_nodes)
        stall_s = sv.cfg.load_stall_s
        if a.loaded_nodes and stalled and stall_s > 0 and now >= a.first_loaded_at + stall_s:
            loaded = f"step {a.resume_step}" if a.resume_step >= 0 else "from scratch"
            _hang(
                sv,
                "hang:load",
                stalled,
                a.resume_step,
                f"checkpoint load stalled on {sv.names(stalled)}: {len(a.loaded_nodes)} of "
                f"{len(a.node_step)} nodes loaded {loaded}, the first {now - a.first_loaded_at:.0f}s ago "
                f"(load_stall_s {stall_s:g})",
                a.first_loaded_at,
            )
            return
        deadline = a.launched_at + sv.cfg.startup_timeout_s
        if now >= deadline:
            silent = sorted(n for n, s in a.node_step.items() if s == UNREPORTED)
            _hang(
                sv,
                "hang:startup",
                silent,
                sv.job_step,
                f"no progress from {sv.names(silent)} within {sv.cfg.startup_timeout_s:g}s of launch",
                a.launched_at,
            )
            return
    elif a.finished_nodes and a.finished_nodes >= a.node_step.keys():
        # Training is done everywhere: what is left is the ranks' teardown and exit.
        deadline = a.finished_at + sv.cfg.exit_timeout_s
        if now >= deadline:
            left = sorted(n for n in a.node_step if n not in a.exited)
            _hang(
                sv,
                "hang:exit",
                left,
                a.min_step,
                f"{sv.names(left)} took the last step and did not exit within {sv.cfg.exit_timeout_s:g}s",
                a.finished_at,
            )
            return
    else:
        timeout = hang_timeout(sv)
        deadline = a.min_advanced_at + timeout
        first_step = (
            not sv.step_times and sv.cfg.hang_timeout_s is None and a.min_step <= max(0, a.resume_step)
        )
        if first_step:
            # No step of this run has been measured and this attempt has taken none past its resume
            # point, so the step's length is unknown: a 20 s first step is not a 10 s hang. The
            # startup timeout holds until one has (the collective rule still catches a rank its peers
            # wait for).
            deadline = max(deadline, a.launched_at + sv.cfg.startup_timeout_s)
        if now >= deadline:
            behind = sorted(n for n, s in a.node_step.items() if s == a.min_step)
            med = stats.median(sv.step_times) if sv.step_times else None
            med_txt = f"{med:.3g}s" if med else "unknown"
            if first_step:
                med_txt += f": no step completed within startup_timeout_s {sv.cfg.startup_timeout_s:g}s"
            _hang(
                sv,
                "hang",
                behind,
                a.min_step,
                f"hang: step {a.min_step} did not advance for {now - a.min_advanced_at:.1f}s "
                f"(timeout {timeout:.3g}s = max(floor, {sv.cfg.hang_step_multiple:g} x median step "
                f"{med_txt}){'; a rank is in a checkpoint' if a.ckpt_nodes else ''}"
                f"{'; a rank is in an evaluation' if a.eval_nodes else ''})",
                a.min_advanced_at,
            )
            return
        at = _collective_deadline(sv)
        if at is None:
            return
        deadline = min(deadline, at)
    a.hang_timer_at = deadline
    sv.emit(SetTimer(key="hang", at=deadline))


def classify(sv: Run, ev: AttemptExited) -> str | None:
    """Record a node's exit of the current attempt; its label, or None when stale or already seen."""
    a = sv.cur
    if ev.attempt != a.number or ev.node not in a.node_step or ev.node in a.exited:
        return None
    label = (
        "never started"
        if ev.never_started
        else detectors.classify_exit(ev.exit_code, ev.signal, stopping=False).label
    )
    a.exited[ev.node] = label
    return label


def on_exited(sv: Run, ev: AttemptExited) -> None:
    """RUNNING: a clean exit of every node completes the run; any other exit is a crash."""
    label = classify(sv, ev)
    if label is None:
        return
    a = sv.cur
    if label == "clean" and ev.planned_stop:
        # The ranks stopped on a request that did not come through this controller (a stop file a
        # batch script touched, a SIGTERM from the scheduler): a planned stop, never the end of training.
        stops.on_stop_request_running(
            sv,
            StopRequested(
                reason=f"{ev.node} stopped on its own ({ev.planned_stop})",
                requested_by=ev.node,
                relaunch=True,
            ),
        )
        return
    if label == "clean":
        if len(a.exited) == len(a.node_step) and all(v == "clean" for v in a.exited.values()):
            transitions.finish(sv, RunState.COMPLETED, "completed", "every node exited 0: the run completed")
        return
    if ev.never_started:
        # The controller's own half-done launch, not a crash: the others wait in a rendezvous this
        # node never joins. No first exit to blame, no restart or crash-loop hit; relaunched at once.
        failure.begin_no_fault(
            sv,
            E.EVENT_KIND_CONTROL_PLANE,
            f"attempt {ev.attempt} never started on {ev.node} ({ev.detail or 'no worker of it there'})",
            nodes=[ev.node],
            label="never_started",
        )
        return
    latency = max(0.0, sv.now - ev.ended_at) if ev.ended_at else 0.0
    rank = f" rank {ev.rank}" if ev.rank is not None else ""
    reason = f"{ev.node}{rank} exited first ({label}{': ' + ev.detail if ev.detail else ''})"
    status = common_pb2.ExitStatus(ended_at=ev.ended_at or 0.0, detail=ev.detail)
    if ev.exit_code is not None:
        status.exit_code = ev.exit_code
    if ev.signal is not None:
        status.signal = ev.signal
    sv.log(
        E.EVENT_KIND_EXIT,
        f"{ev.node} exited: {label}",
        exit=E.ExitDetail(node=ev.node, status=status, classification=label),
    )
    failure.begin(
        sv,
        Failure(
            detector=E.DETECTOR_CRASH,
            nodes=[ev.node],
            step=sv.job_step,
            label=label,
            reason=reason,
            first_exit=ev.node,
            first_exit_at=ev.ended_at,
            ranks=[ev.rank] if ev.rank is not None else [],
        ),
        latency=latency,
    )


def on_exited_ending(sv: Run, ev: AttemptExited) -> None:
    """COLLECTING, CONTROL_PLANE: a victim's exit, counted in the attempt's one EXIT summary."""
    if (label := classify(sv, ev)) is not None:
        _reconsider_first_exit(sv, ev, label)


def on_exited_stopping(sv: Run, ev: AttemptExited) -> None:
    """STOPPING: a victim's exit, counted; the last one decides."""
    if (label := classify(sv, ev)) is not None:
        _reconsider_first_exit(sv, ev, label)
        failure.maybe_stopped(sv, ev.node)


# A rank dead of one of these did not exit over its peers' failure; a peer's error exit reported
# just before it is that death's collateral (its collective's "connection reset by peer"), the two
# reports racing from two hosts. (SIGABRT and SIGTERM are left out: NCCL's watchdog aborts a rank
# over a peer's failure, and a stop sends TERM.)
FATAL_SIGNALS = frozenset(
    {"signal:SIGKILL", "signal:SIGSEGV", "signal:SIGBUS", "signal:SIGILL", "signal:SIGFPE"}
)
COLLATERAL_S = 1.0  # a death this close after the first exit (the agents' clocks) is its cause


def _reconsider_first_exit(sv: Run, ev: AttemptExited, label: str) -> None:
    """The crash's first exit was an error exit and this node's rank died of a fatal signal at
    nearly the same moment: this node's death is the cause, the first exit its collateral."""
    f = sv.failure
    if (
        f is None
        or f.detector != E.DETECTOR_CRASH
        or f.first_exit is None
        or f.first_exit == ev.node
        or f.label in FATAL_SIGNALS
        or label not in FATAL_SIGNALS
        or f.first_exit_at is None
        or ev.ended_at is None
        or ev.ended_at - f.first_exit_at > COLLATERAL_S
    ):
        return
    collateral, gap = f.first_exit, max(0.0, ev.ended_at - f.first_exit_at)
    f.first_exit, f.first_exit_at, f.label, f.nodes = ev.node, ev.ended_at, label, [ev.node]
    f.ranks = [ev.rank] if ev.rank is not None else []
    f.reason = (
        f"{ev.node} died of {label.split(':', 1)[1]}; {collateral}'s "
        f"{sv.cur.exited.get(collateral, 'exit')} {gap:.2f} s before it was its collateral"
    )
