"""Validation of every RPC field: a bad request is a ValidationError naming the field.

The servicer turns ValidationError into INVALID_ARGUMENT; nothing here touches state.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence

from nodeagent.daemon import torchrun
from runwarden.names import check_name
from runwarden.v1 import agent_pb2, common_pb2

MAX_REPORTS = 4096
MAX_RANK = 1 << 20
MAX_SECONDS = 1e7
MAX_ARGV = 4096
MAX_ARG_BYTES = 64 * 1024
MAX_ARGV_BYTES = 1024 * 1024
MAX_PEERS = 65536
MAX_ENV = 1024
MAX_STEP = 1 << 62
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,255}$")
CHECK_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


class ValidationError(ValueError):
    pass


def run_name(run: str, field: str = "run") -> str:
    try:
        return check_name(field, run)
    except ValueError as exc:
        raise ValidationError(str(exc)) from None


def seconds(value: float, field: str, *, low: float = 0.0, high: float = MAX_SECONDS) -> float:
    if not math.isfinite(value) or not low <= value <= high:
        raise ValidationError(f"{field}: must be a finite number in [{low:g}, {high:g}], got {value!r}")
    return value


def integer(value: int, field: str, *, low: int, high: int) -> int:
    if not low <= value <= high:
        raise ValidationError(f"{field}: must be in [{low}, {high}], got {value}")
    return value


MAX_RECENT_LOSSES = 64
MAX_SNAPSHOT_STEPS = 4  # RankProgress.snapshot_steps: the trainer keeps 2 (memory_state.KEEP)


def _step_losses(r: common_pb2.RankProgress) -> None:
    kept = [(x.step, x.loss) for x in r.recent_losses if 0 <= x.step <= MAX_STEP]
    dropped = len(r.recent_losses) - len(kept)
    if len(kept) > MAX_RECENT_LOSSES:
        dropped += len(kept) - MAX_RECENT_LOSSES
        kept = kept[-MAX_RECENT_LOSSES:]
    if dropped:
        del r.recent_losses[:]
        r.recent_losses.extend(common_pb2.StepLoss(step=s, loss=v) for s, v in kept)
        r.losses_dropped = max(0, r.losses_dropped) + dropped


def progress_request(req: agent_pb2.ReportProgressRequest) -> None:
    run_name(req.run)
    integer(req.attempt, "attempt", low=0, high=MAX_STEP)
    if not req.reports:
        raise ValidationError("reports: at least one report is required")
    if len(req.reports) > MAX_REPORTS:
        raise ValidationError(f"reports: at most {MAX_REPORTS} per call, got {len(req.reports)}")
    now = time.time()
    for i, r in enumerate(req.reports):
        where = f"reports[{i}]"
        integer(r.rank, f"{where}.rank", low=0, high=MAX_RANK)
        integer(r.local_rank, f"{where}.local_rank", low=0, high=MAX_RANK)
        integer(r.step, f"{where}.step", low=0, high=MAX_STEP)
        integer(r.pid, f"{where}.pid", low=0, high=1 << 30)
        integer(r.world_size, f"{where}.world_size", low=0, high=MAX_RANK)
        for name in ("step_time_s", "compute_s", "wait_s"):
            seconds(getattr(r, name), f"{where}.{name}")
        # NaN and infinite losses are the trainer's news (the controller's loss rules), not bad input;
        # a loss at a step out of range is dropped alone, and a list over the limit keeps its newest
        if r.recent_losses:
            _step_losses(r)
        r.losses_dropped = max(0, r.losses_dropped)
        if len(r.checkpoint_error) > 1024:
            raise ValidationError(f"{where}.checkpoint_error: at most 1024 characters")
        if len(r.load_fallback) > 1024:
            raise ValidationError(f"{where}.load_fallback: at most 1024 characters")
        if len(r.load_error) > 1024:
            raise ValidationError(f"{where}.load_error: at most 1024 characters")
        if r.HasField("invalid_step"):
            integer(r.invalid_step, f"{where}.invalid_step", low=0, high=MAX_STEP)
        if r.load_error and not r.HasField("invalid_step"):
            raise ValidationError(f"{where}.load_error: set without the invalid_step it is about")
        if len(r.stop_reason) > 1024:
            raise ValidationError(f"{where}.stop_reason: at most 1024 characters")
        if r.HasField("committed_step"):
            integer(r.committed_step, f"{where}.committed_step", low=0, high=MAX_STEP)
        if r.HasField("loaded_step"):
            integer(r.loaded_step, f"{where}.loaded_step", low=-1, high=MAX_STEP)
        if len(r.snapshot_steps) > MAX_SNAPSHOT_STEPS:
            raise ValidationError(f"{where}.snapshot_steps: at most {MAX_SNAPSHOT_STEPS}")
        for i, s in enumerate(r.snapshot_steps):
            integer(s, f"{where}.snapshot_steps[{i}]", low=1, high=MAX_STEP)
        if r.reported_at == 0:
            r.reported_at = now
        seconds(r.reported_at, f"{where}.reported_at", high=now + 86400)
        if r.HasField("collectives_entered"):
            integer(r.collectives_entered, f"{where}.collectives_entered", low=0, high=MAX_STEP)
            # this host's clock, like reported_at; the agent turns it into an age when it writes
            seconds(r.collective_entered_at, f"{where}.collective_entered_at", high=now + 86400)
        elif r.collective_entered_at:
            raise ValidationError(f"{where}.collective_entered_at: set without collectives_entered")
        if r.collective_age_s:
            raise ValidationError(f"{where}.collective_age_s: the agent sets it, a rank does not")


PREFLIGHT_MODES = ("quick", "full", "burn_in")  # preflight.config.RUN_MODES (no preflight import here)


def preflight_request(req: agent_pb2.RunPreflightRequest) -> None:
    if req.mode not in PREFLIGHT_MODES:
        raise ValidationError(f"mode: 'quick', 'full' or 'burn_in', got {req.mode[:40]!r}")
    if len(req.only) > 256:
        raise ValidationError("only: at most 256 check names")
    for i, name in enumerate(req.only):
        if not CHECK_NAME.match(name):
            raise ValidationError(f"only[{i}]: not a check name: {name[:40]!r}")
    # A burn-in runs for most of an hour by default; a per-attempt preflight for at most minutes.
    seconds(req.budget_s, "budget_s", high=86400 if req.mode == "burn_in" else 600)


def launch_request(req: agent_pb2.LaunchWorkersRequest) -> None:
    run_name(req.run)
    integer(req.attempt, "attempt", low=0, high=MAX_STEP)
    if req.rendezvous_id:
        run_name(req.rendezvous_id, "rendezvous_id")
    if req.HasField("torchrun"):
        if req.argv:
            raise ValidationError("argv: must be empty with torchrun (give one of the two)")
        _argv(req.torchrun.command, "torchrun.command")
        try:
            torchrun.split_endpoint(req.torchrun.rdzv_endpoint)
        except ValueError as exc:
            raise ValidationError(f"torchrun.rdzv_endpoint: {exc}") from None
        if req.nnodes < 1:
            raise ValidationError(f"nnodes: at least 1 with torchrun, got {req.nnodes}")
        if req.torchrun.script_mode not in agent_pb2.ScriptMode.values():
            raise ValidationError(f"torchrun.script_mode: unknown value {req.torchrun.script_mode}")
        if req.torchrun.script_mode == agent_pb2.SCRIPT_MODE_UNMODIFIED:
            if req.torchrun.no_python:
                raise ValidationError(
                    "torchrun.script_mode: an unmodified script runs through the bootstrap under "
                    "torchrun's interpreter; no_python cannot be set with it"
                )
            first = req.torchrun.command[0]
            if first.startswith("-") and not (first == "-m" and len(req.torchrun.command) >= 2):
                raise ValidationError(
                    f"torchrun.command: an unmodified script is a script or -m MODULE, got {first[:40]!r}"
                )
        if len(req.torchrun.peers) > MAX_PEERS:
            raise ValidationError(f"torchrun.peers: at most {MAX_PEERS}, got {len(req.torchrun.peers)}")
        for peer in req.torchrun.peers:
            try:
                torchrun.split_endpoint(peer)
            except ValueError as exc:
                raise ValidationError(f"torchrun.peers: {exc}") from None
    else:
        _argv(req.argv, "argv")
    if len(req.env) > MAX_ENV:
        raise ValidationError(f"env: at most {MAX_ENV} variables")
    for key, value in req.env.items():
        if not ENV_NAME.match(key):
            raise ValidationError(f"env: bad variable name {key[:40]!r}")
        if "\0" in value or len(value) > MAX_ARG_BYTES:
            raise ValidationError(f"env[{key}]: contains NUL or is too long")
    if len(req.cwd) > 4096 or "\0" in req.cwd:
        raise ValidationError("cwd: too long or contains NUL")
    integer(req.nnodes, "nnodes", low=0, high=MAX_RANK)
    integer(req.node_rank, "node_rank", low=0, high=max(0, req.nnodes - 1) if req.nnodes else MAX_RANK)
    integer(req.resume_step, "resume_step", low=-1, high=MAX_STEP)
    integer(req.leader_fence, "leader_fence", low=0, high=MAX_STEP)
    # Another host's wall clock: any finite time up to the year 5138 (a skewed clock is not refused).
    seconds(req.launched_at, "launched_at", high=1e11)
    if req.HasField("stop_older"):  # StopWorkersRequest's bounds
        seconds(req.stop_older.grace_s, "stop_older.grace_s", high=3600)
        seconds(req.stop_older.park_within_s, "stop_older.park_within_s", high=60)


def _argv(argv: Sequence[str], field: str) -> None:
    if not argv:
        raise ValidationError(f"{field}: the command is required")
    if len(argv) > MAX_ARGV:
        raise ValidationError(f"{field}: at most {MAX_ARGV} items")
    total = 0
    for i, arg in enumerate(argv):
        size = len(arg.encode())
        total += size
        if i == 0 and not arg:
            raise ValidationError(f"{field}[0]: empty")
        if "\0" in arg or size > MAX_ARG_BYTES:
            raise ValidationError(f"{field}[{i}]: contains NUL or is longer than {MAX_ARG_BYTES} bytes")
    if total > MAX_ARGV_BYTES:
        raise ValidationError(f"{field}: {total} bytes in all, limit {MAX_ARGV_BYTES}")


MAX_DRAIN_REASON = 500


def drain_request(req: agent_pb2.DrainRequest) -> None:
    if len(req.reason) > MAX_DRAIN_REASON:
        raise ValidationError(f"reason: at most {MAX_DRAIN_REASON} characters, got {len(req.reason)}")
    if not req.reason.isprintable():
        raise ValidationError(
            f"reason: printable characters only (no newlines or controls): {req.reason[:40]!r}"
        )


def fault_request(req: agent_pb2.InjectFaultRequest) -> None:
    if req.kind == agent_pb2.FAULT_KIND_UNSPECIFIED or req.kind not in agent_pb2.FaultKind.values():
        raise ValidationError(f"kind: a FaultKind is required, got {req.kind}")
    integer(req.local_rank, "local_rank", low=0, high=MAX_RANK)
    if req.kind == agent_pb2.FAULT_KIND_SLOW_RANK:
        seconds(req.value, "value", high=3600)
    if req.kind == agent_pb2.FAULT_KIND_XID and not 0 < len(req.line) <= 4096:
        raise ValidationError("line: the kernel-log line is required (at most 4096 characters)")
