"""What a warm rank frees before it parks again after a GPU attempt (nodeagent.warm.rank.release_gpu).

There is no GPU here: `torch.cuda` is replaced at its boundary in the test that says so, and the
test checks that the caching allocator is emptied after the work is synchronised, and what the
rank says it keeps. The real thing runs in tests/gpu/gpu_runwarden.py (warm_rank)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from nodeagent.trainer import memory_state
from nodeagent.warm import rank as warm_rank

WARM = {"RUNWARDEN_RUN": "r", "RUNWARDEN_ATTEMPT": "1", "RUNWARDEN_LAUNCH_PATH": "warm"}


@pytest.fixture(autouse=True)
def _no_copies() -> Iterator[None]:
    memory_state._copies.clear()
    yield
    memory_state._copies.clear()


def test_a_rank_that_never_touched_cuda_has_nothing_to_release() -> None:
    assert not torch.cuda.is_initialized()
    assert warm_rank.release_gpu() == ""


def test_after_a_gpu_attempt_the_cache_is_emptied_and_what_is_kept_is_said(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[str] = []
    reserved = [3 << 30]  # what the attempt's tensors left in torch's cache

    def empty_cache() -> None:
        calls.append("empty_cache")
        reserved[0] = 2 << 20  # a block still referenced somewhere stays

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: calls.append("ipc_collect"))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: reserved[0])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    memory_state.keep(5, {"state": {"w": torch.zeros(1 << 18)}}, rank=0, world_size=1, env=WARM)  # 1 MiB
    line = warm_rank.release_gpu()
    assert calls == ["synchronize", "empty_cache", "ipc_collect"]  # emptied after the GPU's work ended
    assert line == (
        "runwarden warm: parked after a GPU attempt: keeps its CUDA context on device 3, "
        "2 MiB still reserved by torch's allocator, 1 MiB of copies in host memory"
    )
    assert line in capsys.readouterr().err  # stderr: the agent's log
