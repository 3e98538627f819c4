"""Supervise a training script that has no runwarden calls in it at all.

    python -m nodeagent.trainer.bootstrap SCRIPT [ARGS...]       # as `python SCRIPT ARGS...` would run it
    python -m nodeagent.trainer.bootstrap -m MODULE [ARGS...]    # as `python -m MODULE ARGS...` would

The agent runs every rank this way when a launch says `script_mode: SCRIPT_MODE_UNMODIFIED`
(`[controller] script_mode = "unmodified"`): torchrun's command becomes
`-m nodeagent.trainer.bootstrap <command...>`, which torchrun's own interpreter runs on the cold path and
the parked rank runs with runpy on the warm path (nodeagent.warm.rank), so both paths are unchanged.

Before the script's own code runs, in the rank's process:

* the flight recorder's worker socket (nodeagent.trainer.flight_recording), so the agent can collect this
  rank's dump without the GIL when the controller investigates a hang; the process groups' real
  `pg_config` is written next to it whenever a new group appears;
* a sampler thread that reads the process groups' flight-recorder counters every
  `RUNWARDEN_BOOTSTRAP_SAMPLE_S` (default 0.02 s): torch's JSON dump *without* collectives, whose
  `pg_status` holds per group the last collective enqueued, started and completed (a cheap read;
  the dump with entries is not, so it is never polled);
* a `ProgressReporter` (nodeagent.trainer) that sends what the sampler derives through the agent's
  progress socket, every `RUNWARDEN_BOOTSTRAP_REPORT_S` (default 1 s) in which it changed. Its own
  thread adds, as on the instrumented path, the collectives entered on the default process group
  and when the newest was entered (RankProgress.collectives_entered, collective_entered_at), for the
  controller's collective rule.

What is reported (`CollectiveClock`): the step is the number of collectives this rank has entered,
summed over its process groups (aligned across ranks for the default group, since every rank calls
the same collectives in the same order). Entered, not completed: a rank that waits in collective S
has done its part, and the rank that never called S is the one left at S-1 -- so the controller's
"the node whose progress stopped first" rung already names it, before the flight recorder does.
Wait is the time the rank had a collective outstanding (enqueued and not yet completed; on NCCL with
timing, which the bootstrap turns on, started and not completed: the device's view); compute is the
rest of the interval; both are per-step averages, as the instrumented path sends them. So the
straggler rule sees the slow rank with high compute and low wait, the others the reverse.

What this mode cannot see: what happens between collectives (a stretch without any -- an
evaluation on one rank, a synchronous save, a slow data loader -- is a hang once it outlasts the
hang timeout: keep `hang_timeout_s` above it; every rank stuck outside a collective at once stops
all counts equal, so a hang is seen but no culprit named; one rank's stretch while its peers wait in
a collective is, to the collective rule, that rank's hang: the script cannot declare an evaluation,
`evaluating()` is the instrumented path's), the loss (no NaN, spike or divergence
checks), checkpoint commits (the controller never learns one, so every attempt resumes where the
script's own checkpoint logic says), the load phase (no LOAD_DONE), planned stops
(the script does not poll a stop flag: a planned stop ends as a hard stop after the grace; a script
that handles SIGTERM itself still gets it), and chaos `slow-rank` (it only delays this mode's
reports). DDP overlaps its gradient all-reduce with backward compute: that overlap counts as wait
on every rank, so a straggler whose delay is small against it is not flagged (the instrumented
path's communication hook separates them).

Errors: a usage error or a bad RUNWARDEN_BOOTSTRAP_* value exits 2 before the script starts; a
script's exception or exit code is its own, unchanged. Without RUNWARDEN_NODEAGENT_SOCKET (nor the
older agents' RUNWARDEN_AGENT_SOCKET: not launched by an agent) the script just runs.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import runpy
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)
ENV_SAMPLE_S = "RUNWARDEN_BOOTSTRAP_SAMPLE_S"
ENV_REPORT_S = "RUNWARDEN_BOOTSTRAP_REPORT_S"
DEFAULT_SAMPLE_S = 0.02
DEFAULT_REPORT_S = 1.0
EXIT_USAGE = 2
MAX_STATUS_BYTES = 1 << 20  # pg_status of a few thousand groups; more is not torch's answer
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_COUNTER = re.compile(r"^-?[0-9]{1,19}$")


class UsageError(ValueError):
    """The bootstrap's command line or environment is wrong (exit 2, nothing runs)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BootstrapConfig:
    sample_interval_s: float = DEFAULT_SAMPLE_S
    report_interval_s: float = DEFAULT_REPORT_S

    def __post_init__(self) -> None:
        if not (math.isfinite(self.sample_interval_s) and 0.001 <= self.sample_interval_s <= 1.0):
            raise UsageError(f"{ENV_SAMPLE_S}: seconds in [0.001, 1], got {self.sample_interval_s!r}")
        if not (
            math.isfinite(self.report_interval_s) and self.sample_interval_s <= self.report_interval_s <= 60.0
        ):
            raise UsageError(
                f"{ENV_REPORT_S}: seconds in [{ENV_SAMPLE_S} ({self.sample_interval_s:g}), 60], "
                f"got {self.report_interval_s!r}"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> BootstrapConfig:
        def seconds(name: str, default: float) -> float:
            raw = environ.get(name, "").strip()
            if not raw:
                return default
            try:
                return float(raw)
            except ValueError:
                raise UsageError(f"{name}: not a number: {raw[:40]!r}") from None

        return cls(
            sample_interval_s=seconds(ENV_SAMPLE_S, DEFAULT_SAMPLE_S),
            report_interval_s=seconds(ENV_REPORT_S, DEFAULT_REPORT_S),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """What to run: a script path, or a module (`-m`), and its arguments."""

    script: str = ""
    module: str = ""
    args: tuple[str, ...] = ()


def parse_target(argv: list[str]) -> Target:
    if not argv:
        raise UsageError(
            "usage: python -m nodeagent.trainer.bootstrap SCRIPT [ARGS...] | -m MODULE [ARGS...]"
        )
    if argv[0] == "-m":
        if len(argv) < 2 or not _MODULE.match(argv[1]):
            raise UsageError("-m needs a module name")
        return Target(module=argv[1], args=tuple(argv[2:]))
    if argv[0].startswith("-"):
        raise UsageError(f"a script or -m MODULE, got the interpreter option {argv[0]!r}")
    if not os.path.isfile(argv[0]):
        raise UsageError(f"can't open file {argv[0]!r}: not a file")
    return Target(script=argv[0], args=tuple(argv[1:]))


# --- the counters -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupCounters:
    """One process group's flight-recorder counters (torch's `pg_status`); -1: not tracked."""

    enqueued: int
    started: int  # -1 on gloo, and on NCCL without TORCH_NCCL_ENABLE_TIMING
    completed: int

    @property
    def in_collective(self) -> bool:
        """A collective of this group is outstanding: the rank waits (or transfers) in it."""
        if self.started >= 0:
            return self.started > self.completed
        return self.enqueued > self.completed


def parse_pg_status(raw: bytes | str) -> dict[str, GroupCounters]:
    """torch's JSON dump (`_dump_fr_trace_json(includeCollectives=False)`) -> counters per group id.

    ValueError for anything that is not that shape (the counters are strings in torch's JSON)."""
    if len(raw) > MAX_STATUS_BYTES:
        raise ValueError(f"pg_status: over {MAX_STATUS_BYTES} bytes")
    doc = json.loads(raw)
    status = doc.get("pg_status") if isinstance(doc, dict) else None
    if not isinstance(status, dict):
        raise ValueError("pg_status: missing or not an object")
    out: dict[str, GroupCounters] = {}
    for pg, fields in status.items():
        if not isinstance(fields, dict):
            raise ValueError(f"pg_status[{pg!r}]: not an object")
        values = []
        for name in ("last_enqueued_collective", "last_started_collective", "last_completed_collective"):
            text = str(fields.get(name, "-1"))
            if not _COUNTER.match(text):
                raise ValueError(f"pg_status[{pg!r}].{name}: not a counter: {text[:30]!r}")
            values.append(max(-1, int(text)))
        out[str(pg)] = GroupCounters(enqueued=values[0], started=values[1], completed=values[2])
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Interval:
    """Progress since the previous interval with steps: per-step averages, as RankProgress has them."""

    step: int  # collectives entered so far, over every group
    steps: int  # entered during the interval (>= 1)
    step_time_s: float
    compute_s: float
    wait_s: float


class CollectiveClock:
    """Counter samples -> the step and the compute/wait split. Pure: time comes in as `now`.

    The time between two samples counts as wait when the earlier sample saw a collective
    outstanding (an unbiased estimate for waits longer than the sample interval). The first
    interval starts at the first collective seen, so the first report's timings are about 0 (not
    measured, like the instrumented path's load mark). A group whose counter goes down was
    destroyed and made again under its id: what it counted stays.

    `baseline`: the counters before the script ran. A warm rank process runs attempt after attempt;
    torch keeps a destroyed group's last counters in `pg_status` (and gives the next group a new
    id), so an attempt counts from its baseline, and a group still exactly at it (a previous
    attempt's, perhaps left mid-collective) is not taken for a wait."""

    def __init__(self, now: float, baseline: Mapping[str, GroupCounters] | None = None) -> None:
        self._baseline = dict(baseline or {})
        self._entered: dict[str, int] = {pg: max(0, c.enqueued) for pg, c in self._baseline.items()}
        self._gone = -sum(self._entered.values())  # what groups counted before being re-created
        self._waiting = False
        self._at = now
        self._since = now  # start of the current interval
        self._since_step = 0
        self._wait = 0.0

    @property
    def entered(self) -> int:
        return self._gone + sum(self._entered.values())

    @property
    def waiting(self) -> bool:
        return self._waiting

    def observe(self, now: float, groups: Mapping[str, GroupCounters]) -> None:
        if now > self._at:
            if self._waiting:
                self._wait += now - self._at
            self._at = now
        had = self.entered
        for pg, counters in groups.items():
            entered = max(0, counters.enqueued)
            before = self._entered.get(pg, 0)
            if entered < before:
                self._gone += before
            self._entered[pg] = entered
        self._waiting = any(c.in_collective for pg, c in groups.items() if self._baseline.get(pg) != c)
        if had == 0 and self.entered > 0:
            # the first collective: what came before it (imports, data, init) is no step's time
            self._since, self._wait = now, 0.0

    def take(self, now: float) -> Interval | None:
        """The interval since the last one that had steps; None (and it goes on) when none was entered."""
        self.observe(now, {})  # the time up to now, by the state last seen
        step = self.entered
        steps = step - self._since_step
        if steps <= 0:
            return None
        elapsed = max(0.0, now - self._since)
        wait = min(self._wait, elapsed)
        interval = Interval(
            step=step,
            steps=steps,
            step_time_s=elapsed / steps,
            compute_s=(elapsed - wait) / steps,
            wait_s=wait / steps,
        )
        self._since, self._since_step, self._wait = now, step, 0.0
        return interval


def read_pg_status() -> dict[str, GroupCounters]:
    """This process's counters, from torch (the cheap dump: no entries, no stack traces)."""
    from nodeagent.trainer.torch_api import c10d_private

    return parse_pg_status(c10d_private("_dump_fr_trace_json")(includeCollectives=False, onlyActive=False))


# --- the rank's thread --------------------------------------------------------------------------


class CollectiveSampler:
    """Reads the counters every sample interval and reports through `reporter` (a ProgressReporter)
    once per report interval in which a collective was entered; the first report goes at once."""

    def __init__(
        self,
        *,
        reporter: Any,
        config: BootstrapConfig,
        on_new_group: Callable[[], object] | None = None,
        read_status: Callable[[], Mapping[str, GroupCounters]] = read_pg_status,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._reporter = reporter
        self._config = config
        self._on_new_group = on_new_group
        self._read = read_status
        self._clock_fn = clock
        try:
            baseline = dict(read_status())  # a warm rank's earlier attempts (see CollectiveClock)
        except Exception:
            baseline = {}
        self.clock = CollectiveClock(clock(), baseline)
        self.reports = 0
        self.samples = 0
        self._groups = len(baseline)
        self._next_report = 0.0
        self._read_failed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="runwarden-collectives", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling; a last sample and report, so the final step is not lost."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self._config.report_interval_s + 1.0)
        self.sample(report=True)

    def _loop(self) -> None:
        while not self._stop.wait(self._config.sample_interval_s):
            try:
                self.sample()
            except Exception as exc:  # never let supervision kill or stall the script
                log.debug("collective sample failed: %s", exc)

    def sample(self, *, report: bool = False) -> None:
        try:
            groups = self._read()
        except Exception as exc:
            if not self._read_failed:
                self._read_failed = True
                log.warning("runwarden bootstrap: cannot read the flight recorder's counters: %s", exc)
            return
        now = self._clock_fn()
        self.samples += 1
        self.clock.observe(now, groups)
        if len(groups) > self._groups:
            self._groups = len(groups)
            if self._on_new_group is not None:
                try:
                    self._on_new_group()
                except Exception as exc:  # a group made while we read the table: the next one retries
                    self._groups -= 1
                    log.debug("pg_config not recorded yet: %s", exc)
        first = self.reports == 0 and self.clock.entered > 0
        if not (first or report or now >= self._next_report):
            return
        interval = self.clock.take(now)
        if interval is None:
            return
        self._next_report = now + self._config.report_interval_s
        self.reports += 1
        self._reporter.report(
            interval.step,
            step_time_s=interval.step_time_s,
            compute_s=interval.compute_s,
            wait_s=interval.wait_s,
        )
        self._reporter.flush()


# --- running the script -------------------------------------------------------------------------


class Session:
    """The flight recorder's socket, the reporter and the sampler of one supervised rank."""

    def __init__(self, *, recording: Any, reporter: Any, sampler: CollectiveSampler) -> None:
        self.recording = recording
        self.reporter = reporter
        self.sampler = sampler

    def close(self, *, finished: bool) -> None:
        """The script is over: the last step, `finished` if it ended well, then the sockets."""
        self.sampler.stop()
        if finished:
            self.reporter.finished()
        self.reporter.close()
        if self.recording is not None:
            self.recording.close()


def start_session(config: BootstrapConfig, environ: Mapping[str, str]) -> Session | None:
    """Set up supervision in this process before the script runs; None when no agent launched it.

    UsageError when the flight recorder is off (TORCH_FR_BUFFER_SIZE=0): this mode's progress comes
    from it, and a run that never reports would only end at the startup timeout."""
    from nodeagent.trainer import agent_socket

    if not agent_socket(environ) or not environ.get("RANK", "").isdigit():
        log.warning("runwarden bootstrap: not launched by a runwarden agent; running the script unsupervised")
        return None
    if environ.get("TORCH_FR_BUFFER_SIZE", "").strip() == "0":
        raise UsageError(
            "TORCH_FR_BUFFER_SIZE=0 turns the flight recorder off, and an unmodified script's progress "
            "comes from it: set the agent's fr_buffer_size above 0"
        )
    # NCCL records when a collective starts on the device only with timing on (read at group creation)
    os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")
    from nodeagent.trainer import ProgressReporter
    from nodeagent.trainer.flight_recording import setup_flight_recording_from_env

    recording = setup_flight_recording_from_env()  # None (logged) if the socket cannot be made
    # SIGTERM is the script's: it polls no stop flag, so a TERM must end it (or reach its own handler)
    reporter = ProgressReporter.from_env(environ, handle_sigterm=False)
    sampler = CollectiveSampler(
        reporter=reporter,
        config=config,
        on_new_group=recording.record_process_groups if recording is not None else None,
    )
    sampler.start()
    return Session(recording=recording, reporter=reporter, sampler=sampler)


def run_target(target: Target) -> None:
    """Run the script as `python` would: argv, sys.path[0], `__main__`."""
    if target.module:
        sys.argv = [target.module, *target.args]
        sys.path[0:1] = [os.getcwd()]
        runpy.run_module(target.module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target.script, *target.args]
        sys.path[0:1] = [os.path.dirname(os.path.realpath(target.script))]
        runpy.run_path(target.script, run_name="__main__")


def main(argv: list[str] | None = None) -> int:
    try:
        target = parse_target(sys.argv[1:] if argv is None else argv)
        config = BootstrapConfig.from_env(os.environ)
        session = start_session(config, os.environ)
    except UsageError as exc:
        print(f"runwarden bootstrap: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    finished = False
    try:
        run_target(target)
        finished = True
    except SystemExit as exc:
        finished = exc.code in (None, 0)
        raise
    finally:
        if session is not None:
            session.close(finished=finished)
    return 0


if __name__ == "__main__":
    sys.exit(main())
