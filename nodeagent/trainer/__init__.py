"""The training script's side of the contract: progress, stop requests, committed checkpoints.

    from nodeagent import trainer
    reporter = trainer.ProgressReporter.from_env()      # RUNWARDEN_* / RANK / LOCAL_RANK from the launcher
    ckpt = trainer.resume_point(ckpt_root)              # the supervisor's resume step, never half-written
    start = ... load ckpt (its step) or 0 ...
    reporter.loaded(ckpt.step if ckpt else -1)         # the restart's load phase ends here
    reporter.time_collectives(ddp_model)               # per-step wait in DDP's all-reduce (a comm hook)
    saver = trainer.DcpCheckpointer(ckpt_root, reporter=reporter)   # torch.distributed.checkpoint, async
    for step in range(start, steps):
        ...train one step...
        reporter.report(step + 1, loss=loss)            # step time, compute and wait measured
        if rank == 0 and (step + 1) % eval_every == 0:
            with reporter.evaluating():                 # the peers' wait on this rank is no hang
                ...evaluate, no collectives...
        if reporter.stop_requested():                   # SIGTERM, the stop file or the agent's flag
            saver.save(step + 1, model=m, optimizer=o, data_state={...}); saver.wait()
            reporter.close(); sys.exit(0)

Loading: `trainer.load_checkpoint(found, model=m, optimizer=o)` reads either format (DCP, or the
old `save_checkpoint`'s `rank<r>.pt`); nodeagent.trainer.dcp says how a DCP step is committed and checked.

A SIGTERM to the rank (Kubernetes' notice, scancel, preemption, torchrun forwarding its own) is a
stop request: the reporter, created in the main thread, installs a handler that only sets a flag
(`handle_sigterm=False` leaves SIGTERM alone). The rank then has its grace period to finish the
step, save, commit and exit 0 (torchrun's own wait after a SIGTERM is its --shutdown-timeout, 30 s
by default; the agent sets it to the longest grace it may give, see nodeagent.daemon.launcher). A rank
blocked in a collective runs no Python handler: it is KILLed at the end of the grace, as before.
When `stop_requested()` first turns True the reporter remembers why (`stop_reason`: "SIGTERM",
"stop file <path>[: <its first line>]", "the agent asked: <reason>") and sends it at once and on
every later report, so the agent's exit record says "planned stop" before the rank exits. A rank
that stops because its peers agreed to (a collective over their flags) calls
`stopping("...")`, so every node of the attempt reports the stop as planned.

Steps are counted as steps completed, the same number a checkpoint saved at that point carries.

Timings: a `report()` without `step_time_s`/`compute_s`/`wait_s` measures them. The step time
is the host time since the previous report (or since `loaded()`), divided by the steps it covers
(a report every k steps sends per-step averages); the wait is what the collective timer
(`time_collectives()`, nodeagent.trainer.timing: DDP's gradient all-reduce after backward compute is done,
plus `waiting()` blocks) counted meanwhile, likewise per step; compute is the rest. An injected
slow-down (the agent's `slow_s`, from `controllerctl chaos NODE slow-rank`) is slept at the end
of `report()`, outside any collective, so it lands in the next step's compute. A report repeating
the step just reported (the marks around a checkpoint save) carries that step's timings again and
starts the next interval, so a save's time is no step's compute; nor is an evaluation's
(`evaluating()`: the interval leaves it out). Without a timer (no
`time_collectives()`, no `waiting()`) compute and wait are sent as 0: not measured. Timings passed
explicitly are sent as given (missing ones as 0).

`report()` only appends to a bounded deque; a background thread sends the newest report to the
local agent every `flush_interval_s` as one unix datagram (`<RUNWARDEN_NODEAGENT_SOCKET>.progress`,
see nodeagent.daemon.progress_socket); the agent's answer carries its stop flag and any injected slow-down. If the agent is gone the reports are
dropped and training goes on. torch is imported only by the checkpoint save/load functions and
the collective timer's hook.

Collective counts: that thread also reads, every COLLECTIVE_SAMPLE_S, how many collectives the rank
has entered on the job's default process group (torch's sequence number for the group:
torch_api.default_group_sequence, read only from a torch.distributed the script imported), and
every report carries it with when the newest was entered (RankProgress.collectives_entered,
collective_entered_at: the first sample that saw it, so late by up to COLLECTIVE_SAMPLE_S). A count
that changed is sent at the next flush even when nothing else is new (the last report again), once
the rank has reported something (a report or `loaded()`). Every rank calls the group's collectives
in the same order, so the controller can say "rank r has not entered the collective its peers
entered 5 s ago" whatever the step length. A rank that is elsewhere by design while its peers wait
in the next step's collectives (an evaluation on rank 0 alone) says so with `evaluating()`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodeagent.trainer import torch_api
from nodeagent.trainer.checkpoint import (
    CheckpointWriter,
    CommittedCheckpoint,
    latest_committed,
    read_commit,
    step_dir,
)
from nodeagent.trainer.dcp import DcpCheckpointer
from nodeagent.trainer.snapshot import SnapshotPoint, Snapshotter, SnapshotUnavailable, resume_snapshot
from nodeagent.trainer.timing import CollectiveCount, CollectiveTimer

__all__ = [
    "CollectiveTimer",
    "CommittedCheckpoint",
    "DcpCheckpointer",
    "LoadedCheckpoint",
    "ProgressReporter",
    "SnapshotPoint",
    "SnapshotUnavailable",
    "Snapshotter",
    "latest_committed",
    "load_checkpoint",
    "resume_point",
    "save_checkpoint",
    "setup_flight_recording",
]

log = logging.getLogger(__name__)
MAX_RECENT_LOSSES = 64  # losses a rank sends per report (RankProgress.recent_losses); older: dropped
# A rank's stop reason when it stops only because a peer asked (`stop_agreed`); the agent's exit record
# prefers the reason a stop began with (nodeagent.daemon.progress.FOLLOWED_STOP_REASON: the same words).
FOLLOWED_STOP_REASON = "a peer rank's stop request"
_Report = tuple[int, float, float, float, bool, "float | None", float]
# How often the flush thread reads the default group's collective count (RankProgress.collectives_entered):
# the entry time it sends is late by up to this, against the controller's seconds-long collective rule.
COLLECTIVE_SAMPLE_S = 0.1
# step -> seconds save_checkpoint of that step took in this process (the training thread was blocked
# all along): set_committed(step) sends it. A few only: the script commits right after the save.
_SAVE_STALLS: dict[int, float] = {}


class ProgressReporter:
    """One per rank process. Thread-safe `report()`; never raises because the agent is away.

    With an agent socket, a background thread sends the reports (every `flush_interval_s`) and reads
    the default process group's collective count (every COLLECTIVE_SAMPLE_S), which every report
    carries; the module doc says what is sent when."""

    def __init__(
        self,
        *,
        run: str,
        attempt: int,
        rank: int,
        local_rank: int,
        world_size: int,
        agent_socket: str = "",
        stop_file: str = "",
        flush_interval_s: float = 1.0,
        answer_timeout_s: float = 0.2,
        handle_sigterm: bool = True,
    ) -> None:
        self.run, self.attempt, self.rank, self.local_rank, self.world_size = (
            run,
            attempt,
            rank,
            local_rank,
            world_size,
        )
        self._stop_file = stop_file
        self._agent_socket = agent_socket
        self._flush_interval_s = flush_interval_s
        self._answer_timeout_s = answer_timeout_s
        self._sock: socket.socket | None = None
        self._pending: deque[_Report] = deque(maxlen=64)
        # every step's loss since the last send (RankProgress.recent_losses), the oldest dropped
        self._losses: deque[tuple[int, float]] = deque()
        self._losses_dropped = 0
        self._loss_lock = threading.Lock()
        self._agent_stop = False
        self._slow_s = 0.0
        self._committed: tuple[int, float] | None = None  # (step, its save's stall in seconds)
        self._last_report: _Report | None = None
        self._loaded: int | None = None
        self._first_step_unsent = False  # after loaded(): the next step's report is sent at once
        self._in_checkpoint = False
        self._in_eval = False
        self._eval_began = 0.0  # perf_counter() when the evaluation now running began
        self._collectives = CollectiveCount()  # sampled by the flush thread and by every send
        self._count_lock = threading.Lock()  # the flush thread and the training thread both sample
        self._ckpt_error: tuple[int, str] | None = None
        self._snapshots: tuple[int, ...] = ()  # the complete snapshots this rank holds (Snapshotter)
        self._load_error: tuple[int, str] | None = None
        self._sigterm = False
        self._stop_reason = ""
        self._finished = False
        self._last_step = 0
        self._previous_sigterm: Any = None
        self._timer: CollectiveTimer | None = None
        self._interval_start = time.perf_counter()
        self._timed_step: int | None = None  # the step the last measured timings belong to
        self._interval_step: int | None = None  # the step the current interval starts after
        self._timings = (0.0, 0.0, 0.0)  # its (step time, compute, wait)
        if handle_sigterm and threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self._on_sigterm)
        self._closed = threading.Event()
        self._send_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        if agent_socket:
            self._thread = threading.Thread(target=self._flush_loop, name="runwarden-progress", daemon=True)
            self._thread.start()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> ProgressReporter:
        """Identity from the launcher's environment (RUNWARDEN_*, RANK, LOCAL_RANK, WORLD_SIZE)."""
        env = os.environ if environ is None else environ

        def num(name: str, default: int) -> int:
            value = env.get(name, "")
            return int(value) if value.lstrip("-").isdigit() else default

        kwargs: dict[str, Any] = {
            "run": env.get("RUNWARDEN_RUN", ""),
            "attempt": num("RUNWARDEN_ATTEMPT", 0),
            "rank": num("RANK", 0),
            "local_rank": num("LOCAL_RANK", 0),
            "world_size": num("WORLD_SIZE", 1),
            "agent_socket": agent_socket(env),
            "stop_file": env.get("RUNWARDEN_STOP_FILE", ""),
        }
        kwargs.update(overrides)
        return cls(**kwargs)

    def time_collectives(self, ddp_model: Any, *, process_group: Any = None) -> CollectiveTimer:
        """Time DDP's gradient all-reduce from now on (a communication hook on `ddp_model`, before
        its first forward); `report()` without timings then sends the measured compute and wait.
        See nodeagent.trainer.timing for what is measured and what is not."""
        self._timer = CollectiveTimer.attach(ddp_model, process_group=process_group)
        return self._timer

    def waiting(self) -> contextlib.AbstractContextManager[None]:
        """`with reporter.waiting(): dist.all_reduce(...)`: the block's time counts as this step's wait."""
        if self._timer is None:
            self._timer = CollectiveTimer()
        return self._timer.waiting()

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """`with reporter.evaluating(): ...`: an evaluation (or other work outside the training
        collectives) on this rank, while its peers may already wait in the next step's collectives.
        The supervisor does not take the peers' wait on a rank inside it for a hang, up to its eval
        allowance (the policy's; past it, it is one), and its time is no step's: the measured step
        time and compute leave it out (else the rank that evaluates looks like a straggler, the
        slowest compute and the least wait, and its healthy node is flagged). Entering and leaving
        are sent at once, like a checkpoint save's (RankProgress.in_eval); before the rank's first
        report or `loaded()` the flag rides on that first report. Nested blocks are one evaluation."""
        outer = self._in_eval
        if not outer:
            self._set_in_eval(True)
        try:
            yield
        finally:
            if not outer:
                self._set_in_eval(False)

    def _set_in_eval(self, in_eval: bool) -> None:
        now = time.perf_counter()
        if in_eval:
            self._eval_began = now
        else:  # the measured interval leaves the evaluation out (the part of it inside the interval)
            self._interval_start += max(0.0, now - max(self._eval_began, self._interval_start))
        self._in_eval = in_eval
        self._send_last_again()

    def _repeat_last(self) -> _Report | None:
        """The last report again, dated now (no loss: that step's loss was sent with it), to send a
        state change with; None when this rank has reported nothing yet (no step is invented)."""
        last = self._last_report
        if last is not None:
            return (*last[:4], self._in_checkpoint, None, time.time())
        if self._loaded is not None:
            return (max(0, self._loaded), 0.0, 0.0, 0.0, self._in_checkpoint, None, time.time())
        return None

    def stop_agreed(self, *, process_group: Any = None, device: Any = None) -> bool:
        """`stop_requested()` on any rank, agreed by every rank: a MAX all-reduce of the flags (its
        time counts as wait), so all ranks save and stop at the same step. Call it at the same
        point of every step on every rank (`device`: where the flag tensor lives, e.g. the rank's
        GPU under NCCL). A rank that stops because a peer asked reports a planned stop too."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if self.stop_requested() else 0], device=device)
        with self.waiting():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=process_group)
        stop = bool(flag.item())
        if stop and not self._stop_reason:
            self.stopping(FOLLOWED_STOP_REASON)
        return stop

    def _measure(self, step: int) -> tuple[float, float, float]:
        """Per-step (step time, compute, wait) since the previous report (see the module doc): a
        report every k steps sends the interval's averages."""
        now = time.perf_counter()
        wait = self._timer.take() if self._timer is not None else 0.0
        start, self._interval_start = self._interval_start, now
        if step == self._timed_step:  # a repeat (around a save): that step's timings, a new interval
            return self._timings
        since = self._interval_step
        steps = step - since if since is not None and step > since else 1
        self._interval_step = step
        step_time = max(0.0, now - start) / steps
        if self._timer is None:
            timings = (step_time, 0.0, 0.0)
        else:
            wait = min(wait / steps, step_time)
            timings = (step_time, step_time - wait, wait)
        self._timed_step, self._timings = step, timings
        return timings

    def report(
        self,
        step: int,
        *,
        step_time_s: float | None = None,
        compute_s: float | None = None,
        wait_s: float | None = None,
        in_checkpoint: bool = False,
        loss: float | None = None,
    ) -> None:
        """Record progress: `step` steps completed (~1 us). Sleeps only if chaos made this rank slow.

        Timings left out are measured (the module doc says how). Entering or leaving a checkpoint
        save is sent at once, not at the next flush: the supervisor allows a saving rank the long
        checkpoint timeout, so a stale "saving" (a rank that stops right after its save) would hold
        hang detection back by that much."""
        if step_time_s is None and compute_s is None and wait_s is None:
            step_time_s, compute_s, wait_s = self._measure(step)
        else:
            if self._timer is not None:
                self._timer.take()  # superseded by the caller's own numbers (and kept from piling up)
            step_time_s, compute_s, wait_s = step_time_s or 0.0, compute_s or 0.0, wait_s or 0.0
        self._last_step = step
        if loss is not None:
            self._keep_loss(step, loss)
        self._last_report = (step, step_time_s, compute_s, wait_s, in_checkpoint, loss, time.time())
        self._pending.append(self._last_report)
        first_after_load = (
            self._loaded is not None and self._first_step_unsent and step > max(0, self._loaded)
        )
        if first_after_load:
            # the restart's first new step: sent now, like the load mark (the supervisor's
            # FIRST_STEP ends the restart's downtime; an interval's wait would count as downtime)
            self._first_step_unsent = False
        if in_checkpoint != self._in_checkpoint or first_after_load:
            self._in_checkpoint = in_checkpoint
            self.flush()
        if self._slow_s > 0:
            time.sleep(self._slow_s)

    def _keep_loss(self, step: int, loss: float) -> None:
        """Every step's loss reaches the agent (at most MAX_RECENT_LOSSES a send; NaN is news too)."""
        with self._loss_lock:
            if len(self._losses) >= MAX_RECENT_LOSSES:
                self._losses.popleft()
                self._losses_dropped += 1
            self._losses.append((int(step), float(loss)))

    def set_committed(self, step: int, *, save_stall_s: float | None = None) -> None:
        """Tell the supervisor that checkpoint `step` is committed (its marker written, after fsync).

        Global rank 0 calls it after `save_checkpoint` returns a commit (and after resuming, with the
        step it loaded); a DcpCheckpointer calls it on rank 0 as it commits and on every other rank
        once it sees the marker of its earlier save. The agent carries it in the node's progress
        and the controller records the commit. Only a committed step is ever a resume point.

        `save_stall_s`: how long that save blocked this rank's training (RankProgress.save_stall_s,
        goodput's checkpoint_stall). Left out, it is what `save_checkpoint` of `step` measured in
        this process, else 0 (a step resumed from was not saved by this attempt)."""
        if save_stall_s is None:
            save_stall_s = _SAVE_STALLS.pop(int(step), 0.0)
        stall = float(save_stall_s)
        new = self._committed is None or self._committed[0] != int(step)
        self._committed = (int(step), stall if math.isfinite(stall) and stall > 0 else 0.0)
        if new:
            # Sent now, not at the next flush: the commit's time in the event log ends its save in
            # the goodput timeline (a stop's save is planned back from there).
            self._send_last_again()

    def set_snapshots(self, steps: tuple[int, ...]) -> None:
        """The complete in-memory snapshots this rank now holds (a Snapshotter calls it after each):
        sent at once (the controller chooses the resume point from these), and on every later
        report (RankProgress.snapshot_steps)."""
        self._snapshots = tuple(int(s) for s in steps)[-4:]
        self._send_last_again()

    def _send_last_again(self) -> None:
        """The last report again, sent now, with what changed since (never raises: it runs inside a
        save's upload thread or a snapshot, which reporting must never fail)."""
        repeat = self._repeat_last() if self._last_report is not None else None
        if repeat is None:
            return
        self._pending.append(repeat)
        try:
            self.flush()
        except Exception as exc:
            log.debug("progress flush failed: %s", exc)

    def loaded(self, step: int) -> None:
        """Tell the supervisor this rank finished loading checkpoint `step` (-1: starting from scratch)
        and is about to take its first step; sent at once, and carried on every later report. When
        every node of the attempt has said so the controller logs LOAD_DONE, which splits the
        restart's "load" phase from its "first step" phase in the goodput breakdown."""
        self._loaded = max(-1, int(step))
        self._first_step_unsent = True
        if self._timer is not None:
            self._timer.take()  # collectives of the load belong to no step
        self._interval_start = time.perf_counter()  # the first step's time starts here
        self._interval_step = max(0, self._loaded)
        self._pending.append((max(0, self._loaded), 0.0, 0.0, 0.0, False, None, time.time()))
        self.flush()

    def checkpoint_failed(self, step: int, error: str) -> None:
        """Tell the supervisor that saving checkpoint `step` failed (no marker was written) and why;
        sent at once, so the reason is in the event log before this rank exits."""
        self._ckpt_error = (int(step), str(error)[:500])
        self._pending.append((int(step), 0.0, 0.0, 0.0, True, None, time.time()))
        self.flush()

    def load_failed(self, step: int, error: str) -> None:
        """Tell the supervisor that committed step `step` failed its validation at load (a shard's
        content is not what its commit recorded) and why; sent at once, before this rank exits. The
        supervisor stops taking it as a resume point and relaunches from the commit before it."""
        self._load_error = (int(step), str(error)[:1000])
        self._pending.append((max(0, int(step)), 0.0, 0.0, 0.0, False, None, time.time()))
        self.flush()

    def stop_requested(self) -> bool:
        """True once this rank got SIGTERM, the agent asked this run to stop, or the stop file
        exists. Poll once per step. The first True is reported to the agent at once, with why."""
        if self._stop_reason:
            return True
        # The agent writes its reason into the stop file before it raises its flag, so the file,
        # checked first, names the reason whichever of the two this rank sees first.
        if self._sigterm:
            reason = "SIGTERM"
        elif self._stop_file and os.path.exists(self._stop_file):
            line = self._stop_file_line()
            reason = f"stop file {self._stop_file}" + (f": {line}" if line else "")
        elif self._agent_stop:
            reason = "the agent asked: " + (self._stop_file_line() or "stop requested")
        else:
            return False
        self.stopping(reason)
        return True

    @property
    def stop_reason(self) -> str:
        """Why this rank is stopping ("" while it is not)."""
        return self._stop_reason

    def finished(self) -> None:
        """This rank took its last step (and saved what it must): sent now and on every later
        report, so the time it takes to tear down and exit is not taken for a hang."""
        if self._finished:
            return
        self._finished = True
        self._pending.append((self._last_step, 0.0, 0.0, 0.0, False, None, time.time()))
        self.flush()

    def stopping(self, reason: str) -> None:
        """This rank ends on a stop request: `reason` is sent now and on every later report (the
        agent's exit record then says planned_stop). `stop_requested()` calls it; a rank that
        stops because its peers agreed to (a collective over their flags) calls it itself. The
        first reason stays."""
        if self._stop_reason:
            return
        self._stop_reason = " ".join(str(reason).split())[:500] or "stop requested"
        log.info("rank %d stopping: %s", self.rank, self._stop_reason)
        self._pending.append((self._last_step, 0.0, 0.0, 0.0, self._in_checkpoint, None, time.time()))
        self.flush()

    def _stop_file_line(self) -> str:
        """The first line of the stop file (the agent writes its reason there), "" if none."""
        if not self._stop_file:
            return ""
        try:
            with open(self._stop_file, errors="replace") as f:
                return f.readline(600).strip()
        except OSError:
            return ""

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """Only a flag: the training loop sees it at its next stop_requested()."""
        self._sigterm = True
        if callable(self._previous_sigterm):
            self._previous_sigterm(signum, frame)

    @property
    def injected_delay_s(self) -> float:
        return self._slow_s

    @property
    def last_timings(self) -> tuple[int, float, float, float] | None:
        """(step, step time, compute, wait) of the last measured report; None before the first."""
        if self._timed_step is None:
            return None
        return (self._timed_step, *self._timings)

    def flush(self) -> bool:
        """Send the newest pending report now; False if the agent could not be reached."""
        if not self._pending or not self._agent_socket:
            return True
        latest = self._take_pending()
        if latest is None:
            return True
        with self._send_lock:
            return self._send(latest)

    def _take_pending(self) -> _Report | None:
        """The newest pending report (None: none), the older ones dropped."""
        latest: _Report | None = None
        while True:  # popleft until empty: a report appended meanwhile is never lost
            try:
                latest = self._pending.popleft()
            except IndexError:
                return latest

    def close(self) -> None:
        """Send the last report, stop the sender and give SIGTERM back its previous handler (the
        rank has saved what it will save: a TERM now may end it)."""
        self._closed.set()
        if (
            self._previous_sigterm is not None
            and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) == self._on_sigterm
        ):
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None
        if self._thread is not None:
            self._thread.join(timeout=self._flush_interval_s + self._answer_timeout_s + 1)
            self._sample_collectives()  # the count this rank ends at, not the one of up to a sample ago
        with contextlib.suppress(Exception):
            self._flush_with_collectives()
        if self._sock is not None:
            self._sock.close()

    def _flush_loop(self) -> None:
        """Every COLLECTIVE_SAMPLE_S: the collective count; every flush interval: the newest report,
        or the last one again when only the count changed."""
        next_sample = next_flush = time.monotonic()
        next_flush += self._flush_interval_s
        while not self._closed.wait(max(0.0, min(next_sample, next_flush) - time.monotonic())):
            now = time.monotonic()
            try:
                if now >= next_sample:
                    next_sample = now + COLLECTIVE_SAMPLE_S
                    self._sample_collectives()
                if now >= next_flush:
                    next_flush = now + self._flush_interval_s
                    self._flush_with_collectives()
            except Exception as exc:  # never let reporting kill or slow the trainer
                log.debug("progress flush failed: %s", exc)

    def _sample_collectives(self) -> None:
        """Read the default group's collective count (never raises: torch_api returns None instead)."""
        with self._count_lock:
            self._collectives.observe(torch_api.default_group_sequence(), time.monotonic())

    def _flush_with_collectives(self) -> bool:
        """flush(), or the last report again when a new collective count is all there is to send."""
        if not self._agent_socket:
            return True
        # the repeat only when nothing was pending as it was taken: a report the training thread
        # appends meanwhile stays pending (for its own flush or the next), never shadowed by a repeat
        latest = self._take_pending()
        if latest is None and self._collectives.unsent:
            latest = self._repeat_last()
        if latest is None:
            return True
        with self._send_lock:
            return self._send(latest)

    def _send(self, item: _Report) -> bool:
        """One datagram to the agent's progress socket, then its answer (stop flag, slow-down)."""
        from nodeagent.trainer import memory_state
        from nodeagent.wire import progress_socket_path
        from runwarden.v1 import agent_pb2, common_pb2

        if self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.bind("")  # an abstract auto-bound address, so the agent can answer
        step, step_time_s, compute_s, wait_s, in_ckpt, loss, at = item
        progress = common_pb2.RankProgress(
            rank=self.rank,
            local_rank=self.local_rank,
            step=step,
            step_time_s=step_time_s,
            compute_s=compute_s,
            wait_s=wait_s,
            in_checkpoint=in_ckpt,
            reported_at=at,
            pid=os.getpid(),
            world_size=self.world_size,
        )
        if loss is not None:
            progress.loss = loss
        with self._loss_lock:
            losses, self._losses = self._losses, deque()
            dropped, self._losses_dropped = self._losses_dropped, 0
        progress.recent_losses.extend(common_pb2.StepLoss(step=s, loss=v) for s, v in losses)
        progress.losses_dropped = dropped
        if self._committed is not None:
            progress.committed_step, progress.save_stall_s = self._committed
        if self._loaded is not None:
            progress.loaded_step = self._loaded
            progress.loaded_from = memory_state.loaded_from(self._loaded)  # memory | storage | ""
            progress.load_fallback = memory_state.why_fell_back(self._loaded)
        progress.snapshot_steps.extend(self._snapshots)
        if self._ckpt_error is not None:
            progress.step, progress.checkpoint_error = self._ckpt_error
        if self._load_error is not None:
            progress.invalid_step, progress.load_error = self._load_error
        if self._stop_reason:
            progress.stop_reason = self._stop_reason
        if self._finished:
            progress.finished = True
        progress.in_eval = self._in_eval
        # read now, not the flush thread's last sample: a send at once (an evaluation's end, a save's)
        # must not say the rank is collectives behind where it is
        self._sample_collectives()
        entered = self._collectives.latest
        if entered is not None:
            progress.collectives_entered = entered.count
            # the monotonic moment on this host's wall clock (the agent turns it into an age)
            progress.collective_entered_at = time.time() - (time.monotonic() - entered.changed_at)
        request = agent_pb2.ReportProgressRequest(run=self.run, attempt=self.attempt, reports=[progress])
        self._read_answers(timeout_s=0.0)  # late answers of earlier sends
        try:
            self._sock.sendto(request.SerializeToString(), progress_socket_path(self._agent_socket))
        except OSError as exc:  # no agent (no socket file, or nobody reading it): drop, carry on
            log.debug("agent unreachable: %s", exc)
            return False
        if entered is not None:
            with self._count_lock:
                self._collectives.sent(entered)
        self._read_answers(timeout_s=self._answer_timeout_s)
        return True

    def _read_answers(self, timeout_s: float) -> None:
        from runwarden.v1 import agent_pb2

        assert self._sock is not None
        self._sock.settimeout(max(0.0, timeout_s))  # 0: non-blocking
        while True:
            try:
                data = self._sock.recv(4096)
            except OSError:  # nothing (more) to read: timeout or would-block
                return
            try:
                answer = agent_pb2.ReportProgressResponse.FromString(data)
            except Exception:
                continue
            self._agent_stop = self._agent_stop or answer.stop_requested
            self._slow_s = max(0.0, min(answer.slow_s, 3600.0))
            self._sock.settimeout(0.0)  # one answer per send: take what else is queued, no waiting


