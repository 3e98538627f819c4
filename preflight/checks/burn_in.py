"""The burn-in pipeline (`preflight run --burn-in`, mode "burn_in"): its stages (matmul, memory, dcgm,
allreduce, storage) run one at a time in the order of [burn_in].stages within [run]
burn_in_budget_s, beside the quick preflight's own units (a stage replaces the quick unit it does
more thoroughly), so a node never leaves quarantine with a check it would fail at its next launch.
Every result is named `burn_in.<stage>...`. The agent runs it for a quarantined node's burn-in.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import importlib.util
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from preflight.burn_in_device import (
    LoopOutcome,
    MemoryOutcome,
    ReadbackFn,
    child_args,
    matmul_outcomes,
    memory_outcomes,
)
from preflight.checks import dcgm, storage
from preflight.checks.base import (
    CheckContext,
    CheckSpec,
    budget_timeout,
    gpus_unreachable,
    out_of_budget,
    own_process_tree,
    process_name,
)
from preflight.checks.collective_check import _local_world, launch_ranks
from preflight.checks.compute import CudaUnavailable, MatmulFn, no_cuda, no_torch
from preflight.checks.expectations import no_floor
from preflight.collective import SoakResult
from preflight.config import BURN_IN, BURN_IN_STAGES, BurnInConfig, ErrorsConfig, PreflightConfig
from preflight.nvml import THROTTLE_BITS, Nvml, NvmlError, NvmlNotSupported, RemappedRows
from preflight.result import CheckResult, failed, inconclusive, passed, skipped, warned

PREFIX = "burn_in"
_PROJECT_ROOT = str(Path(__file__).resolve().parents[2])
_DRAIN = "drain the node; reset the GPU and run the vendor's field diagnostics; RMA if it repeats"
_SDC = "silent data corruption: drain the node and run the vendor diagnostics (dcgmi diag -r 3)"


def stage_name(stage: str, part: str = "") -> str:
    return f"{PREFIX}.{stage}" + (f".{part}" if part else "")


# --- NVML counters around a stage ------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Counters:
    """One GPU's readings; None where this GPU/driver does not report the counter."""

    ecc_volatile: int | None
    remap: RemappedRows | None
    throttle: int | None
    temperature: int | None
    errors: tuple[str, ...] = ()  # queries that failed (a lost GPU, a driver error)


def read_counters(nvml: Nvml, gpu: int) -> Counters:
    queries: dict[str, Callable[[], Any]] = {
        "ecc_volatile": lambda: nvml.ecc_uncorrected(gpu, volatile=True),
        "remap": lambda: nvml.remapped_rows(gpu),
        "throttle": lambda: nvml.throttle_reasons(gpu),
        "temperature": lambda: nvml.temperature(gpu),
    }
    values: dict[str, Any] = {}
    errors = []
    for key, query in queries.items():
        try:
            values[key] = query()
        except NvmlNotSupported:
            values[key] = None
        except NvmlError as exc:
            values[key] = None
            errors.append(f"{key}: {exc}")
    return Counters(**values, errors=tuple(errors))


def _reasons(mask: int) -> list[str]:
    return sorted(reason for reason, bit in THROTTLE_BITS.items() if mask & bit)


def _describe(c: Counters) -> str:
    remap = (
        "n/a"
        if c.remap is None
        else f"unc={c.remap.uncorrectable} pending={int(c.remap.pending)} failure={int(c.remap.failure)}"
    )
    throttle = (
        "n/a" if c.throttle is None else f"0x{c.throttle:x} ({', '.join(_reasons(c.throttle)) or 'none'})"
    )
    return (
        f"ecc_volatile_uncorrectable={'n/a' if c.ecc_volatile is None else c.ecc_volatile} "
        f"row_remap[{remap}] throttle={throttle} temperature={'n/a' if c.temperature is None else c.temperature} C"
    )


