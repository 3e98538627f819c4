"""Runs the check units (`run_preflight`): side by side where safe, the compute/collective/DCGM units
one at a time, each under its own timeout and all within the mode's total budget; the runner never
waits past a budget. A unit that overruns its own timeout is a FAIL (a hung GPU, driver or mount)
and is abandoned; one cut off by the run's budget is INCONCLUSIVE, and in the per-attempt modes runs
once more alone when nothing failed. Called by the node agent, `preflight run` and the burn-in.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from preflight.checks import (
    burn_in,
    collective_check,
    compute,
    counters,
    cpu,
    dcgm,
    expectations,
    inventory,
    network,
    storage,
    xid_check,
)
from preflight.checks.base import CheckContext, CheckSpec, NvmlSession
from preflight.config import BURN_IN, BURN_IN_STAGES, MODES, RUN_MODES, PreflightConfig
from preflight.gpus import GpuExpectation, expect_gpus, resolve_device
from preflight.nvml import Nvml, PynvmlAdapter
from preflight.report import PreflightReport
from preflight.result import CheckResult, CheckStatus, failed, inconclusive

# Order matters only within the serial lane: the known-answer matmul first (cheap, most telling),
# then the collective, then DCGM's diag, which takes whatever budget is left.
ALL_SPECS: tuple[CheckSpec, ...] = (
    expectations.SPEC,
    inventory.SPEC,
    counters.SPEC,
    xid_check.SPEC,
    storage.SPEC,
    network.SPEC,
    cpu.SPEC,
    compute.SPEC,
    collective_check.SPEC,
    dcgm.SPEC,
)
MIN_START_S = 1.0  # a unit is not started with less budget than this left: INCONCLUSIVE instead

OnResult = Callable[[CheckResult], None]


@dataclass(slots=True)
class _Running:
    spec: CheckSpec
    started: float
    deadline: float
    by_budget: bool  # the deadline is the run's budget's, not the unit's own timeout


@dataclass(slots=True)
class _Run:
    ctx: CheckContext
    clock: Callable[[], float]
    on_result: OnResult | None
    done: queue.Queue[tuple[str, list[CheckResult], float]] = field(default_factory=queue.Queue)
    running: dict[str, _Running] = field(default_factory=dict)
    results: list[CheckResult] = field(default_factory=list)
    abandoned: list[str] = field(default_factory=list)
    budget_s: float = 0.0
    hold: bool = False  # keep the budget's INCONCLUSIVE results back (not streamed): a re-run follows
    held: dict[str, list[CheckResult]] = field(default_factory=dict)  # unit -> its results
    again: bool = False  # this is the re-run

    def emit(self, result: CheckResult) -> None:
        self.results.append(result)
        if self.on_result is not None:
            self.on_result(result)

    def out_of_budget(self, spec: CheckSpec, result: CheckResult) -> None:
        if self.again:
            result = replace(result, message=f"{result.message} (again, on its re-run)")
        if self.hold:
            self.held[spec.name] = [result]
        else:
            self.emit(result)

    def start(self, spec: CheckSpec) -> None:
        now = self.clock()
        left = self.ctx.deadline - now
        if left < MIN_START_S:
            self.out_of_budget(
                spec,
                inconclusive(
                    spec.name,
                    f"not started: {left:.1f} s of the run's {self.budget_s:g} s budget left; "
                    "the budget ran out, not the node",
                ),
            )
            return
        own = spec.timeout_s(self.ctx.config, self.ctx.mode)
        timeout = min(own, left)
        self.running[spec.name] = _Running(
            spec=spec, started=now, deadline=now + timeout, by_budget=left < own
        )
        thread = threading.Thread(target=self._work, args=(spec,), name=f"preflight-{spec.name}", daemon=True)
        thread.start()

    def _work(self, spec: CheckSpec) -> None:
        started = self.clock()
        try:
            results = spec.run(self.ctx)
        except Exception as exc:  # a check's bug is a result, never a crashed runner
            results = [
                failed(
                    spec.name,
                    f"check crashed: {type(exc).__name__}: {exc}",
                    remedy="a preflight bug or an unexpected node state: read the message",
                )
            ]
        self.done.put((spec.name, results, self.clock() - started))

    def finish(self, name: str, results: list[CheckResult], duration: float) -> None:
        if self.running.pop(name, None) is None:
            return  # it had already timed out and been reported
        if self.again:
            results = [
                replace(r, message=f"{r.message} (again, on its re-run)")
                if r.status is CheckStatus.INCONCLUSIVE
                else r
                for r in results
            ]
        if self.hold and any(r.status is CheckStatus.INCONCLUSIVE for r in results):
            self.held[name] = [r if r.duration_s else r.with_duration(duration) for r in results]
            return  # it could not tell (its child ran out of the budget): it runs again
        for result in results:
            self.emit(result if result.duration_s else result.with_duration(duration))

    def expire(self) -> list[CheckSpec]:
        now = self.clock()
        expired = [r for r in self.running.values() if r.deadline <= now]
        for r in expired:
            del self.running[r.spec.name]
            self.abandoned.append(r.spec.name)
            took = now - r.started
            if r.by_budget:  # cut off by the run's budget before its own timeout: it could not tell
                self.out_of_budget(
                    r.spec,
                    inconclusive(
                        r.spec.name,
                        f"ran out of the run's {self.budget_s:g} s budget after {took:.1f} s "
                        f"(its own limit is {r.spec.timeout_s(self.ctx.config, self.ctx.mode):g} s); "
                        "its results are unknown",
                        duration_s=took,
                        remedy="run it again; a budget too small for this node's GPUs: raise [run] budgets",
                    ),
                )
                continue
            self.emit(
                failed(
                    r.spec.name,
                    f"timed out after {took:.1f} s; its results are unknown",
                    duration_s=took,
                    remedy="a hung check usually means a hung GPU, driver or mount: inspect the node",
                )
            )
        return [r.spec for r in expired]


def select_specs(
    config: PreflightConfig,
    mode: str,
    only: Iterable[str] = (),
    specs: Sequence[CheckSpec] | None = None,
    quick_specs: Sequence[CheckSpec] = ALL_SPECS,
) -> list[CheckSpec]:
    """The units to run: the mode's (the checks whose `modes` name it; in burn_in, the quick units of
    `quick_specs` and the configured stages in their order), or the `only` ones (in burn_in, stage
    names too: "memory" or "burn_in.memory"). `specs` replaces the mode's candidates (tests)."""
    if mode not in RUN_MODES:
        raise ValueError(f"mode must be one of {', '.join(RUN_MODES)}, got {mode!r}")
    if specs is None:
        specs = (
            burn_in.pipeline(config, burn_in.DeviceWorker(), quick_specs) if mode == BURN_IN else ALL_SPECS
        )
    wanted = {burn_in.stage_name(n) if mode == BURN_IN and n in BURN_IN_STAGES else n for n in only}
    unknown = wanted - {s.name for s in specs}
    if unknown:
        raise ValueError(
            f"unknown check(s) {', '.join(sorted(unknown))}; known: {', '.join(s.name for s in specs)}"
        )
    return [s for s in specs if (s.name in wanted if wanted else mode in s.modes(config))]