# --- checkpoints (torch imported here only) ----------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadedCheckpoint:
    step: int
    path: Path
    data_state: Any
    extra: Any


# The agent's socket, as the launcher gives it to every rank; older agents set the second name,
# which sat inside the agent's own RUNWARDEN_AGENT_* config prefix (nodeagent.daemon.config).
AGENT_SOCKET_ENV = "RUNWARDEN_NODEAGENT_SOCKET"
OLD_AGENT_SOCKET_ENV = "RUNWARDEN_AGENT_SOCKET"


def agent_socket(env: Mapping[str, str]) -> str:
    """The socket of the agent that launched this rank ("" when none did)."""
    return env.get(AGENT_SOCKET_ENV) or env.get(OLD_AGENT_SOCKET_ENV, "")


def _rng_state() -> dict[str, Any]:
    import torch

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (kind, [int(k) for k in keys], int(pos), int(has_gauss), float(gauss))
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: Mapping[str, Any]) -> None:
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        try:
            import numpy as np

            kind, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        except ImportError:
            pass
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    root: Path | str,
    step: int,
    *,
    model: Any = None,
    optimizer: Any = None,
    scheduler: Any = None,
    data_state: Any = None,
    extra: Any = None,
    rank: int = 0,
    world_size: int = 1,
    barrier: Callable[[], None] | None = None,
) -> CommittedCheckpoint | None:
    """The old format, synchronous (DcpCheckpointer is the default of the examples): every rank
    writes `rank<r>.pt` (model, optimizer, scheduler, data position, RNG); after `barrier` (default:
    torch.distributed.barrier when world_size > 1) rank 0 writes the commit marker. Returns the
    commit on rank 0, None elsewhere. `data_state` must be plain data."""
    import torch

    started = time.perf_counter()
    writer = CheckpointWriter(root, step)
    payload = {
        "step": step,
        "model": model.state_dict() if model is not None else None,
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "data_state": data_state,
        "extra": extra,
        "rng": _rng_state(),
    }
    with writer.open(f"rank{rank}.pt") as f:
        torch.save(payload, f)
    if world_size > 1:
        if barrier is None:
            import torch.distributed as dist

            barrier = dist.barrier
        barrier()
    from nodeagent.trainer import memory_state

    memory_state.keep(step, payload, rank=rank, world_size=world_size)  # every rank's file is written
    if rank != 0:
        _save_stalled(step, started)
        return None
    meta: dict[str, Any] = {"format": "torch", "world_size": world_size}
    attempt = os.environ.get("RUNWARDEN_ATTEMPT", "")
    if attempt.isdigit():
        meta["attempt"] = int(attempt)  # which attempt committed it (a superseded one is never resumed from)
    commit = writer.commit(files=[f"rank{r}.pt" for r in range(world_size)], meta=meta)
    _save_stalled(step, started)
    return commit


