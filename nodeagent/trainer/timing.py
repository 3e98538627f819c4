"""How long a rank waits in collectives, per step, measured by a DDP communication hook.

    reporter = trainer.ProgressReporter.from_env()
    ddp = DistributedDataParallel(model)
    reporter.time_collectives(ddp)            # once, before the first forward
    for step in ...:
        loss = loss_fn(ddp(x), y); loss.backward(); opt.step()
        with reporter.waiting():               # an explicit collective of the loop's own
            dist.all_reduce(flag)
        reporter.report(step + 1, loss=loss.item())   # step time, compute and wait filled in

A step's wait is the time after backward's compute is done until every rank's gradients arrived,
plus the `waiting()` blocks; compute is the rest of the step (CollectiveTimer says how each moment is
taken on gloo and on NCCL).

What the timer cannot see: collectives outside DDP's gradient all-reduce that are not inside
`waiting()` (they count as compute); waiting that overlaps this rank's own backward (an early
bucket's all-reduce blocked on a slow peer while later buckets are still being computed): only
what is left after the last bucket is ready counts, so a peer's delay shorter than this rank's
remaining backward does not show; a backward under `no_sync()` (no all-reduce, all compute). A
`waiting()` block is host time: on CUDA an asynchronous collective inside it times only its
enqueue unless the block also synchronizes (e.g. `.item()` on the result).

`CollectiveCount`: the bookkeeping behind RankProgress.collectives_entered / collective_entered_at:
samples of the default group's collective count (the reporter's flush thread reads it every
COLLECTIVE_SAMPLE_S) -> the count, when it last changed, and whether that is sent yet.
"""

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CollectiveCount", "CollectiveTimer", "Entered"]


class _HostStamps:
    """Moments as host `perf_counter` seconds (CPU tensors: gloo completes on the host)."""

    def stamp(self) -> Any:
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        return float(end - start)


class _CudaStamps:
    """Moments as CUDA events on the current stream (CUDA tensors: NCCL completes on the device)."""

    def stamp(self) -> Any:
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        end.synchronize()
        return float(start.elapsed_time(end)) / 1000.0  # elapsed_time is in milliseconds


@dataclass(slots=True)
class _Pass:
    """One backward pass's buckets: the last bucket's readiness, every bucket's completion."""

    ready: Any = None
    done: list[Any] = field(default_factory=list)
    outstanding: int = 0

    @property
    def finished(self) -> bool:
        return self.ready is not None and self.outstanding == 0


