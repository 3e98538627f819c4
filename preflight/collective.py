"""All-reduce bus bandwidth over torch.distributed: NCCL on GPUs, gloo on CPU.

One entry point (`python -m preflight.collective`) for the preflight's in-node check (one process
per GPU, or `cpu_processes` gloo ranks), a run across a few nodes under torchrun or any launcher
that sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK, and the node agent's
MeasureAllReduce (one rank per node, the group given by flags). Bus bandwidth follows nccl-tests:
busbw = bytes / time * 2 (n - 1) / n; the reduction's answer is checked too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class AllReduceResult:
    world_size: int
    backend: str
    size_bytes: int
    iterations: int
    time_s: float  # mean time of one all-reduce, slowest rank
    algbw_gbps: float  # GB/s, 1e9 bytes
    busbw_gbps: float
    correct: bool


def bus_bandwidth(size_bytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s for one all-reduce of `size_bytes` taking `seconds` (nccl-tests' formula)."""
    if seconds <= 0 or world_size < 1:
        raise ValueError(f"need seconds > 0 and world_size >= 1, got {seconds}, {world_size}")
    algbw = size_bytes / seconds / 1e9
    return algbw, algbw * 2 * (world_size - 1) / world_size


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None or not value.strip().isdigit():
        raise SystemExit(
            f"preflight.collective: environment variable {name} must be a non-negative integer, got {value!r}"
        )
    return int(value)


def _check_sum(dist: Any, torch: Any, tensor: Any, rank: int, world: int, device: Any) -> bool:
    tensor.fill_(float(rank + 1))
    dist.all_reduce(tensor)
    ok = torch.tensor([1.0 if bool((tensor == world * (world + 1) / 2).all()) else 0.0], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item() == 1.0)


