"""What validating every restore costs (issue 30, "every restore validated"): the XXH3-128 of each DCP
shard taken by the rank that wrote it, checked by every load from storage, and the XXH3-128 of each
in-memory copy's tensors taken once it lands, checked when a load takes it (BENCHMARKS.md,
"Validated restores").

    flock /tmp/runwarden-heavy.lock env PYTHONPATH=. .venv/bin/python bench/bench_restore_validation.py \\
        [--params-mb 400] [--repeats 3] [--out bench/results/bench_restore_validation.json]

One process (DCP without a process group), a model of `--params-mb` MB of float32 parameters (a
stack of square Linear layers) with AdamW after one step, so the state is 3x that (parameters and
both moments: 1.2 GB at the default, the ~100M-parameter job of the issue). Per repeat:

* save_s: a synchronous DcpCheckpointer.save (write, fsync, the shards' hashing, the commit);
  shard_hash_s: hashing the same shard files again (from the page cache, as write_data does
  right after writing them): the part of the save the digests add;
* load_s: nodeagent.trainer.load_checkpoint from storage, whole (verify_shards, then DCP's load);
  verify_s: verify_shards alone;
* keep_hash_s: the checksums of a kept copy's buffers (what the copy's hashing thread does, off the
  training thread); take_s: memory_state.take of that copy, whole (its check, and the clone the
  load gets); take_check_s: its check alone.

Medians over the repeats; every repeat in the json. The page cache is warm for the hashes (what the
product sees: a rank hashes what it just wrote; a load on the host that saved reads from cache too;
a load on a fresh host reads the shards from disk once for the check and again for DCP's load).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nodeagent import trainer
from nodeagent.trainer import memory_state
from nodeagent.trainer.checkpoint import latest_committed, xxh3_file
from nodeagent.trainer.dcp import DcpCheckpointer, verify_shards


def _model(params_mb: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    width = 2048
    layers = max(1, params_mb * 1024 * 1024 // (4 * width * width))
    model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, width)).pow(2).mean().backward()
    opt.step()
    return model, opt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params-mb", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("bench/results/bench_restore_validation.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.update(RUNWARDEN_RUN="bench", RUNWARDEN_ATTEMPT="1", RUNWARDEN_LAUNCH_PATH="warm")
    model, opt = _model(args.params_mb)
    state_bytes = sum(p.numel() * 4 for p in model.parameters()) * 3
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        root = Path(tmp)
        saver = DcpCheckpointer(root, async_save=False)
        for i in range(args.repeats):
            step = i + 1
            t0 = time.perf_counter()
            saver.save(step, model=model, optimizer=opt)
            save_s = time.perf_counter() - t0
            commit = latest_committed(root)
            assert commit is not None and commit.step == step and commit.shard_xxh3
            t0 = time.perf_counter()
            for name in commit.shard_xxh3:
                xxh3_file(commit.path / name)
            shard_hash_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            verify_shards(commit)
            verify_s = time.perf_counter() - t0
            memory_state._copies.clear()  # the load below reads storage, not this process's copy
            t0 = time.perf_counter()
            trainer.load_checkpoint(commit, model=model, optimizer=opt, rank=0)
            load_s = time.perf_counter() - t0
            assert memory_state.loaded_from(step) == memory_state.STORAGE
            memory_state.keep(
                step, {"state": {"model": model.state_dict()}, "rank_state": {}}, rank=0, world_size=1
            )
            (held,) = [x for x in memory_state._copies if x.step == step]
            assert held.hashed.wait(600) and held.digests
            t0 = time.perf_counter()
            for b in held.buffers:
                memory_state.digest(b)
            keep_hash_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            assert memory_state.take(step, 1, rank=0, world_size=1) is not None
            take_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            assert [memory_state.digest(b) for b in held.buffers] == held.digests
            take_check_s = time.perf_counter() - t0
            copy_bytes = held.nbytes
            memory_state._copies.clear()
            rows.append(
                dict(
                    save_s=save_s,
                    shard_hash_s=shard_hash_s,
                    load_s=load_s,
                    verify_s=verify_s,
                    keep_hash_s=keep_hash_s,
                    take_s=take_s,
                    take_check_s=take_check_s,
                    copy_bytes=copy_bytes,
                )
            )
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in rows[-1].items()}))

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    summary = {
        "state_bytes": state_bytes,
        "copy_bytes": rows[0]["copy_bytes"],
        **{f"{k}_median": round(med(k), 4) for k in rows[0] if k.endswith("_s")},
        "shard_hash_share_of_save": round(med("shard_hash_s") / med("save_s"), 3),
        "verify_share_of_load": round(med("verify_s") / med("load_s"), 3),
        "hash_gb_per_s": round(state_bytes / 1e9 / med("shard_hash_s"), 2),
        "take_check_share_of_take": round(med("take_check_s") / med("take_s"), 3),
    }
    doc = {
        "command": " ".join([sys.executable, *sys.argv]),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_before": os.getloadavg(),
        "params_mb": args.params_mb,
        "repeats": rows,
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
