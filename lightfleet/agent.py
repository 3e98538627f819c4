"""One light agent: a node's state and what the real agent would answer, without I/O.

`LightAgent` holds what nodeagent.daemon.agent.Agent holds (the lease, the drain, fatal evidence, the
last preflight, the runs' fences and attempts, stop requests) and decides what the real one decides,
with the real one's messages, from requests and the time it is given (`now`: wall-clock seconds).
Sleeping, etcd and gRPC are the caller's (lightfleet.server, lightfleet.process).

An attempt's ranks are arithmetic, not processes. Every node of an attempt runs one step clock:
step = max(resume, 0) + (t - t0) // step_s, where t0 is the attempt record's `launched_at` (the
controller's, one for every node) plus `startup_s`, the stand-in for torchrun's rendezvous, which
starts every rank of an attempt together. So nodes hosted in different processes agree on the step
at any instant, and a hang freezes every node of the attempt at one step, as a collective that one
rank never joins does. Global ranks are torchrun's with --node-rank: node_rank x local_ranks + local.
"""

from __future__ import annotations

import collections
import json
import math
import random
import signal as signals
import socket
from dataclasses import dataclass

import runwarden
from lightfleet.settings import AgentSettings, Latency
from nodeagent.daemon import torchrun
from nodeagent.daemon.preflight_bridge import summarize
from preflight.xid import parse_xid_line, xid_evidence
from runwarden.evidence import is_fatal
from runwarden.v1 import agent_pb2, common_pb2, store_pb2

MAX_RECENT_LOSSES = 64  # per rank per write, as the real agent sends them (nodeagent.daemon.progress)
FR_KEPT = 8  # flight-recorder entries per rank dump: the newest collectives (the ring buffer's tail)
NO_SOCKET = "no dump: no flight-recorder socket (the rank opened none, or it has exited)"
WARM_OFF = "warm_workers is off"  # nodeagent.warm.groups.plan's answer when the agent runs cold
WARM_ON = "kept from the previous attempt (light agent: its parked ranks)"
FAULT_CHECK = "lightfleet.injected"


class Refused(Exception):
    """An RPC refused before anything changed: the gRPC status code's name and the real agent's message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True, kw_only=True)
class StopState:
    reason: str
    requested_at: float


@dataclass(slots=True, kw_only=True)
class PlannedStop:
    """The ranks finish step `step`, save and commit it (`commit_at`), then exit 0 (`exit_at`)."""

    reason: str
    step: int
    commit_at: float
    exit_at: float


def exit_status(now: float, *, code: int | None = None, signal: int | None = None) -> common_pb2.ExitStatus:
    """An exit as nodeagent.daemon.launcher's reaper records torchrun's."""
    status = common_pb2.ExitStatus(ended_at=now)
    if signal is not None:
        status.signal = signal
        status.detail = f"killed by {_signal_name(signal)}"
    else:
        status.exit_code = 0 if code is None else code
        status.detail = f"exit code {status.exit_code}"
    return status


def _signal_name(number: int) -> str:
    try:
        return signals.Signals(number).name
    except ValueError:
        return f"signal {number}"


def loss(step: int, rank: int) -> float:
    """A deterministic loss per (step, rank): a resumed attempt replays the same values, so the
    controller's divergence check sees a faithful replay."""
    return 2.5 * math.exp(-step / 400.0) + 0.3 + 0.001 * (rank % 7)


