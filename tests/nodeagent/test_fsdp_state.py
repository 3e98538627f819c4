"""Sharded state (FSDP2, `fully_shard`) through runwarden's checkpoints, real processes: 2 gloo ranks
on CPU whose parameters and AdamW moments are DTensor shards save with DcpCheckpointer (each rank
its own shard, its digests in the commit) and load back: from storage (DCP's sharded load, every
shard checked), from each rank's own in-memory copy of its shard (a warm restart), and, for a rank
whose process is new (a lost host's replacement), its shard from its buddy's memory, which holds a
copy of it since the commit (checked against its checksums: a changed copy is refused and every rank
loads from storage, as when no rank holds it). Every load replays the next two steps' losses
exactly; a shard whose bytes changed on storage after the commit is refused by every rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.nodeagent.helpers import ROOT, run_gloo_ranks

WORLD = 2
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _run(tmp: Path, mode: str) -> list[dict]:
    ckpt, out = tmp / "ckpt", tmp / "out"
    out.mkdir(parents=True)
    job = ROOT / "tests" / "nodeagent" / "fsdp_job.py"
    args = ("--ckpt", str(ckpt), "--out", str(out), "--mode", mode)
    run_gloo_ranks(job, WORLD, *args, run="fsdp-test", warm=mode != "storage" and mode != "corrupt")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize(
    ("mode", "sources"),
    [
        ("storage", ["storage", "storage"]),
        ("memory", ["memory", "memory"]),
        ("forget", ["memory", "peer"]),  # rank 1's shard from its buddy, rank 0
        ("forget-both", ["storage", "storage"]),  # no holder left
        ("rot", ["storage", "storage"]),  # the held copy changed: refused
    ],
)
def test_sharded_state_saves_and_loads_back_to_the_same_losses(
    tmp_path: Path, mode: str, sources: list[str]
) -> None:
    results = _run(tmp_path, mode)
    assert len(results[0]["shards"]) == WORLD, "one shard file per rank, each with its digest"
    if mode == "rot":
        assert all("from a buddy's memory was refused" in got["fell_back"] for got in results), results
        assert "does not match its checksum" in results[1]["fell_back"]
    for rank, (got, source) in enumerate(zip(results, sources, strict=True)):
        assert got["error"] == "", got["error"]
        assert got["source"] == source, (rank, got["source"])
        assert got["data_state"] == {"next_step": 3}
        assert got["replay"] == got["reference"], f"rank {rank} ({source}) replays other losses"
    assert results[0]["reference"] != results[1]["reference"], "each rank its own batches"


def test_a_sharded_step_with_a_changed_shard_is_refused_by_every_rank(tmp_path: Path) -> None:
    results = _run(tmp_path, "corrupt")
    for got in results:
        assert "differ" in got["error"] and "step 3 is no resume point" in got["error"], got