def measure(size_bytes: int, iterations: int, warmup: int, backend: str = "") -> AllReduceResult:
    """Runs inside an initialized process group; every rank gets the same result.

    backend: the name to report ("": the group's own, which a bound gloo group would misname)."""
    import torch  # lazily: only GPU hosts and tests have torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    backend = backend or str(dist.get_backend())
    device = torch.device(f"cuda:{torch.cuda.current_device()}") if backend == "nccl" else torch.device("cpu")
    tensor = torch.zeros(max(1, size_bytes // 4), dtype=torch.float32, device=device)
    correct = _check_sum(dist, torch, tensor, rank, world, device)
    tensor.zero_()
    for _ in range(warmup):
        dist.all_reduce(tensor)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(tensor)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / iterations], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    correct = correct and _check_sum(dist, torch, tensor, rank, world, device)
    seconds = float(elapsed.item())
    algbw, busbw = bus_bandwidth(tensor.numel() * 4, seconds, world)
    return AllReduceResult(
        world_size=world,
        backend=backend,
        size_bytes=tensor.numel() * 4,
        iterations=iterations,
        time_s=seconds,
        algbw_gbps=algbw,
        busbw_gbps=busbw,
        correct=correct,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class SoakResult:
    """The burn-in's soak: rounds of `iterations` all-reduces for about `duration_s`, every result
    checked. Its bandwidth counts the refill and the check of each result too (the same work in every
    round, so the rounds compare; it reads a little under `measure`'s figure)."""

    world_size: int
    backend: str
    size_bytes: int
    iterations: int  # all-reduces per round
    rounds: int
    busbw_gbps: tuple[float, ...]  # one figure per round, the slowest rank's time
    bad_results: int  # all-reduces, over all ranks, whose sum was wrong
    first_bad_round: int  # -1: none
    duration_s: float
    # Who loaded the host's CPUs during the rounds: the ranks' own CPU time (summed), and every
    # CPU's busy time from /proc/stat (-1: unreadable) over `host_cpus` CPUs. The difference is
    # other processes' load: a sag measured under it is the host's, not the link's.
    own_cpu_s: float = 0.0
    host_busy_s: float = -1.0
    host_cpus: int = 0
    # The same per round: other processes' CPU seconds and the round's seconds (() where unmeasured),
    # so a sag is judged by the load during its own rounds, not diluted over the whole soak.
    round_foreign_s: tuple[float, ...] = ()
    round_s: tuple[float, ...] = ()


def host_cpu_busy() -> tuple[float, int] | None:
    """(busy seconds of all CPUs since boot, CPU count) from /proc/stat; None where unreadable."""
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            lines = fh.read().splitlines()
        # user nice system idle iowait irq softirq steal ...: busy is all but idle and iowait
        ticks = [int(x) for x in lines[0].split()[1:9]]
        cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    except (OSError, ValueError, IndexError):
        return None
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK"), cpus


def soak(
    size_bytes: int,
    iterations: int,
    warmup: int,
    duration_s: float,
    all_reduce: Callable[..., Any] | None = None,
) -> SoakResult:
    """Runs inside an initialized process group; every rank gets the same result. Each all-reduce
    (`all_reduce`: torch.distributed's, or a test's corrupting wrapper) sums rank + 1 over the ranks
    and is checked on the spot; all ranks stop after the same round
    (the decision is the slowest rank's clock, all-reduced)."""
    import torch
    import torch.distributed as dist

    reduce = all_reduce or dist.all_reduce
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = str(dist.get_backend())
    device = torch.device(f"cuda:{torch.cuda.current_device()}") if backend == "nccl" else torch.device("cpu")
    tensor = torch.empty(max(1, size_bytes // 4), dtype=torch.float32, device=device)
    want = float(world * (world + 1) / 2)
    for _ in range(warmup):
        tensor.fill_(float(rank + 1))
        reduce(tensor)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()  # the first round starts together: it is the baseline a sag is measured against
    rates: list[float] = []
    bad_total, first_bad = 0, -1
    host_before = host_cpu_busy() if rank == 0 else None
    cpu_before = time.process_time()
    started = time.perf_counter()
    foreign_s: list[float] = []
    round_s: list[float] = []
    while True:
        bad = torch.zeros(1, dtype=torch.float64, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        round_host = host_cpu_busy() if rank == 0 else None
        round_cpu = time.process_time()
        t0 = time.perf_counter()  # (also the start of the span the host's busy time is read over)
        for _ in range(iterations):
            tensor.fill_(float(rank + 1))
            reduce(tensor)
            bad += (tensor != want).any().to(torch.float64)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        # [this round's time, elapsed]: MAX; [wrong results, this round's CPU time]: SUM over ranks.
        stats = torch.tensor([now - t0, now - started], dtype=torch.float64, device=device)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        summed = torch.cat(
            [bad, torch.tensor([time.process_time() - round_cpu], dtype=torch.float64, device=device)]
        )
        dist.all_reduce(summed)
        bad = summed[:1]
        host_now = host_cpu_busy() if round_host is not None else None
        if round_host is not None and host_now is not None:
            # busy time and wall time over the same span (the round and its two small reductions)
            foreign_s.append(max(0.0, host_now[0] - round_host[0] - float(summed[1].item())))
            round_s.append(time.perf_counter() - t0)
        count = int(bad.item())
        if count and first_bad < 0:
            first_bad = len(rates)
        bad_total += count
        rates.append(bus_bandwidth(tensor.numel() * 4 * iterations, float(stats[0].item()), world)[1])
        if float(stats[1].item()) >= duration_s:
            break
    own = torch.tensor([time.process_time() - cpu_before], dtype=torch.float64, device=device)
    dist.all_reduce(own)  # SUM: every rank's CPU time over the rounds
    host_after = host_cpu_busy() if rank == 0 else None
    host_busy, host_cpus = -1.0, 0
    if host_before is not None and host_after is not None:
        host_busy, host_cpus = max(0.0, host_after[0] - host_before[0]), host_after[1]
    return SoakResult(
        world_size=world,
        backend=backend,
        size_bytes=tensor.numel() * 4,
        iterations=iterations,
        rounds=len(rates),
        busbw_gbps=tuple(rates),
        bad_results=bad_total,
        first_bad_round=first_bad,
        duration_s=time.perf_counter() - started,
        own_cpu_s=float(own.item()),
        host_busy_s=host_busy,
        host_cpus=host_cpus,
        round_foreign_s=tuple(foreign_s) if len(foreign_s) == len(rates) else (),
        round_s=tuple(round_s) if len(round_s) == len(rates) else (),
    )


def run_from_env(
    size_bytes: int,
    iterations: int,
    warmup: int,
    backend: str = "auto",
    timeout_s: float = 60.0,
    soak_s: float = 0.0,
) -> AllReduceResult | SoakResult:
    """Joins the group described by torchrun-style environment variables, measures (or soaks for
    `soak_s` seconds), leaves."""
    import torch
    import torch.distributed as dist

    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(
        backend=backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )
    try:
        if soak_s > 0:
            return soak(size_bytes, iterations, warmup, soak_s)
        return measure(size_bytes, iterations, warmup)
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True, slots=True, kw_only=True)
class Group:
    """One rank's place in an explicitly described group (no torchrun, no environment).

    master_listen_fd: rank 0 only, a socket already bound and listening on master_addr:master_port
    (the caller chose the port there, so nothing races for it); the store serves on it.
    bind_host: the address this rank's gloo connections use ("" = gloo's default device, or
    GLOO_SOCKET_IFNAME when set). group_id: the store prefix, so a stray rank of another group never
    joins this one."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    master_listen_fd: int | None = None
    bind_host: str = ""
    group_id: str = ""
    local_rank: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"need 0 <= rank < world_size, got {self.rank}, {self.world_size}")
        if not self.master_addr or not 0 < self.master_port < 65536:
            raise ValueError(f"need a master address and port, got {self.master_addr!r}:{self.master_port}")
        if self.master_listen_fd is not None and self.rank != 0:
            raise ValueError("only rank 0 serves the store (master_listen_fd)")


_BOUND_GLOO = "gloo_bound"


def _bound_gloo(bind_host: str) -> str:
    """A gloo backend whose one device is `bind_host` (torch has no option for it in init_process_group);
    registered once per process under its own name."""
    import torch.distributed as dist

    def create(store: Any, rank: int, world: int, pg_timeout: datetime.timedelta) -> Any:
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # stubs omit it; the one way to set the device
        opts._timeout = pg_timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
        return dist.ProcessGroupGloo(store, rank, world, opts)

    if _BOUND_GLOO not in dist.Backend.backend_list:
        dist.Backend.register_backend(_BOUND_GLOO, create, devices=["cpu"])
    return _BOUND_GLOO


def run_group(
    group: Group,
    size_bytes: int,
    iterations: int,
    warmup: int,
    backend: str = "auto",
    timeout_s: float = 60.0,
) -> AllReduceResult:
    """Joins the group as described (its own store, no environment), measures, leaves."""
    import torch
    import torch.distributed as dist

    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(group.local_rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        group.master_addr,
        group.master_port,
        group.world_size,
        is_master=group.rank == 0,
        timeout=timeout,
        master_listen_fd=group.master_listen_fd,
    )
    name = backend
    if backend == "gloo" and group.bind_host and not os.environ.get("GLOO_SOCKET_IFNAME"):
        name = _bound_gloo(group.bind_host)
    dist.init_process_group(
        backend=name,
        store=dist.PrefixStore(group.group_id or "allreduce", store),
        rank=group.rank,
        world_size=group.world_size,
        timeout=timeout,
    )
    try:
        return measure(size_bytes, iterations, warmup, backend)
    finally:
        dist.destroy_process_group()


def _group_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Group | None:
    """The explicit group when --world-size is given (None: the torchrun-style environment)."""
    if args.world_size is None:
        return None
    if args.rank is None or not args.master_addr or args.master_port is None:
        parser.error("--world-size needs --rank, --master-addr and --master-port")
    try:
        return Group(
            rank=args.rank,
            world_size=args.world_size,
            master_addr=args.master_addr,
            master_port=args.master_port,
            master_listen_fd=args.master_listen_fd,
            bind_host=args.bind_host,
            group_id=args.group,
            local_rank=int(os.environ.get("LOCAL_RANK", "0") or 0),
        )
    except ValueError as exc:
        parser.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    """The CLI, under torchrun or with the group given explicitly (the node agent's MeasureAllReduce)::

        torchrun --nnodes 2 --nproc-per-node 8 -m preflight.collective --out result.json
        python -m preflight.collective --rank 1 --world-size 3 --master-addr 10.0.0.5 \\
            --master-port 29641 --bind-host 10.0.0.6 --group bw-1f3a-set --out result.json

    With the group given explicitly, rank 0's agent hands it an already listening socket on its own
    advertised host, and each rank's gloo connections use its own address (`--bind-host`).
    """
    parser = argparse.ArgumentParser(
        prog="python -m preflight.collective", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--size-bytes", type=int, default=64 * 1024 * 1024)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto")
    parser.add_argument("--timeout", type=float, default=60.0, help="process-group timeout, seconds")
    parser.add_argument("--out", help="rank 0 writes the JSON result here (default: stdout)")
    parser.add_argument(
        "--soak-s",
        dest="soak_s",
        type=float,
        default=0.0,
        help="repeat rounds of --iterations all-reduces this long, checking each (the burn-in's soak)",
    )
    explicit = parser.add_argument_group("an explicit group (instead of RANK, WORLD_SIZE, MASTER_*)")
    explicit.add_argument("--rank", type=int)
    explicit.add_argument("--world-size", dest="world_size", type=int)
    explicit.add_argument("--master-addr", dest="master_addr", default="")
    explicit.add_argument("--master-port", dest="master_port", type=int)
    explicit.add_argument(
        "--master-listen-fd", dest="master_listen_fd", type=int, help="rank 0: a listening socket to serve on"
    )
    explicit.add_argument("--bind-host", dest="bind_host", default="", help="gloo: this rank's address")
    explicit.add_argument("--group", default="", help="the group's name (its store prefix)")
    args = parser.parse_args(argv)
    if args.size_bytes < 4 or args.iterations < 1 or args.warmup < 0:
        parser.error("need --size-bytes >= 4, --iterations >= 1, --warmup >= 0")
    group = _group_from_args(args, parser)
    result: AllReduceResult | SoakResult
    if group is not None:
        if args.soak_s > 0:
            parser.error("--soak-s runs in the environment's group (one node's ranks), not with --world-size")
        result = run_group(group, args.size_bytes, args.iterations, args.warmup, args.backend, args.timeout)
    else:
        result = run_from_env(
            args.size_bytes, args.iterations, args.warmup, args.backend, args.timeout, args.soak_s
        )
    if (group.rank if group is not None else _env_int("RANK")) == 0:
        text = json.dumps(asdict(result))
        if args.out:
            with open(args.out, "w", encoding="utf-8") as fh:
                fh.write(text)
        else:
            print(text)
    # A soak's wrong results are in its result, for the caller to report; a measurement's fail the run.
    return 0 if isinstance(result, SoakResult) or result.correct else 1


if __name__ == "__main__":
    sys.exit(main())
