"""Whether and when to relaunch after a failure: a pure decision that carries its reason.

torchft's habit: the decision returns the sentence the event log records, and tests assert on it.
`RestartHistory` is the little state the rules need (kept by the core across attempts); the
functions read it and return a frozen decision; only `RestartHistory.record` changes it.

* no suspect and the same failure (label, step) `crash_loop_count` times in a row -> `CrashLoop`;
* more than `restart_budget` failure restarts within `restart_budget_window_s` -> `BudgetExhausted`;
* otherwise `Relaunch`, at once for an independent fault, after an exponential backoff in a storm.
  A failure is part of a storm when nothing was quarantined for it (the cause is not out of the
  run) or it is the same kind of failure as the one before; k counts the storm's failures in a row
  (`backoff_base_s` x 2^(k-1), at most `backoff_max_s`; an attempt that ran `backoff_reset_s` ends
  the storm). A first failure of its kind whose suspect was quarantined and replaced waits for
  nothing: the node that failed is out, so there is nothing to wait for, and unrelated faults on
  different nodes do not tax each other. Planned stops and control-plane faults consume neither
  the budget nor the crash-loop count (`Relaunch(delay=0)`).
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


@dataclass(slots=True)
class RestartHistory:
    restart_times: list[float] = field(default_factory=list)  # failure restarts, for the budget window
    storm: int = 0  # failures in a row that were storm-like (see the module doc); 0 after an independent one
    last_label: str = ""  # the last counted failure's kind
    loop_signature: tuple[str, int] | None = None
    loop_count: int = 0
    launch_failures: int = 0  # attempts in a row that were never launched (ActionFailed on Launch)

    def used(self, cfg: SupervisorConfig, now: float) -> int:
        window = cfg.restart_budget_window_s
        return sum(1 for t in self.restart_times if not window or now - t < window)


def restart_decision(
    cfg: SupervisorConfig,
    history: RestartHistory,
    *,
    now: float,
    label: str,
    step: int,
    suspects_quarantined: bool,
    planned: bool,
    control_plane: bool,
    attempt_ran_s: float,
) -> RestartDecision:
    """The decision for a stopped attempt; `RestartHistory.record(decision)` must follow it."""
    if planned or control_plane:
        what = "planned stop" if planned else "control-plane fault"
        return Relaunch(
            delay=0.0, counted=False, reason=f"{what}: relaunching without consuming the restart budget"
        )
    if not suspects_quarantined:
        sig = (label, step)
        count = history.loop_count + 1 if sig == history.loop_signature else 1
        if count >= cfg.crash_loop_count:
            return CrashLoop(
                reason=f"crash loop: the same failure ({label}) at step {step} {count} times in a "
                "row with no suspect; stopped and paged"
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
    delay = 0.0 if k == 0 else min(cfg.backoff_max_s, cfg.backoff_base_s * 2 ** (k - 1))
    why = "an independent fault: its node is out" if k == 0 else f"storm x{k}"
    return Relaunch(
        delay=delay,
        counted=True,
        reason=f"restart {used + 1}/{cfg.restart_budget} after {label or 'failure'}; backoff {delay:g}s ({why})",
    )


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
    label: str,
    step: int,
    suspects_quarantined: bool,
    attempt_ran_s: float,
) -> None:
    """Apply a decision to the history (the only place the history changes after a stop)."""
    if isinstance(decision, Relaunch) and not decision.counted:
        history.loop_signature, history.loop_count = None, 0
        return
    if suspects_quarantined:
        history.loop_signature, history.loop_count = None, 0
    else:
        sig = (label, step)
        history.loop_count = history.loop_count + 1 if sig == history.loop_signature else 1
        history.loop_signature = sig
    if isinstance(decision, Relaunch):
        window = cfg.restart_budget_window_s
        history.restart_times = [*(t for t in history.restart_times if not window or now - t < window), now]
        history.storm = storm_count(
            cfg, history, label=label, suspects_quarantined=suspects_quarantined, attempt_ran_s=attempt_ran_s
        )
        history.last_label = label


def launch_retry_delay(cfg: SupervisorConfig, history: RestartHistory) -> float:
    """Backoff before preparing again after an attempt that was never launched (k-th in a row)."""
    return min(cfg.backoff_max_s, cfg.backoff_base_s * 2 ** max(0, history.launch_failures - 1))
