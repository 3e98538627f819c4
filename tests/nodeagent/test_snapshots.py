"""In-memory snapshots between commits (issue 30), real processes: 4 gloo ranks on CPU as 2 hosts
of 2 ranks take snapshots of a DDP model with AdamW and a scheduler (tests/nodeagent/snapshot_job.py)
and restore the newest the way a restart resumes from it. Each rank must end exactly where it was
when the snapshot was taken (model, optimizer, scheduler, RNG, data position), from its own memory,
or, for a rank whose process is new (a lost host's, a crashed rank's), the model and optimizer from
a peer and its rank state from its buddy on the other host; a rank whose state has no holder left
makes every rank refuse the snapshot (the supervisor then resumes from the commit). The plan's rule
is unit-tested below."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from nodeagent.trainer import memory_state
from nodeagent.trainer.snapshot import Snapshotter, interval_from_env, plan_snapshot_load, steps_for
from tests.nodeagent.helpers import ROOT, run_gloo_ranks

WORLD = 4


def _run(tmp: Path, *extra: str, job: str = "snapshot_job.py") -> list[dict]:
    out = tmp / "out"
    out.mkdir(parents=True)
    script = ROOT / "tests" / "nodeagent" / job
    run_gloo_ranks(script, WORLD, "--out", str(out), *extra, run="snap-test", warm=True, timeout_s=150)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _exactly_as_snapshotted(results: list[dict]) -> None:
    assert len({got["collectives"] for got in results}) == 1, [got["collectives"] for got in results]
    for r, got in enumerate(results):
        assert "error" not in got, got
        assert got["fingerprint"] == got["reference"], (
            f"rank {r} ({got['source']}) is not its state at step 5"
        )
        assert got["data_state"] == {"next_step": 5, "rank": r}


@pytest.mark.slow
def test_a_snapshot_restores_every_rank_from_memory_or_its_buddy_and_a_peer(tmp_path: Path) -> None:
    results = _run(tmp_path / "all")
    assert [r["source"] for r in results] == ["memory"] * WORLD
    assert all(r["reported"] == [[3], [3, 5]] for r in results), results  # complete ones, as taken
    _exactly_as_snapshotted(results)
    # the second host's processes are new (a lost host replaced): its ranks get the model and
    # optimizer from rank 0 and their own RNG and data position from their buddies, ranks 0 and 1
    results = _run(tmp_path / "host", "--forget", "2", "3")
    assert [r["source"] for r in results] == ["memory", "memory", "peer", "peer"]
    _exactly_as_snapshotted(results)
    # a copy that rotted in host memory is not served: that rank receives it as a new one would
    results = _run(tmp_path / "rot", "--rot", "1")
    assert [r["source"] for r in results] == ["memory", "peer", "memory", "memory"]
    _exactly_as_snapshotted(results)


@pytest.mark.slow
def test_a_rank_whose_state_has_no_holder_left_makes_every_rank_refuse_the_snapshot(tmp_path: Path) -> None:
    # rank 1 and its buddy rank 3 are both new: rank 1's RNG and data position are nowhere
    results = _run(tmp_path / "gone", "--forget", "1", "3")
    for got in results:
        assert (
            "rank 1's rank state (RNG, data position) is held neither by it nor by its buddy 3"
            in got["error"]
        ), got
        assert [step for step, _ in got["load_errors"]] == [5]  # the supervisor is told


def _row(
    copy_rank: int, *, whole: bool = True, nbytes: int = 100, buddy: int = -1, shard: bool = False
) -> list[int]:
    return [copy_rank, int(whole), nbytes if copy_rank >= 0 else 0, buddy, int(shard)]


@pytest.mark.parametrize(
    ("rows", "sender", "donors", "why"),
    [
        ([_row(0, buddy=2), _row(1, buddy=3), _row(2, buddy=0), _row(3, buddy=1)], -1, (0, 1, 2, 3), ""),
        ([_row(0, buddy=2), _row(1, buddy=3), _row(-1), _row(-1)], 0, (0, 1, 0, 1), ""),
        # ranks 1 and 3 swapped: each uses the other's copy (a replica), its own rank state sent by it
        ([_row(0, buddy=2), _row(3, buddy=3), _row(2, buddy=0), _row(1, buddy=1)], -1, (0, 3, 2, 1), ""),
        ([_row(0), _row(-1), _row(2), _row(-1)], None, None, "rank 1's rank state"),
        ([_row(0, whole=False), _row(1, whole=False), _row(-1), _row(3, whole=False)], None, None, "sharded"),
        (
            [_row(0, nbytes=100), _row(1, nbytes=99), _row(-1, buddy=1), _row(3, buddy=2)],
            None,
            None,
            "sharded",
        ),
        ([_row(-1)] * 4, None, None, "no rank holds a copy"),
    ],
)
def test_the_snapshot_load_plan_is_one_rule_on_every_rank(
    rows: list[list[int]], sender: int | None, donors: tuple[int, ...] | None, why: str
) -> None:
    plans = [plan_snapshot_load(rows, r, 2) for r in range(len(rows))]  # 2 hosts of 2 ranks
    assert len({(p.sender, p.rank_state_donors) if p else why_ for p, why_ in plans}) == 1
    plan, said = plans[0]
    if sender is None:
        assert plan is None and why in said
    else:
        assert plan is not None and plan.sender == sender and plan.rank_state_donors == donors


def test_a_sharded_state_plans_each_missing_shard_from_the_buddy_that_holds_it() -> None:
    def sharded(copy_rank: int, buddy: int = -1, shard: bool = False) -> list[int]:
        return _row(copy_rank, whole=False, buddy=buddy, shard=shard)

    # the second host is new: ranks 2 and 3 take their shards (and rank states) from ranks 0 and 1
    rows = [sharded(0, 2, True), sharded(1, 3, True), sharded(-1), sharded(-1)]
    plan, why = plan_snapshot_load(rows, 2, 2)
    assert plan is not None and why == ""
    assert (plan.sender, plan.shard_donors, plan.rank_state_donors) == (-1, (0, 1, 0, 1), (0, 1, 0, 1))
    # every rank kept its process: each its own shard, nothing moves
    plan, _ = plan_snapshot_load([sharded(r, (r + 2) % 4, True) for r in range(4)], 0, 2)
    assert plan is not None and plan.shard_donors == (0, 1, 2, 3)
    # the buddy holds rank 2's rank state but its shard never arrived: no holder for the shard
    rows = [sharded(0, 2, False), sharded(1, 3, True), sharded(-1), sharded(-1)]
    plan, why = plan_snapshot_load(rows, 0, 2)
    assert (
        plan is None and "rank 2's shard of the sharded state is held neither by it nor by its buddy 0" in why
    )
    # a process that now runs as rank 1 holds rank 3's shard, not its own: a shard is never a replica
    rows = [sharded(0, 2, True), sharded(3, 3, True), sharded(2, 0, True), sharded(-1)]
    plan, why = plan_snapshot_load(rows, 0, 2)
    assert plan is None and "rank 1's shard" in why


def test_the_interval_becomes_steps_from_the_measured_step_time_and_bad_values_are_refused() -> None:
    assert steps_for(60.0, [5.0, 5.2, 4.8, 9.0, 5.0]) == 12  # the median step, not a slow first one
    assert steps_for(0.5, [1.0]) == 1  # at least every step
    for bad in ("nan", "inf", "-1", "soon"):
        with pytest.raises(ValueError, match="RUNWARDEN_SNAPSHOT_INTERVAL_S"):
            interval_from_env({"RUNWARDEN_SNAPSHOT_INTERVAL_S": bad})
    with pytest.raises(ValueError, match="RUNWARDEN_SNAPSHOT_EVERY"):
        Snapshotter(env={"RUNWARDEN_SNAPSHOT_EVERY": "-3"})
    warm = {"RUNWARDEN_LAUNCH_PATH": "warm", "RUNWARDEN_ATTEMPT": "1"}
    assert Snapshotter(env={**warm, "RUNWARDEN_SNAPSHOT_EVERY": "4"}).due(8)
    assert not Snapshotter(env={**warm, "RUNWARDEN_SNAPSHOT_EVERY": "4"}).due(6)
    # a cold launch's processes end with the attempt: no snapshot, whatever the interval
    cold = Snapshotter(env={"RUNWARDEN_ATTEMPT": "1", "RUNWARDEN_SNAPSHOT_EVERY": "1"})
    assert not any(cold.due(s) for s in range(1, 20))


def test_the_copy_and_digest_threads_yield_to_the_training_thread() -> None:
    """Their niceness is per thread (Linux): the training thread's own is untouched."""
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: list[int] = []

    def background() -> None:
        memory_state.yield_to_training()
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    t = threading.Thread(target=background)
    t.start()
    t.join()
    assert seen == [memory_state.BACKGROUND_NICE]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