def _one_pass(
    ctx: CheckContext,
    chosen: Sequence[CheckSpec],
    *,
    clock: Callable[[], float],
    on_result: OnResult | None,
    budget: float,
    hold: bool,
    again: bool = False,
) -> _Run:
    run = _Run(ctx=ctx, clock=clock, on_result=on_result, budget_s=budget, hold=hold, again=again)
    serial = [s for s in chosen if s.serial]
    for spec in chosen:
        if not spec.serial:
            run.start(spec)

    def next_serial() -> None:
        while serial and not any(r.spec.serial for r in run.running.values()):
            run.start(serial.pop(0))

    next_serial()
    while run.running:
        wait = min(r.deadline for r in run.running.values()) - clock()
        try:
            name, results, duration = run.done.get(timeout=max(0.0, wait))
        except queue.Empty:
            run.expire()
        else:
            run.finish(name, results, duration)
        next_serial()
    return run


def run_preflight(
    config: PreflightConfig,
    mode: str = "quick",
    *,
    on_result: OnResult | None = None,
    only: Iterable[str] = (),
    budget_s: float | None = None,
    nvml_factory: Callable[[], Nvml] = PynvmlAdapter,
    specs: Sequence[CheckSpec] | None = None,
    quick_specs: Sequence[CheckSpec] = ALL_SPECS,
    gpus: GpuExpectation | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> PreflightReport:
    """Runs the mode's checks (or `only` these units) and returns the report.

    `on_result` is called from this thread as each result arrives, so an agent can stream them; a
    unit that runs again after the budget ran out streams only its final answer. `quick_specs` are
    the quick units a burn-in includes (the agent passes its own). `gpus` is where GPUs are
    expected (default: read from this host, preflight.gpus).
    Raises ValueError for a bad mode or check name; never raises for a failing or hanging check.

    Before the units run, the runner reads where GPUs are expected (preflight.gpus) and `[compute]
    device = "auto"` becomes "cuda" there. An abandoned unit's daemon thread is left behind (its
    subprocesses kill themselves on their own timeouts). INCONCLUSIVE also covers a unit whose child the
    budget stopped (preflight.checks.base.budget_timeout) or one that cannot start in the budget left.
    """
    worker = burn_in.DeviceWorker()  # the burn-in's device stages share one child process
    if specs is None and mode == BURN_IN:
        specs = burn_in.pipeline(config, worker, quick_specs)
    chosen = select_specs(config, mode, only, specs)
    gpus = expect_gpus(config) if gpus is None else gpus
    config = resolve_device(config, gpus)
    budget = budget_s if budget_s and budget_s > 0 else config.budget_s(mode)
    started_wall, started = time.time(), clock()
    nvml = NvmlSession(nvml_factory)
    rerun = mode in MODES  # the burn-in's budget is an hour: it is not run twice
    first = _one_pass(
        CheckContext(config=config, mode=mode, nvml=nvml, deadline=started + budget, gpus=gpus),
        chosen,
        clock=clock,
        on_result=on_result,
        budget=budget,
        hold=rerun,
    )
    results, abandoned = list(first.results), list(first.abandoned)
    if first.held:
        if any(r.status is CheckStatus.FAIL for r in results):  # the node fails anyway: no second run
            for held in first.held.values():
                for result in held:
                    first.emit(result)
            results = list(first.results)
        else:
            again = _one_pass(
                CheckContext(config=config, mode=mode, nvml=nvml, deadline=clock() + budget, gpus=gpus),
                [s for s in chosen if s.name in first.held],
                clock=clock,
                on_result=on_result,
                budget=budget,
                hold=False,
                again=True,
            )
            results += again.results
            abandoned += again.abandoned
    if abandoned:
        worker.kill()  # an abandoned stage may be waiting on it
    else:
        worker.close()
        nvml.close()  # an abandoned NVML call may still be running; leave the library loaded then
    return PreflightReport(
        mode=mode,
        host=socket.gethostname(),
        started_at=started_wall,
        duration_s=clock() - started,
        budget_s=budget,
        results=tuple(results),
        abandoned=tuple(abandoned),
    )