class CollectiveTimer:
    """Per-step time in collectives: DDP's gradient all-reduce (a comm hook) and `waiting()` blocks.

    Thread-safe: the hook runs on the autograd thread, the completion callbacks on the process
    group's thread, `take()` on the training loop's.

    The hook replaces DDP's built-in gradient all-reduce with the same arithmetic (each bucket scaled
    by 1/world size, then summed across ranks: the reducer's own order of operations, so gradients and
    losses are bit-identical to an unhooked run; torch's `allreduce_hook` divides instead, which is not
    bit-identical for a world size that is not a power of two) and stamps two moments per bucket: when
    the bucket became ready (the hook is called: backward has computed its gradients) and when its
    all-reduce completed (the future's callback). A backward pass's wait is the time from the last
    bucket's readiness (backward compute is done) to the last completion (every rank's gradients have
    arrived); what the all-reduces overlap with backward compute is compute, not wait. A step's wait is
    the sum over its backward passes plus the `waiting()` blocks; compute is the step time (the time
    between two reports) minus the wait.

    What the future's completion means:

    * gloo (CPU tensors): the callback runs on gloo's thread when the all-reduce is done: host
      timestamps (`time.perf_counter`) are the truth.
    * NCCL (CUDA tensors): the future is marked complete as soon as the collective is *enqueued*, and
      its callback runs at once on the host, with its current stream made to wait for the NCCL stream.
      A host timestamp there says nothing about the device, so on CUDA both moments are CUDA events
      instead: one recorded on the backward's stream when the bucket is ready, one on the callback's
      stream (ordered after the all-reduce on the device). `take()` (at each report) synchronizes on
      the step's last events, a host wait for the all-reduce the optimizer step's kernels follow
      anyway, and reads their elapsed time. The step time stays host time between reports: a loop
      that never synchronizes lets the host run ahead of the device, so the wait is capped at it.
    """

    def __init__(self, *, device: str = "cpu") -> None:
        """`device`: where the hooked model's gradients live ("cuda": CUDA events, else host time)."""
        self._stamps: _HostStamps | _CudaStamps = _CudaStamps() if device == "cuda" else _HostStamps()
        self._lock = threading.Lock()
        self._passes: list[_Pass] = []
        self._explicit_s = 0.0

    @classmethod
    def attach(cls, ddp_model: Any, *, process_group: Any = None) -> "CollectiveTimer":
        """A timer installed on `ddp_model` (a DistributedDataParallel) as its communication hook.

        Call before the first forward pass; DDP allows one hook per model. `process_group`: the
        group DDP reduces over (default: the one it was built with)."""
        first = next(ddp_model.parameters(), None)
        device = first.device.type if first is not None else "cpu"
        timer = cls(device=device)
        group = process_group if process_group is not None else ddp_model.process_group
        ddp_model.register_comm_hook(group, timer.comm_hook())
        return timer

    def comm_hook(self) -> Callable[[Any, Any], Any]:
        """The hook for `DistributedDataParallel.register_comm_hook(process_group, hook)`: DDP's
        default all-reduce, stamped (annotated with the real torch types, which DDP checks)."""
        import torch
        import torch.distributed as dist

        def hook(
            process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
        ) -> torch.futures.Future[torch.Tensor]:
            return self._allreduce(process_group, bucket)

        return hook

    def _allreduce(self, process_group: Any, bucket: Any) -> Any:
        """Scale the bucket by 1/world size, sum it across ranks, hand it back; stamp both moments."""
        import torch.distributed as dist

        tensor = bucket.buffer()
        ready = self._stamps.stamp()
        with self._lock:
            # DDP launches a backward's buckets in index order: bucket 0 opens a pass
            if bucket.index() == 0 or not self._passes or self._passes[-1].ready is not None:
                self._passes.append(_Pass())
            current = self._passes[-1]
            current.outstanding += 1
            if bucket.is_last():
                current.ready = ready
        group = process_group if process_group is not None else dist.group.WORLD
        # the reducer's own arithmetic (grad * (1/world) into the bucket), so gradients are identical
        tensor.mul_(1.0 / dist.get_world_size(group))
        fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()

        def completed(f: Any) -> Any:
            done = self._stamps.stamp()
            with self._lock:
                current.done.append(done)
                current.outstanding -= 1
            return f.value()[0]

        return fut.then(completed)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Count the block's host time as wait (an explicit collective: a barrier, a flag all-reduce)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            with self._lock:
                self._explicit_s += max(0.0, elapsed)

    def take(self) -> float:
        """The wait since the last `take()`, in seconds, and start counting afresh.

        The current backward pass, if its last bucket is not ready or its all-reduces have not all
        completed (take() called from inside a backward), stays for the next take(); an earlier
        unfinished one (a backward that raised) is dropped."""
        with self._lock:
            finished = [p for p in self._passes if p.finished]
            last = self._passes[-1] if self._passes else None
            self._passes = [last] if last is not None and not last.finished else []
            wait = self._explicit_s
            self._explicit_s = 0.0
        for p in finished:
            wait += max(0.0, max(self._stamps.seconds(p.ready, d) for d in p.done))
        return wait


@dataclass(frozen=True, slots=True)
class Entered:
    """`count` collectives entered; the newest first seen at `changed_at` (time.monotonic seconds)."""

    count: int
    changed_at: float


class CollectiveCount:
    """Samples of a rank's collective count -> the count and when it last changed. Pure: no torch,
    no clock (time comes in as `now`, monotonic seconds).

    A change is dated by the sample that first saw it, so `changed_at` is late by up to the sample
    interval. A sample of None (no group: not made yet, or destroyed at the end) keeps what was
    known. A count that goes down is a new group (a warm worker's next attempt): a change like any.
    Readers need no lock (the state is one immutable `Entered`, replaced whole); observers take turns
    (the reporter's flush thread and its sends both sample, under the reporter's lock)."""

    def __init__(self) -> None:
        self._latest: Entered | None = None
        self._sent: Entered | None = None

    def observe(self, count: int | None, now: float) -> bool:
        """One sample; True when the count changed (or is the first known)."""
        latest = self._latest
        if count is None or (latest is not None and latest.count == count):
            return False
        self._latest = Entered(count, now)
        return True

    @property
    def latest(self) -> Entered | None:
        """The count and when it changed, as one consistent pair; None before the first count."""
        return self._latest

    @property
    def unsent(self) -> bool:
        """A count known and not yet sent (the reporter then sends even with nothing else new)."""
        return self._latest is not None and self._latest != self._sent

    def sent(self, entered: Entered) -> None:
        """`entered` (a `latest` read before the send) reached the agent."""
        self._sent = entered