def _run_sharded(tmp: Path, *extra: str) -> list[dict]:
    return _run(tmp, *extra, job="fsdp_snapshot_job.py")


@pytest.mark.slow
def test_a_sharded_snapshot_survives_a_lost_host_through_the_buddies_copies(tmp_path: Path) -> None:
    # FSDP2: each rank's shard is its own; the second host's processes are new, so ranks 2 and 3 get
    # their shards (and RNG, data position) from their buddies on the first host, ranks 0 and 1
    results = _run_sharded(tmp_path / "host", "--forget", "2", "3")
    assert len({got["collectives"] for got in results}) == 1, [got["collectives"] for got in results]
    # a sharded snapshot is complete (and reported) once the rank behind's shard is held here too
    assert all(got["reported"][-1] == [3, 5] for got in results), results
    assert [got.get("source") for got in results] == ["memory", "memory", "peer", "peer"], results
    for r, got in enumerate(results):
        assert got["fingerprint"] == got["reference"], (
            f"rank {r} ({got['source']}) is not its state at step 5"
        )
        assert got["data_state"] == {"next_step": 5}
    # the pairs' gloo threads move the shards beside the step: at the copy threads' low priority
    for got in results:
        assert got["pair_threads_nice"], "no gloo threads were made for the buddy pairs"
        assert set(got["pair_threads_nice"]) == {memory_state.BACKGROUND_NICE}, got["pair_threads_nice"]


@pytest.mark.slow
def test_a_sharded_snapshot_without_a_holder_or_with_a_rotted_shard_is_refused_by_every_rank(
    tmp_path: Path,
) -> None:
    # rank 1 and its buddy rank 3 are both new: rank 1's shard is nowhere
    for got in _run_sharded(tmp_path / "gone", "--forget", "1", "3"):
        assert (
            "rank 1's shard of the sharded state is held neither by it nor by its buddy 3" in got["error"]
        ), got
    # rank 3 is new and the copy of its shard that rank 1 holds changed in host memory: refused
    results = _run_sharded(tmp_path / "rot", "--forget", "3", "--rot", "1")
    assert len({got["collectives"] for got in results}) == 1
    for got in results:
        assert "was refused by the rank it was for" in got["error"], got
    assert "does not match its checksum" in results[3]["error"]
