"""The discrete-event world around the real supervisor core (`controller.supervisor.machine.Supervisor`).

The world owns what the core cannot see: the training job's real progress, the checkpoint
cadence, the faults (drawn once per seed and shared by every policy), the latencies with which
each signal reaches the supervisor, and how long each action takes. The core owns every
decision: detection, blame, quarantine, spares, preflight, backoff, relaunch. Each `handle` call
returns a `Batch`: its entries are appended to the event log first (in the live controller's format,
which the live goodput function `controller.goodput.report.compute_goodput` reads), then its actions
are executed with the scenario's latencies. `SetTimer` follows `controller.supervisor.timers.Timers`,
the shells' one implementation; the world's heap only delivers (a replaced timer's entry is stale).

What is summarised, and why it does not change the answer:

* Progress. A 2,048-node job makes ~10^6 steps in 54 days; feeding every step of every node would
  be ~10^9 `handle` calls. Instead every node reports one `ProgressObserved` at the first step of
  an attempt and at each fault instant (the last good observation before the fault). The core's
  hang timers that fall due while the world knows the job is healthy are delivered *late*, right
  after the next such progress round (the timer contract allows late ticks): the hang detector
  then sees the same last-advance time it would have seen with per-step progress, so a hang is
  detected exactly one hang timeout after the fault, and a healthy run is never declared hung.
  Straggler detection is not exercised (the scenario has no stragglers).
* Ranks. Each node reports one rank sample (`local_ranks=1`): the core's decisions are per node.
* Stop exits are delivered in reverse node order: the core checks "all exited" on each exit and
  short-circuits on the first live node, so this keeps a 2,048-node stop linear instead of quadratic.

A fault drawn while the job is not training hits the node in its slot: a hardware fault leaves
that node broken (preflight may catch it; otherwise it fails again soon after the next first
step); a node-loss fault takes the host down; a software fault has nothing to crash and is
counted as absorbed.
"""

from __future__ import annotations

import heapq
import random
import signal as signal_mod
from collections.abc import Callable
from dataclasses import dataclass
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
    Tick,
)
from controller.supervisor.machine import RunState, Supervisor
from controller.supervisor.policy import RunPlan
from controller.supervisor.timers import Timers
from runwarden.v1 import common_pb2, events_pb2

E = events_pb2
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


@dataclass(slots=True)
class SimResult:
    policy: str
    seed: int
    events: list[events_pb2.Event]
    interruptions: list[Interruption]
    start_ts: float
    end_ts: float
    handle_calls: int
    final_state: str
    planned_stops: int


class World:
    """One policy on one seed's draws. `run()` returns the result; the object is single-use."""

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
        self.events: list[events_pb2.Event] = []
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

    # --- plumbing ---------------------------------------------------------------------------------

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, fn, args))

    def feed(self, event: Event) -> None:
        self.handle_calls += 1
        batch = self.core.handle(event, self.t0 + self.now)
        for entry in batch.entries:  # the log first, then the actions (actions.py's order of obligations)
            self.log(entry)
        for act in batch.actions:
            self.execute(act)

    def log(self, ev: events_pb2.Event) -> None:
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
            if self.core.state in (
                RunState.CRASH_LOOP,
                RunState.BUDGET_EXHAUSTED,
                RunState.STOPPED,
                RunState.COMPLETED,
            ):
                break
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
                self.at(self.now + self.det.dumps_s, self._dumps, act.attempt)
            case Quarantine():
                node = self.nodes.get(act.node)
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
            case Release() | Page() | PersistNode() | PersistMemory() | PersistCheckpoint():
                pass  # nothing to do in the world (the core logged them)
            case _:
                assert_never(act)

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
            return
        self.feed(Tick())

    def _preflight(self, act: RunPreflight) -> None:
        if act.purpose == "burn_in":
            for name in act.nodes:
                node = self.nodes[name]
                done = max(self.now, node.repaired_at) + self.costs.burn_in_s / max(
                    1, self.pol.supervisor.burn_in_passes
                )
                self.at(done, self._preflight_results, ((name, True),))
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
        self.at(done, self._preflight_results, tuple(results))

    def _preflight_results(self, results: tuple[tuple[str, bool], ...]) -> None:
        # All nodes of one RunPreflight finish together (they run in parallel): one heap entry.
        for name, passed in results:
            node = self.nodes[name]
            if passed and node.broken is not None and node.repaired_at and self.now >= node.repaired_at:
                node.broken = None  # burn-in after repair
            failed = () if passed else ("sim.broken_node",)
            self.feed(PreflightResult(node=name, passed=passed, failed_checks=failed))

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
        self.train_base_step = max(self.resume_step, 0) + 1
        self.train_since = self.now
        self._progress_round()
        self._schedule_checkpoint()
        for name in self.attempt_nodes:
            node = self.nodes[name]
            if node.broken is not None:  # put back into a run while broken: it fails again soon
                cause = self.sc.causes[node.broken]
                self.at(
                    self.now + self.rng.random() * self.det.refail_s, self._refail, name, self.epoch, cause
                )
                break

    def _progress_round(self, culprit: str | None = None, behind: bool = False) -> None:
        step = self.step_now()
        in_ckpt = self.in_save
        for rank, name in enumerate(self.attempt_nodes):
            s = step - 1 if behind and name == culprit else step
            sample = RankSample(
                rank=rank,
                step=max(s, -1),
                step_time_s=self.step_time,
                compute_s=self.step_time * 0.8,
                wait_s=self.step_time * 0.2,
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
        if self.training and not self.fault_open and name in self.attempt_nodes:
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

    def _dumps(self, attempt: int) -> None:
        suspects: tuple[Suspect, ...] = ()
        cause = self.culprit_cause
        if (
            self.pol.flight_recorder
            and self.culprit is not None
            and cause is not None
            and cause.hardware
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
            self.at(self.now + save + self.costs.stop_s, self._exits, act, 0)
            return
        if act.attempt == self.attempt:
            self._halt_training()
            self.fault_open = True
        self.at(self.now + self.costs.stop_s, self._exits, act, None)

    def _planned_commit(self, attempt: int, step: int) -> None:
        self.feed(
            CheckpointCommitted(step=step, attempt=attempt, save_duration_s=self.pol.checkpoint_stall_s)
        )

    def _exits(self, act: StopAttempt, code: int | None) -> None:
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
        self.feed(StopRequested(reason="planned maintenance", requested_by="sim"))


def simulate(scenario: Scenario, policy: Policy, draws: Draws) -> SimResult:
    """Run one policy on one seed's draws."""
    return World(scenario, policy, draws).run()
