"""State from a peer (issue 18, mechanism 3), real processes: 3 gloo ranks on CPU save a DDP model
with DCP, and load it back as a warm restart does. A rank that holds no copy of the commit (the
replacement host's fresh rank) receives the model and optimizer state from the lowest holder over
the process group and only its own small state file from storage; the ranks that kept theirs use
their own, a rank renumbered since its save its copy's model and optimizer with its own state file
from storage (its RNG would give it away otherwise); every rank ends up exactly where a load from storage puts it (model, optimizer, scheduler,
RNG and data position). With the peer path off, all load from storage. The rule (every case, and
that every rank agrees on it) and the checks of a peer's bytes are unit-tested below; every rank
holding its own copy (memory) is tests/nodeagent/test_warm_restart.py's last attempt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nodeagent.trainer import memory_state
from nodeagent.trainer.dcp import whole_tensors_bytes
from tests.nodeagent.helpers import ROOT, run_gloo_ranks

WORLD = 3


def _run(tmp: Path, *extra: str) -> list[dict]:
    ckpt, out = tmp / "ckpt", tmp / "out"
    out.mkdir(parents=True)
    job = ROOT / "tests" / "nodeagent" / "peer_state_job.py"
    run_gloo_ranks(
        job, WORLD, "--ckpt", str(ckpt), "--out", str(out), *extra, run="peer-test", warm=True, timeout_s=120
    )
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _same_as_storage(results: list[dict]) -> None:
    for r, got in enumerate(results):
        assert got["fingerprint"] == got["reference"], (
            f"rank {r} ({got['source']}) differs from storage's load"
        )
        assert got["data_state"] == got["reference_data_state"] == {"next_step": 3, "rank": r}


@pytest.mark.slow
def test_the_replacement_rank_gets_its_state_from_a_peer_exactly_as_storage_would_give_it(
    tmp_path: Path,
) -> None:
    # rank 0 holds a copy it saved as rank 1, rank 1 its own, rank 2 (the replacement) none
    results = _run(tmp_path / "peer", "--forget", "2", "--shift", "0")
    assert [r["source"] for r in results] == ["memory", "memory", "peer"]
    _same_as_storage(results)
    # rank 0 reports each commit it writes; the others the marker of their previous save (so a lost
    # rank-0 host does not leave the supervisor resuming from an older commit than the survivors hold)
    assert [r["commits_reported"] for r in results] == [[3, 5], [3], [3]]
    results = _run(tmp_path / "off", "--forget", "0", "--no-peer")
    assert [r["source"] for r in results] == ["storage"] * WORLD
    _same_as_storage(results)


@pytest.mark.slow
def test_a_copy_that_rotted_in_memory_or_a_transfer_that_garbled_it_is_never_loaded(tmp_path: Path) -> None:
    """Every restore is checked against the checksum taken when it was made: a rank whose copy changed
    in host memory since it was kept does not serve it (a peer sends it the state instead); a
    receiver whose bytes do not hash to the sender's refuses them, and every rank loads from
    storage. Either way each rank ends exactly where a load from storage puts it, and says why."""
    results = _run(tmp_path / "rot", "--rot", "1")
    assert [r["source"] for r in results] == ["memory", "peer", "memory"]
    assert "no longer matches the checksum" in results[1]["fell_back"]
    assert results[0]["fell_back"] == results[2]["fell_back"] == ""
    _same_as_storage(results)
    results = _run(tmp_path / "garble", "--forget", "2", "--garble", "2")
    assert [r["source"] for r in results] == ["storage"] * WORLD
    assert all("refused by a receiver" in r["fell_back"] for r in results), results
    _same_as_storage(results)


H, S, W, P = memory_state._HOLDS, memory_state._HOLDS_STATE, memory_state._WHOLE, memory_state._PEER_OK


@pytest.mark.parametrize(
    ("flags", "expect", "sender"),
    [
        ([H | W | P] * 3, ["memory"] * 3, -1),
        ([H, H, H], ["memory"] * 3, -1),  # every rank kept its own: sharded state too
        ([W | P, H | W | P, H | W | P], ["peer", "memory", "memory"], 1),
        ([W | P, W | P, H | W | P], ["peer", "peer", "memory"], 2),
        ([S | W | P, W | P, H | W | P], ["memory", "peer", "memory"], 0),  # rank 0 renumbered
        ([S | W | P, S | W | P, H | W | P], ["memory"] * 3, -1),  # nobody to send to
        ([S, H, H], ["storage"] * 3, -1),  # renumbered, sharded: its copy is not its shard
        ([W | P, H | P, H | W | P], ["storage"] * 3, -1),  # a rank says the state is sharded
        ([W | P, H | W, H | W | P], ["storage"] * 3, -1),  # a rank may not take a peer's
        ([W | P] * 3, ["storage"] * 3, -1),  # nobody holds a copy
    ],
)
def test_the_load_plan_is_one_rule_on_every_rank(flags: list[int], expect: list[str], sender: int) -> None:
    plans = [memory_state.plan_load(flags, r) for r in range(len(flags))]
    assert [p.source for p in plans] == expect
    assert {p.sender for p in plans} == {sender}  # every rank agrees on who sends, if anyone
    assert [p.own_rank_state for p in plans] == [
        p.source == "storage" or bool(f & H) for p, f in zip(plans, flags, strict=True)
    ]


B = memory_state._HOLDS_SHARD


@pytest.mark.parametrize(
    ("flags", "local", "donors"),
    [
        ([H | P] * 4, 2, None),  # every rank holds its own shard: memory, no donor needed
        ([H | P | B, H | P | B, P, P], 2, (0, 1, 0, 1)),  # host 2 new: ranks 0, 1 hold its shards
        ([P | B, H | P | B, H | P | B, H | P | B], 1, (1, 1, 2, 3)),  # one host per rank
        ([H | P, H | P | B, P, P], 2, None),  # rank 2's buddy, rank 0, does not hold its shard
        ([P, P, H | P | B, H | P | B], 2, (2, 3, 2, 3)),  # host 1 new, host 2 holds its shards
        ([H | P | B, H | P | B, P | B, B], 2, None),  # rank 3 may not take a peer's state
        ([P, P], 2, None),  # one host: no buddy on another
    ],
)
def test_a_sharded_commit_takes_each_missing_shard_from_the_buddy_that_holds_it(
    flags: list[int], local: int, donors: tuple[int, ...] | None
) -> None:
    assert memory_state.shard_donors(flags, local) == donors


def test_whole_tensors_and_sharded_ones_told_apart_from_dcp_metadata() -> None:
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    def tensor(size: list[int], chunks: list[tuple[list[int], list[int]]]) -> TensorStorageMetadata:
        return TensorStorageMetadata(
            properties=TensorProperties(dtype=torch.float32),
            size=torch.Size(size),
            chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in chunks],
        )

    whole = Metadata(
        state_dict_metadata={
            "model.w": tensor([4, 2], [([0, 0], [4, 2])]),
            "optim.param_groups.0.lr": BytesStorageMetadata(),
        }
    )
    assert whole_tensors_bytes(whole) == 4 * 2 * 4
    halves = Metadata(state_dict_metadata={"model.w": tensor([4, 2], [([0, 0], [2, 2]), ([2, 0], [2, 2])])})
    assert whole_tensors_bytes(halves) is None
    part = Metadata(state_dict_metadata={"model.w": tensor([4, 2], [([2, 0], [2, 2])])})
    assert whole_tensors_bytes(part) is None


def test_a_peer_state_goes_as_a_skeleton_and_flat_tensors_and_must_add_up_to_the_commit() -> None:
    state = {
        "model": {"w": torch.arange(8.0).view(4, 2), "b": torch.zeros(2, dtype=torch.float64)},
        "optim": {
            "state": {"w": {"step": torch.tensor(3.0)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}],
        },
    }
    skeleton, tensors = memory_state._split(state)
    assert len(tensors) == 3 and skeleton["optim"]["param_groups"] == state["optim"]["param_groups"]
    back = memory_state._join(skeleton, tensors)
    assert back["model"]["w"] is tensors[0] and back["optim"]["param_groups"][0]["betas"] == (0.9, 0.99)
    with pytest.raises(ValueError, match="out of range"):
        memory_state._join({"x": {memory_state._SLOT: 7}}, tensors)
    specs = [(list(t.shape), str(t.dtype).removeprefix("torch.")) for t in tensors]
    assert memory_state._specs_bytes(specs) == 8 * 4 + 2 * 8 + 4
    for bad in (None, [([4], "not_a_dtype")], [([-1], "float32")], [([4], "Tensor")], [("4", "float32")]):
        assert memory_state._specs_bytes(bad) is None, bad