def judge_counters(
    stage: str,
    gpu: int,
    before: Counters,
    after: Counters,
    *,
    throttle_seen: int,
    hottest: int | None,
    errors: ErrorsConfig,
    temperature_max_c: int,
) -> CheckResult:
    """One GPU's verdict from its readings before, during (`throttle_seen`, `hottest`) and after."""
    name = stage_name(stage, "counters")
    evidence = (
        f"before: {_describe(before)}",
        f"during: throttle reasons seen 0x{throttle_seen:x} ({', '.join(_reasons(throttle_seen)) or 'none'}), "
        f"hottest {'n/a' if hottest is None else hottest} C",
        f"after: {_describe(after)}",
    )
    if all(v is None for v in (after.ecc_volatile, after.remap, after.throttle, after.temperature)):
        if after.errors:
            return failed(
                name, f"NVML queries failed: {'; '.join(after.errors)}", gpu_index=gpu, remedy=_DRAIN
            )
        return skipped(name, "this GPU/driver reports none of the counters", gpu_index=gpu)
    problems = [f"NVML query failed: {e}" for e in after.errors]
    if after.ecc_volatile is not None:
        if before.ecc_volatile is not None and after.ecc_volatile > before.ecc_volatile:
            problems.append(
                f"{after.ecc_volatile - before.ecc_volatile} new uncorrectable ECC error(s) during the stage"
            )
        elif after.ecc_volatile > errors.ecc_volatile_uncorrectable_max:
            problems.append(f"{after.ecc_volatile} uncorrectable ECC error(s) since the driver loaded")
    if after.remap is not None:
        if after.remap.failure:
            problems.append("row remapping failed (no spare rows left)")
        if after.remap.pending:
            problems.append("row remapping pending until the GPU is reset")
        if before.remap is not None and after.remap.uncorrectable > before.remap.uncorrectable:
            problems.append(
                f"{after.remap.uncorrectable - before.remap.uncorrectable} new row(s) remapped for "
                "uncorrectable errors during the stage"
            )
    seen = _reasons(throttle_seen)
    if bad := [r for r in seen if r in errors.fail_throttle_reasons]:
        problems.append("clocks throttled under load: " + ", ".join(bad))
    if temperature_max_c and hottest is not None and hottest > temperature_max_c:
        problems.append(f"reached {hottest} C, above the {temperature_max_c} C limit")
    kw: dict[str, Any] = {"gpu_index": gpu, "evidence": evidence}
    if hottest is not None:
        kw.update(
            value=float(hottest), unit="C", threshold=float(temperature_max_c) if temperature_max_c else None
        )
    if problems:
        return failed(name, "; ".join(problems), remedy=_DRAIN, **kw)
    if meh := [r for r in seen if r in errors.warn_throttle_reasons]:
        return warned(
            name, "clocks throttled under load: " + ", ".join(meh), remedy="check cooling and airflow", **kw
        )
    return passed(name, "no new ECC errors or row remaps, no harmful throttling under load", **kw)


class CounterWatch:
    """NVML around one stage: `before` at construction, `sample()` during, `finish()` after."""

    def __init__(self, ctx: CheckContext, stage: str) -> None:
        self.stage = stage
        self.config = ctx.config
        self.ctx = ctx
        self.skip_reason = ""
        self.nvml: Nvml | None = None
        self.before: dict[int, Counters] = {}
        self.throttle_seen: dict[int, int] = {}
        self.hottest: dict[int, int | None] = {}
        try:
            nvml = ctx.nvml.get()
            count = nvml.device_count()
        except NvmlError as exc:
            self.skip_reason = f"no NVML: {exc}"
            return
        if count == 0:
            self.skip_reason = "NVML sees no GPU"
            return
        self.nvml = nvml
        for gpu in range(count):
            self.before[gpu] = read_counters(nvml, gpu)
            self.throttle_seen[gpu] = 0
            self.hottest[gpu] = None
            self._note(gpu, self.before[gpu])

    def _note(self, gpu: int, c: Counters) -> None:
        if c.throttle is not None:
            self.throttle_seen[gpu] |= c.throttle
        if c.temperature is not None:
            hot = self.hottest[gpu]
            self.hottest[gpu] = c.temperature if hot is None else max(hot, c.temperature)

    def sample(self) -> None:
        if self.nvml is None:
            return
        for gpu in self.before:
            self._note(gpu, read_counters(self.nvml, gpu))

    def finish(self) -> list[CheckResult]:
        if self.nvml is None:
            # where GPUs are expected, counters that cannot be read FAIL (preflight.gpus)
            return [gpus_unreachable(stage_name(self.stage, "counters"), self.ctx, self.skip_reason)]
        results = []
        for gpu, before in self.before.items():
            after = read_counters(self.nvml, gpu)
            self._note(gpu, after)
            results.append(
                judge_counters(
                    self.stage,
                    gpu,
                    before,
                    after,
                    throttle_seen=self.throttle_seen[gpu],
                    hottest=self.hottest[gpu],
                    errors=self.config.errors,
                    temperature_max_c=self.config.burn_in.temperature_max_c,
                )
            )
        return results


