"""Detectors: pure functions over observed state. The core's rules (controller/supervisor/) call them.

* node lost: the lease DELETE itself (no function needed) — but `is_mass_expiry` decides whether
  many losses at once are a control-plane fault instead;
* hang: `hang_timeout` (the slowest rank's step did not advance, outside a checkpoint; the check and
  the first-step allowance are running.check_hang's), and the collective rule (collectives.py);
* straggler: `straggler_candidate` (one evaluation) + `persistent_straggler` (over a window);
* crash: `classify_exit` (exit code / signal);
* hardware evidence: `runwarden.evidence.is_fatal` (one definition for the agent, the core and goodput).
"""

from __future__ import annotations

import functools
import math
import signal as signal_mod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from controller.supervisor.policy import SupervisorConfig
from controller.supervisor.stats import median

# --- crash -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ExitClass:
    kind: str  # "clean" | "crash" | "signal" | "stop"
    label: str  # e.g. "exit:1", "signal:SIGKILL", "clean"


@functools.lru_cache(maxsize=256)
def _signal_name(num: int) -> str:
    try:
        return signal_mod.Signals(num).name
    except ValueError:
        return f"SIG{num}"


@functools.lru_cache(maxsize=1024)  # pure and called once per node per attempt end
def classify_exit(exit_code: int | None, signal: int | None, *, stopping: bool) -> ExitClass:
    """Classify a worker group's end. While the supervisor is stopping it, any end is a "stop"."""
    if stopping:
        return ExitClass(kind="stop", label="stop")
    if signal is not None and signal > 0:
        return ExitClass(kind="signal", label=f"signal:{_signal_name(signal)}")
    if exit_code is None:
        return ExitClass(kind="crash", label="exit:unknown")
    if exit_code == 0:
        return ExitClass(kind="clean", label="clean")
    if 128 < exit_code < 128 + 65:  # a shell / torchrun reporting a signal as 128+n
        return ExitClass(kind="signal", label=f"signal:{_signal_name(exit_code - 128)}")
    if exit_code < 0:  # subprocess convention: -n = killed by signal n
        return ExitClass(kind="signal", label=f"signal:{_signal_name(-exit_code)}")
    return ExitClass(kind="crash", label=f"exit:{exit_code}")


# --- hang --------------------------------------------------------------------------------------


def hang_timeout(
    cfg: SupervisorConfig,
    median_step_s: float | None,
    *,
    in_checkpoint: bool,
    recent_saves_s: Sequence[float] = (),
    in_eval: bool = False,
) -> float:
    """max(floor, k x median step, longest collective); >= the save allowance while saving, and
    >= `eval_timeout_s` while a rank is inside a declared evaluation.

    The save allowance is `checkpoint_barrier_s` until `checkpoint_saves_to_learn` saves were
    seen, then `checkpoint_save_multiple` x the longest of `recent_saves_s`, never more than
    `checkpoint_barrier_s` (the configured worst case stays the cap).
    """
    if cfg.hang_timeout_s is not None:
        base = cfg.hang_timeout_s
    else:
        derived = cfg.hang_step_multiple * median_step_s if median_step_s else 0.0
        base = max(cfg.hang_timeout_floor_s, derived)
    base = max(base, cfg.longest_collective_s)
    if in_checkpoint:
        allowance = cfg.checkpoint_barrier_s
        if len(recent_saves_s) >= cfg.checkpoint_saves_to_learn:
            allowance = min(allowance, cfg.checkpoint_save_multiple * max(recent_saves_s))
        base = max(base, allowance)
    if in_eval:
        base = max(base, cfg.eval_timeout_s)
    return base


# --- straggler ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class StragglerCandidate:
    rank: int
    node: str
    reason: str


def straggler_candidate(
    loads: Mapping[int, tuple[str, float, float]], cfg: SupervisorConfig
) -> StragglerCandidate | None:
    """The rank with high compute and low wait while the others show the reverse, if any.

    loads: rank -> (node, compute seconds, collective-wait seconds), e.g. smoothed per step.
    """
    if len(loads) < 2:
        return None
    top = max(loads, key=lambda r: (loads[r][1], -r))
    node, compute, wait = loads[top]
    med_compute = median([v[1] for r, v in loads.items() if r != top])
    med_wait = median([v[2] for r, v in loads.items() if r != top])
    if med_wait < cfg.straggler_min_wait_s or med_compute <= 0:
        return None
    if compute < cfg.straggler_compute_ratio * med_compute:
        return None
    if wait > cfg.straggler_wait_ratio * med_wait:
        return None
    return StragglerCandidate(
        rank=top,
        node=node,
        reason=(
            f"rank {top} on {node}: compute {compute:.4g}s vs median {med_compute:.4g}s, "
            f"wait {wait:.4g}s vs median {med_wait:.4g}s"
        ),
    )


def persistent_straggler(history: Iterable[int | None], cfg: SupervisorConfig) -> int | None:
    """A rank flagged in at least `persistence` of a full window of evaluations, else None."""
    items = list(history)
    if len(items) < cfg.straggler_window:
        return None
    counts: dict[int, int] = {}
    for rank in items:
        if rank is not None:
            counts[rank] = counts.get(rank, 0) + 1
    need = math.ceil(cfg.straggler_persistence * cfg.straggler_window)
    for rank, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if n >= need:
            return rank
    return None


# --- control plane -----------------------------------------------------------------------------


def mass_expiry_threshold(cfg: SupervisorConfig, fleet_size: int) -> int:
    """Lease expiries within the window that make a control-plane fault: mass_expiry_min_nodes at any
    fleet size (a fraction alone let 500 of 2,048 hosts vanish as "hardware"), fewer only in a fleet
    too small for that count (mass_expiry_fraction of it), never one."""
    return max(2, min(cfg.mass_expiry_min_nodes, math.ceil(cfg.mass_expiry_fraction * fleet_size)))


def is_mass_expiry(loss_times: Sequence[float], now: float, fleet_size: int, cfg: SupervisorConfig) -> bool:
    """Many lease expiries within one short window: the control plane, not the hardware."""
    recent = sum(1 for t in loss_times if now - t <= cfg.mass_expiry_window_s)
    return recent >= mass_expiry_threshold(cfg, fleet_size)
