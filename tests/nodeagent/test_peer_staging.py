"""The peer path's staging (issue 28): under NCCL a peer's state crosses the GPU in chunks of at most
STAGE_BYTES (memory_state._broadcast_host), never whole. The chunking is the same code whatever the
device: here two gloo ranks stage through host buffers of 64 bytes and every element must arrive,
the last short chunk included. tests/gpu/gpu_runwarden.py runs it through a GPU with its peak."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.nodeagent.helpers import ROOT

RANK = """
import sys, torch, torch.distributed as dist
from nodeagent.trainer import memory_state
rank = int(sys.argv[1])
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[2], 2), rank=rank, world_size=2)
for dtype, n in ((torch.float32, 1001), (torch.int64, 7), (torch.float64, 16)):
    want = torch.arange(n).to(dtype) * 3 + 1
    flat = want.clone() if rank == 1 else torch.zeros(n, dtype=dtype)
    memory_state._broadcast_host(flat, 1, rank=rank, device="cpu", stage_bytes=64)
    assert flat.device.type == "cpu" and torch.equal(flat, want), (rank, dtype, flat)
dist.destroy_process_group()
print("ok", rank)
"""


def test_a_peer_state_arrives_whole_through_a_small_staging_buffer(tmp_path: Path) -> None:
    store = tmp_path / "store"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(r), str(store)],
            cwd=ROOT,
            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [o.strip().splitlines()[-1] for o in outs] == ["ok 0", "ok 1"]