def _save_stalled(step: int, started: float) -> None:
    """save_checkpoint of `step` blocked this process from `started` to now (set_committed sends it)."""
    _SAVE_STALLS[step] = time.perf_counter() - started
    for old in sorted(_SAVE_STALLS)[:-8]:
        del _SAVE_STALLS[old]


class ResumeError(RuntimeError):
    """The supervisor named a resume step that is not committed on this storage."""


def resume_point(
    root: Path | str, env: Mapping[str, str] | None = None
) -> CommittedCheckpoint | SnapshotPoint | None:
    """Where this attempt resumes: the step the supervisor chose (RUNWARDEN_RESUME_STEP: the latest
    commit it accepted, or with RUNWARDEN_RESUME_SNAPSHOT an in-memory snapshot, a SnapshotPoint;
    -1: from scratch), or, run alone, the newest commit on disk.

    Under a supervisor the newest directory on disk is not the answer: a superseded attempt (a
    partitioned host's ranks, before they fenced themselves) may have committed after the
    supervisor moved on. A named step that is not committed here is an error, never a silent
    restart from scratch."""
    env = os.environ if env is None else env
    raw = env.get("RUNWARDEN_RESUME_STEP", "").strip()
    if not raw:
        return latest_committed(root)
    try:
        step = int(raw)
    except ValueError:
        raise ResumeError(f"RUNWARDEN_RESUME_STEP={raw!r} is not a step number") from None
    if step < 0:
        return None
    snapshot = resume_snapshot(env, step)
    if snapshot is not None:
        return snapshot
    found = read_commit(step_dir(root, step))
    if found is None:
        raise ResumeError(
            f"the supervisor resumes from step {step}, but {step_dir(root, step)} is not committed"
        )
    return found


