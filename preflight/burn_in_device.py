"""The burn-in's device work: a sustained known-answer matmul loop and a device-memory pattern test,
on every GPU at once (one thread per GPU) or on the CPU. It runs in one child process per burn-in
(`python -m preflight.burn_in_device`, `serve`), so neither torch nor a CUDA context stays in the
agent; preflight.checks.burn_in drives it, and tests call the functions in-process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from preflight.checks.compute import (
    CudaUnavailable,
    MatmulFn,
    _tolerance,
    _torch,
    expected_checksums,
    known_inputs,
    plan_devices,
)
from preflight.config import BurnInConfig, ComputeConfig, config_from_mapping

if TYPE_CHECKING:
    import torch

ReadbackFn = Callable[["torch.Tensor"], "torch.Tensor"]
T = TypeVar("T")
WORD = 8  # bytes: the memory test works on int64 words
WINDOW_S = 1.0  # the loop's throughput is also reported per window of about this long (its slowest)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoopOutcome:
    device: str
    gpu_index: int | None
    size: int
    dtype: str
    iterations: int  # checked products (the reference not counted)
    bad_iterations: int
    reference_ok: bool  # the device's fp32 reference product matched its exact checksums
    first_bad: str  # "" when every product was right; else which, how many elements, where
    tflops: float  # mean over the loop, matmul time only
    tflops_min_window: float  # the slowest ~1 s window (a GPU that throttles mid-loop)
    seconds: float


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryOutcome:
    device: str
    gpu_index: int | None
    bytes_free: int  # free device memory before the test (the host buffer's size on CPU)
    bytes_tested: int
    chunks: int
    patterns: tuple[str, ...]
    bad_words: int
    first_bad: str  # "" when every word read back as written; else pattern, byte offset, values
    note: str  # why fewer bytes were tested than asked for ("" when not)
    seconds: float


def devices(compute: ComputeConfig) -> list[tuple[str, int | None]]:
    """Raises CudaUnavailable for device "cuda" without CUDA (compute's `plan_devices`)."""
    return plan_devices(compute.device)


def _sync(device: Any) -> None:
    if device.type == "cuda":
        _torch().cuda.synchronize(device)


def sustained_matmul(
    device_name: str,
    size: int,
    duration_s: float,
    dtype_name: str,
    *,
    matmul: MatmulFn | None = None,
    gpu_index: int | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> LoopOutcome:
    """The known-answer product on one device for `duration_s`, every result checked.
    `matmul` is the torch boundary tests corrupt (it computes the reference too)."""
    torch = _torch()
    mm = matmul or torch.matmul
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = getattr(torch, dtype_name)
    a, b = known_inputs(size)
    rows_want, cols_want = expected_checksums(a, b)
    a32, b32 = a.to(device, torch.float32), b.to(device, torch.float32)
    reference = mm(a32, b32)
    _sync(device)
    bad_rows = int((reference.double().sum(dim=1).cpu() != rows_want.double()).sum())
    bad_cols = int((reference.double().sum(dim=0).cpu() != cols_want.double()).sum())
    base: dict[str, Any] = {"device": device_name, "gpu_index": gpu_index, "size": size, "dtype": dtype_name}
    if bad_rows or bad_cols:
        return LoopOutcome(
            **base,
            iterations=0,
            bad_iterations=0,
            reference_ok=False,
            first_bad=f"the fp32 reference product: {bad_rows} row / {bad_cols} column checksums differ",
            tflops=0.0,
            tflops_min_window=0.0,
            seconds=0.0,
        )
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    reference = reference.to(wide)
    rtol, atol = _tolerance(dtype)
    limit = reference.abs() * rtol + atol
    at, bt = a32.to(dtype), b32.to(dtype)
    flops = 2.0 * size**3
    iterations = bad = 0
    first_bad = ""
    busy = window_busy = 0.0
    window_flops = 0.0
    window_rates: list[float] = []
    started = window_start = clock()
    while iterations == 0 or clock() - started < duration_s:
        t0 = clock()
        out = mm(at, bt)
        _sync(device)
        spent = clock() - t0
        if iterations:  # the first product (kernel choice, clocks ramping) is checked, not timed
            busy += spent
            window_busy += spent
            window_flops += flops
        wrong = (out.to(wide) - reference).abs() > limit
        count = int(wrong.sum())
        if count:
            bad += 1
            if not first_bad:
                i, j = (int(x) for x in wrong.nonzero()[0])
                first_bad = (
                    f"product {iterations}: {count} element(s) wrong, first [{i}, {j}] = "
                    f"{float(out[i, j]):g} (want {float(reference[i, j]):g})"
                )
        iterations += 1
        if clock() - window_start >= WINDOW_S and window_busy > 0:
            window_rates.append(window_flops / window_busy / 1e12)
            window_busy = window_flops = 0.0
            window_start = clock()
    seconds = clock() - started
    timed = max(iterations - 1, 0)
    tflops = flops * timed / busy / 1e12 if busy > 0 else 0.0
    return LoopOutcome(
        **base,
        iterations=iterations,
        bad_iterations=bad,
        reference_ok=True,
        first_bad=first_bad,
        tflops=tflops,
        tflops_min_window=min(window_rates, default=tflops),
        seconds=seconds,
    )


def _fill(scratch: torch.Tensor, pattern: str, first_word: int, seed: int) -> None:
    """The expected words of `pattern` for words first_word .. first_word + len(scratch), into scratch."""
    torch = _torch()
    if pattern == "random":
        gen = torch.Generator(device=scratch.device).manual_seed(seed + first_word)
        torch.randint(
            -(2**63),
            2**63 - 1,
            scratch.shape,
            generator=gen,
            dtype=torch.int64,
            device=scratch.device,
            out=scratch,
        )
        return
    torch.arange(
        first_word, first_word + scratch.numel(), dtype=torch.int64, device=scratch.device, out=scratch
    )
    if pattern == "address":
        return
    scratch.remainder_(64)
    torch.bitwise_left_shift(torch.ones_like(scratch), scratch, out=scratch)
    if pattern == "walking_zeros":
        scratch.bitwise_not_()


def memory_test(
    device_name: str,
    *,
    host_bytes: int,
    fraction: float,
    chunk_bytes: int,
    patterns: Sequence[str],
    seed: int,
    readback: ReadbackFn | None = None,
    gpu_index: int | None = None,
) -> MemoryOutcome:
    """Patterns over `fraction` of the device's free memory (a GPU) or a `host_bytes` buffer (CPU).
    `readback` is the seam tests use to corrupt what a chunk reads back as."""
    torch = _torch()
    read = readback or (lambda t: t)
    device = torch.device(device_name)
    started = time.perf_counter()
    note = ""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        free, _ = torch.cuda.mem_get_info(device)
        target = int(free * fraction)
    else:
        free = target = host_bytes
        chunk_bytes = min(chunk_bytes, host_bytes)
    words = max(1, chunk_bytes // WORD)
    scratch = torch.empty(words, dtype=torch.int64, device=device)
    # On a GPU the expected words and the comparison's mask (a chunk and an eighth) come out of the
    # fraction of free memory; a host buffer's size is the tested bytes alone.
    used = words * WORD + words if device.type == "cuda" else 0
    chunks: list[Any] = []  # torch tensors (the local `torch` is the module, imported lazily)
    while used + words * WORD <= target:
        try:
            chunks.append(torch.empty(words, dtype=torch.int64, device=device))
        except torch.cuda.OutOfMemoryError:  # another process took memory meanwhile: test what we have
            note = f"allocation stopped at {len(chunks)} chunks (out of memory)"
            break
        used += words * WORD
    bad = 0
    first_bad = ""
    for pattern in patterns:
        for index, chunk in enumerate(chunks):
            _fill(scratch, pattern, index * words, seed)
            chunk.copy_(scratch)
        _sync(device)
        for index, chunk in enumerate(chunks):
            _fill(scratch, pattern, index * words, seed)
            got = read(chunk)
            wrong = got != scratch
            count = int(wrong.sum())
            if count:
                bad += count
                if not first_bad:
                    at = int(wrong.nonzero()[0])
                    offset = (index * words + at) * WORD
                    first_bad = (
                        f"pattern {pattern}: {count} word(s) wrong in chunk {index}; first at byte "
                        f"offset {offset} (0x{offset:x}): read 0x{int(got[at]) & (2**64 - 1):016x}, "
                        f"wrote 0x{int(scratch[at]) & (2**64 - 1):016x}"
                    )
            del wrong
    count_chunks = len(chunks)
    del chunks, scratch
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return MemoryOutcome(
        device=device_name,
        gpu_index=gpu_index,
        bytes_free=int(free),
        bytes_tested=count_chunks * words * WORD,
        chunks=count_chunks,
        patterns=tuple(patterns),
        bad_words=bad,
        first_bad=first_bad,
        note=note,
        seconds=time.perf_counter() - started,
    )


def _each_device(targets: list[tuple[str, int | None]], fn: Callable[[str, int | None], T]) -> list[T]:
    """`fn` on every device at once (a thread each: torch lets go of the GIL in CUDA calls)."""
    if len(targets) == 1:
        return [fn(*targets[0])]
    with ThreadPoolExecutor(max_workers=len(targets), thread_name_prefix="burn-in") as pool:
        return list(pool.map(lambda t: fn(*t), targets))


def matmul_outcomes(
    burn: BurnInConfig, compute: ComputeConfig, matmul: MatmulFn | None = None
) -> list[LoopOutcome]:
    """The loop on every device. Raises CudaUnavailable (see `devices`)."""
    targets = devices(compute)
    cuda = targets[:1] != [("cpu", None)]
    size = burn.matmul_size if cuda else burn.matmul_size_cpu
    duration = burn.matmul_duration_s if cuda else burn.matmul_duration_s_cpu
    dtype = burn.matmul_dtype if burn.matmul_dtype != "auto" else ("bfloat16" if cuda else "float32")
    return _each_device(
        targets, lambda dev, gpu: sustained_matmul(dev, size, duration, dtype, matmul=matmul, gpu_index=gpu)
    )


def memory_outcomes(
    burn: BurnInConfig, compute: ComputeConfig, readback: ReadbackFn | None = None
) -> list[MemoryOutcome]:
    """The pattern test on every device. Raises CudaUnavailable (see `devices`)."""
    return _each_device(
        devices(compute),
        lambda dev, gpu: memory_test(
            dev,
            host_bytes=burn.memory_mb_cpu * 1024 * 1024,
            fraction=burn.memory_fraction,
            chunk_bytes=burn.memory_chunk_mb * 1024 * 1024,
            patterns=burn.memory_patterns,
            seed=burn.memory_seed,
            readback=readback,
            gpu_index=gpu,
        ),
    )


def child_args(burn: BurnInConfig, compute: ComputeConfig) -> list[str]:
    return [
        "--burn-in",
        json.dumps(dataclasses.asdict(burn)),
        "--compute",
        json.dumps(dataclasses.asdict(compute)),
        "--parent",
        str(os.getpid()),
    ]


def serve(burn: BurnInConfig, compute: ComputeConfig) -> int:
    """The device worker's loop: a stage name a line on stdin; its outcomes as JSON lines on stdout,
        then {"done": stage} ({"cuda_unavailable": why} instead of outcomes when CUDA is required and
    unavailable). Ends at EOF. One process serves a burn-in's device stages one after the
        other, so torch and CUDA start once per burn-in, not once per stage.

    matmul (`sustained_matmul`): preflight.checks.compute's inputs; the reference product is computed
    on the device and verified by its checksums, then the timed dtype's product is computed for
    `duration_s` and every result is compared with the reference (exact for 32/64-bit dtypes, compute's
    tolerance for 16-bit ones); throughput counts the matmul time only.

    memory (`memory_test`): each pattern is written over every chunk first and only then read back, so
    a value sits in memory while the rest is written. Patterns: walking_ones (word i holds
    1 << (i mod 64)), walking_zeros, address (word i holds its own index) and random (a seeded stream
    regenerated to verify).
    """
    work: dict[str, Callable[[BurnInConfig, ComputeConfig], Sequence[Any]]] = {
        "matmul": matmul_outcomes,
        "memory": memory_outcomes,
    }
    for line in sys.stdin:
        stage = line.strip()
        if stage not in work:
            print(f"preflight.burn_in_device: unknown stage {stage[:40]!r}", file=sys.stderr, flush=True)
            return 2
        try:
            for outcome in work[stage](burn, compute):
                print(json.dumps(dataclasses.asdict(outcome)), flush=True)
        except CudaUnavailable as exc:  # an answer: the parent fails the stage closed with it
            print(json.dumps({"cuda_unavailable": str(exc)}), flush=True)
        print(json.dumps({"done": stage}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m preflight.burn_in_device")
    parser.add_argument("--burn-in", dest="burn_in", required=True, help="the [burn_in] section as JSON")
    parser.add_argument("--compute", required=True, help="the [compute] section as JSON")
    parser.add_argument(
        "--parent", type=int, default=0, help="the pid that serves it (default: its parent now)"
    )
    args = parser.parse_args(argv)
    config = config_from_mapping(
        {"burn_in": json.loads(args.burn_in), "compute": json.loads(args.compute)}, "--burn-in/--compute"
    )
    exit_with_parent(args.parent or os.getppid())
    return serve(config.burn_in, config.compute)


PARENT_POLL_S = 0.2


def exit_with_parent(parent: int, poll_s: float = PARENT_POLL_S) -> None:
    """This process serves the agent that started it: once that agent is gone (stopped, killed),
    a stage in progress (minutes of matmul on every GPU) ends now, not at its next read of stdin.
    Polled, not PR_SET_PDEATHSIG: that signal follows the parent's thread, and the agent starts
    this process from a preflight thread that may end first."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(3)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
