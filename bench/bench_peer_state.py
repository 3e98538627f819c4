"""State from a peer vs from storage, on a warm restart's load (BENCHMARKS.md, "state from a peer").

    flock /tmp/runwarden-heavy.lock env PYTHONPATH=. .venv/bin/python bench/bench_peer_state.py \\
        [--ranks 3] [--params-mb 25 100] [--trials 5] [--out bench/results/bench_peer_state.json]

`--ranks` gloo ranks on CPU (one process each, on this machine) train a DDP model of `--params-mb`
MB of float32 parameters (square Linear layers) with AdamW for 2 steps and save it once with DCP
(nodeagent.trainer.dcp, synchronous), so the commit holds the parameters and both AdamW moments (3x the
parameters). Then, `--trials` times per mode, alternating, every rank loads that commit through
`nodeagent.trainer.load_checkpoint` as the next attempt would:

* storage: no rank holds a copy (a cold restart, or sharded state): DCP's collective load, every
  rank reading the whole replicated state from the checkpoint directory (this machine's disk, in
  its page cache after the first read: the best case for storage);
* storage-cold: the same, with this machine's page cache dropped first (root): read from the disk;
* peer: the last rank holds no copy (the replacement host), the others their own; it receives the
  lowest holder's state over gloo (nodeagent.trainer.memory_state) and reads only its own state file.

Per load: the wall time of the call on each rank (the slowest rank is the attempt's), and the
bytes the fresh rank has to read from storage, from the commit itself: from storage, every tensor
of the replicated state (DCP reads each whole, on every rank; the metadata's sizes) and its state
file; from a peer, its state file only. Medians over the trials.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


MODES = ("storage", "storage-cold", "peer")


def _drop_page_cache() -> None:
    """Write back and drop this machine's page cache (root): the next read comes from the disk."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("1\n")


def _rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from nodeagent import trainer
    from nodeagent.trainer import memory_state
    from nodeagent.trainer.checkpoint import latest_committed
    from nodeagent.trainer.dcp import DcpCheckpointer, rank_state_name, read_dcp_metadata, whole_tensors_bytes

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    width = 1024
    layers = max(1, round(args.params_mb[0] * 1e6 / 4 / (width * width + width)))
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(*(nn.Linear(width, width) for _ in range(layers))))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(2):
        model(torch.randn(2, width)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    ckpt = Path(args.dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        DcpCheckpointer(ckpt, async_save=False).save(
            2, model=model, optimizer=opt, data_state={"next_step": 2}
        )
    dist.barrier()
    commit = latest_committed(ckpt)
    assert commit is not None
    kept = list(memory_state._copies)

    # what a rank reads from storage: DCP reads every tensor of replicated state whole on every rank
    state_file = (commit.path / rank_state_name(rank)).stat().st_size
    storage_bytes = (whole_tensors_bytes(read_dcp_metadata(commit)) or 0) + state_file
    from_storage = {"storage": storage_bytes, "peer": state_file, "memory": 0}
    rows = []
    for trial in range(args.trials):
        for mode in MODES:
            fresh = rank == world - 1 if mode == "peer" else True
            memory_state._copies[:] = [] if fresh else list(kept)
            dist.barrier()
            if mode == "storage-cold":
                if rank == 0:
                    _drop_page_cache()
                dist.barrier()
            t0 = time.perf_counter()
            trainer.load_checkpoint(commit, model=model, optimizer=opt, rank=rank)
            took = time.perf_counter() - t0
            rows.append(
                {
                    "trial": trial,
                    "mode": mode,
                    "rank": rank,
                    "fresh": fresh,
                    "source": memory_state.loaded_from(2),
                    "load_s": took,
                    "bytes_from_storage": from_storage[memory_state.loaded_from(2)],
                }
            )
    state_bytes = sum(p.numel() * 4 * 3 for p in model.parameters())
    Path(args.rows).joinpath(f"rank{rank}.json").write_text(
        json.dumps({"rows": rows, "state_bytes": state_bytes})
    )
    dist.destroy_process_group()


def _run(params_mb: float, ranks: int, trials: int) -> dict[str, Any]:
    from testbed.etcd_server import free_port
    from testbed.gloo_ranks import gloo_rank_env

    with tempfile.TemporaryDirectory(prefix="bench-peer-") as tmp:
        rows_dir = Path(tmp) / "rows"
        rows_dir.mkdir()
        port = free_port()
        procs = []
        for rank in range(ranks):
            env = gloo_rank_env(rank, ranks, port, run="bench-peer", root=ROOT, warm=True)
            cmd = [
                sys.executable,
                __file__,
                "--rank-child",
                "--params-mb",
                str(params_mb),
                "--trials",
                str(trials),
            ]
            procs.append(subprocess.Popen([*cmd, "--dir", f"{tmp}/ckpt", "--rows", str(rows_dir)], env=env))
        for p in procs:
            if p.wait(timeout=1800) != 0:
                raise SystemExit(f"a rank failed (exit {p.returncode})")
        per_rank = [json.loads((rows_dir / f"rank{r}.json").read_text()) for r in range(ranks)]
    rows = [row for doc in per_rank for row in doc["rows"]]
    out: dict[str, Any] = {"params_mb": params_mb, "ranks": ranks, "state_bytes": per_rank[0]["state_bytes"]}
    for mode in MODES:
        slowest = [
            max(r["load_s"] for r in rows if r["mode"] == mode and r["trial"] == t) for t in range(trials)
        ]
        fresh = [r for r in rows if r["mode"] == mode and r["rank"] == ranks - 1]
        sources = sorted({r["source"] for r in rows if r["mode"] == mode})
        out[mode] = {
            "slowest_rank_load_s_median": statistics.median(slowest),
            "fresh_rank_load_s_median": statistics.median(r["load_s"] for r in fresh),
            "fresh_rank_bytes_from_storage": statistics.median(r["bytes_from_storage"] for r in fresh),
            "sources": sources,
        }
    out["rows"] = rows
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--params-mb", type=float, nargs="+", default=[25.0, 100.0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "bench_peer_state.json")
    parser.add_argument("--rank-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--rows", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_child:
        _rank_main(args)
        return
    if args.ranks < 2 or args.trials < 1 or any(mb <= 0 for mb in args.params_mb):
        parser.error("--ranks >= 2, --trials >= 1 and every --params-mb > 0")
    if not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        parser.error("the storage-cold mode drops the page cache: run as root (/proc/sys/vm/drop_caches)")
    results = []
    for mb in args.params_mb:
        r = _run(mb, args.ranks, args.trials)
        results.append(r)
        s, c, p = r["storage"], r["storage-cold"], r["peer"]
        print(
            f"{mb:g} MB params ({r['state_bytes'] / 1e6:.0f} MB state), {args.ranks} ranks: "
            f"slowest rank's load: storage {s['slowest_rank_load_s_median']:.3f} s (page cache), "
            f"{c['slowest_rank_load_s_median']:.3f} s (from the disk), "
            f"peer {p['slowest_rank_load_s_median']:.3f} s; "
            f"fresh rank reads {s['fresh_rank_bytes_from_storage'] / 1e6:.1f} MB vs "
            f"{p['fresh_rank_bytes_from_storage'] / 1e6:.3f} MB from storage; sources {s['sources']} / {p['sources']}",
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"ranks": args.ranks, "trials": args.trials, "results": results}, indent=1)
    )


if __name__ == "__main__":
    main()
