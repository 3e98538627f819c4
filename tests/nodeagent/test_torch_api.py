"""nodeagent.trainer.torch_api: the private torch calls the ranks make, the version check around them
and their fallbacks, against the torch installed here (scripts/test_compat.sh runs this module at both
ends of the supported range)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from nodeagent.trainer import torch_api
from nodeagent.trainer.torch_api import TorchApiError


def test_the_version_is_read_as_major_minor_and_checked_against_the_range() -> None:
    assert torch_api.parse_version("2.9.1+cu128") == (2, 9)
    assert torch_api.parse_version("2.14.0a0+git1234") == (2, 14)
    assert torch_api.parse_version("2.13.0+cpu") == (2, 13)
    with pytest.raises(TorchApiError, match="cannot read"):
        torch_api.parse_version("nightly")
    assert torch_api.supported((2, 9)) and torch_api.supported((2, 14))
    assert not torch_api.supported((2, 8)) and not torch_api.supported((2, 15))
    assert not torch_api.supported((3, 0))


def test_every_private_c10d_call_exists_in_this_torch() -> None:
    for name in ("_dump_fr_trace_json", "_dump_fr_trace", "_WorkerServer"):
        assert callable(torch_api.c10d_private(name))


def test_a_missing_call_names_the_torch_version_and_the_range(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TorchApiError) as inside:
        torch_api.c10d_private("_no_such_call")
    message = str(inside.value)
    assert f"torch {torch.__version__} has no torch._C._distributed_c10d._no_such_call" in message
    assert "supports torch 2.9 to 2.14" in message and "outside" not in message
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    with pytest.raises(TorchApiError, match=r"torch 2\.99\.0 has no .*\(2\.99\.0 is outside it\)"):
        torch_api.c10d_private("_no_such_call")


def test_the_flight_recorder_dump_is_json_this_torch_reads() -> None:
    from nodeagent.trainer.bootstrap import read_pg_status

    assert read_pg_status() == {}  # no process group yet: an empty table, not an error


def _reference_set(root: Any, path: tuple[str | int, ...], value: Any) -> None:
    from torch.distributed.checkpoint._nested_dict import set_element

    set_element(root, path, value)


@pytest.mark.parametrize(
    "paths",
    [
        [("a",), ("b", "c"), ("b", "d")],
        [("opt", "state", 0, "exp_avg"), ("opt", "state", 1, "step"), ("opt", "param_groups", 0, "lr")],
        [("lst", 2), ("lst", 0, "x"), ("lst", 1, 0)],
        [("sched", "milestones", 1), ("sched", "last_epoch")],
    ],
)
def test_set_nested_builds_what_dcps_own_set_element_builds(paths: list[tuple[str | int, ...]]) -> None:
    ours: dict[str, Any] = {}
    theirs: dict[str, Any] = {}
    for n, path in enumerate(paths):
        torch_api.set_nested(ours, path, n)
        _reference_set(theirs, path, n)
    assert ours == theirs


def test_set_nested_keeps_int_keys_of_a_dict_and_refuses_a_bad_path() -> None:
    state: dict[Any, Any] = {"state": {}}
    torch_api.set_nested(state, ("state", 3, "step"), 7)
    assert state == {"state": {3: {"step": 7}}}
    with pytest.raises(TypeError, match="into a list"):
        torch_api.set_nested({"l": [1]}, ("l", "x"), 0)
    with pytest.raises(TypeError, match="into a int"):
        torch_api.set_nested({"l": [1]}, ("l", 0, "x"), 0)
    with pytest.raises(ValueError, match="empty path"):
        torch_api.set_nested({}, (), 0)


def test_abort_uses_the_groups_own_abort_and_falls_back_to_destroy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        aborted: list[str] = []
        world = dist.group.WORLD
        assert world is not None and callable(getattr(world, "abort", None))  # every supported torch has it
        monkeypatch.setattr(type(world), "abort", lambda self: aborted.append("abort"), raising=False)
        torch_api.abort_default_group()
        assert aborted == ["abort"] and dist.is_initialized()
        # a torch whose group has no abort: the group is destroyed instead
        monkeypatch.setattr(dist, "group", SimpleNamespace(WORLD=object()))
        torch_api.abort_default_group()
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_the_default_groups_sequence_counts_every_collective_this_rank_entered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert torch_api.default_group_sequence() is None  # no group yet
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert torch_api.default_group_sequence() == 0  # a fresh group
        for _ in range(3):
            dist.all_reduce(torch.ones(2))
        dist.barrier()
        assert torch_api.default_group_sequence() == 4  # a barrier is a collective of the group too
        from torch.distributed import distributed_c10d

        def gone() -> None:
            raise RuntimeError("the default group is gone")

        monkeypatch.setattr(distributed_c10d, "_get_default_group", gone)
        assert torch_api.default_group_sequence() is None  # polled from a thread: None, never an error
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()
    assert torch_api.default_group_sequence() is None


def test_the_worker_servers_handlers_are_read_from_torch() -> None:
    assert torch_api.has_worker_handler("ping") and not torch_api.has_worker_handler("no_such_handler")
    # where torch's C++ server has no JSON dump of every ring (2.9), the Python server answers it
    assert torch_api.has_worker_handler("fr_trace_json") == (
        torch_api.parse_version(torch.__version__) >= (2, 10)
    )


_RANK_WITH_PYTHON_SERVER = """
import sys, torch, torch.distributed as dist
from nodeagent.trainer.flight_recording import PythonWorkerServer
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
server = PythonWorkerServer(sys.argv[2])
dist.all_reduce(torch.ones(4))
print("ready", flush=True)
sys.stdin.readline()
server.shutdown()
"""


def test_the_python_worker_server_answers_the_agents_request_with_this_ranks_ring(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from nodeagent.daemon.flight_recorder import fetch_dump
    from runwarden.flightrec import parse_dump

    sock = tmp_path / "rank0.sock"
    rank = subprocess.Popen(
        [sys.executable, "-c", _RANK_WITH_PYTHON_SERVER, str(tmp_path / "store"), str(sock)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TORCH_FR_BUFFER_SIZE": "100"},  # read once, when the first group is made
    )
    try:
        assert rank.stdout is not None
        while (line := rank.stdout.readline()) and line.strip() != "ready":  # gloo prints to stdout too
            pass
        assert line.strip() == "ready"
        got = fetch_dump(0, sock, 5.0, 1 << 24)
        assert got.ok, got.error
        dump = parse_dump(got.data, max_bytes=1 << 24)
        assert any(e.profiling_name.endswith("all_reduce") for e in dump.entries), dump
    finally:
        rank.communicate("done\n", timeout=30)
    assert rank.returncode == 0
