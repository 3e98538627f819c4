"""Where the in-memory checkpoint copies live (issue 28): host memory, bounded, only on the warm path.

At the torch boundary: the kept tensors are checked by their `.device` and their type (a tensor
that claims another device must not come back as itself), the budget by what is kept and what is
said, and the whole save -> load path through a real DCP save in this process."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from nodeagent import trainer
from nodeagent.daemon.config import AgentConfig
from nodeagent.trainer import memory_state
from nodeagent.trainer.dcp import DcpCheckpointer

WARM = {"RUNWARDEN_RUN": "r", "RUNWARDEN_ATTEMPT": "1", "RUNWARDEN_LAUNCH_PATH": "warm"}


@pytest.fixture(autouse=True)
def _fresh_module_state() -> Iterator[None]:
    saved = memory_state.budget()
    memory_state._copies.clear()
    memory_state._not_kept.clear()
    yield
    memory_state._copies.clear()
    memory_state._not_kept.clear()
    memory_state.set_budget(saved)


class ClaimsCuda(torch.Tensor):
    """A tensor that says it is on a GPU (its bytes are on the host: there is no GPU here)."""

    @property
    def device(self) -> torch.device:  # the claim is the point
        return torch.device("cuda", 0)


def _leaves(x: Any) -> Iterator[Any]:
    """Every tensor of a kept payload, a DTensor's host shard included."""
    if isinstance(x, memory_state._HostDTensor):
        yield x.local
    elif isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _leaves(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _leaves(v)


def _state() -> dict[str, Any]:
    w = torch.arange(12.0).view(3, 4)
    return {
        "model": {
            "w": w,
            "b": torch.ones(4, dtype=torch.float64),
            "claims": torch.arange(5.0).as_subclass(ClaimsCuda),
        },
        "optim": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1}]},
    }


def test_every_kept_tensor_is_a_plain_host_tensor_and_the_next_step_cannot_change_it() -> None:
    state = _state()
    assert state["model"]["claims"].device.type == "cuda"  # the claim holds at the boundary
    assert memory_state.keep(3, {"state": state}, rank=0, world_size=1, env=WARM) == ""
    (snap,) = memory_state._copies
    leaves = list(_leaves(snap.payload))
    assert len(leaves) == 4
    for t in leaves:
        assert type(t) is torch.Tensor and t.device.type == "cpu", (type(t), t.device)
        assert not t.is_pinned()  # pinned only when CUDA is available (tests/gpu checks that side)
    assert snap.nbytes == 12 * 4 + 4 * 8 + 5 * 4 + 4
    with torch.no_grad():
        state["model"]["w"].add_(100.0)  # the next optimizer step
    got = memory_state.take(3, 1, rank=0, world_size=1, env=WARM)
    assert torch.equal(got["state"]["model"]["w"], torch.arange(12.0).view(3, 4))
    assert torch.equal(got["state"]["model"]["claims"], torch.arange(5.0))
    assert got["state"]["optim"]["param_groups"] == [{"lr": 0.1}]
    got["state"]["model"]["w"].zero_()  # a load may alias what it is given: the copy stays intact
    assert torch.equal(snap.payload["state"]["model"]["w"], torch.arange(12.0).view(3, 4))


def test_a_dtensor_keeps_its_shard_on_the_host_and_comes_back_a_dtensor() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        d = DTensor.from_local(torch.arange(6.0), mesh, [Replicate()])
        assert memory_state.keep(2, {"state": {"d": d}}, rank=0, world_size=1, env=WARM) == ""
        (kept,) = _leaves(memory_state._copies[0].payload)
        assert type(kept) is torch.Tensor and kept.device.type == "cpu"
        back = memory_state.take(2, 1, rank=0, world_size=1, env=WARM)["state"]["d"]
        assert isinstance(back, DTensor) and torch.equal(back.to_local(), torch.arange(6.0))
    finally:
        dist.destroy_process_group()


def test_a_tensor_without_data_is_not_kept_and_that_is_said(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="nodeagent.trainer.memory_state")
    why = memory_state.keep(
        4, {"state": {"w": torch.empty(3, device="meta")}}, rank=0, world_size=1, env=WARM
    )
    assert "meta" in why and memory_state.kept_steps() == ()
    assert memory_state.why_not_kept(4) == why and "no in-memory copy of step 4" in caplog.text


