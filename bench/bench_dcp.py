"""The training stall of a DCP save: async_save vs a synchronous save, each with and without the
warm path's in-memory copy (BENCHMARKS.md, "DCP checkpoints", "the in-memory copy in the save").

    flock /tmp/runwarden-heavy.lock env PYTHONPATH=. .venv/bin/python bench/bench_dcp.py \\
        [--params-mb 100] [--saves 7] [--modes async,sync] [--out bench/results/bench_dcp.json]

A mode ending in `-copy` (async-copy, sync-copy) runs the ranks as the warm path does
(RUNWARDEN_RUN/ATTEMPT set, RUNWARDEN_LAUNCH_PATH=warm), so every save also takes the in-memory
copy (nodeagent.trainer.memory_state.keep: into host buffers, reused from the third save on); without it
(a cold launch, and this bench before issue 28) no copy is taken. Per save it also records
`copy_s`, the time keep() held the training thread.

Two ranks (gloo, CPU, one process each) train a DDP model of `--params-mb` MB of float32
parameters (a stack of square Linear layers) with AdamW, so one save holds the parameters and
both AdamW moments (3x the parameters). Each mode (async first, then sync, in one run) saves
`--saves` times through nodeagent.trainer.dcp.DcpCheckpointer, every `--every` steps, to a fresh directory
under `--dir` (default: a temporary directory on this machine's disk).

Per save, on every rank:

* stall: the time `save()` held the training loop (async: staging the CPU copy and starting the
  upload, plus any wait for the previous save at the next one; sync: the whole save and commit);
* slowdown: the extra time of the steps that ran while an async upload was in flight, against
  the median step without one (the upload's threads share the cores with the training);
* upload: save() to commit (async: the marker written on rank 0's upload thread);
* staged copy: the bytes of the CPU copy async_save stages (every tensor of the state dict), and
  the rank's peak RSS during the save above its RSS before it (VmRSS sampled every 2 ms).

Medians over the saves (the first save of each mode included: DCP plans once per save), then
the worse of the two ranks. The json has every save's numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


class PeakRss:
    """VmRSS sampled every 2 ms on a thread while the block runs (and after, until `stop()`)."""

    def __init__(self) -> None:
        self.peak = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, _rss_bytes())
            self._done.wait(0.002)

    def start(self) -> PeakRss:
        self.peak = _rss_bytes()
        self._thread.start()
        return self

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return max(self.peak, _rss_bytes())


def run_rank(rank: int, world: int, store_path: str, args: argparse.Namespace, out: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from nodeagent.trainer.dcp import DcpCheckpointer

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=600))
    width = 1024
    layers = max(1, round(args.params_mb * 1e6 / 4 / (width * width + width)))
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    x = torch.randn(args.batch, width)

    def step() -> float:
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
        return time.perf_counter() - t

    for _ in range(3):
        step()  # AdamW state exists before the first save, as in a real run
    staged_bytes = sum(
        t.numel() * t.element_size()
        for t in [*model.state_dict().values(), *(v for s in opt.state.values() for v in s.values())]
        if isinstance(t, torch.Tensor)
    )
    results: dict[str, Any] = {
        "rank": rank,
        "layers": layers,
        "params_bytes": params,
        "staged_bytes": staged_bytes,
    }
    from nodeagent.trainer import memory_state

    keep, copy_s = memory_state.keep, [0.0]

    def timed_keep(*a: Any, **k: Any) -> str:  # what the copy costs the training thread
        t = time.perf_counter()
        why = keep(*a, **k)
        copy_s[0] = time.perf_counter() - t
        return why

    memory_state.keep = timed_keep  # a bench's probe, this process only
    warm = {"RUNWARDEN_RUN": "bench-dcp", "RUNWARDEN_ATTEMPT": "1", "RUNWARDEN_LAUNCH_PATH": "warm"}
    for mode in args.modes:
        memory_state._copies.clear()
        for key, value in warm.items():
            if mode.endswith("-copy"):
                os.environ[key] = value
            else:
                os.environ.pop(key, None)
        saver = DcpCheckpointer(Path(args.dir) / mode, async_save=mode.startswith("async"))
        plain = [step() for _ in range(args.every)]  # steps with no save in flight: the baseline
        saves: list[dict[str, Any]] = []
        current: dict[str, Any] | None = None
        peak: PeakRss | None = None

        def close(save: dict[str, Any], sampler: PeakRss, saver: DcpCheckpointer = saver) -> None:
            save["rss_peak_over_before"] = float(sampler.stop() - save.pop("rss_before"))
            commit = saver.last_commit
            if rank == 0 and commit is not None and commit.step == save["step"]:
                save["upload_s"] = commit.committed_at - save["t0_wall"]  # save() to its marker
            save.pop("t0_wall")

        for i in range(1, args.saves * args.every + 1):
            if i % args.every == 0:
                dist.barrier()  # every rank starts the save together: the stall is the save's own
                before = _rss_bytes()
                sampler = PeakRss().start()
                t0, wall = time.perf_counter(), time.time()
                saver.wait()  # what save() does first: a previous upload still in flight stalls this one
                if current is not None and peak is not None:
                    close(current, peak)
                copy_s[0] = 0.0
                saver.save(i, model=model, optimizer=opt, data_state={"next_step": i})
                current = {"step": i, "rss_before": before, "t0_wall": wall, "during": []}
                current["stall_s"] = time.perf_counter() - t0
                current["copy_s"] = copy_s[0]
                current["copies_kept"] = len(memory_state.kept_steps())
                saves.append(current)
                peak = sampler
                if mode.startswith("sync"):
                    close(current, peak)
                    current = None
            t = step()
            if current is not None and saver.in_flight:
                current["during"].append(t)
            else:
                if current is not None and peak is not None:
                    close(current, peak)
                    current = None
                plain.append(t)
        saver.wait()
        if current is not None and peak is not None:
            close(current, peak)
        base = statistics.median(plain)
        for save in saves:
            during = save.pop("during")
            save["steps_during_upload"] = len(during)
            save["slowdown_s"] = sum(max(0.0, t - base) for t in during)
        results[mode] = {"saves": saves, "median_step_s": base, "kept_bytes": memory_state.kept_bytes()}
        dist.barrier()
    out.put(results)
    dist.destroy_process_group()


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def summarise(per_rank: list[dict[str, Any]], modes: list[str]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for mode in modes:
        m: dict[str, float] = {}
        for key in ("stall_s", "copy_s", "upload_s", "slowdown_s", "rss_peak_over_before"):
            values = [_median([s[key] for s in r[mode]["saves"] if key in s]) for r in per_rank]
            m[f"median_{key}"] = max(values)
        m["median_step_s"] = max(r[mode]["median_step_s"] for r in per_rank)
        m["kept_bytes_per_rank"] = max(r[mode]["kept_bytes"] for r in per_rank)
        summary[mode] = m
    if "sync" in summary and "async" in summary:
        summary["stall_ratio_sync_over_async"] = summary["sync"]["median_stall_s"] / max(
            summary["async"]["median_stall_s"], 1e-9
        )
    summary["staged_bytes_per_rank"] = max(r["staged_bytes"] for r in per_rank)
    summary["params_bytes"] = per_rank[0]["params_bytes"]
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params-mb", type=float, default=100.0)
    p.add_argument("--saves", type=int, default=7)
    p.add_argument("--every", type=int, default=8, help="steps between saves")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--dir", default="", help="where the checkpoints go (default: a temporary directory)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "bench_dcp.json")
    p.add_argument(
        "--modes",
        default="async,sync",
        help="comma-separated, in this order: async, sync, async-copy, sync-copy (-copy: as a warm rank)",
    )
    args = p.parse_args()
    args.modes = [m for m in args.modes.split(",") if m]
    if not args.modes or any(m not in ("async", "sync", "async-copy", "sync-copy") for m in args.modes):
        p.error(f"--modes: async, sync, async-copy, sync-copy; got {args.modes}")
    import torch.multiprocessing as mp

    world = 2
    with tempfile.TemporaryDirectory(prefix="bench-dcp-") as tmp:
        args.dir = args.dir or tmp
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        store = os.path.join(tmp, "store")
        started = time.time()
        procs = [ctx.Process(target=run_rank, args=(r, world, store, args, out)) for r in range(world)]
        for proc in procs:
            proc.start()
        per_rank = sorted((out.get(timeout=1800) for _ in procs), key=lambda r: r["rank"])
        for proc in procs:
            proc.join(timeout=60)
    summary = summarise(per_rank, args.modes)
    doc = {
        "command": " ".join(["python", *sys.argv]),
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "wall_s": round(time.time() - started, 1),
        "host": {"cpus": os.cpu_count(), "load_avg_1m_at_end": os.getloadavg()[0]},
        "world_size": world,
        "params_mb": args.params_mb,
        "modes": args.modes,
        "saves_per_mode": args.saves,
        "steps_between_saves": args.every,
        "summary": summary,
        "per_rank": per_rank,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
