"""The simulator's world: a seeded discrete-event loop around the real supervisor core
(`controller.supervisor.machine.Supervisor`). The world owns what the core cannot see (the job's
progress, checkpoints, the faults drawn once per seed, signal latencies, action durations); the
core owns every decision. `simulate(scenario, policy, draws)` returns a `SimResult`: the event log
the core wrote, in the live controller's format, and the harm it did. Called by
`controller.sim.report` and `controllerctl simulate`.
"""

from __future__ import annotations

import heapq
import random
import signal as signal_mod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, assert_never

from controller.sim.draws import Draws, Fault
from controller.sim.scenario import Cause, Costs, Policy, Scenario
from controller.supervisor.actions import (
    Action,
    AllocateFromQueue,
    CollectDumps,
    Launch,
    MeasureBandwidth,
    Page,
    PersistCheckpoint,
    PersistMemory,
    PersistNode,
    Quarantine,
    Release,
    RunPreflight,
    SetTimer,
    StopAttempt,
    TakeSpare,
)
from controller.supervisor.blame import FlightRecorderVerdict, Suspect
from controller.supervisor.events import (
    AttemptExited,
    BandwidthMeasured,
    CheckpointCommitted,
    ControlPlaneLost,
    ControlPlaneRestored,
    DumpsCollected,
    Event,
    EvidenceObserved,
    NodeJoined,
    NodeLost,
    OperatorRelease,
    PreflightResult,
    ProgressObserved,
    RankSample,
    StopRequested,
    StoreListed,
    Tick,
)
from controller.supervisor.machine import RunState, Supervisor
from controller.supervisor.policy import RunPlan
from controller.supervisor.pool import NodeRecordView, PoolState
from controller.supervisor.states import TransitionError
from controller.supervisor.timers import Timers
from runwarden.eventlog import LogEntry
from runwarden.v1 import common_pb2, events_pb2

E = events_pb2
_ENDED = (RunState.CRASH_LOOP, RunState.BUDGET_EXHAUSTED, RunState.STOPPED, RunState.COMPLETED)
_CONTROL_PLANE_EVENTS = (Tick, ControlPlaneLost, ControlPlaneRestored, StoreListed)
_EVIDENCE_KIND = {
    "xid": common_pb2.EVIDENCE_KIND_XID,
    "ecc": common_pb2.EVIDENCE_KIND_ECC_UNCORRECTABLE,
    "row_remap": common_pb2.EVIDENCE_KIND_ROW_REMAP_FAILURE,
    "gpu_lost": common_pb2.EVIDENCE_KIND_GPU_LOST,
    "network": common_pb2.EVIDENCE_KIND_NETWORK,
}


@dataclass(slots=True)
class SimNode:
    name: str
    broken: int | None = None  # cause index while broken
    repaired_at: float = 0.0  # when a broken node's repair is done (set when it is taken out)
    alive: bool = True


@dataclass(slots=True)
class Interruption:
    """One fault the world injected, and what it did."""

    t: float
    cause: str
    node: str
    outcome: str  # "interrupted" | "refail" | "absorbed" | "broke_idle_node" | "node_down"


@dataclass(slots=True, kw_only=True)
class Quarantined:
    """One quarantine the core ordered, and what the world knew about the node."""

    t: float  # seconds since the run's start
    node: str
    healthy: bool  # no hardware fault on the node: whatever it was blamed for was not its own
    fault: str  # the last fault the world injected before it: a cause name, "planned", "none"
    fault_kind: str  # "hardware" | "software" | "fixed_step" | "control_plane" | "planned" | "none"
    held: bool
    reason: str
    bug: int = 0  # the fixed-step bug (FixedStepBug.id) whose hit it followed; 0: none
    out_s: float = 0.0  # how long it stayed out of service (until back in the pool, or the window's end)


@dataclass(slots=True, kw_only=True)
class Released:
    t: float
    node: str
    reason: str


@dataclass(slots=True)
class FixedStepBug:
    """A software/data bug at a fixed step: recurs at `step` on every attempt, on another node."""

    id: int  # 1, 2, ... in the order they appeared
    cause: Cause
    step: int  # the attempt fails while computing the step after this one
    fix_at: float  # world seconds: the job is fixed then
    culprits: list[str]


@dataclass(slots=True)
class SimResult:
    policy: str
    seed: int
    events: list[LogEntry]
    interruptions: list[Interruption]
    start_ts: float
    end_ts: float
    handle_calls: int
    final_state: str
    planned_stops: int
    quarantines: list[Quarantined] = field(default_factory=list)
    releases: list[Released] = field(default_factory=list)
    run_restarts: int = 0  # times the operator started the run again after the core ended it
    pages: list[str] = field(default_factory=list)