@dataclass(slots=True, kw_only=True)
class Attempt:
    """One attempt's ranks on this node: their step clock, their end, and what etcd has of them."""

    run: str
    attempt: int
    rendezvous_id: str
    node_rank: int
    nnodes: int
    resume_step: int
    local_ranks: int
    settings: AgentSettings
    started_at: float  # when the launch was accepted (WorkerStatus.started_at)
    launched_at: float = 0.0  # the controller's clock at the launch (LaunchWorkersRequest.launched_at)
    t0: float  # every rank loaded; step base + 1 completes at t0 + step_s
    nodes: tuple[str, ...] = ()  # the attempt record's nodes ((): unknown)
    pid: int = 0
    stop: PlannedStop | None = None
    frozen_at: int | None = None  # hang: no rank passes this step
    culprit: int | None = None  # the local rank that never joined the next collective
    culprit_stopped: bool = False  # ... and whose process reads as stopped (no dump, state T)
    end_step: int | None = None
    exit: common_pb2.ExitStatus | None = None
    stop_reason: str = ""  # what the ranks report as their stop reason (a stop request, SIGTERM)
    finished: bool = False
    # what etcd has: the write bookkeeping of the progress key
    written_step: int = -2
    written_commit: int | None = None
    written_stop: str = ""
    loaded_written: bool = False
    first_step_written: bool = False
    exit_written: bool = False
    next_write_at: float = 0.0
    losses_from: int = -1  # the last step whose loss is in etcd

    @property
    def base(self) -> int:
        return max(self.resume_step, 0)

    @property
    def running(self) -> bool:
        return self.exit is None

    def time_of(self, step: int) -> float:
        """When `step` completed on every rank (the base: when they loaded)."""
        return self.t0 + (step - self.base) * self.settings.step_s

    def step_at(self, t: float) -> int | None:
        """Steps completed at wall time t; None before the ranks report at all."""
        if t < self.t0:
            return None
        step = self.base + int((t - self.t0) // self.settings.step_s)
        for cap in (self.frozen_at, self.end_step, self.stop.step if self.stop else None):
            if cap is not None:
                step = min(step, cap)
        if self.settings.steps:
            step = min(step, max(self.settings.steps, self.base))
        return step

    def committed_at(self, t: float) -> int | None:
        """The newest step this attempt committed by t (None: none yet)."""
        best: int | None = None
        every = self.settings.ckpt_every
        if every:
            saved = self.step_at(t - self.settings.save_s)
            if saved is not None and (newest := saved // every * every) > self.base:
                best = newest
        reached = self.frozen_at is None or self.frozen_at >= (self.stop.step if self.stop else 0)
        if self.stop is not None and t >= self.stop.commit_at and reached:  # a hung rank saves nothing
            best = max(best or 0, self.stop.step)
        return best

    def advance(self, now: float) -> None:
        """The ends that come with time: a planned stop's exit 0, the last step's exit 0."""
        if self.exit is not None or self.frozen_at is not None:
            return
        if self.stop is not None and now >= self.stop.exit_at:
            self.end(self.stop.exit_at, exit_status(self.stop.exit_at), planned=self.stop.reason)
        elif (last := self.settings.steps) and last > self.base and now >= self.time_of(last) + 0.1:
            self.finished = True
            self.end(self.time_of(last) + 0.1, exit_status(self.time_of(last) + 0.1))

    def end(self, at: float, status: common_pb2.ExitStatus, *, planned: str = "") -> None:
        """The worker group ended at `at`; its ranks stop where they were. `planned`: the stop reason
        a rank reported (ExitStatus.planned_stop, as nodeagent.daemon.progress.record_exit sets it)."""
        if self.exit is not None:
            return
        step = self.step_at(at)
        self.end_step = self.base if step is None else step
        if planned:
            status.planned_stop = planned
        self.exit = status

    def request_stop(self, reason: str, now: float) -> None:
        """A planned stop: finish the step under way, save, commit, exit 0 (nodeagent.trainer)."""
        if self.stop is not None or self.exit is not None:
            return
        step = self.step_at(max(now, self.t0))
        stop_step = (self.base if step is None else step) + 1
        if self.settings.steps:
            stop_step = min(stop_step, max(self.settings.steps, self.base))
        commit_at = self.time_of(stop_step) + self.settings.save_s
        self.stop = PlannedStop(reason=reason, step=stop_step, commit_at=commit_at, exit_at=commit_at + 0.1)
        self.stop_reason = reason

    def reported_stop(self, t: float) -> str:
        """The stop reason the ranks report at t: once they finished the step they were told to stop after."""
        if self.stop is not None and t < self.time_of(self.stop.step):
            return ""
        return self.stop_reason

    def ranks(self, t: float, pid: int) -> list[common_pb2.RankProgress]:
        """Every local rank's newest report at t (empty before they report)."""
        step = self.step_at(t)
        if step is None:
            return []
        committed = self.committed_at(t)
        reported_at = self.time_of(step) if step > self.base else self.t0
        stop_reason = self.reported_stop(t)
        s = self.settings
        out = []
        for local in range(self.local_ranks):
            rank = self.node_rank * self.local_ranks + local
            r = common_pb2.RankProgress(
                rank=rank,
                local_rank=local,
                step=step,
                step_time_s=s.step_s,
                compute_s=0.85 * s.step_s,
                wait_s=0.15 * s.step_s,
                reported_at=reported_at,
                pid=pid,
                world_size=self.nnodes * self.local_ranks,
                loaded_step=self.resume_step,
                stop_reason=stop_reason,
                finished=self.finished,
            )
            if step > self.base:
                r.loss = loss(step, rank)
            if committed is not None:
                r.committed_step = committed
            out.append(r)
        return out

    def with_losses(self, ranks: list[common_pb2.RankProgress]) -> None:
        """Each step's loss since the last write (RankProgress.recent_losses, the newest 64)."""
        if not ranks:
            return
        step = ranks[0].step
        first = max(self.losses_from + 1, self.base + 1)
        steps = range(max(first, step - MAX_RECENT_LOSSES + 1), step + 1)
        dropped = max(0, len(range(first, step + 1)) - len(steps))
        for r in ranks:
            r.recent_losses.extend(common_pb2.StepLoss(step=k, loss=loss(k, r.rank)) for k in steps)
            r.losses_dropped = dropped
        self.losses_from = max(self.losses_from, step)

    def dump(self, local: int, now: float) -> agent_pb2.RankDump:
        """One rank's flight-recorder dump as torch writes it (JSON, ring buffer tail, no pg_config:
        the default group's members are then every rank the controller expects)."""
        rank = self.node_rank * self.local_ranks + local
        if self.exit is not None:
            return agent_pb2.RankDump(rank=rank, ok=False, error=NO_SOCKET)
        step = self.step_at(now)
        assert step is not None
        frozen = self.frozen_at is not None
        if frozen and local == self.culprit and self.culprit_stopped:
            return agent_pb2.RankDump(
                rank=rank, ok=False, error="no dump: its process is stopped", process_state="T"
            )
        # collective k is step k's gradient all-reduce. In a hang every rank but the culprit has
        # enqueued the next one and waits in it; the culprit never called it.
        last = step + 1 if frozen and local != self.culprit else step
        entries = [
            {
                "record_id": seq - 1,
                "pg_id": 0,
                "process_group": ["0", "default_pg"],
                "collective_seq_id": seq,
                "p2p_seq_id": 0,
                "op_id": seq,
                "is_p2p": False,
                "profiling_name": "nccl:all_reduce",
                "input_sizes": [[1048576]],
                "input_dtypes": ["Float"],
                "output_sizes": [[1048576]],
                "output_dtypes": ["Float"],
                "state": "completed" if seq <= step else "scheduled",
                "retired": seq <= step,
                "timeout_ms": 600_000,
                "time_created_ns": int(self.time_of(max(seq - 1, self.base)) * 1e9),
                "frames": [],
            }
            for seq in range(max(1, last - FR_KEPT + 1), last + 1)
        ]
        data = json.dumps({"version": "2.10", "pg_config": {}, "entries": entries}).encode()
        return agent_pb2.RankDump(rank=rank, ok=True, format="json", data=data)

    def worker_status(self) -> agent_pb2.WorkerStatus:
        status = agent_pb2.WorkerStatus(
            run=self.run, attempt=self.attempt, pid=self.pid, running=self.running, started_at=self.started_at
        )
        if self.exit is not None:
            status.exit.CopyFrom(self.exit)
        return status


@dataclass(slots=True)
class PreflightFaults:
    """Injected preflight behaviour: `times` preflights left (-1: every one until cleared)."""

    slow: Latency | None = None
    slow_times: int = 0
    fail_check: str = ""
    fail_times: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class PreflightPlan:
    mode: str
    latency_s: float
    fail_check: str  # "" : every check passes


@dataclass(slots=True, kw_only=True)
class Registration:
    lease_id: int = 0
    ttl_s: float = 0.0
    confirmed_at: float = 0.0  # monotonic: when the last answered keepalive (or the grant) was sent
    registered_at: float = 0.0
    registrations: int = 0


class LightAgent:
    def __init__(
        self,
        node: str,
        *,
        port: int,
        settings: AgentSettings,
        rdzv_port: int = 0,
        host: str = "127.0.0.1",
        pid: int = 0,
    ) -> None:
        self.node = node
        self.port = port
        self.host = host
        self.settings = settings
        self.rdzv_port = rdzv_port or torchrun.pick_rdzv_port()  # as the real agent's start() picks it
        self.pid = pid
        self.rng = random.Random(f"{settings.seed}:{node}")
        self.lease = Registration()
        self.evidence_seq = 0
        self._fresh()

    def _fresh(self) -> None:
        """The state an agent starts with (and a restarted one starts again with)."""
        self.dark = False  # lease-loss fault: the host is gone (no keepalive, no write, no RPC)
        self.drain_reason = ""
        self.unhealthy = False
        self.unhealthy_because = ""
        self.preflight_running = False
        self.last_preflight: common_pb2.PreflightSummary | None = None
        self.evidence: collections.deque[common_pb2.Evidence] = collections.deque(maxlen=50)
        self.attempts: dict[str, Attempt] = {}  # run -> its newest attempt here
        self.fences: dict[str, int] = {}
        self.latest: dict[str, int] = {}  # run -> the newest attempt a launch was accepted for
        self.stops: dict[str, StopState] = {}
        self.progress_interval: dict[str, float] = {}  # run -> the policy's agent_progress_interval_s
        self.faults = PreflightFaults()
        self.record_dirty = False  # the node record changed since its last put

    # --- the node record -------------------------------------------------------------------------

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def lease_held(self) -> bool:
        return self.lease.lease_id != 0 and not self.dark

    def node_state(self) -> common_pb2.NodeState.ValueType:
        if self.unhealthy:
            return common_pb2.NODE_STATE_UNHEALTHY
        if self.drain_reason:
            return common_pb2.NODE_STATE_DRAINING
        if self.preflight_running:
            return common_pb2.NODE_STATE_PREFLIGHT
        if any(a.running for a in self.attempts.values()):
            return common_pb2.NODE_STATE_RUNNING
        return common_pb2.NODE_STATE_READY

    def node_record(self) -> store_pb2.NodeRecord:
        """The record as nodeagent.daemon.agent.Agent.node_record makes it, under the current lease
        (registered_at is the caller's: only a registration sets it, as liveness.Registration does)."""
        record = store_pb2.NodeRecord(
            node=self.node,
            host=socket.gethostname(),
            address=self.address,
            gpu_count=0,
            agent_version=runwarden.__version__,
            state=self.node_state(),
            local_ranks=self.settings.local_ranks,
            rdzv_port=self.rdzv_port,
            torch_host=torchrun.torch_host(self.host),
            drain_reason=self.drain_reason,
            lease_id=self.lease.lease_id,
        )
        if self.last_preflight is not None:
            record.last_preflight.CopyFrom(self.last_preflight)
        return record

    def state_changed(self) -> None:
        self.record_dirty = True

    # --- lease -------------------------------------------------------------------------------

    def registered(self, lease_id: int, ttl_s: float, now: float, mono: float) -> None:
        self.lease = Registration(
            lease_id=lease_id,
            ttl_s=ttl_s,
            confirmed_at=mono,
            registered_at=now,
            registrations=self.lease.registrations + 1,
        )

    def lease_lost(self, now: float) -> None:
        """etcd said the lease is gone (not a fault): the real agent self-fences -- its workers stop
        (TERM; torchrun exits 1) -- and registers again under a new lease."""
        self.lease.lease_id = 0
        for a in self.attempts.values():
            a.end(now, exit_status(now, code=1))

    def go_dark(self, now: float) -> None:
        """lease-loss fault: the host vanishes. Its ranks stop with it and nothing reaches etcd again."""
        self.dark = True
        for a in self.attempts.values():
            if a.running:
                a.end(now, exit_status(now, signal=9))
                a.exit_written = True  # a dead host writes no exit

    def come_back(self) -> None:
        """The host's agent restarted: a fresh agent on the same node and port, not yet registered."""
        self.lease = Registration(registrations=self.lease.registrations)
        self._fresh()

    # --- preflight -----------------------------------------------------------------------------

    def begin_preflight(self, mode: str) -> PreflightPlan:
        if self.preflight_running:
            raise Refused("ABORTED", "a preflight is already running on this node")
        f = self.faults
        latency = self.settings.preflight
        if f.slow is not None and f.slow_times:
            latency = f.slow
            f.slow_times -= 1 if f.slow_times > 0 else 0
        fail = ""
        if f.fail_check and f.fail_times:
            fail = f.fail_check
            f.fail_times -= 1 if f.fail_times > 0 else 0
        self.preflight_running = True
        self.state_changed()
        return PreflightPlan(mode=mode, latency_s=latency.sample(self.rng), fail_check=fail)

    def finish_preflight(
        self, plan: PreflightPlan, duration_s: float, now: float
    ) -> tuple[list[common_pb2.CheckResult], common_pb2.PreflightSummary, common_pb2.Evidence | None]:
        """The results streamed, the summary (kept as the last preflight) and the evidence a failure
        publishes, as nodeagent.daemon.preflight_bridge does."""
        results = [
            common_pb2.CheckResult(
                name="lightfleet.simulated",
                status=common_pb2.CHECK_STATUS_PASS,
                duration_s=duration_s,
                message="light agent: no real check ran (lightfleet)",
            )
        ]
        if plan.fail_check:
            results.append(
                common_pb2.CheckResult(
                    name=plan.fail_check,
                    status=common_pb2.CHECK_STATUS_FAIL,
                    duration_s=duration_s,
                    message="injected by lightfleet (fail-preflight)",
                    remedy="clear the fault: `clear NODE` on the fleet's control channel",
                )
            )
        if self.unhealthy:
            results.append(
                common_pb2.CheckResult(
                    name="agent.fatal_evidence",
                    status=common_pb2.CHECK_STATUS_FAIL,
                    message=f"this agent holds fatal evidence ({self.unhealthy_because}) and launches nothing",
                    remedy="restart the node agent once the host is repaired (a repair is a reboot or an agent restart)",
                )
            )
        summary = summarize(plan.mode, results, duration_s)
        self.end_preflight(summary)
        evidence = None
        if summary.fail_count:
            evidence = self.new_evidence(
                common_pb2.Evidence(
                    kind=common_pb2.EVIDENCE_KIND_PREFLIGHT_FAIL,
                    severity=common_pb2.SEVERITY_WARNING,
                    detail=f"preflight {plan.mode} failed: {', '.join(summary.failed_checks)}"[:500],
                    source="preflight",
                ),
                now,
            )
        return results, summary, evidence

    def end_preflight(self, summary: common_pb2.PreflightSummary | None = None) -> None:
        if summary is not None:
            self.last_preflight = summary
        self.preflight_running = False
        self.state_changed()

    # --- evidence ----------------------------------------------------------------------------

    def new_evidence(self, evidence: common_pb2.Evidence, now: float) -> common_pb2.Evidence:
        """Number a piece of evidence (`evidence_seq`: its key) and apply it: fatal evidence makes the
        node unhealthy (no launch until its agent restarts), as the real agent's listener does."""
        evidence.node = evidence.node or self.node
        evidence.observed_at = evidence.observed_at or now
        self.evidence_seq = max(self.evidence_seq + 1, int(now * 1e6))  # the real seq: wall-clock µs
        self.evidence.append(evidence)
        if is_fatal(evidence) and not self.unhealthy:
            self.unhealthy = True
            self.unhealthy_because = evidence.detail[:300] or common_pb2.EvidenceKind.Name(evidence.kind)
            self.state_changed()
        return evidence

    def xid(self, code: int, gpu: int, now: float) -> common_pb2.Evidence:
        """An Xid line through the real parser, as the agent's kernel-log monitor publishes it."""
        line = f"NVRM: Xid (PCI:0000:{0x18 + gpu:02x}:00): {code}, pid=<unknown>, name=<unknown>, lightfleet"
        event = parse_xid_line(line)
        if event is None:
            raise ValueError(f"Xid {code}: not an Xid line the parser reads")
        return self.new_evidence(
            xid_evidence(event, node=self.node, observed_at=now, source="chaos", gpu_index=gpu), now
        )

    # --- launch and stop -----------------------------------------------------------------------

    def check_launch(self, request: agent_pb2.LaunchWorkersRequest) -> None:
        """What nodeagent.daemon.agent.Agent.launch_workers refuses before anything starts (a
        validated request); then the run's fence and attempt are recorded and its stop cleared."""
        run = request.run
        if not self.lease_held:
            raise Refused(
                "FAILED_PRECONDITION",
                f"node {self.node} holds no lease (etcd unreachable or self-fenced): nothing is launched",
            )
        if self.drain_reason:
            raise Refused("FAILED_PRECONDITION", f"node {self.node} is draining: {self.drain_reason}")
        rendezvous_id = request.rendezvous_id or f"{run}-{request.attempt}"
        if request.HasField("torchrun"):
            facts = torchrun.NodeFacts(
                torchrun=("python", "-m", "torch.distributed.run"),
                local_ranks=self.settings.local_ranks,
                torch_host=torchrun.torch_host(self.host),
                rdzv_port=self.rdzv_port,
                collective_ifname="",
            )
            try:
                torchrun.build(facts, request, rendezvous_id)
            except torchrun.TorchrunRefused as exc:
                raise Refused("FAILED_PRECONDITION", str(exc)) from None
            if request.torchrun.no_python:
                raise Refused(
                    "PERMISSION_DENIED",
                    f"torchrun.command: argv[0]: {request.torchrun.command[0]!r} is not in the agent's "
                    "allowed_executables (a light agent runs no command)",
                )
        self.check_fence(request)
        current = self.attempts.get(run)
        if current is not None and current.running:
            raise Refused("ALREADY_EXISTS", f"run {run!r} already has running workers here")
        self.fences[run] = request.leader_fence
        self.latest[run] = request.attempt
        self.stops.pop(run, None)
        if self.unhealthy:  # checked by Agent.launch after the fence is recorded
            raise Refused(
                "FAILED_PRECONDITION",
                f"node {self.node} is unhealthy (fatal evidence, see GetNodeStatus): nothing is launched",
            )

    def check_fence(self, request: agent_pb2.LaunchWorkersRequest) -> None:
        """A stale leader's launch, or an attempt older than one launched: refused (Agent._check_fence)."""
        run = request.run
        if request.leader_fence < self.fences.get(run, 0):
            raise Refused(
                "FAILED_PRECONDITION",
                f"leader_fence {request.leader_fence} is older than {self.fences[run]}: stale leader",
            )
        if request.attempt < self.latest.get(run, 0):
            raise Refused(
                "FAILED_PRECONDITION",
                f"attempt {request.attempt} is older than attempt {self.latest[run]} already launched",
            )

    def older_than(self, run: str, attempt: int) -> list[Attempt]:
        """The run's running attempt here if it is older than `attempt` (what a launch's stop_older stops)."""
        current = self.attempts.get(run)
        return [current] if current is not None and current.running and current.attempt < attempt else []

    def start_attempt(
        self, request: agent_pb2.LaunchWorkersRequest, now: float, record: store_pb2.AttemptRecord | None
    ) -> Attempt:
        """The launch goes on (after its latency): the ranks start. `record`: the run's attempt record
        (its launched_at sets the step clock every node shares; None: this node's own clock)."""
        run = request.run
        if request.attempt < self.latest.get(run, 0):
            raise Refused(
                "FAILED_PRECONDITION",
                f"attempt {request.attempt} was superseded by attempt {self.latest[run]} while it waited",
            )
        current = self.attempts.get(run)
        if current is not None and current.running:
            raise Refused("ALREADY_EXISTS", f"run {run!r} already has running workers here")
        shared = record is not None and record.attempt == request.attempt and record.launched_at > 0
        origin = record.launched_at if shared and record is not None else now
        attempt = Attempt(
            run=run,
            attempt=request.attempt,
            rendezvous_id=request.rendezvous_id or f"{run}-{request.attempt}",
            node_rank=request.node_rank,
            nnodes=max(1, request.nnodes),
            resume_step=request.resume_step,
            local_ranks=self.settings.local_ranks,
            settings=self.settings,
            started_at=now,
            launched_at=request.launched_at,
            t0=origin + self.settings.startup_s,
            nodes=tuple(record.nodes) if shared and record is not None else (),
            pid=self.pid,
        )
        self.attempts[run] = attempt
        self.state_changed()
        return attempt

    def stoppable(self, run: str, attempt: int) -> list[Attempt]:
        """StopWorkers' targets; NOT_FOUND when the run never had workers here (the real servicer's rule)."""
        current = self.attempts.get(run)
        if current is None:
            raise Refused("NOT_FOUND", f"run {run!r} has no workers on this node")
        return [current] if current.running and attempt in (0, current.attempt) else []

    def stop_delay(self, targets: list[Attempt], grace_s: float, park_s: float = 0.0) -> float:
        """How long the stop takes: warm ranks asked to park (`park_s` > 0) leave within the stop
        latency, hung or not; otherwise a hung attempt's ranks cannot act on TERM, so they are KILLed
        after the grace, and healthy ranks finish their step and exit within the stop latency."""
        if not targets:
            return 0.0
        if self.parks(grace_s, park_s):
            return min(self.settings.stop.sample(self.rng), park_s)
        if grace_s == 0 or any(a.frozen_at is not None for a in targets):
            return grace_s
        return min(self.settings.stop.sample(self.rng), grace_s)

    def parks(self, grace_s: float, park_s: float) -> bool:
        """Whether a stop parks the ranks (warm, asked to park, and not a KILL at once)."""
        return self.settings.warm and park_s > 0 and grace_s > 0

    def finish_stop(
        self, targets: list[Attempt], grace_s: float, now: float, park_s: float = 0.0
    ) -> list[agent_pb2.WorkerStatus]:
        """The stopped attempts end: parked (warm: the ranks left their collectives, exit 1), KILLed
        (a hang, no grace) or TERMed (torchrun exits 1; the ranks report the SIGTERM as their stop
        reason, so the exit carries it as planned_stop)."""
        for a in targets:
            if self.parks(grace_s, park_s):
                a.end(now, exit_status(now, code=1))
            elif grace_s == 0 or a.frozen_at is not None:
                a.end(now, exit_status(now, signal=9))
            else:
                a.stop_reason = a.stop_reason or "SIGTERM"
                a.end(now, exit_status(now, code=1), planned=a.stop_reason)
        self.state_changed()
        return [a.worker_status() for a in targets]

    def knows_run(self, run: str) -> bool:
        return run in self.attempts or run in self.stops

    def request_stop(self, run: str, reason: str, now: float) -> None:
        """RequestStop or the run's stop key: the flag the ranks see at the end of their step."""
        if run not in self.stops:
            self.stops[run] = StopState(reason=reason, requested_at=now)
        a = self.attempts.get(run)
        if a is not None and a.running:
            a.request_stop(self.stops[run].reason, now)

    def stop_key(self, run: str, value: store_pb2.StopRequest | None, now: float) -> None:
        """The run's stop key changed (nodeagent.daemon.agent.Agent._apply_stop_key's rule)."""
        if value is None:
            self.stops.pop(run, None)
            return
        a = self.attempts.get(run)
        if a is not None and value.relaunch and 0 < value.requested_at < a.launched_at:
            return  # the relaunching stop this launch follows (both stamps the controller's clock)
        if run not in self.stops:
            self.request_stop(run, value.reason or "stop requested", now)

    # --- faults --------------------------------------------------------------------------------

    def running(self) -> list[Attempt]:
        return [a for a in self.attempts.values() if a.running]

    def crash(self, now: float, *, code: int | None, signal: int | None) -> list[Attempt]:
        """A rank died: torchrun tears the group down and exits (1 by default), as the reaper records it."""
        out = self.running()
        for a in out:
            a.end(now, exit_status(now, code=code, signal=signal))
        if out:
            self.state_changed()
        return out

    def hang(self, node: str, *, culprit: int | None, at: float, stopped: bool = False) -> list[Attempt]:
        """A rank of `node` stops at wall time `at`: every node of its attempt stops at the same step
        (their ranks wait in the collective it never joins). culprit None: `node`'s ranks are gone
        (a crash, a dead host) and its peers are left waiting the same way. Returns the attempts
        frozen here."""
        out = []
        for a in self.running():
            if node != self.node and node not in a.nodes:
                continue
            if a.frozen_at is None:
                step = a.step_at(at)
                a.frozen_at = a.base if step is None else step
            if node == self.node and culprit is not None:
                a.culprit, a.culprit_stopped = culprit, stopped
            out.append(a)
        return out

    # --- progress ------------------------------------------------------------------------------

    def interval(self, run: str) -> float:
        return self.progress_interval.get(run) or self.settings.progress_interval_s

    def progress_due(self, now: float) -> list[store_pb2.NodeProgress]:
        """The progress writes due now, one per run (the real agent's flush): once per interval while
        the ranks advance, at once for an exit, the first report after the load, the first step after
        it, a new commit and a stop reason. Marked written; `progress_failed` undoes that. Cheap when
        nothing is due: the ranks are only built for a write."""
        out = []
        for a in self.attempts.values():
            a.advance(now)
            if a.exit_written:
                continue
            at = now if a.exit is None else min(now, a.exit.ended_at or now)
            step = a.step_at(at)
            if step is None and a.exit is None:
                continue
            commit = a.committed_at(at) if step is not None else None
            stop = a.reported_stop(at) if step is not None else ""
            urgent = (
                a.exit is not None
                or not a.loaded_written
                or (not a.first_step_written and step is not None and step > a.base)
                or commit != a.written_commit
                or stop != a.written_stop
            )
            if not urgent and (step == a.written_step or now < a.next_write_at):
                continue
            ranks = a.ranks(at, self.pid) if step is not None else []
            a.with_losses(ranks)
            message = store_pb2.NodeProgress(
                node=self.node, run=a.run, attempt=a.attempt, ranks=ranks, written_at=now, exit=a.exit
            )
            a.written_step = a.written_step if step is None else step
            a.written_commit, a.written_stop = commit, stop
            a.loaded_written = True
            a.first_step_written = a.first_step_written or (step is not None and step > a.base)
            a.exit_written = a.exit is not None
            a.next_write_at = now + self.interval(a.run)
            out.append(message)
        return out

    def progress_failed(self, message: store_pb2.NodeProgress) -> None:
        """A put failed: written again next time (a failed write's losses are lost, as the real agent's are)."""
        a = self.attempts.get(message.run)
        if a is not None and a.attempt == message.attempt:
            a.written_step = -2
            a.next_write_at = 0.0
            if message.HasField("exit"):
                a.exit_written = False

    # --- status and dumps ------------------------------------------------------------------------

    def status(self, now: float, mono: float) -> agent_pb2.GetNodeStatusResponse:
        held = self.lease_held
        response = agent_pb2.GetNodeStatusResponse(
            node=self.node,
            state=self.node_state(),
            lease_held=held,
            last_heartbeat_age_s=mono - self.lease.confirmed_at if held else -1.0,
            recent_evidence=list(self.evidence),
            agent_version=runwarden.__version__,
        )
        if self.last_preflight is not None:
            response.last_preflight.CopyFrom(self.last_preflight)
        for a in self.attempts.values():
            response.ranks.extend(a.ranks(min(now, a.exit.ended_at) if a.exit else now, self.pid))
            response.workers.append(a.worker_status())
        return response

    def dumps(self, run: str, now: float) -> agent_pb2.CollectFlightRecorderResponse:
        """CollectFlightRecorder: one dump per rank of the run's attempt that has reported (ranks that
        never reported opened no socket the real agent could find)."""
        response = agent_pb2.CollectFlightRecorderResponse(node=self.node)
        a = self.attempts.get(run)
        if a is None or a.step_at(min(now, a.exit.ended_at) if a.exit else now) is None:
            return response
        response.dumps.extend(a.dump(local, now) for local in range(a.local_ranks))
        return response

    def drain(self, reason: str) -> None:
        reason = reason or "drain requested (no reason given)"
        if reason != self.drain_reason:
            self.drain_reason = reason
            self.state_changed()

    def undrain(self) -> None:
        if self.drain_reason:
            self.drain_reason = ""
            self.state_changed()
