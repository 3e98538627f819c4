"""What every light agent of a fleet is told: latencies, clocks and sizes, validated once.

A latency is a fixed number of seconds ("5") or a uniform range ("5:30"), sampled per call from the
agent's own seeded generator, so a fleet started with the same seed answers with the same delays.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field


class SettingsError(ValueError):
    """A setting is out of range or unreadable: one line naming it."""


@dataclass(frozen=True, slots=True)
class Latency:
    """A fixed delay (low == high) or a uniform range, in seconds."""

    low: float
    high: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.low) and math.isfinite(self.high)) or not 0 <= self.low <= self.high:
            raise SettingsError(f"a latency is 0 <= low <= high seconds, got {self.low!r}:{self.high!r}")

    @classmethod
    def fixed(cls, seconds: float) -> Latency:
        return cls(seconds, seconds)

    @classmethod
    def parse(cls, text: str, what: str = "latency") -> Latency:
        """ "5" (fixed) or "5:30" (uniform between the two)."""
        low, sep, high = text.strip().partition(":")
        try:
            lo = float(low)
            hi = float(high) if sep else lo
            return cls(lo, hi)
        except (ValueError, SettingsError):
            raise SettingsError(
                f"{what}: expected SECONDS or LOW:HIGH (0 <= LOW <= HIGH), got {text!r}"
            ) from None

    def sample(self, rng: random.Random) -> float:
        return self.low if self.low == self.high else rng.uniform(self.low, self.high)

    def __str__(self) -> str:
        return f"{self.low:g}" if self.low == self.high else f"{self.low:g}:{self.high:g}"


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentSettings:
    """One light agent's behaviour. The defaults are the real agent's where it has one (lease TTL 5 s,
    progress every 1 s) and small, plausible delays for what a real host would spend time on."""

    local_ranks: int = 8
    lease_ttl_s: float = 5.0  # nodeagent.daemon.config.AgentConfig.lease_ttl_s
    progress_interval_s: float = 1.0  # AgentConfig.progress_interval_s
    preflight: Latency = field(default_factory=lambda: Latency.fixed(2.0))
    launch: Latency = field(default_factory=lambda: Latency.fixed(0.05))  # a cold torchrun Popen
    stop: Latency = field(default_factory=lambda: Latency.fixed(0.3))  # TERM -> the ranks' exit
    dump: Latency = field(default_factory=lambda: Latency.fixed(0.05))  # flight-recorder collection
    step_s: float = 1.0  # one training step (every rank of an attempt steps in lockstep)
    startup_s: float = 3.0  # the attempt record's launched_at -> every rank loaded (imports, rendezvous)
    save_s: float = 0.5  # a checkpoint's save and commit after its step
    ckpt_every: int = 10  # steps between commits (0: none but a planned stop's)
    steps: int = 0  # the run's last step: the ranks finish and exit 0 there (0: train forever)
    seed: int = 0
    # The real agent's default (warm_workers = true): parked ranks take a launch, and an unplanned
    # stop that lets them park (park_within_s > 0) ends the attempt within the stop latency, hung
    # peers included (a warm rank leaves a failed collective when its sockets are shut: ~2 ms,
    # BENCHMARKS.md). Off: torchrun's ranks, where a rank blocked in a collective waits out the grace.
    warm: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.local_ranks <= 1024:
            raise SettingsError(f"local_ranks: 1..1024, got {self.local_ranks}")
        for name in ("lease_ttl_s", "progress_interval_s", "step_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise SettingsError(f"{name}: a positive number of seconds, got {value!r}")
        if self.lease_ttl_s < 1:
            raise SettingsError(
                f"lease_ttl_s: etcd grants whole seconds, at least 1, got {self.lease_ttl_s!r}"
            )
        for name in ("startup_s", "save_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise SettingsError(f"{name}: seconds >= 0, got {value!r}")
        if self.ckpt_every < 0 or self.steps < 0:
            raise SettingsError(f"ckpt_every and steps: >= 0, got {self.ckpt_every} and {self.steps}")