class World:
    """One policy on one seed's draws. `run()` returns the result; the object is single-use.

    Each `handle` call returns a `Batch`: its entries are appended to the event log first, then its
    actions are executed with the scenario's latencies. `SetTimer` follows
    `controller.supervisor.timers.Timers`; the world's heap only delivers (a replaced timer's entry is stale).

    What is summarised, and why it does not change the answer:

    * Progress. Every node reports one `ProgressObserved` at the first step of an attempt and at each
      fault instant and planned stop (the last good observation before it; without it at a planned
      stop the core would see healthy hosts that last advanced hours ago and preflight them all), not
      every step. The core's timers that fall due while the job is healthy are delivered late, right
      after the next such round (the timer contract allows late ticks), so a hang is detected exactly
      one hang timeout after the fault and a healthy run is never declared hung. Two exceptions: the
      spares' background sweep (`spare_check`) is delivered on time, after a round of its own (its
      tick reads every node's progress), so a replacement is vouched for as the live controller's
      would be; and while a straggler runs, the world sends `straggler_window` + 2 rounds one step
      apart in which its rank computes longer and waits less, so the core's detector sees it.
    * Ranks. Each node reports one rank sample (`local_ranks=1`): the core's decisions are per node.
    * Stop exits are delivered in reverse node order: the core checks "all exited" on each exit and
      stops at the first live node, so a 2,048-node stop stays linear.

    A fault drawn while the job is not training hits the node in its slot: a hardware fault leaves it
    broken, a node-loss fault takes the host down, a software fault is counted as absorbed.

    Software bugs at a fixed step (`Cause.fixed_step`): the first hit arms a bug at the job's step;
    every later attempt that reaches it fails there, each time on another node, until the job is fixed
    `fix_hours` after the first hit; the fix reaches a running attempt as a planned stop and relaunch.
    If the core ends the run meanwhile, the operator fixes the job and starts the run again: a fresh
    core given the store's state in a `StoreListed`, as `controller run` does. A control-plane blip is
    `ControlPlaneLost`, `ControlPlaneRestored`, then a relisting `StoreListed`.

    Harm is recorded as it happens: every `Quarantine` with whether the node was healthy and the last
    fault injected before it (`SimResult.quarantines`), and every `Release` (`SimResult.releases`).
    """

    def __init__(self, scenario: Scenario, policy: Policy, draws: Draws, *, keep_log: bool = True) -> None:
        self.sc = scenario
        self.pol = policy
        self.costs: Costs = policy.effective_costs(scenario.costs)
        self.det = scenario.detection
        self.draws = draws
        self.step_time = scenario.run.step_time_s
        self.t0 = scenario.run.start_ts
        self.horizon = scenario.run.duration_s
        self.rng = random.Random(f"{draws.seed}:{policy.name}:world")
        startup = self.costs.launch_s + self.costs.load_s + self.costs.first_step_s
        if policy.supervisor.startup_timeout_s <= startup:
            raise ValueError(
                f"policy {policy.name}: supervisor.startup_timeout_s "
                f"({policy.supervisor.startup_timeout_s:g}s) must exceed launch + load + first step "
                f"({startup:g}s), or every launch is declared hung"
            )
        self.core = Supervisor(policy.supervisor, RunPlan(run=scenario.run.name, nodes=scenario.run.nodes))
        self.heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self.seq = 0
        self.now = 0.0
        self.events: list[LogEntry] = []
        self.nodes: dict[str, SimNode] = {}
        self.queue_serial = 0
        self.handle_calls = 0
        self.interruptions: list[Interruption] = []
        self.planned_stops = 0
        # the attempt as the world sees it
        self.attempt = 0
        self.attempt_nodes: list[str] = []
        self.resume_step = -1
        self.training = False  # making progress right now
        self.epoch = 0  # bumped whenever training stops: cancels its scheduled events
        self.train_base_step = 0  # step at the start of the current training stretch
        self.train_since = 0.0  # when the current training stretch (after a stall) began
        self.in_save = False
        self.fault_open = False  # a fault hit the current attempt and the core has not stopped it
        self.culprit: str | None = None
        self.culprit_cause: Cause | None = None
        self.culprit_u = 0.0
        self.tick_owed = False
        self.timers = Timers()
        self.ready_at = 0.0  # spares taken: preflight cannot finish before they arrive
        self.keep_log = keep_log
        # harm, software bugs at a fixed step, a fresh core after the operator's fix
        self.quarantines: list[Quarantined] = []
        self.releases: list[Released] = []
        self.pages: list[str] = []
        self.last_fault = "none"
        self.last_fault_kind = "none"
        self.bug: FixedStepBug | None = None
        self.bugs = 0
        self.records: dict[str, NodeRecordView] = {}  # the store: each node's last persisted record
        self.memory: Any = None  # the store: the supervisor memory last persisted (PersistMemory)
        self.generation = 0  # bumped with each fresh core: late answers to an older core are dropped
        self.restart_at: float | None = None
        self.run_restarts = 0
        self.out: dict[str, Quarantined] = {}  # quarantined and not back in the pool yet
        self.blind = False  # a control-plane blip: what the store sees now reaches the core after it
        self.missed: list[Event] = []

    # --- plumbing ---------------------------------------------------------------------------------

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, fn, args))

    def feed(self, event: Event) -> None:
        if self.blind and not isinstance(event, _CONTROL_PLANE_EVENTS):
            self.missed.append(event)  # the watch resumes from its revision: delivered after the blip
            return
        self.handle_calls += 1
        if self.core.state in _ENDED:
            try:  # the run is over until the operator starts it again: what still arrives is dropped
                batch = self.core.handle(event, self.t0 + self.now)
            except TransitionError:
                return
        else:
            batch = self.core.handle(event, self.t0 + self.now)
        for entry in batch.entries:  # the log first, then the actions (actions.py's order of obligations)
            self.log(entry)
        for act in batch.actions:
            self.execute(act)

    def log(self, ev: LogEntry) -> None:
        ev.seq = len(self.events) + 1
        self.events.append(ev)

    def step_now(self) -> int:
        if not self.training:
            return self.train_base_step
        return self.train_base_step + max(0, int((self.now - self.train_since) / self.step_time))

    # --- the run ------------------------------------------------------------------------------

    def run(self) -> SimResult:
        spares = self.pol.spare_count(self.sc.run)
        for i in range(self.sc.run.nodes + spares):
            name = f"n{i:05d}"
            self.nodes[name] = SimNode(name=name)
        for f in self.draws.faults:
            self.at(f.t, self._fault, f)
        for tp in self.draws.planned:
            self.at(tp, self._planned_stop)
        for name in self.nodes:
            self.feed(NodeJoined(node=name, local_ranks=1))
        while self.heap:
            t, _, fn, args = heapq.heappop(self.heap)
            if t > self.horizon:
                break
            self.now = t
            fn(*args)
            if self.core.state in _ENDED and not self._restart_after_fix():
                break
        end = min(self.now, self.horizon) if self.core.state in _ENDED else self.horizon
        for name in list(self.out):
            q = self.out.pop(name)
            q.out_s = max(0.0, end - q.t)
        return SimResult(
            policy=self.pol.name,
            seed=self.draws.seed,
            events=self.events,
            interruptions=self.interruptions,
            start_ts=self.t0,
            end_ts=self.t0 + self.horizon,
            handle_calls=self.handle_calls,
            final_state=self.core.state.value,
            planned_stops=self.planned_stops,
            quarantines=self.quarantines,
            releases=self.releases,
            run_restarts=self.run_restarts,
            pages=self.pages,
        )

    # --- actions ------------------------------------------------------------------------------

    def execute(self, act: Action) -> None:
        match act:
            case SetTimer():
                if self.timers.set(act.key, act.at):  # a new deadline: one heap entry to deliver it
                    self.at(max(act.at - self.t0, self.now), self._timer, act.key, act.at)
            case RunPreflight():
                self._preflight(act)
            case Launch():
                self._launch(act)
            case StopAttempt():
                self._stop(act)
            case CollectDumps():
                self.at(self.now + self.det.dumps_s, self._dumps, act.attempt, self.generation)
            case Quarantine():
                node = self.nodes.get(act.node)
                q = Quarantined(
                    t=self.now,
                    node=act.node,
                    healthy=node is None or node.broken is None,
                    fault=self.last_fault,
                    fault_kind=self.last_fault_kind,
                    held=act.held,
                    reason=act.reason,
                    bug=self.bug.id if self.bug is not None and self.last_fault_kind == "fixed_step" else 0,
                )
                self.quarantines.append(q)
                self.out.setdefault(act.node, q)
                if node is not None and node.broken is not None and node.repaired_at <= self.now:
                    repair = self.sc.causes[node.broken].repair_hours
                    node.repaired_at = self.now + 3600.0 * (
                        repair if repair is not None else self.costs.repair_hours
                    )
                if act.held and node is not None:
                    # A held node (fatal evidence: needs repair; or a repeat offender) goes to the
                    # repair crew, who mark it repaired (the operator release) when the repair is done.
                    done = (
                        node.repaired_at
                        if node.repaired_at > self.now
                        else self.now + 3600.0 * (self.costs.repair_hours)
                    )
                    self.at(done, self._repaired, act.node)
            case TakeSpare():
                self.ready_at = max(self.ready_at, self.now + self.costs.allocate_spare_s)
            case AllocateFromQueue():
                for _ in range(act.count):
                    self.queue_serial += 1
                    name = f"q{self.queue_serial:05d}"
                    self.at(self.now + self.costs.allocate_queue_s, self._joined, name)
            case MeasureBandwidth():
                # The simulated fabric has no slow links: every node measures the same.
                self.feed(
                    BandwidthMeasured(
                        nodes=act.nodes, set_gbps=1.0, per_node_gbps=tuple((n, 1.0) for n in act.nodes)
                    )
                )
            case Release():
                self.releases.append(Released(t=self.now, node=act.node, reason=act.reason))
                self._back_in_service(act.node)
            case Page():
                self.pages.append(act.reason)
            case PersistNode():
                self.records[act.record.node] = act.record
            case PersistMemory():
                self.memory = act.record
            case PersistCheckpoint():
                pass  # nothing to do in the world (the core logged it)
            case _:
                assert_never(act)

    def _back_in_service(self, name: str) -> None:
        q = self.out.pop(name, None)
        if q is not None:
            q.out_s = self.now - q.t

    def _joined(self, name: str) -> None:
        node = self.nodes.setdefault(name, SimNode(name=name))
        node.alive = True
        if node.broken is not None and node.repaired_at and self.now >= node.repaired_at:
            node.broken = None  # back from repair
        self.feed(NodeJoined(node=name, local_ranks=1))

    def _repaired(self, name: str) -> None:
        node = self.nodes[name]
        if node.broken is not None and node.repaired_at and self.now >= node.repaired_at:
            node.broken = None
        self.feed(OperatorRelease(node=name, reason="sim: repaired"))

    def _timer(self, key: str, at: float) -> None:
        if not self.timers.is_current(key, at):
            return  # a stale heap entry: replaced by a later SetTimer with the same key
        self.timers.pop(key)
        if self.training and not self.fault_open:
            self.tick_owed = True  # healthy: the tick is delivered late, after the next progress round
            if key == "spare_check":  # ... but the spares' sweep on time, as the live controller's
                self._progress_round()
            return
        self.feed(Tick())

    def _preflight(self, act: RunPreflight) -> None:
        if act.purpose == "burn_in":
            for name in act.nodes:
                node = self.nodes[name]
                done = max(self.now, node.repaired_at) + self.costs.burn_in_s / max(
                    1, self.pol.supervisor.burn_in_passes
                )
                self.at(done, self._preflight_results, ((name, True),), self.generation)
            return
        start = max(self.now, self.ready_at)
        done = start + (self.costs.preflight_s if self.pol.preflight else 0.0)
        results = []
        for name in act.nodes:
            node = self.nodes[name]
            passed = True
            if self.pol.preflight and node.broken is not None:
                passed = self.rng.random() >= self.sc.causes[node.broken].preflight_catch
            results.append((name, passed))
        self.at(done, self._preflight_results, tuple(results), self.generation)

    def _preflight_results(self, results: tuple[tuple[str, bool], ...], generation: int) -> None:
        # All nodes of one RunPreflight finish together (they run in parallel): one heap entry.
        if generation != self.generation:
            return  # asked by a core the operator replaced: the fresh one asks again
        for name, passed in results:
            node = self.nodes[name]
            if passed and node.broken is not None and node.repaired_at and self.now >= node.repaired_at:
                node.broken = None  # burn-in after repair
            failed = () if passed else ("sim.broken_node",)
            self.feed(PreflightResult(node=name, passed=passed, failed_checks=failed))
            if passed and name in self.out and self.core.pool.get(name).state is PoolState.SPARE:
                self._back_in_service(name)  # its burn-in passed

    def _launch(self, act: Launch) -> None:
        self.attempt = act.attempt
        self.attempt_nodes = [nr.node for nr in act.nodes]
        self.resume_step = act.resume_step
        self.training = False
        self.fault_open = False
        self.culprit = None
        self.epoch += 1
        c = self.costs
        self.at(self.now + c.launch_s + c.load_s, self._load_done, act.attempt, self.epoch)
        self.at(self.now + c.launch_s + c.load_s + c.first_step_s, self._first_step, act.attempt, self.epoch)

    def _load_done(self, attempt: int, epoch: int) -> None:
        if epoch != self.epoch or self.fault_open:
            return
        # Live, the core logs LOAD_DONE once every node has sent its ranks' load mark (`loaded_step`).
        # Here that would be one more ProgressObserved per node per restart (2,048 calls) to learn a
        # time the scenario already fixes, so the world logs it at the modelled moment instead.
        self.log(
            E.Event(
                ts=self.t0 + self.now,
                run=self.sc.run.name,
                attempt=attempt,
                step=self.resume_step,
                kind=E.EVENT_KIND_LOAD_DONE,
                message=f"attempt {attempt} loaded step {self.resume_step}",
            )
        )

    def _first_step(self, attempt: int, epoch: int) -> None:
        if epoch != self.epoch or self.fault_open:
            return
        self.training = True
        bug = self.bug
        if bug is not None and self.now < bug.fix_at and self.resume_step == bug.step:
            # Resumed from the commit right before the bug: the first step itself fails.
            self.train_base_step, self.train_since = max(self.resume_step, 0), self.now
            self._bug_hit(bug)
            return
        self.train_base_step = max(self.resume_step, 0) + 1
        self.train_since = self.now
        self._progress_round()
        self._schedule_checkpoint()
        for name in self.attempt_nodes:
            node = self.nodes[name]
            if node.broken is not None:  # put back into a run while broken: it fails again soon
                cause = self.sc.causes[node.broken]
                if cause.symptom == "straggler":
                    self.at(self.now + self.step_time, self._straggle, name, self.epoch, 0)
                    continue
                self.at(
                    self.now + self.rng.random() * self.det.refail_s, self._refail, name, self.epoch, cause
                )
                break
        self._schedule_bug()

    def _progress_round(
        self, culprit: str | None = None, behind: bool = False, slow: str | None = None
    ) -> None:
        step = self.step_now()
        in_ckpt = self.in_save
        for rank, name in enumerate(self.attempt_nodes):
            s = step - 1 if behind and name == culprit else step
            slowest = name == slow  # a straggler computes while the others wait for it
            sample = RankSample(
                rank=rank,
                step=max(s, -1),
                step_time_s=self.step_time,
                compute_s=self.step_time * (0.99 if slowest else 0.8),
                wait_s=self.step_time * (0.01 if slowest else 0.2),
                in_checkpoint=in_ckpt,
                reported_at=self.t0 + self.now,
            )
            self.feed(ProgressObserved(node=name, attempt=self.attempt, ranks=(sample,)))
        if self.tick_owed:
            self.tick_owed = False
            self.feed(Tick())

    # --- checkpoints --------------------------------------------------------------------------

    def _schedule_checkpoint(self) -> None:
        self.at(self.now + self.pol.checkpoint_interval_s, self._save_begin, self.epoch)

    def _save_begin(self, epoch: int) -> None:
        if epoch != self.epoch or not self.training:
            return
        step = self.step_now()
        self.train_base_step, self.train_since = step, self.now
        self.in_save = True
        self.training = True
        # Training is blocked for the stall: freeze the step count until the commit.
        self.train_since = self.now + self.pol.checkpoint_stall_s
        self.at(self.now + self.pol.checkpoint_stall_s, self._save_commit, epoch, step)

    def _save_commit(self, epoch: int, step: int) -> None:
        if epoch != self.epoch:
            return
        self.in_save = False
        self.train_base_step, self.train_since = step, self.now
        self.feed(
            CheckpointCommitted(step=step, attempt=self.attempt, save_duration_s=self.pol.checkpoint_stall_s)
        )
        self._schedule_checkpoint()

    def _halt_training(self) -> None:
        """Training stops now: freeze the step, cancel the stretch's checkpoints."""
        self.train_base_step = self.step_now()
        self.training = False
        self.in_save = False
        self.epoch += 1

    # --- faults -------------------------------------------------------------------------------

    def _fault(self, f: Fault) -> None:
        cause = self.sc.causes[f.cause]
        if self.attempt_nodes:
            name = self.attempt_nodes[f.slot % len(self.attempt_nodes)]
        else:
            name = f"n{f.slot:05d}"
        node = self.nodes[name]
        running = self.training and not self.fault_open and name in self.attempt_nodes
        if cause.fixed_step:
            self._fixed_step_fault(f, cause, name, running)
            return
        if cause.symptom == "control_plane":
            self._blip(f, cause, name, running)
            return
        if cause.symptom == "straggler" and node.broken is None:
            self._break(node, cause, f.cause)
            outcome = "interrupted" if running else "broke_idle_node"
            self.interruptions.append(Interruption(t=self.now, cause=cause.name, node=name, outcome=outcome))
            if running:
                self.at(self.now + self.step_time, self._straggle, name, self.epoch, 0)
            return
        if running:
            self.interruptions.append(
                Interruption(t=self.now, cause=cause.name, node=name, outcome="interrupted")
            )
            self._strike(name, cause, f.u)
            return
        # Not training: nothing running to crash; hardware still breaks, hosts still die.
        if cause.symptom == "node_lost" and node.alive:
            self.interruptions.append(
                Interruption(t=self.now, cause=cause.name, node=name, outcome="node_down")
            )
            self._break(node, cause, f.cause)
            node.alive = False
            self.at(self.now + self.pol.lease_ttl_s + f.u * self.det.lease_check_s, self._lost, name)
        elif cause.hardware and node.broken is None:
            self.interruptions.append(
                Interruption(t=self.now, cause=cause.name, node=name, outcome="broke_idle_node")
            )
            self._break(node, cause, f.cause)
        else:
            self.interruptions.append(
                Interruption(t=self.now, cause=cause.name, node=name, outcome="absorbed")
            )

    # --- software bugs at a fixed step, stragglers, control-plane blips -----------------

    def _fixed_step_fault(self, f: Fault, cause: Cause, name: str, running: bool) -> None:
        """A bug at a fixed step appears: armed at the job's step (the first hit now, if it runs)."""
        if self.bug is not None:  # one bug at a time: the job is already stuck on one
            self.interruptions.append(
                Interruption(t=self.now, cause=cause.name, node=name, outcome="absorbed")
            )
            return
        if running:
            step = self.step_now()
        else:  # not training: the bug lies ahead, within a checkpoint interval of the resume point
            ahead = int(f.u * self.pol.checkpoint_interval_s / self.step_time)
            step = max(self.train_base_step, 0) + 1 + ahead
        self.bugs += 1
        self.bug = FixedStepBug(
            id=self.bugs, cause=cause, step=step, fix_at=self.now + 3600.0 * cause.fix_hours, culprits=[]
        )
        self.at(self.bug.fix_at, self._fix_deployed, self.bug.id)
        if running:
            self.interruptions.append(
                Interruption(t=self.now, cause=cause.name, node=name, outcome="interrupted")
            )
            self.bug.culprits.append(name)
            self._strike(name, cause, f.u)
        else:
            self.interruptions.append(Interruption(t=self.now, cause=cause.name, node=name, outcome="armed"))

    def _schedule_bug(self) -> None:
        bug = self.bug
        if bug is None:
            return
        if self.now >= bug.fix_at or self.resume_step > bug.step:
            self.bug = None  # fixed, or the job is past it
            return
        due = max(0, bug.step - self.step_now()) * self.step_time + self.rng.random() * self.step_time
        self.at(self.now + due, self._bug_due, self.epoch)

    def _bug_due(self, epoch: int) -> None:
        bug = self.bug
        if bug is None or epoch != self.epoch or self.fault_open or not self.training:
            return
        if self.now >= bug.fix_at:
            self.bug = None
            return
        if self.step_now() < bug.step:  # checkpoint stalls held the job back: not there yet
            self.at(self.now + (bug.step - self.step_now()) * self.step_time, self._bug_due, epoch)
            return
        self._bug_hit(bug)

    def _bug_hit(self, bug: FixedStepBug) -> None:
        fresh = [n for n in self.attempt_nodes if n not in bug.culprits] or self.attempt_nodes
        name = fresh[self.rng.randrange(len(fresh))]  # the culprit rotates: another rank hits it
        bug.culprits.append(name)
        self.interruptions.append(Interruption(t=self.now, cause=bug.cause.name, node=name, outcome="refail"))
        self._strike(name, bug.cause, self.rng.random())

    def _fix_deployed(self, bug_id: int) -> None:
        """The fix is ready: a running attempt is stopped and relaunched with it (a planned stop, as
        `controllerctl stop --relaunch` does); an attempt being restarted gets it at its launch; a
        run the core ended is started again with it (`_operator_restart`)."""
        if self.bug is None or self.bug.id != bug_id or self.core.state in _ENDED:
            return
        self.bug = None
        if self.training and not self.fault_open:
            self.planned_stops += 1
            self.last_fault = self.last_fault_kind = "planned"
            self._progress_round()  # the ranks' last reports before the stop
            self.feed(StopRequested(reason="deploy the fix of a software bug", requested_by="sim"))

    def _restart_after_fix(self) -> bool:
        """The core ended the run while a fixed-step bug is unfixed: the operator fixes the job and
        starts the run again at the fix. Whether the world goes on."""
        if self.restart_at is not None:
            return True
        if self.bug is None or self.core.state not in (RunState.CRASH_LOOP, RunState.BUDGET_EXHAUSTED):
            return False
        self.restart_at = max(self.now, self.bug.fix_at)
        self._halt_training()
        self.at(self.restart_at, self._operator_restart)
        return True

    def _operator_restart(self) -> None:
        """`controller run` after the fix: a fresh core, given what the old one left in the store."""
        self.blind, self.missed = False, []
        self.bug = None
        self.restart_at = None
        self.run_restarts += 1
        self.generation += 1
        self.timers = Timers()
        self.fault_open = False
        self.training = False
        self.epoch += 1
        old = self.core
        self.log(
            E.Event(
                ts=self.t0 + self.now,
                run=self.sc.run.name,
                attempt=old.attempt,
                step=old.latest_committed,
                kind=E.EVENT_KIND_RUN_START,
                message="sim: the operator fixed the job and started the run again",
                run_detail=E.RunDetail(nodes=self.sc.run.nodes),
            )
        )
        self.core = Supervisor(self.pol.supervisor, RunPlan(run=self.sc.run.name, nodes=self.sc.run.nodes))
        extra: dict[str, Any] = {} if self.memory is None else {"memory": self.memory}
        self.feed(
            StoreListed(
                alive={n: 1 for n, node in self.nodes.items() if node.alive},
                records=tuple(self.records.values()),
                attempt=old.attempt,
                resume_step=old.latest_committed,
                committed_steps=tuple(sorted(old.committed)),
                **extra,
            )
        )

    def _straggle(self, name: str, epoch: int, rounds: int) -> None:
        """A slow node: progress rounds one step apart in which its rank computes longer."""
        if epoch != self.epoch or self.fault_open or not self.training or name not in self.attempt_nodes:
            return
        self._progress_round(slow=name)
        if rounds + 1 < self.pol.supervisor.straggler_window + 2:
            self.at(self.now + self.step_time, self._straggle, name, epoch, rounds + 1)

    def _blip(self, f: Fault, cause: Cause, name: str, running: bool) -> None:
        """The controller loses etcd for a few seconds; the job runs on."""
        if self.core.state in _ENDED:
            self.interruptions.append(
                Interruption(t=self.now, cause=cause.name, node=name, outcome="absorbed")
            )
            return
        self.interruptions.append(
            Interruption(t=self.now, cause=cause.name, node="", outcome="interrupted" if running else "blip")
        )
        self.last_fault, self.last_fault_kind = cause.name, "control_plane"
        self.feed(ControlPlaneLost())
        self.blind = True
        self.at(self.now + 1.0 + f.u * 20.0, self._blip_over, self.generation)

    def _blip_over(self, generation: int) -> None:
        if not self.blind:
            return
        self.blind = False
        missed, self.missed = self.missed, []
        if generation != self.generation:
            return
        self.feed(ControlPlaneRestored())
        core = self.core
        self.feed(
            StoreListed(
                alive={n: 1 for n, node in self.nodes.items() if node.alive},
                attempt=core.attempt,
                attempt_nodes=tuple(core.cur.node_step) if self.training else (),
                resume_step=core.cur.resume_step,
                committed_steps=tuple(sorted(core.committed)),
            )
        )
        for event in missed:  # the watch, resumed from its revision, delivers what was put meanwhile
            self.feed(event)

    def _break(self, node: SimNode, cause: Cause, index: int) -> None:
        if cause.hardware and node.broken is None:
            node.broken = index
            node.repaired_at = 0.0

    def _refail(self, name: str, epoch: int, cause: Cause) -> None:
        if epoch != self.epoch or self.fault_open or not self.training:
            return
        self.interruptions.append(Interruption(t=self.now, cause=cause.name, node=name, outcome="refail"))
        self._strike(name, cause, self.rng.random())

    def _strike(self, name: str, cause: Cause, u: float) -> None:
        """A fault hits `name` in the running attempt: training stops, the signals go out."""
        node = self.nodes[name]
        self.last_fault = cause.name
        self.last_fault_kind = (
            "fixed_step" if cause.fixed_step else "hardware" if cause.hardware else "software"
        )
        self._break(node, cause, self.sc.causes.index(cause))
        self.fault_open = True
        self.culprit, self.culprit_cause, self.culprit_u = name, cause, u
        behind = cause.symptom == "hang" and u < 0.5  # half the time the culprit's progress stopped first
        # The last good observation: every node's progress at the fault instant.
        was_saving = self.in_save
        self._progress_round(culprit=name, behind=behind)
        self.in_save = was_saving
        self._halt_training()
        attempt = self.attempt
        if self.pol.use_evidence and cause.evidence:
            self.at(self.now + self.det.evidence_s, self._evidence, name, cause, self.t0 + self.now)
        if cause.symptom == "crash":
            self.at(self.now + self.det.crash_s, self._crashed, name, attempt, self.t0 + self.now)
        elif cause.symptom == "node_lost":
            node.alive = False
            self.at(self.now + self.pol.lease_ttl_s + u * self.det.lease_check_s, self._lost, name)
        # hang: nothing is sent; the core's hang timer fires.

    def _evidence(self, name: str, cause: Cause, observed_at: float) -> None:
        ev = common_pb2.Evidence(
            node=name,
            kind=_EVIDENCE_KIND[cause.evidence],
            severity=common_pb2.SEVERITY_FATAL,
            detail=f"sim: {cause.name}",
            observed_at=observed_at,
            source="chaos",
        )
        self.feed(EvidenceObserved(evidence=ev))

    def _crashed(self, name: str, attempt: int, ended_at: float) -> None:
        self.feed(
            AttemptExited(
                node=name, attempt=attempt, exit_code=1, ended_at=ended_at, detail="sim: process crashed"
            )
        )

    def _lost(self, name: str) -> None:
        node = self.nodes[name]
        if node.broken is not None:
            repair = self.sc.causes[node.broken].repair_hours
            node.repaired_at = self.now + 3600.0 * (repair if repair is not None else self.costs.repair_hours)
            self.at(node.repaired_at, self._joined, name)
        self.feed(NodeLost(node=name))

    def _dumps(self, attempt: int, generation: int) -> None:
        if generation != self.generation:
            return
        suspects: tuple[Suspect, ...] = ()
        cause = self.culprit_cause
        # A hardware hang's culprit, and a fixed-step bug's (the rank stuck in the data loader never
        # reached the collective: the flight recorder names it, though nothing is wrong with its node).
        if (
            self.pol.flight_recorder
            and self.culprit is not None
            and cause is not None
            and (cause.hardware or cause.fixed_step)
            and cause.symptom == "hang"
            and self.culprit_u < self.det.flight_recorder_accuracy
        ):
            suspects = (
                Suspect(
                    node=self.culprit,
                    confidence=0.9,
                    reason="never reached the collective the others wait in",
                ),
            )
        self.feed(DumpsCollected(attempt=attempt, verdict=FlightRecorderVerdict(suspects=suspects)))

    def _stop(self, act: StopAttempt) -> None:
        if act.planned and self.training and act.attempt == self.attempt:
            # The trainer finishes its step, saves and commits, then exits 0.
            step = self.step_now()
            self._halt_training()
            save = self.pol.checkpoint_stall_s
            self.at(self.now + save, self._planned_commit, act.attempt, step)
            self.at(self.now + save + self.costs.stop_s, self._exits, act, 0, self.generation)
            return
        if act.attempt == self.attempt:
            self._halt_training()
            self.fault_open = True
        self.at(self.now + self.costs.stop_s, self._exits, act, None, self.generation)

    def _planned_commit(self, attempt: int, step: int) -> None:
        self.feed(
            CheckpointCommitted(step=step, attempt=attempt, save_duration_s=self.pol.checkpoint_stall_s)
        )

    def _exits(self, act: StopAttempt, code: int | None, generation: int) -> None:
        if generation != self.generation:
            return
        sig = None if code is not None else int(signal_mod.SIGTERM)
        # Reverse order: the core's "all exited?" check then stops at the first node, not the last.
        for name in reversed(act.nodes):
            self.feed(
                AttemptExited(
                    node=name, attempt=act.attempt, exit_code=code, signal=sig, ended_at=self.t0 + self.now
                )
            )

    def _planned_stop(self) -> None:
        if not (self.training and not self.fault_open):
            return
        self.planned_stops += 1
        self.last_fault = self.last_fault_kind = "planned"
        self._progress_round()  # the ranks' last reports before the stop: they trained until now
        self.feed(StopRequested(reason="planned maintenance", requested_by="sim"))


def simulate(scenario: Scenario, policy: Policy, draws: Draws) -> SimResult:
    """Run one policy on one seed's draws."""
    return World(scenario, policy, draws).run()