def load_checkpoint(
    checkpoint: CommittedCheckpoint | SnapshotPoint | Path | str,
    *,
    model: Any = None,
    optimizer: Any = None,
    scheduler: Any = None,
    rank: int = 0,
    restore_rng: bool = True,
    map_location: str = "cpu",
    from_peer: bool = True,
    reporter: ProgressReporter | None = None,
) -> LoadedCheckpoint:
    """Load a committed checkpoint (a commit, or a root: its latest commit) into model, optimizer
    and scheduler, restore this rank's RNG states, and return its data position. Either format:
    a DCP step (DcpCheckpointer; a collective, every rank calls it; validated as nodeagent.trainer.dcp
    says) or the old one (this rank's `rank<r>.pt`, read with torch's weights_only unpickler).
    A warm restart serves it from memory where it can (nodeagent.trainer.memory_state): each rank's own
    copy, or for a DCP step with replicated state a peer's (`from_peer=False`: storage instead).

    A DCP step whose shards differ from the digests recorded at its commit raises CorruptCheckpoint
    on every rank; with `reporter`, the supervisor is told first (`load_failed`), and relaunches from
    the commit before it instead of looping on this one. An in-memory snapshot (a SnapshotPoint)
    loads from the ranks' memory (nodeagent.trainer.snapshot.restore) or raises SnapshotUnavailable
    on every rank, told to the supervisor likewise: it relaunches from the newest commit."""
    from nodeagent.trainer.checkpoint import CorruptCheckpoint

    how: dict[str, Any] = dict(
        model=model, optimizer=optimizer, scheduler=scheduler, rank=rank, restore_rng=restore_rng
    )
    try:
        if isinstance(checkpoint, SnapshotPoint):
            from nodeagent.trainer import snapshot

            data_state, extra = snapshot.restore(checkpoint, **how)
            return LoadedCheckpoint(
                step=checkpoint.step,
                path=Path(f"<snapshot {checkpoint.step}>"),
                data_state=data_state,
                extra=extra,
            )
        return _load_checkpoint(checkpoint, map_location=map_location, from_peer=from_peer, **how)
    except (CorruptCheckpoint, SnapshotUnavailable) as exc:
        if reporter is not None:
            reporter.load_failed(exc.step, str(exc))
        raise


