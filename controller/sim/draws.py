"""Failure draws shared across policies (common random numbers): `draw(scenario, seed)` depends only
on the scenario's failure processes and the seed, never on the policy, so every policy of a
comparison sees the same faults (times, causes, node slots) and the difference between two ETTRs is
the policy's doing. A slot is a position in the run's node list; the fault hits whichever node holds
it at that moment. Called by `controller.sim.report` and the engine's tests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from controller.sim.scenario import Scenario


@dataclass(frozen=True, slots=True, kw_only=True)
class Fault:
    t: float  # seconds since the run's start
    cause: int  # index into scenario.causes
    slot: int  # which node position it hits
    u: float  # a uniform draw for the fault's own randomness (jitter, dump accuracy)


@dataclass(frozen=True, slots=True, kw_only=True)
class Draws:
    seed: int
    faults: tuple[Fault, ...]  # sorted by time
    planned: tuple[float, ...]  # planned-stop times, sorted


def _poisson_times(rng: random.Random, rate_s: float, horizon_s: float) -> list[float]:
    times: list[float] = []
    if rate_s <= 0:
        return times
    t = rng.expovariate(rate_s)
    while t < horizon_s:
        times.append(t)
        t += rng.expovariate(rate_s)
    return times


def draw(scenario: Scenario, seed: int) -> Draws:
    """Poisson arrivals per cause over the scenario's duration, each with its own RNG stream."""
    horizon = scenario.run.duration_s
    faults: list[Fault] = []
    for i, cause in enumerate(scenario.causes):
        rng = random.Random(f"{seed}:cause:{cause.name}")
        for t in _poisson_times(rng, cause.fleet_rate_s(scenario.run), horizon):
            faults.append(Fault(t=t, cause=i, slot=rng.randrange(scenario.run.nodes), u=rng.random()))
    faults.sort(key=lambda f: (f.t, f.cause))
    prng = random.Random(f"{seed}:planned")
    planned = tuple(_poisson_times(prng, scenario.planned.rate_s(scenario.run), horizon))
    return Draws(seed=seed, faults=tuple(faults), planned=planned)