def test_a_copy_over_the_budget_is_not_kept_and_older_copies_make_room(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="nodeagent.trainer.memory_state")
    one = {"state": {"w": torch.zeros(256)}}  # 1024 bytes
    memory_state.set_budget(1500)
    assert memory_state.keep(1, one, rank=0, world_size=1, env=WARM) == ""
    assert memory_state.keep(2, one, rank=0, world_size=1, env=WARM) == ""
    assert memory_state.kept_steps() == (2,)  # two would be 2048 bytes: the older one made room
    assert memory_state.kept_bytes() == 1024 and "copy of step 1 dropped" in caplog.text
    why = memory_state.keep(3, {"state": {"w": torch.zeros(512)}}, rank=0, world_size=1, env=WARM)
    assert "2048 bytes are over the copy budget of 1500 bytes" in why
    assert memory_state.kept_steps() == (2,)  # what fits stays
    assert memory_state.why_not_kept(3) == why and "over the copy budget" in caplog.text
    memory_state.set_budget(0)
    assert "over the copy budget of 0" in memory_state.keep(5, one, rank=0, world_size=1, env=WARM)


def test_a_cold_launch_keeps_no_copy() -> None:
    cold = {k: v for k, v in WARM.items() if k != "RUNWARDEN_LAUNCH_PATH"}
    why = memory_state.keep(3, {"state": _state()}, rank=0, world_size=1, env=cold)
    assert "cold launch" in why and memory_state.kept_steps() == ()
    assert memory_state.keep(3, {"state": _state()}, rank=0, world_size=1, env={}) == "not under a supervisor"
    assert memory_state.why_not_kept(3) == why


def test_the_host_buffers_are_reused_by_the_next_copies_of_the_same_model() -> None:
    state = {"state": {"w": torch.zeros(64), "b": torch.zeros(8, dtype=torch.int64)}}
    for step in (1, 2, 3):
        memory_state.keep(step, state, rank=0, world_size=1, env=WARM)
    first_two = [x.buffers for x in memory_state._copies]
    assert memory_state.kept_steps() == (2, 3)
    memory_state.keep(4, state, rank=0, world_size=1, env=WARM)
    assert [b.data_ptr() for b in memory_state._copies[-1].buffers] == [b.data_ptr() for b in first_two[0]]


def test_the_default_budget_is_the_agents() -> None:
    assert AgentConfig().memory_copy_budget_bytes == memory_state.DEFAULT_BUDGET_BYTES


def _saved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, budget: int) -> tuple[Any, nn.Module]:
    for k, v in WARM.items():
        monkeypatch.setenv(k, v)
    memory_state.set_budget(budget)
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    DcpCheckpointer(tmp_path, async_save=False).save(3, model=model, optimizer=opt, data_state={"n": 3})
    with torch.no_grad():
        model.weight.zero_()
    commit = trainer.resume_point(tmp_path, env={})
    assert commit is not None
    return commit, model


def test_a_dcp_save_keeps_its_copy_and_the_load_uses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    commit, model = _saved(tmp_path, monkeypatch, memory_state.DEFAULT_BUDGET_BYTES)
    assert all(t.device.type == "cpu" for t in _leaves(memory_state._copies[0].payload))
    got = trainer.load_checkpoint(commit, model=model, optimizer=torch.optim.AdamW(model.parameters()))
    assert memory_state.loaded_from(3) == "memory" and got.data_state == {"n": 3}
    assert model.weight.abs().sum() > 0


def test_a_copy_over_the_budget_loads_from_storage_and_the_load_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="nodeagent.trainer.memory_state")
    commit, model = _saved(tmp_path, monkeypatch, 1024)
    assert memory_state.kept_steps() == ()
    trainer.load_checkpoint(commit, model=model, optimizer=torch.optim.AdamW(model.parameters()))
    assert memory_state.loaded_from(3) == "storage" and model.weight.abs().sum() > 0
    assert (
        "no copy of step 3 in this process's memory" in caplog.text and "copy budget of 1024" in caplog.text
    )