def watched(ctx: CheckContext, stage: str, work: Callable[[], list[CheckResult]]) -> list[CheckResult]:
    """Runs `work` with NVML read before, sampled during and read after; its results, then the counters'."""
    watch = CounterWatch(ctx, stage)
    out: list[CheckResult] = []
    crash: list[BaseException] = []

    def target() -> None:
        try:
            out.extend(work())
        except BaseException as exc:  # re-raised below, in the runner's thread, which reports it
            crash.append(exc)

    thread = threading.Thread(target=target, name=f"burn-in-{stage}", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(ctx.config.burn_in.sample_interval_s)
        watch.sample()
    if crash:
        raise crash[0]
    return out + watch.finish()


# --- device stages: matmul, memory ------------------------------------------------------------


def _child_timeout(ctx: CheckContext, limit_s: float) -> float:
    return min(limit_s, max(0.5, ctx.deadline - time.monotonic() - 0.5))


def _stage_limit(config: PreflightConfig, stage: str) -> float:
    """How long a stage may take: its longest duration (GPU or CPU) plus the slack."""
    b = config.burn_in
    longest = {
        "matmul": max(b.matmul_duration_s, b.matmul_duration_s_cpu),
        "allreduce": max(b.allreduce_duration_s, b.allreduce_duration_s_cpu),
        "memory": 0.0,
        "storage": config.storage.timeout_s,
        "dcgm": config.dcgm.burn_in_timeout_s,
    }[stage]
    return longest + b.stage_slack_s


_STARTED: weakref.WeakSet[DeviceWorker] = weakref.WeakSet()


@atexit.register
def _end_device_workers() -> None:
    """The process that started them exits (an agent stopped mid burn-in): their children end now,
    not minutes later at the end of a stage. (A killed agent's child notices by itself:
    preflight.burn_in_device's `exit_with_parent`.)"""
    for worker in list(_STARTED):
        worker.kill()


class DeviceWorker:
    """The child process that runs a burn-in's device stages one after the other
    (preflight.burn_in_device's `serve`): torch and CUDA start once per burn-in, never in the
    caller (a long-lived agent). Started on first use; `close()` ends it, and so does the
    caller's exit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._stderr: IO[bytes] | None = None

    def _start(self, config: PreflightConfig) -> subprocess.Popen[bytes]:
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(p for p in (_PROJECT_ROOT, os.environ.get("PYTHONPATH")) if p),
        )
        # A file, not a pipe: a chatty child never blocks. Closed in close().
        if self._stderr is not None:
            self._stderr.close()  # the last child's (it was killed or died)
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "preflight.burn_in_device", *child_args(config.burn_in, config.compute)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
            bufsize=0,  # unbuffered: select() on stdout sees every line the child wrote
            start_new_session=True,
        )
        _STARTED.add(self)
        return self._proc

    def _last_words(self) -> str:
        if self._stderr is None:
            return "(no output)"
        self._stderr.seek(0)
        tail = self._stderr.read().decode("utf-8", "replace").strip().splitlines()[-1:]
        return tail[0][:300] if tail else "(no output)"

    def run(self, stage: str, config: PreflightConfig, timeout_s: float) -> list[dict[str, Any]]:
        """The stage's outcomes as mappings. Raises TimeoutError (the child killed) or RuntimeError."""
        with self._lock:
            proc = self._proc if self._proc is not None and self._proc.poll() is None else self._start(config)
            assert proc.stdin is not None and proc.stdout is not None  # both are pipes
            deadline = time.monotonic() + timeout_s
            try:
                proc.stdin.write(f"{stage}\n".encode())
            except OSError as exc:
                self._reap()
                raise RuntimeError(f"burn-in {stage} process is gone: {exc}; {self._last_words()}") from exc
            lines: list[dict[str, Any]] = []
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.kill()
                    raise TimeoutError(f"burn-in {stage} did not finish in {timeout_s:.1f} s (killed)")
                ready, _, _ = select.select([proc.stdout], [], [], left)
                if not ready:
                    continue
                line = proc.stdout.readline()
                if not line:
                    code = self._reap()
                    raise RuntimeError(f"burn-in {stage} process exited {code}: {self._last_words()}")
                try:
                    item = json.loads(line)
                except ValueError as exc:
                    self.kill()
                    raise RuntimeError(f"burn-in {stage} process wrote something unexpected: {exc}") from exc
                if item == {"done": stage}:
                    return lines
                lines.append(item)

    def _reap(self) -> int | None:
        proc, self._proc = self._proc, None
        return None if proc is None else proc.wait()

    def kill(self) -> None:
        """Ends the child now (a timed-out stage, an abandoned run); safe while a stage waits on it."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def close(self) -> None:
        """Ends the child once its current stage (if any) is over: EOF on its stdin, then a kill after 10 s."""
        proc = self._proc
        if proc is None:
            return
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()
        if self._stderr is not None:
            self._stderr.close()


def _device_outcomes(
    ctx: CheckContext, stage: str, in_process: Callable[[], list[Any]] | None, worker: DeviceWorker | None
) -> list[Any]:
    """The stage's outcomes from the run's device worker (a one-off one when none is given), or
    in-process when a test passed a seam (or [compute] isolate is off). Raises TimeoutError or RuntimeError."""
    if in_process is not None:
        return in_process()
    own = worker is None
    child = worker or DeviceWorker()
    try:
        lines = child.run(stage, ctx.config, _child_timeout(ctx, _stage_limit(ctx.config, stage)))
    finally:
        if own:
            child.close()
    for line in lines:
        if "cuda_unavailable" in line:
            raise CudaUnavailable(str(line["cuda_unavailable"]))
    try:
        if stage == "matmul":
            return [LoopOutcome(**line) for line in lines]
        return [MemoryOutcome(**{**line, "patterns": tuple(line["patterns"])}) for line in lines]
    except (TypeError, KeyError) as exc:
        raise RuntimeError(f"burn-in {stage} process wrote something unexpected: {exc}") from exc


def loop_result(o: LoopOutcome, floor: float) -> CheckResult:
    name = stage_name("matmul")
    kw: dict[str, Any] = {
        "gpu_index": o.gpu_index,
        "value": o.tflops,
        "unit": "TFLOP/s",
        "threshold": floor or None,
        "evidence": (
            f"device={o.device} n={o.size} dtype={o.dtype} products={o.iterations} in {o.seconds:.1f} s",
            f"wrong products={o.bad_iterations} tflops={o.tflops:.4g} slowest_window={o.tflops_min_window:.4g}",
            *((o.first_bad,) if o.first_bad else ()),
        ),
    }
    if not o.reference_ok:
        return failed(name, f"{o.device}: wrong reference product ({o.first_bad})", remedy=_SDC, **kw)
    if o.bad_iterations:
        return failed(
            name,
            f"{o.device}: {o.bad_iterations} of {o.iterations} products wrong over {o.seconds:.0f} s",
            remedy=_SDC,
            **kw,
        )
    if floor and o.tflops < floor:
        return failed(
            name,
            f"{o.device}: {o.tflops:.2f} TFLOP/s sustained, below the floor {floor:.2f}",
            remedy="check clocks, throttle reasons, power and cooling; compare with `preflight baseline`",
            **kw,
        )
    note = "" if floor else no_floor("compute.tflops_floor")
    return passed(
        name,
        f"{o.device}: {o.iterations} products in {o.seconds:.0f} s all right, {o.tflops:.3g} TFLOP/s{note}",
        **kw,
    )


def loop_spread(outcomes: list[LoopOutcome], spread_max: float) -> CheckResult:
    name = stage_name("matmul", "spread")
    median = statistics.median(o.tflops for o in outcomes)
    worst = min(o.tflops for o in outcomes) / median if median > 0 else 0.0
    kw: dict[str, Any] = {
        "value": worst,
        "unit": "ratio",
        "threshold": 1.0 - spread_max,
        "evidence": tuple(f"{o.device}: {o.tflops:.4g} TFLOP/s" for o in outcomes),
    }
    slow = [o.device for o in outcomes if o.tflops < median * (1.0 - spread_max)]
    if slow:
        return failed(
            name,
            f"sustained throughput below the node's median by more than {spread_max:.0%}: {', '.join(slow)}",
            remedy="a throttled or degraded GPU: check clocks, power, cooling and PCIe",
            **kw,
        )
    return passed(name, f"{len(outcomes)} devices; the slowest at {worst:.0%} of the median", **kw)


def memory_result(o: MemoryOutcome) -> CheckResult:
    name = stage_name("memory")
    gib = o.bytes_tested / 2**30
    share = o.bytes_tested / o.bytes_free if o.bytes_free else 0.0
    kw: dict[str, Any] = {
        "gpu_index": o.gpu_index,
        "value": float(o.bad_words),
        "unit": "words",
        "threshold": 0.0,
        "evidence": (
            f"device={o.device} tested={o.bytes_tested} B ({share:.0%} of {o.bytes_free} B free) "
            f"chunks={o.chunks} patterns={','.join(o.patterns)} in {o.seconds:.1f} s",
            *((o.first_bad,) if o.first_bad else ()),
            *((o.note,) if o.note else ()),
        ),
    }
    if o.bytes_tested == 0:
        return failed(
            name,
            f"{o.device}: no memory could be allocated to test ({o.note or 'less free than one chunk'})",
            remedy="another process holds the device memory: find it (nvidia-smi) before the burn-in",
            **kw,
        )
    if o.bad_words:
        return failed(
            name,
            f"{o.device}: {o.bad_words} word(s) read back wrong; {o.first_bad}",
            remedy="device memory returns wrong data: " + _DRAIN,
            **kw,
        )
    message = f"{o.device}: {gib:.3g} GiB x {len(o.patterns)} patterns read back as written"
    if o.note:
        return warned(name, f"{message}, but {o.note}", remedy="rerun with the device idle", **kw)
    return passed(name, message, **kw)


def _has_torch() -> bool:
    return importlib.util.find_spec("torch") is not None  # looks, without importing it


def _device_stage(
    ctx: CheckContext,
    stage: str,
    local: Callable[[], list[Any]] | None,
    worker: DeviceWorker | None,
    judge: Callable[[list[Any]], list[CheckResult]],
) -> list[CheckResult]:
    """A device stage (matmul, memory): run in `worker` (or `local`, in this process), under the
    counters watch; errors and a missing device are results, the outcomes are judged by `judge`."""
    name = stage_name(stage)
    if not _has_torch():
        return [no_torch(name, ctx)]

    def work() -> list[CheckResult]:
        _, by_budget = budget_timeout(ctx, _stage_limit(ctx.config, stage), floor_s=0.5)
        try:
            outcomes = _device_outcomes(ctx, stage, local, worker)
        except CudaUnavailable as exc:  # where GPUs are expected: never a CPU burn-in that passes
            return [no_cuda(name, ctx, exc)]
        except TimeoutError as exc:
            if by_budget:
                return [out_of_budget(name, ctx, str(exc))]
            return [failed(name, str(exc), remedy="a hung GPU: drain the node and inspect it")]
        except (RuntimeError, OSError) as exc:
            return [failed(name, str(exc), remedy="read the error; check the driver and GPUs")]
        return judge(outcomes)

    return watched(ctx, stage, work)


def run_matmul(
    ctx: CheckContext, matmul: MatmulFn | None = None, worker: DeviceWorker | None = None
) -> list[CheckResult]:
    """The matmul stage, in `worker`. `matmul` (a test seam at the torch boundary) runs it in this process."""
    cfg = ctx.config
    local = matmul is not None or not cfg.compute.isolate

    def judge(outcomes: list[LoopOutcome]) -> list[CheckResult]:
        results = [loop_result(o, cfg.compute.tflops_floor) for o in outcomes]
        if len(outcomes) > 1:
            results.append(loop_spread(outcomes, cfg.compute.gpu_spread_max))
        return results

    run = (lambda: matmul_outcomes(cfg.burn_in, cfg.compute, matmul)) if local else None
    return _device_stage(ctx, "matmul", run, worker, judge)


def run_memory(
    ctx: CheckContext, readback: ReadbackFn | None = None, worker: DeviceWorker | None = None
) -> list[CheckResult]:
    """The memory stage, in `worker`. `readback` (a test seam: what a chunk reads back as) runs it in
    this process."""
    cfg = ctx.config
    local = readback is not None or not cfg.compute.isolate
    run = (lambda: memory_outcomes(cfg.burn_in, cfg.compute, readback)) if local else None
    return _device_stage(ctx, "memory", run, worker, lambda outcomes: [memory_result(o) for o in outcomes])


# --- dcgm, allreduce, storage -----------------------------------------------------------------


def _renamed(results: list[CheckResult]) -> list[CheckResult]:
    return [dataclasses.replace(r, name=f"{PREFIX}.{r.name}") for r in results]


def run_dcgm(ctx: CheckContext) -> list[CheckResult]:
    """`dcgmi diag -r [dcgm].burn_in_level` (the check reads the level off the mode); SKIP without DCGM."""
    return _renamed(dcgm.run_dcgm(ctx))


@dataclass(frozen=True, slots=True, kw_only=True)
class HostLoad:
    """What else loaded the node while the soak ran: other processes' share of the host's CPUs
    (None: not measured) and the processes other than the soak's own seen on its GPUs."""

    cpu_share: float | None = None
    gpu_processes: tuple[str, ...] = ()

    def busy(self, max_share: float) -> list[str]:
        """Why the node was not idle ([]: it was, as far as could be seen)."""
        why = []
        if self.cpu_share is not None and self.cpu_share > max_share:
            why.append(
                f"other processes used {self.cpu_share:.0%} of the host's CPUs (limit {max_share:.0%})"
            )
        if self.gpu_processes:
            why.append(f"other processes on its GPUs: {', '.join(self.gpu_processes[:4])}")
        return why

    def describe(self) -> str:
        cpu = "not measured" if self.cpu_share is None else f"{self.cpu_share:.1%}"
        return f"host load by other processes: CPU {cpu}; GPU processes: {', '.join(self.gpu_processes) or 'none'}"


def foreign_cpu_share(result: SoakResult) -> float | None:
    """Other processes' share of the host's CPUs over the soak's rounds (None: /proc/stat unreadable)."""
    if result.host_busy_s < 0 or result.host_cpus <= 0 or result.duration_s <= 0:
        return None
    return max(0.0, result.host_busy_s - result.own_cpu_s) / (result.duration_s * result.host_cpus)


WINDOW_MIN_S = 0.5  # /proc/stat counts 10 ms ticks: a shorter window's share is mostly rounding


def window_cpu_share(result: SoakResult, first: int, rounds: int) -> float | None:
    """Other processes' share of the host's CPUs over rounds [first, first + rounds), widened round by
    round on both sides until they span WINDOW_MIN_S (None: not measured, or the soak too short)."""
    n = len(result.round_s)
    if len(result.round_foreign_s) != n or result.host_cpus <= 0 or not 0 <= first < first + rounds <= n:
        return None
    lo, hi = first, first + rounds
    while sum(result.round_s[lo:hi]) < WINDOW_MIN_S and (lo > 0 or hi < n):
        lo, hi = max(0, lo - 1), min(n, hi + 1)
    wall = sum(result.round_s[lo:hi])
    if wall < WINDOW_MIN_S:
        return None
    return sum(result.round_foreign_s[lo:hi]) / (wall * result.host_cpus)


def evaluate_soak(
    result: SoakResult, burn: BurnInConfig, floor_gbps: float = 0.0, load: HostLoad | None = None
) -> CheckResult:
    """The soak's verdict. A wrong sum FAILs whatever else ran (load does not corrupt a sum). The
    baseline is the node's own floor (`floor_gbps`: [collective] busbw_floor_gbps) when set, else the
    first rounds' median; a window below allreduce_min_ratio x the baseline is a sag: a FAIL on an
    idle node, INCONCLUSIVE when something else loaded it (the host's load, not the link)."""
    name = stage_name("allreduce")
    load = load or HostLoad(cpu_share=foreign_cpu_share(result))
    rates = list(result.busbw_gbps)
    w = burn.allreduce_window
    evidence = [
        f"backend={result.backend} ranks={result.world_size} bytes={result.size_bytes} "
        f"rounds={result.rounds} x {result.iterations} all-reduces in {result.duration_s:.1f} s",
        "busbw per round (GB/s, each result's refill and check included): "
        + " ".join(f"{r:.3g}" for r in rates[:40])
        + (" ..." if len(rates) > 40 else ""),
        load.describe(),
    ]
    kw: dict[str, Any] = {"unit": "ratio", "threshold": burn.allreduce_min_ratio}
    if result.bad_results:
        return failed(
            name,
            f"{result.bad_results} all-reduce result(s) wrong, the first in round {result.first_bad_round}",
            evidence=tuple(evidence),
            remedy="drain the node; check NVLink/NVSwitch (nvidia-smi nvlink -e) and NCCL",
            **kw,
        )
    if floor_gbps <= 0 and len(rates) < 2 * w:
        return passed(
            name,
            f"{result.bad_results} wrong results over {result.rounds} rounds; too few rounds "
            f"({result.rounds} < {2 * w}) to judge a bandwidth sag",
            evidence=tuple(evidence),
            **kw,
        )
    if floor_gbps > 0:
        base, basis = floor_gbps, "the node's floor ([collective] busbw_floor_gbps)"
        starts = range(max(1, len(rates) - w + 1))
    else:
        base, basis = statistics.median(rates[:w]), "its first rounds"
        starts = range(w, len(rates) - w + 1)
    windows = {i: statistics.median(rates[i : i + w]) for i in starts}
    slowest = min(windows, key=lambda i: windows[i])
    worst = windows[slowest] / base if base > 0 else 0.0
    evidence.append(f"baseline {base:.4g} GB/s ({basis}); the slowest window at {worst:.0%}")
    if worst < burn.allreduce_min_ratio:
        sag = f"bandwidth sagged to {worst:.0%} of {basis} (limit {burn.allreduce_min_ratio:.0%})"
        during = window_cpu_share(result, slowest, w)
        if during is not None and (load.cpu_share is None or during > load.cpu_share):
            # the load while it sagged, not diluted over the soak: a neighbour's burst is the host's
            load = dataclasses.replace(load, cpu_share=during)
            evidence.append(f"in the slowest window: {load.describe()}")
        if why := load.busy(burn.allreduce_max_foreign_load):
            return inconclusive(
                name,
                f"{sag}, but the node was not idle: {'; '.join(why)}: it measured the host's load, "
                "not the link; run it again on an idle node",
                evidence=tuple(evidence),
                value=worst,
                remedy="rerun the burn-in with nothing else on the node",
                **kw,
            )
        return failed(
            name,
            sag,
            evidence=tuple(evidence),
            value=worst,
            remedy="a link that degrades under load: check NVLink/PCIe errors, cooling and NCCL",
            **kw,
        )
    return passed(
        name,
        f"{result.rounds} rounds, every result right; bandwidth held at >= {worst:.0%} of {basis}",
        evidence=tuple(evidence),
        value=worst,
        **kw,
    )


def gpu_strangers(ctx: CheckContext) -> list[str]:
    """Processes on the node's GPUs that are not this check's own (nor allowed by name), as
    "gpuN pid=P name=C"; [] without NVML (then the CPU share alone says whether the node was idle)."""
    try:
        nvml = ctx.nvml.get()
        count = nvml.device_count()
    except NvmlError:
        return []
    mine = own_process_tree()
    allowed = ctx.config.inventory.allowed_gpu_processes
    out = []
    for gpu in range(count):
        try:
            procs = nvml.compute_processes(gpu)
        except NvmlError:
            continue  # a GPU NVML cannot list says nothing about load; the counters judge it
        for proc in procs:
            if proc.pid in mine:
                continue
            comm = process_name(proc.pid)
            if comm not in allowed:
                out.append(f"gpu{gpu} pid={proc.pid} name={comm}")
    return out


class GpuWatch:
    """Samples `gpu_strangers` every `interval_s` while a soak runs (one at the start)."""

    def __init__(self, ctx: CheckContext, interval_s: float) -> None:
        self._ctx, self._interval = ctx, interval_s
        self._seen: dict[str, None] = dict.fromkeys(gpu_strangers(ctx))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="burn-in-gpu-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._seen.update(dict.fromkeys(gpu_strangers(self._ctx)))

    def stop(self) -> tuple[str, ...]:
        self._stop.set()
        self._thread.join()
        self._seen.update(dict.fromkeys(gpu_strangers(self._ctx)))
        return tuple(self._seen)


def run_allreduce(ctx: CheckContext) -> list[CheckResult]:
    name = stage_name("allreduce")
    if not _has_torch():
        return [skipped(name, "torch is not installed on this host")]
    burn, coll = ctx.config.burn_in, ctx.config.collective
    backend, world = _local_world(ctx)
    if world < 2:
        return [
            skipped(
                name,
                f"needs at least 2 ranks on this node, have {world} ({backend}): no in-node link to soak "
                "(links between nodes are the supervisor's bandwidth gate)",
            )
        ]
    gpu = backend == "nccl"
    duration = burn.allreduce_duration_s if gpu else burn.allreduce_duration_s_cpu
    size = coll.size_bytes_gpu if gpu else coll.size_bytes_cpu
    timeout = _child_timeout(ctx, duration + burn.stage_slack_s)
    watch = GpuWatch(ctx, burn.sample_interval_s)
    try:
        data = launch_ranks(
            world,
            backend,
            size,
            burn.allreduce_iterations,
            coll.warmup,
            timeout,
            extra=("--soak-s", str(duration)),
        )
        result = SoakResult(**{**data, "busbw_gbps": tuple(data["busbw_gbps"])})
    except TimeoutError as exc:
        return [failed(name, str(exc), remedy="a hung collective: check NCCL/NVLink and the GPUs' health")]
    except (RuntimeError, OSError, ValueError, TypeError, KeyError) as exc:
        return [
            failed(name, f"all-reduce soak failed: {exc}", remedy="read the ranks' errors; check NCCL/NVLink")
        ]
    finally:
        strangers = watch.stop()
    load = HostLoad(cpu_share=foreign_cpu_share(result), gpu_processes=strangers)
    return [evaluate_soak(result, burn, coll.busbw_floor_gbps, load)]


def run_storage(ctx: CheckContext) -> list[CheckResult]:
    """The storage check in its full form (the throughput probe included)."""
    return _renamed(storage.run_storage(dataclasses.replace(ctx, mode="full")))


def _runner_of(stage: str, worker: DeviceWorker) -> Callable[[CheckContext], list[CheckResult]]:
    if stage == "matmul":
        return lambda ctx: run_matmul(ctx, worker=worker)
    if stage == "memory":
        return lambda ctx: run_memory(ctx, worker=worker)
    return {"dcgm": run_dcgm, "allreduce": run_allreduce, "storage": run_storage}[stage]


def _spec(stage: str, worker: DeviceWorker) -> CheckSpec:
    return CheckSpec(
        name=stage_name(stage),
        run=_runner_of(stage, worker),
        # The stage's own limit, plus a margin so its child's timeout (with a better message) fires first.
        timeout_s=lambda c, m: _stage_limit(c, stage) + 2.0,
        modes=lambda c: (BURN_IN,) if stage in c.burn_in.stages else (),
        serial=True,  # one stage at a time: each would disturb the others' measurements
    )


def stage_specs(config: PreflightConfig, worker: DeviceWorker) -> list[CheckSpec]:
    """The configured stages in their configured order, then the others (run only when asked by
    name); the device stages run in `worker` (the caller closes it when the run is over)."""
    order = list(config.burn_in.stages) + [s for s in BURN_IN_STAGES if s not in config.burn_in.stages]
    return [_spec(s, worker) for s in order]


# --- the quick preflight inside the burn-in ----------------------------------------------------

# A quick unit a configured stage does more thoroughly (the matmul loop for the one matmul, the soak
# for the short all-reduce, dcgmi -r 3 for -r 1, the storage probe for the storage check).
SUPERSEDED_BY = {"compute": "matmul", "collective": "allreduce", "dcgm": "dcgm", "storage": "storage"}


def as_burn_in(spec: CheckSpec) -> CheckSpec:
    """`spec`, a quick preflight unit, as part of the burn-in: run exactly as in quick mode (its
    timeout, its mode), when quick mode runs it and no configured stage supersedes it."""

    def modes(config: PreflightConfig) -> tuple[str, ...]:
        wanted = "quick" in spec.modes(config) and SUPERSEDED_BY.get(spec.name) not in config.burn_in.stages
        return (BURN_IN,) if wanted else ()

    return dataclasses.replace(
        spec,
        run=lambda ctx: spec.run(dataclasses.replace(ctx, mode="quick")),
        timeout_s=lambda c, m: spec.timeout_s(c, "quick"),
        modes=modes,
    )


def pipeline(config: PreflightConfig, worker: DeviceWorker, quick: Sequence[CheckSpec]) -> list[CheckSpec]:
    """The burn-in as it runs: every quick preflight unit in `quick` (inventory, counters, Xid, the
    agent's leftovers; see `as_burn_in`) and then the stages (`stage_specs`), so a node cannot leave
    quarantine with a check it would fail at its next launch. The quick units that are not serial
    run beside the first stage; they are cheap.

    * matmul: the known-answer loop on every device at once (preflight.burn_in_device), per-device
      throughput against [compute] tflops_floor and the node's median ([compute] gpu_spread_max).
    * memory: write/verify patterns over memory_fraction of each GPU's free memory (memory_mb_cpu on CPU).
    * dcgm: `dcgmi diag -r [dcgm] burn_in_level` where DCGM is installed, else SKIP.
    * allreduce: the in-node all-reduce repeated for allreduce_duration_s, every result checked, its
      bandwidth watched for sag against the node's baseline; a busy GPU or CPU makes a sag INCONCLUSIVE.
    * storage: the storage check in its full form.

    NVML counters are watched around matmul and memory (`watched`): a new uncorrectable ECC error or
    row remap, a pending or failed remap, a failing throttle reason under load or a temperature above
    temperature_max_c is a FAIL with the before/during/after readings as evidence.
    """
    return [as_burn_in(s) for s in quick] + stage_specs(config, worker)
