"""Automatic compute/wait timing (nodeagent.trainer.timing through ProgressReporter): the numbers a real
3-rank gloo DDP run measures (3, not 2: scaling a gradient by 1/3 is where torch's allreduce_hook
and DDP's built-in reduction differ in the last bit), fed to the supervisor core's straggler rule
(tests/supervisor/harness.py Driver); the reporter's arithmetic; and the CUDA-event path at the
torch boundary with only torch.cuda mocked."""

from __future__ import annotations

import contextlib
import queue
import statistics
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from controller.supervisor.events import ProgressObserved, RankSample
from nodeagent import trainer
from nodeagent.trainer.timing import CollectiveTimer
from runwarden.v1 import events_pb2 as E
from tests.nodeagent import timing_job
from tests.supervisor.harness import Driver, fast

WORLD = 3
SLOW = 1  # the rank slowed in the slow scenarios
Timings = list[tuple[int, float, float, float]]  # per step: (step, step time, compute, wait)


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """Every rank's results of one real gloo DDP run of every scenario (tests/nodeagent/timing_job.py)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = str(tmp_path_factory.mktemp("timing") / "store")
    procs = [ctx.Process(target=timing_job.run_rank, args=(r, WORLD, store, SLOW, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + 120
    try:
        while len(results) < len(procs):
            assert time.monotonic() < deadline, "the ranks did not finish in 120 s"
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not failed, f"a rank failed: exit codes {failed}"
            with contextlib.suppress(queue.Empty):
                rank, result = out.get(timeout=0.5)
                results[rank] = result
    finally:
        for p in procs:
            p.join(timeout=30)  # a loaded host tears torch down slowly
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return results


def _straggler_detections(by_rank: dict[int, Timings]) -> list[E.Event]:
    """The core's straggler rule over the measured numbers, one ProgressObserved per node per step."""
    d = Driver(cfg=fast(), nodes=WORLD)
    d.ranks_per_node = 1
    d.start(WORLD)
    nodes = d.running_nodes()
    for i in range(len(by_rank[0])):
        d.now += max(t[i][1] for t in by_rank.values())
        for rank, node in enumerate(nodes):
            step, step_time, compute, wait = by_rank[rank][i]
            sample = RankSample(
                rank=rank, step=step, step_time_s=step_time, compute_s=compute, wait_s=wait, reported_at=d.now
            )
            d.send(ProgressObserved(node=node, attempt=d.sup.attempt, ranks=(sample,)))
    return [e for e in d.events(E.EVENT_KIND_DETECTION) if e.detection.detector == E.DETECTOR_STRAGGLER]


def _scenario(measured: dict[int, dict[str, Any]], name: str) -> dict[int, Timings]:
    return {rank: measured[rank][name] for rank in range(WORLD)}


def _median(timings: Timings, field: int) -> float:
    return statistics.median(t[field] for t in timings[1:])  # the first step carries DDP's first-pass setup


def test_hooked_ddp_losses_equal_the_unhooked_run(measured: dict[int, dict[str, Any]]) -> None:
    for rank in range(WORLD):
        assert measured[rank]["hooked"] == measured[rank]["unhooked"]  # bit for bit


def test_timings_add_up_to_the_time_between_reports(measured: dict[int, dict[str, Any]]) -> None:
    for rank in range(WORLD):
        timings = measured[rank]["clean"]
        assert [t[0] for t in timings] == list(range(1, timing_job.STEPS + 1))
        for _, step_time, compute, wait in timings:
            assert compute >= 0 and wait >= 0 and compute + wait == pytest.approx(step_time)
            assert step_time >= timing_job.BASE_S  # the forward's sleep is in every step


def test_clean_run_flags_no_straggler(measured: dict[int, dict[str, Any]]) -> None:
    assert _straggler_detections(_scenario(measured, "clean")) == []


@pytest.mark.parametrize("scenario", ["forward", "chaos"])
def test_rank_slowed_before_the_collective_is_flagged_the_straggler(
    measured: dict[int, dict[str, Any]], scenario: str
) -> None:
    """A sleep in the forward pass, or the agent's injected slow-down (slept in report()), is compute."""
    by_rank = _scenario(measured, scenario)
    slow = by_rank[SLOW]
    assert _median(slow, 2) >= timing_job.BASE_S + 0.8 * timing_job.EXTRA_S
    assert _median(slow, 3) < 0.3 * timing_job.EXTRA_S
    for rank in set(by_rank) - {SLOW}:  # the peers wait for it in the all-reduce
        assert _median(by_rank[rank], 3) >= 0.6 * timing_job.EXTRA_S
    det = _straggler_detections(by_rank)
    assert len(det) == 1 and det[0].detection.ranks == [SLOW], det


