"""One rank of the automatic-timing tests (tests/nodeagent/test_timing.py): real DDP over gloo on CPU.

`run_rank` trains a tiny model in several scenarios, in one process group, and puts what it
measured on the queue: the losses of an unhooked and a hooked run (which must be equal), and per
scenario the reporter's own timings of every step (`ProgressReporter.last_timings`, from
`report(step)` with no timings: the loop has no timer of its own). Every rank sleeps
`BASE_S` in its forward pass (the step's ordinary compute); in a slow scenario one rank does more:

* forward: sleeps `EXTRA_S` more in its forward pass;
* chaos: its agent (a fake one: a datagram socket answering like nodeagent's) injects a slow-down
  of `EXTRA_S`, which the reporter sleeps at the end of `report()`, as `controllerctl chaos NODE
  slow-rank` makes it;
* backward: sleeps `EXTRA_S` in its backward pass (a custom autograd Function between the layers,
  so the sleep comes before the gradient bucket is ready).
"""

from __future__ import annotations

import socket
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nodeagent import trainer
from nodeagent.wire import progress_socket_path
from runwarden.v1 import agent_pb2

BASE_S = 0.01
EXTRA_S = 0.02
STEPS = 30
SCENARIOS = ("clean", "forward", "chaos", "backward")


class _SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


class Net(nn.Module):
    def __init__(self, *, forward_s: float = 0.0, backward_s: float = 0.0) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 32), nn.Linear(32, 1)
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.forward_s:
            time.sleep(self.forward_s)
        h = self.a(x)
        if self.backward_s:
            h = _SleepInBackward.apply(h, self.backward_s)
        return self.b(torch.tanh(h))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 101 + rank)
    return torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)


def _losses(rank: int, *, hooked: bool) -> list[float]:
    torch.manual_seed(7)
    model = nn.parallel.DistributedDataParallel(Net())
    if hooked:
        trainer.CollectiveTimer.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out = []
    for step in range(12):
        x, y = _batch(step, rank)
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def _fake_agent(agent_socket: str, slow_s: float) -> None:
    """Answer every progress datagram as the node agent does, with an injected slow-down."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(progress_socket_path(agent_socket))
    answer = agent_pb2.ReportProgressResponse(slow_s=slow_s).SerializeToString()

    def serve() -> None:
        while True:
            _, addr = sock.recvfrom(65536)
            sock.sendto(answer, addr)

    threading.Thread(target=serve, daemon=True).start()


def _timed(
    rank: int, world: int, scenario: str, slow: bool, tmp: Path
) -> list[tuple[int, float, float, float]]:
    extra = EXTRA_S if slow else 0.0
    agent_socket = ""
    if scenario == "chaos" and slow:
        agent_socket = str(tmp / f"agent{rank}.sock")
        _fake_agent(agent_socket, EXTRA_S)
    reporter = trainer.ProgressReporter(
        run="timing",
        attempt=1,
        rank=rank,
        local_rank=0,
        world_size=world,
        agent_socket=agent_socket,
        flush_interval_s=0.005,
        handle_sigterm=False,
    )
    torch.manual_seed(7)
    net = Net(
        forward_s=BASE_S + (extra if scenario == "forward" else 0.0),
        backward_s=extra if scenario == "backward" else 0.0,
    )
    model = nn.parallel.DistributedDataParallel(net)
    reporter.time_collectives(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    reporter.loaded(-1)  # sent at once: the fake agent's answer carries the slow-down
    while agent_socket and reporter.injected_delay_s == 0:
        time.sleep(0.005)
    with reporter.waiting():
        dist.barrier()
    measured = []
    for step in range(STEPS):
        x, y = _batch(step, rank)
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        reporter.report(step + 1, loss=loss.item())
        timings = reporter.last_timings
        assert timings is not None
        measured.append(timings)
    reporter.close()
    dist.barrier()
    return measured


def run_rank(rank: int, world: int, store: str, slow_rank: int, out: Any) -> None:
    """`store`: a file for the rendezvous (no TCP port to pick, so none another process can take)."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    result: dict[str, Any] = {
        "unhooked": _losses(rank, hooked=False),
        "hooked": _losses(rank, hooked=True),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for scenario in SCENARIOS:
            slow = scenario != "clean" and rank == slow_rank
            result[scenario] = _timed(rank, world, scenario, slow, Path(tmp))
    dist.destroy_process_group()
    out.put((rank, result))
