"""Whether and when to relaunch after a failure: a pure decision that carries its reason.

`restart_decision` returns a frozen `Relaunch`, `CrashLoop` or `BudgetExhausted` whose reason is the
sentence the event log records (torchft's habit: tests assert on it). `RestartHistory` is the little
state the rules need, kept by the core across attempts and in the store as the run's
`SupervisorMemory` (a new leader continues it); only `record` changes it after a stop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from controller.supervisor.policy import SupervisorConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class Relaunch:
    delay: float
    reason: str
    counted: bool  # whether it consumed a restart of the budget


@dataclass(frozen=True, slots=True, kw_only=True)
class CrashLoop:
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetExhausted:
    reason: str
    page: str


RestartDecision = Relaunch | CrashLoop | BudgetExhausted


@dataclass(frozen=True, slots=True, kw_only=True)
class Signature:
    """What makes two failures "the same": their kind, and their step, give or take one (a bug at
    step 45 is seen at 44 or 45: the slowest rank's completed step), or give or take `slack` when
    both attempts resumed from the same commit (the step it was seen at trails a progress report:
    failure.REPORT_LAG_S of steps, at most the checkpoint interval). The first attempt of a loop
    starts from an older commit than the relaunches after it, so the step alone decides there."""

    label: str
    resume_step: int
    step: int
    slack: int = 0

    def matches(self, other: Signature | None) -> bool:
        if other is None or other.label != self.label:
            return False
        apart = abs(other.step - self.step)
        return apart <= 1 or (other.resume_step == self.resume_step and apart <= max(self.slack, other.slack))


MAX_LOOP_CANDIDATES = 8  # failures the run has not got past yet, each a possible loop


@dataclass(slots=True)
class LoopCandidate:
    """A failure the run has not got past: how often it was seen, and who was quarantined for it."""

    signature: Signature  # its first occurrence
    count: int = 1
    suspects: list[tuple[str, float]] = field(default_factory=list)  # (node, strike time)
    last_first_exit: str = ""  # the node first out at its latest hit ("": none)


@dataclass(slots=True)
class RestartHistory:
    restart_times: list[float] = field(default_factory=list)  # failure restarts, for the budget window
    storm: int = 0  # failures in a row that were storm-like (see the module doc); 0 after an independent one
    last_label: str = ""  # the last counted failure's kind
    loops: list[LoopCandidate] = field(default_factory=list)  # oldest first, at most MAX_LOOP_CANDIDATES
    launch_failures: int = 0  # attempts in a row that were never launched (ActionFailed on Launch)

    def used(self, cfg: SupervisorConfig, now: float) -> int:
        window = cfg.restart_budget_window_s
        return sum(1 for t in self.restart_times if not window or now - t < window)

    def candidate(self, signature: Signature) -> LoopCandidate | None:
        return next((c for c in self.loops if signature.matches(c.signature)), None)

    def got_past(self, step: int) -> None:
        """The run reached `step` (a failure or a commit there): candidates before it are no loop."""
        self.loops = [c for c in self.loops if c.signature.step + max(1, c.signature.slack) >= step]

    def forget(self, candidate: LoopCandidate) -> None:
        self.loops = [c for c in self.loops if c is not candidate]


def restart_decision(
    cfg: SupervisorConfig,
    history: RestartHistory,
    *,
    now: float,
    signature: Signature,
    suspects_quarantined: bool,
    node_evidence: bool,
    planned: bool,
    control_plane: bool,
    attempt_ran_s: float,
    relapse: bool = False,
) -> RestartDecision:
    """The decision for a stopped attempt; `record(...)` must follow it.

    * The same failure `crash_loop_count` times while the run never got past its step -> `CrashLoop`,
      **whoever was blamed**: a software or data bug at one step rotates its victim (the rank that reads
      the bad shard changes with the attempt), so a suspect the flight recorder named and the core
      quarantined does not make the failure the node's. "The same failure": the same label at the same
      step (`Signature.matches` says how close), each compared with the candidate's first. Other
      failures in between (a hardware fault before the step, a planned stop, a control-plane blip) do
      not reset a candidate; the run getting past its step does (a later failure, a later commit).
      A failure blamed on evidence about a node (a fatal Xid, a lost lease: `node_evidence`) is no
      candidate. The nodes quarantined for a candidate's failures are its `suspects`, released by the
      verdict without their strike (failure.py). A `relapse` (the node first out at the candidate's
      latest hit, after an earlier hit by another, is first out again, and is moved out now) completes
      no loop: the next attempt tells the node's fault (it does not recur) from the job's (the next
      hit completes the loop).
    * More than `restart_budget` failure restarts within `restart_budget_window_s` -> `BudgetExhausted`.
    * Otherwise `Relaunch`, at once for an independent fault, after an exponential backoff in a storm.
      A failure is part of a storm when nothing was quarantined for it (the cause is not out of the
      run) or it is the same kind of failure as the one before; k counts the storm's failures in a row.
      The first (k = 1) waits for nothing: a wait learns nothing about a failure seen once, and
      relaunching at once costs no more than a wait would; from the second on the backoff is
      `backoff_base_s` x 2^(k-2), at most `backoff_max_s` (an attempt that ran `backoff_reset_s` ends
      the storm). A first failure of its kind whose suspect was quarantined and replaced waits for
      nothing either: the node that failed is out, and unrelated faults on different nodes do not
      tax each other. Planned stops and control-plane faults consume neither
      the budget nor the crash-loop count (`Relaunch(delay=0)`).
    """
    label, step = signature.label, signature.step
    if planned or control_plane:
        what = "planned stop" if planned else "control-plane fault"
        return Relaunch(
            delay=0.0, counted=False, reason=f"{what}: relaunching without consuming the restart budget"
        )
    if not node_evidence and not relapse:
        count = loop_count_with(history, signature)
        if count >= cfg.crash_loop_count:
            cand = history.candidate(signature)
            blamed = sorted({n for n, _ in cand.suspects}) if cand is not None else []
            who = (
                f"blamed on {len(blamed)} different node(s) ({', '.join(blamed)}): a software or data "
                "fault rotates its victim"
                if blamed or suspects_quarantined
                else "with no suspect"
            )
            return CrashLoop(
                reason=f"crash loop: the same failure ({label}) at step {step} {count} times, the run never "
                f"past it (resumed from step {signature.resume_step}), {who}; stopped and paged"
            )
    window = cfg.restart_budget_window_s
    used = history.used(cfg, now)
    if used >= cfg.restart_budget:
        return BudgetExhausted(
            reason=f"restart budget of {cfg.restart_budget} exhausted; not relaunching",
            page=f"restart budget exhausted: {used} restarts" + (f" within {window:g}s" if window else ""),
        )
    k = storm_count(
        cfg, history, label=label, suspects_quarantined=suspects_quarantined, attempt_ran_s=attempt_ran_s
    )
    delay = 0.0 if k <= 1 else min(cfg.backoff_max_s, cfg.backoff_base_s * 2 ** (k - 2))
    why = (
        "an independent fault: its node is out"
        if k == 0
        else "a first failure: nothing is learned by waiting"
        if k == 1
        else f"storm x{k}"
    )
    return Relaunch(
        delay=delay,
        counted=True,
        reason=f"restart {used + 1}/{cfg.restart_budget} after {label or 'failure'}; backoff {delay:g}s ({why})",
    )


def loop_count_with(history: RestartHistory, signature: Signature) -> int:
    """How many times this failure has now been seen since the run last got past its step."""
    cand = history.candidate(signature)
    return cand.count + 1 if cand is not None else 1


def storm_count(
    cfg: SupervisorConfig,
    history: RestartHistory,
    *,
    label: str,
    suspects_quarantined: bool,
    attempt_ran_s: float,
) -> int:
    """This failure's place in a storm (1, 2, ...), or 0 for an independent fault (see the module doc)."""
    if attempt_ran_s >= cfg.backoff_reset_s:  # a long attempt ended any storm before it
        return 0 if suspects_quarantined else 1
    repeat = bool(history.last_label) and label == history.last_label
    return 0 if suspects_quarantined and not repeat else history.storm + 1


def record(
    cfg: SupervisorConfig,
    history: RestartHistory,
    decision: RestartDecision,
    *,
    now: float,
    signature: Signature,
    suspects_quarantined: bool,
    quarantined: list[tuple[str, float]],
    node_evidence: bool,
    attempt_ran_s: float,
    first_exit: str | None = None,
) -> None:
    """Apply a decision to the history (the only place the history changes after a stop).

    suspects_quarantined: anyone was quarantined for it; quarantined: those of them quarantined
    without evidence about the node, with their strike's time (a crash-loop verdict gives them
    back without it)."""
    if isinstance(decision, Relaunch) and not decision.counted:
        return  # a planned stop or a control-plane fault: no failure of the job, no candidate changes
    history.got_past(signature.step)
    cand = history.candidate(signature)
    if node_evidence:
        pass  # the node's own fault: neither a candidate nor a hit of one
    elif cand is not None:
        cand.count += 1
        cand.suspects.extend(quarantined)
        cand.last_first_exit = first_exit or ""
    else:
        new = LoopCandidate(signature=signature, suspects=list(quarantined), last_first_exit=first_exit or "")
        history.loops = [*history.loops, new][-MAX_LOOP_CANDIDATES:]
    if isinstance(decision, Relaunch):
        window = cfg.restart_budget_window_s
        history.restart_times = [*(t for t in history.restart_times if not window or now - t < window), now]
        history.storm = storm_count(
            cfg,
            history,
            label=signature.label,
            suspects_quarantined=suspects_quarantined,
            attempt_ran_s=attempt_ran_s,
        )
        history.last_label = signature.label


def launch_retry_delay(cfg: SupervisorConfig, history: RestartHistory) -> float:
    """Backoff before preparing again after an attempt that was never launched (k-th in a row)."""
    return min(cfg.backoff_max_s, cfg.backoff_base_s * 2 ** max(0, history.launch_failures - 1))