def test_heavy_backward_counts_as_compute_not_wait(measured: dict[int, dict[str, Any]]) -> None:
    by_rank = _scenario(measured, "backward")
    slow = by_rank[SLOW]
    assert _median(slow, 2) >= timing_job.BASE_S + 0.8 * timing_job.EXTRA_S
    assert _median(slow, 3) < 0.3 * timing_job.EXTRA_S  # timing around loss.backward() would say ~EXTRA_S
    for rank in set(by_rank) - {SLOW}:
        assert _median(by_rank[rank], 3) >= 0.6 * timing_job.EXTRA_S
    det = _straggler_detections(by_rank)
    assert len(det) == 1 and det[0].detection.ranks == [SLOW], det


# --- the reporter's arithmetic, and the CUDA path at the torch boundary -------------------------


def _reporter() -> trainer.ProgressReporter:
    return trainer.ProgressReporter(
        run="r", attempt=1, rank=0, local_rank=0, world_size=1, handle_sigterm=False
    )


def test_explicit_wait_and_repeated_step_reports() -> None:
    r = _reporter()
    r.loaded(-1)
    time.sleep(0.02)
    with r.waiting():
        time.sleep(0.03)
    r.report(1, loss=1.0)
    timings = r.last_timings
    assert timings is not None
    step, step_time, compute, wait = timings
    assert step == 1 and wait >= 0.03 and compute >= 0.02 and compute + wait == pytest.approx(step_time)
    time.sleep(0.05)  # a save: the repeat carries step 1's timings, and the next step starts after it
    r.report(1, in_checkpoint=True)
    assert r.last_timings == timings
    r.report(2)
    last = r.last_timings
    assert last is not None and last[0] == 2 and last[1] < 0.04
    r.report(3, step_time_s=0.5)  # explicit timings are sent as given, not measured
    assert r.last_timings == last
    r.close()


def test_a_report_every_k_steps_sends_per_step_averages() -> None:
    r = _reporter()
    r.loaded(10)  # resumed at step 10: the interval starts there
    time.sleep(0.06)
    with r.waiting():
        time.sleep(0.06)
    r.report(13)  # three steps in one report: per step 0.04 s, 0.02 of it waiting (undivided: 0.12)
    timings = r.last_timings
    assert timings is not None
    step, step_time, compute, wait = timings
    assert step == 13 and 0.04 <= step_time < 0.1 and 0.02 <= wait < 0.05 and compute >= 0.02
    r.close()


def test_without_a_timer_compute_and_wait_are_not_guessed() -> None:
    r = _reporter()
    time.sleep(0.01)
    r.report(1)
    timings = r.last_timings
    assert timings is not None and timings[1] >= 0.01 and timings[2:] == (0.0, 0.0)
    r.close()


class _FakeCudaEvent:
    """torch.cuda.Event's part the timer uses: record() on the current stream, synchronize(),
    elapsed_time() in milliseconds (refused before synchronize(), as on a real device)."""

    log: list[str] = []
    made: list[_FakeCudaEvent] = []

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None
        self.synced = False
        self.made.append(self)

    def record(self) -> None:
        self.at = time.perf_counter()
        self.log.append("record")

    def synchronize(self) -> None:
        self.synced = True
        self.log.append("synchronize")

    def elapsed_time(self, end: _FakeCudaEvent) -> float:
        assert self.at is not None and end.at is not None and end.synced
        return (end.at - self.at) * 1000.0


@pytest.fixture
def one_process_group() -> Iterator[None]:
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_cuda_event_path_with_torch_cuda_mocked(
    monkeypatch: pytest.MonkeyPatch, one_process_group: None
) -> None:
    """Only torch.cuda is mocked (its Event): a real DDP model, a real gloo group and the real hook."""
    monkeypatch.setattr(torch.cuda, "Event", _FakeCudaEvent)
    _FakeCudaEvent.log, _FakeCudaEvent.made = [], []
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
    timer = CollectiveTimer(device="cuda")
    model.register_comm_hook(None, timer.comm_hook())
    model(torch.randn(3, 4)).sum().backward()
    # one bucket: a ready event in the hook, a done event in the completion callback
    assert _FakeCudaEvent.log == ["record", "record"]
    wait = timer.take()
    assert _FakeCudaEvent.log == ["record", "record", "synchronize"]
    ready, done = _FakeCudaEvent.made
    assert done.synced and ready.at is not None and done.at is not None
    assert wait == pytest.approx(done.at - ready.at) and 0.0 <= wait < 1.0
    assert timer.take() == 0.0  # taken once