def _load_checkpoint(
    checkpoint: CommittedCheckpoint | Path | str,
    *,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    rank: int,
    restore_rng: bool,
    map_location: str,
    from_peer: bool,
) -> LoadedCheckpoint:
    import torch

    from nodeagent.trainer.dcp import FORMAT as DCP_FORMAT
    from nodeagent.trainer.dcp import load_dcp

    if not isinstance(checkpoint, CommittedCheckpoint):
        found = latest_committed(checkpoint)
        if found is None:
            raise FileNotFoundError(f"no committed checkpoint under {checkpoint}")
        checkpoint = found
    if checkpoint.meta.get("format") == DCP_FORMAT:
        from nodeagent.trainer import memory_state

        how: dict[str, Any] = dict(
            model=model, optimizer=optimizer, scheduler=scheduler, rank=rank, restore_rng=restore_rng
        )
        from nodeagent.trainer import shard_replica
        from nodeagent.trainer.dcp import model_and_optim_state

        buddies = shard_replica.HeldShards(
            rank, os.environ.get("RUNWARDEN_RUN", ""), lambda: model_and_optim_state(model, optimizer)
        )
        kept = memory_state.restore_committed_dcp(checkpoint, from_peer=from_peer, buddies=buddies, **how)
        if kept is not None:  # from this rank's memory (a warm worker kept its process) or a peer's
            data_state, extra = kept
            return LoadedCheckpoint(
                step=checkpoint.step, path=checkpoint.path, data_state=data_state, extra=extra
            )
        state = load_dcp(checkpoint, **how)
        return LoadedCheckpoint(
            step=state.step, path=state.path, data_state=state.data_state, extra=state.extra
        )
    from nodeagent.trainer import memory_state

    world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    attempt = checkpoint.meta.get("attempt")
    payload = memory_state.take(
        checkpoint.step, attempt if isinstance(attempt, int) else None, rank=rank, world_size=world_size
    )
    memory_state.loaded(checkpoint.step, memory_state.MEMORY if payload is not None else memory_state.STORAGE)
    if payload is None:
        path = step_dir(checkpoint.path.parent, checkpoint.step) / f"rank{rank}.pt"
        payload = torch.load(path, map_location=map_location, weights_only=True)
    if model is not None and payload["model"] is not None:
        model.load_state_dict(payload["model"])
    if optimizer is not None and payload["optimizer"] is not None:
        optimizer.load_state_dict(payload["optimizer"])
    if scheduler is not None and payload.get("scheduler") is not None:
        scheduler.load_state_dict(payload["scheduler"])
    if restore_rng:
        _restore_rng(payload["rng"])
    return LoadedCheckpoint(
        step=checkpoint.step, path=checkpoint.path, data_state=payload["data_state"], extra=payload["extra"]
    )


def setup_flight_recording(**kwargs: Any) -> Any:
    """Start this rank's flight-recorder socket (before init_process_group); see nodeagent.trainer.flight_recording."""
    from nodeagent.trainer.flight_recording import setup_flight_recording_from_env

    return setup_flight_recording_from_env(**kwargs)
