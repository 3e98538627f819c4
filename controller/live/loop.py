"""The live controller: the thin shell around the sans-IO supervisor core.

raft's split: `controller.supervisor.machine.Supervisor` is the logic (no sockets, clock or threads);
this module's `LiveController` is the goroutine-shell that owns every side effect, and nothing else:
leadership in etcd, the run's node claims, the level-triggered view of the store, one loop that
feeds the core its events and executes its batches (controller/live/executor.py), slow agent work
off the loop. Bad input from outside is logged and dropped; a bug out of the core rebuilds the core
from a store snapshot. `controller run` (controller/live/main.py) starts it.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

from google.protobuf.message import DecodeError

from controller.api import policy as policy_store
from controller.backends.agents import AgentClients
from controller.backends.base import BackendError, RunOutcome, Scheduler, StaticFleet
from controller.backends.local import LocalBackend, LocalConfig
from controller.fleet.claims import BID_WINDOW_S, Claims
from controller.live.executor import Executor, RunSettings
from controller.live.loss_history import read_history
from controller.live.paging import Pager
from controller.live.tasks import TaskPool
from controller.live.translate import Addresses, Listing, Translator, record_view
from controller.supervisor.actions import Batch
from controller.supervisor.events import (
    AttemptExited,
    ControlPlaneLost,
    Event,
    NodeClaimed,
    OperatorQuarantine,
    OperatorRelease,
    StoreListed,
    Tick,
)
from controller.supervisor.machine import SupervisorStatus, TransitionError
from controller.supervisor.policy import RunPlan, SupervisorConfig
from controller.supervisor.pool import OUT_OF_SERVICE, Pool
from controller.supervisor.timers import Timers
from runwarden.eventlog import EventLog, LogEntry
from runwarden.keys import LEGACY_ELECTION, run_election
from runwarden.store import Compare, Leadership, Put, Relisted, Store, StoreError, Watch, WatchEvent
from runwarden.v1 import common_pb2, controller_pb2, store_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class ShellConfig:
    """What the shell needs beyond the core's policy."""

    run: str
    command: tuple[str, ...]  # what each rank runs (each node's agent wraps it in its torchrun)
    run_dir: Path  # event log, checkpoints for the local backend
    identity: str = field(default_factory=lambda: f"{socket.gethostname()}-{time.time_ns() % 10**6}")
    election_ttl_s: float = 3.0
    tick_s: float = 0.25
    rpc_timeout_s: float = 10.0
    env: tuple[tuple[str, str], ...] = ()
    procs_per_node: int = 1
    dump_timeout_s: float = 3.0
    spares: int = 0  # allocated beyond the run's nodes (the scheduler's `allocate`)
    script_mode: str = (
        "instrumented"  # "unmodified": the agents run the command through nodeagent.trainer.bootstrap
    )
    priority: int = 0  # who gets a free node of the shared fleet first: the higher (then first come)
    claim_bid_window_s: float = BID_WINDOW_S  # asks of several runs this close are decided by priority
    # A new launch is wanted (`controller run --resume`, --exit-when-done): a stop that ended the run
    # and was requested before this time (the process's start) is cleared on taking office. None: kept.
    resume_stopped_before: float | None = None

    @property
    def event_log_path(self) -> Path:
        return self.run_dir / "events.jsonl"


class Core(Protocol):
    """What the shell needs of the supervisor core (`controller.supervisor.machine.Supervisor`)."""

    @property
    def cfg(self) -> SupervisorConfig: ...

    @property
    def plan(self) -> RunPlan: ...

    @property
    def pool(self) -> Pool: ...

    def handle(self, event: Event, now: float) -> Batch: ...

    def status(self, now: float) -> SupervisorStatus: ...

    def holds(self) -> frozenset[str]: ...


# After a takeover, launch RPCs the dead leader had in flight may still land for this long.
ADOPT_GRACE_S = 2.0
# ... and the adopted attempt's nodes are asked whether they run it for at most this long.
ADOPT_CHECK_S = 60.0
# Answers fed back in one loop iteration at most (a chain longer than this waits for the next one).
MAX_ANSWERS_PER_ITERATION = 64
# A refused allocation is asked for again this often (while this process leads).
ALLOCATE_RETRY_S = 30.0
# A leader stops acting this long (or two ticks, if longer) before its lease could have expired.
LEADER_MARGIN_S = 0.5


class _Relist:
    """Marker on the queue: the view has a gap; list the store and send a StoreListed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class _Operator:
    """An operator request on the queue, with the future its API call waits on (the node's pool state)."""

    event: OperatorQuarantine | OperatorRelease
    future: Future[common_pb2.PoolState.ValueType | None]


Item = Event | _Relist | _Operator


class CoreRebuilding(Exception):
    """The core failed while handling a request; the shell is rebuilding it. Ask again."""


class _SteppedDown(Exception):
    """Leadership is no longer certain in the middle of an iteration: stop before acting."""


class _CoreBroken(Exception):
    """Raised out of `_feed` when `core.handle` raised something other than TransitionError."""

    def __init__(self, event: object) -> None:
        super().__init__(type(event).__name__)
        self.key = poison_key(event)


def poison_key(event: object) -> str:
    """What identifies an event that broke the core: the same one comes back after a rebuild (an
    exit the relist finds again, an answer the fresh core asks for again)."""
    return f"{type(event).__name__}:{event!r}"[:2048]


# A core that breaks again and again is rebuilt after a growing pause (a poison event must not spin
# the loop); an event that broke two cores is dropped, logged and paged, never fed a third time.
REBUILD_BACKOFF_S = 0.5
REBUILD_BACKOFF_MAX_S = 30.0
REBUILD_QUIET_S = 60.0  # a core that ran this long without breaking resets the pause
POISON_AFTER = 2


_PHASES = {
    "WAITING_NODES": controller_pb2.RUN_PHASE_PENDING,
    "PREFLIGHT": controller_pb2.RUN_PHASE_PREFLIGHT,
    "RUNNING": controller_pb2.RUN_PHASE_RUNNING,
    "COLLECTING": controller_pb2.RUN_PHASE_RECOVERING,
    "STOPPING": controller_pb2.RUN_PHASE_STOPPING,
    "BACKOFF": controller_pb2.RUN_PHASE_RECOVERING,
    "CONTROL_PLANE": controller_pb2.RUN_PHASE_WAITING,
    "COMPLETED": controller_pb2.RUN_PHASE_COMPLETED,
    "STOPPED": controller_pb2.RUN_PHASE_COMPLETED,
    "CRASH_LOOP": controller_pb2.RUN_PHASE_FAILED,
    "BUDGET_EXHAUSTED": controller_pb2.RUN_PHASE_FAILED,
}


# The run's end, as the scheduler is told and `controller run --exit-when-done` exits.
_OUTCOMES = {
    "COMPLETED": RunOutcome.COMPLETED,
    "STOPPED": RunOutcome.STOPPED,
    "CRASH_LOOP": RunOutcome.FAILED,
    "BUDGET_EXHAUSTED": RunOutcome.FAILED,
}


class LiveController:
    """Runs one controller process: campaign, reconcile, then drive the core until stopped.

    * **Leadership.** It campaigns in etcd, in its run's own election (several runs share one root, one
      leader + standbys each); only the leader acts. Its fence (the election key's create revision) goes
      into every attempt record and every fenced write, so a stale leader cannot launch.
    * **Claims.** Nodes are the fleet's, shared by the runs under the root; a run uses a node only while
      it holds the node's claim (controller/fleet/claims.py). After every batch the shell gives back the
      nodes its core no longer holds (`Supervisor.holds`) and takes the out-of-service ones it answers
      for; an attempt's nodes are taken before their preflight (the executor). Other runs' claims reach
      the core as `NodeClaimed` events (and in the StoreListed): a node another run holds is no spare here.
    * **Level-triggered view.** On becoming leader, and after any watch gap (a compacted revision, a
      lost etcd), it lists the store and hands the core a `StoreListed`, then watches from that revision.
    * **One loop.** Watch callbacks, RPC results and timers only enqueue events; a single thread
      pops them, calls `core.handle(event, now)`, and executes the returned `Batch` in the order its
      contract states (controller/live/executor.py). Answers due at once (`ActionFailed` for a refused
      attempt CAS or a failed log append) are fed back to the core in the same iteration.
    * **Slow work off the loop.** Agent RPCs (preflight, launch through the `Backend`, stop, dump
      collection) run in a thread pool with deadlines; their outcomes come back as events.

    What the loop catches: bad input from outside (a value in etcd, an RPC answer; `ValueError` at
    the translation) is logged and dropped; a `TransitionError` (no rule for the event in this state)
    is logged. Any other exception out of `core.handle` is a bug that may have left the core
    half-mutated: the shell logs the traceback and rebuilds a fresh core from a store snapshot, the
    same path as becoming leader (new core from the factory, relist, StoreListed, watch from that
    revision). A fresh core that fails on its very first StoreListed steps down instead, and campaigns again.
    """

    def __init__(
        self,
        cfg: ShellConfig,
        store: Store,
        core_factory: Callable[[], Core],
        *,
        agents: AgentClients | None = None,
        pager: Pager | None = None,
        backend: LocalBackend | None = None,
        scheduler: Scheduler | None = None,
        eventlog_factory: Callable[[Path], EventLog] = EventLog,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.keys = store.keys
        self._core_factory = core_factory
        probe = core_factory()
        self.nodes = int(probe.plan.nodes)
        self.restart_budget = int(probe.cfg.restart_budget)
        self.core: Core | None = None
        self.agents = agents or AgentClients()
        self.tasks = TaskPool()
        self.backend = backend or LocalBackend(
            self.agents,
            lambda node: self.translator.rendezvous(node),  # node records, as the current view has them
            LocalConfig(rpc_timeout_s=cfg.rpc_timeout_s, script_mode=cfg.script_mode),
        )
        self.pager = pager or Pager()
        self.scheduler: Scheduler = scheduler or StaticFleet()
        self.outcome: RunOutcome | None = None  # set once the run is over (and the scheduler told)
        self.done = threading.Event()  # the run is over: `controller run --exit-when-done` exits
        self._allocated = threading.Event()  # allocate() returned (the queue may be asked from then on)
        self._eventlog_factory = eventlog_factory
        self.clock = clock
        self.events: queue.Queue[Item] = queue.Queue()
        self.timers = Timers()
        self.stopping = threading.Event()
        self.leadership: Leadership | None = None
        self.eventlog: EventLog | None = None
        self.translator = Translator(self.keys, cfg.run, procs_per_node=cfg.procs_per_node)
        self.claims = Claims(
            store, cfg.run, priority=cfg.priority, identity=cfg.identity, bid_window_s=cfg.claim_bid_window_s
        )
        self.election = run_election(cfg.run)
        self.executor: Executor | None = None
        self._watches: list[Watch] = []
        self._adopted: tuple[int, float] | None = None
        self.listeners: list[Callable[[LogEntry], None]] = []
        self.is_leader = threading.Event()
        self.status: controller_pb2.RunStatus | None = None
        self.rebuilds = 0  # how often a failed core was replaced (tests and logs read it)
        self._broke_on: dict[str, int] = {}  # poison_key -> cores it broke
        self.dropped_poison = 0  # events dropped for breaking POISON_AFTER cores
        # monotonic time of the supervisor thread's last loop turn (campaigning or leading): the
        # systemd watchdog is fed only while it moves (controller/live/main.py)
        self.alive_at = time.monotonic()

    # -- lifecycle ----------------------------------------------------------------------------

    def run(self) -> None:
        """Campaign, then lead until `stop()`; on losing leadership, campaign again."""
        while not self.stopping.is_set():
            self.alive_at = time.monotonic()
            try:
                if self._legacy_leader():
                    self.stopping.wait(1.0)
                    continue
                self.leadership = self.store.campaign(
                    self.election, self.cfg.identity.encode(), self.cfg.election_ttl_s, timeout_s=1.0
                )
            except StoreError as exc:
                log.debug("campaign: %s", exc)
                self.stopping.wait(0.2)  # etcd may be unreachable: no hot loop
                continue
            log.info("%s is the leader (fence %d)", self.cfg.identity, self.leadership.fence)
            try:
                self._lead()
            except StoreError as exc:
                log.warning("stepping down: the store failed while taking over: %s", exc)
            finally:
                self.is_leader.clear()
                self._cancel_watches()
                if self.eventlog is not None:
                    self.eventlog.close()
                    self.eventlog = None
                with contextlib.suppress(StoreError):
                    self.leadership.resign()

    def _legacy_leader(self) -> bool:
        """A controller of an older version (one election, "controller", for the whole root) leads:
        this one does not lead beside it (two leaders of one run), it waits until that one is gone."""
        if self.election == LEGACY_ELECTION:
            return False
        legacy = self.store.leader(LEGACY_ELECTION)
        if legacy is not None:
            log.warning(
                "an older controller (%s) leads in the root's single election; waiting for it to stop",
                legacy.value.decode("utf-8", "replace"),
            )
        return legacy is not None

    def stop(self) -> None:
        self.stopping.set()
        self.events.put(Tick())

    def close(self) -> None:
        self.stop()
        self.tasks.shutdown()
        self.agents.close()

    # -- leading ------------------------------------------------------------------------------

    def _lead(self) -> None:
        self.eventlog = self._eventlog_factory(self.cfg.event_log_path)
        self._write_spec()
        self._clear_stale_stop()
        in_a_row, built_at = 0, time.monotonic()
        while not self.stopping.is_set():
            try:
                self._take_over()
            except _CoreBroken:
                log.error("the fresh core failed on its first snapshot; stepping down")
                self.stopping.wait(1.0)
                return
            try:
                self._drive()
                return
            except _SteppedDown:
                return
            except _CoreBroken as broken:
                self._broke_on[broken.key] = self._broke_on.get(broken.key, 0) + 1
                self.rebuilds += 1
                in_a_row = 1 if time.monotonic() - built_at > REBUILD_QUIET_S else in_a_row + 1
                pause = min(REBUILD_BACKOFF_MAX_S, REBUILD_BACKOFF_S * 2 ** (in_a_row - 1))
                log.error(
                    "rebuilding the core from a store snapshot in %.1fs (rebuild %d, %d in a row)",
                    pause,
                    self.rebuilds,
                    in_a_row,
                )
                self.stopping.wait(pause)
                built_at = time.monotonic()

    def _take_over(self) -> None:
        """Becoming leader, and rebuilding a failed core: new core, relist, StoreListed, watch from there."""
        assert self.leadership is not None and self.eventlog is not None
        self.is_leader.clear()
        self._cancel_watches()
        self.core = self._core_factory()
        self.timers.clear()
        old = self.events
        self.events = queue.Queue()
        while True:  # operator requests wait on their futures: the new core answers them
            try:
                item = old.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Operator):
                self.events.put(item)
        self.translator = Translator(self.keys, self.cfg.run, procs_per_node=self.cfg.procs_per_node)
        unwritten = self.executor.unwritten if self.executor is not None else []
        self.executor = Executor(
            RunSettings(
                run=self.cfg.run,
                command=self.cfg.command,
                env=self.cfg.env,
                procs_per_node=self.cfg.procs_per_node,
                rpc_timeout_s=self.cfg.rpc_timeout_s,
            ),
            store=self.store,
            leadership=self.leadership,
            eventlog=self.eventlog,
            timers=self.timers,
            backend=self.backend,
            agents=self.agents,
            pager=self.pager,
            translator=self.translator,
            claims=self.claims,
            tasks=self.tasks,
            scheduler=self.scheduler,
            allocated=self._allocated,
            stopping=self.stopping,
            post=lambda ev: self.events.put(ev),
            relist=lambda: self.events.put(_Relist()),
            listeners=self.listeners,
            clock=self.clock,
        )
        self.executor.unwritten.extend(unwritten)  # entries of a failed append are still owed to the log
        if policy_store.seed(  # a new run's first leader: its file's policy is the one in force
            self.store,
            self.cfg.run,
            self.core.cfg,
            changed_by=f"controller {self.cfg.identity}",
            now=self.clock(),
        ):
            log.info("stored this controller's policy for run %s (none was stored)", self.cfg.run)
        # Its StoreListed carries the stored policy and the loss history the event log kept: the core
        # starts with both.
        revision = self._relist(fresh_core=True)
        # An attempt found in the store was launched by an earlier leader; it may never have reached
        # the agents (that leader died between the record and the RPCs). `_check_adopted` asks them.
        attempt = self.executor.attempt
        self._adopted = (attempt, time.monotonic()) if attempt else None
        self._start_watches(revision + 1)
        self.is_leader.set()
        if not self._allocated.is_set():
            self.tasks.submit(self._allocate)
        threading.Thread(
            target=self._check_adopted, args=(self.executor, self.translator), name="adopt-check", daemon=True
        ).start()

    def _clear_stale_stop(self) -> None:
        """A run-ending stop requested before `resume_stopped_before` belongs to the run it stopped, and
        this process was started to launch the run again: the stop stops ending the run. It becomes a
        relaunching stop (one transaction, only if unchanged since read and while this process leads),
        so the attempt it ended is wound up as a planned stop, whatever its exit records say, and the
        next launch retires the key (the executor). A stop requested since this start (a time limit's
        notice while the controller starts) is honoured; a relaunching one is left as it is."""
        before = self.cfg.resume_stopped_before
        if before is None:
            return
        assert self.leadership is not None
        key = self.keys.stop(self.cfg.run)
        cur = self.store.get(key)
        if cur is None:
            return
        try:
            req = store_pb2.StopRequest.FromString(cur.value)
        except DecodeError:
            return  # the translator reports a bad value; a stop nobody can read is not cleared blind
        if req.relaunch or req.requested_at >= before:
            return
        resumed = store_pb2.StopRequest()
        resumed.CopyFrom(req)
        resumed.relaunch = True
        resumed.reason = f"{req.reason or 'stop requested'} (resumed by {self.cfg.identity})"
        cleared = self.store.txn(
            f"clear the stop of {self.cfg.run}",
            [self.store.fence(self.leadership), Compare(key=key, mod_revision=cur.mod_revision)],
            [Put(key=key, value=resumed.SerializeToString())],
        ).succeeded
        if cleared:
            log.warning(
                "run %s: cleared the stop that ended it (requested by %s %.0f s before this controller "
                "started: %s); the run is launched again from its latest commit",
                self.cfg.run,
                req.requested_by or "unknown",
                before - req.requested_at,
                req.reason or "no reason given",
            )
        else:
            log.info(
                "run %s: the stop changed (or the leadership went) while clearing it; kept", self.cfg.run
            )

    def _allocate(self) -> None:
        """The leader holds the run's machines (once per process: `allocate` adopts an allocation an
        earlier leader made, so a takeover never holds two). A refusal pages once and is tried again
        every ALLOCATE_RETRY_S while this process leads; a still-queued allocation is adopted then."""
        paged = False
        while not self.stopping.is_set() and self.is_leader.is_set():
            try:
                got = self.scheduler.allocate(self.nodes, self.cfg.spares)
            except Exception as exc:  # a BackendError, or a backend's bug: the run must not hang on it
                log.error(
                    "allocating %d + %d nodes via %s failed: %s",
                    self.nodes,
                    self.cfg.spares,
                    self.scheduler.name,
                    exc,
                    exc_info=not isinstance(exc, BackendError),
                )
                if not paged:
                    self.pager.page(
                        f"{self.cfg.run}: allocation via {self.scheduler.name} failed: {exc}", "critical"
                    )
                    paged = True
                self.stopping.wait(ALLOCATE_RETRY_S)
                continue
            self._allocated.set()
            if got.nodes:
                log.info("allocation %s via %s: %s", got.id, self.scheduler.name, ", ".join(got.nodes))
            return

    def _finish(self, outcome: RunOutcome) -> None:
        try:
            self.scheduler.finish(outcome)
        except BackendError as exc:
            log.error("giving the allocation back via %s failed: %s", self.scheduler.name, exc)
        except Exception:
            log.exception("finish via %s failed", self.scheduler.name)
        finally:
            self.done.set()

    def _certain(self) -> bool:
        """Whether this leader may still act: its lease is certainly alive for a while longer.

        A leader cut off from etcd keeps no lease it cannot prove; past it a standby may lead, so this
        one stops (no launch, no stop, no event-log append) before its lease can have expired."""
        assert self.leadership is not None
        margin = max(LEADER_MARGIN_S, 2 * self.cfg.tick_s)
        left = self.leadership.certain_for()
        if self.leadership.lost.is_set() or left < margin:
            log.warning(
                "stepping down: leadership %s",
                f"lost ({self.leadership.reason})"
                if self.leadership.lost.is_set()
                else f"not certain for {margin:g}s more ({left:.2f}s left: etcd unreachable?)",
            )
            return False
        return True

    def _drive(self) -> None:
        assert self.leadership is not None
        next_tick = self.clock()
        while not self.stopping.is_set():
            self.alive_at = time.monotonic()
            if not self._certain():
                return
            now = self.clock()
            timer_at = self.timers.next_at()
            due = next_tick if timer_at is None else min(next_tick, timer_at)
            try:
                item: Item | None = self.events.get(timeout=max(0.0, min(due - now, self.cfg.tick_s)))
            except queue.Empty:
                item = None
            now = self.clock()
            if isinstance(item, _Relist):
                try:
                    rev = self._relist()
                except StoreError as exc:
                    log.warning("relist failed: %s", exc)
                    self._feed(ControlPlaneLost(), now)
                    time.sleep(0.5)
                    self.events.put(_Relist())
                    continue
                self._restart_watches(rev + 1)
                continue
            if item is not None:
                self._feed(item, now)
            fired = self.timers.pop_due(now)
            if fired or now >= next_tick:
                next_tick = now + self.cfg.tick_s
                self._feed(Tick(), now)

    def _feed(self, item: Event | _Operator, now: float) -> None:
        """Hand one item to the core, execute its batch, and feed the answers due at once, in order."""
        assert self.core is not None and self.executor is not None
        operator: _Operator | None = None
        event: Event
        if isinstance(item, _Operator):
            operator, event = item, item.event
        else:
            event = item
        future = operator.future if operator is not None else None
        pending: list[Event] = [event]
        fed = 0
        acted = False  # a batch that logs or acts may change what the run holds (claims)
        while pending:
            ev = pending.pop(0)
            if fed > MAX_ANSWERS_PER_ITERATION:
                log.warning("%d answers still due after %d in one iteration; queued", len(pending) + 1, fed)
                for rest in (ev, *pending):
                    self.events.put(rest)
                break
            fed += 1
            key = poison_key(ev)
            if self._broke_on.get(key, 0) >= POISON_AFTER and not isinstance(ev, StoreListed):
                # (a store snapshot is never dropped: without it the core has no view; a fresh core
                # that fails on it steps down instead)
                self.dropped_poison += 1
                log.error("dropping %s: it broke %d cores already: %s", type(ev).__name__, POISON_AFTER, key)
                self.pager.page(
                    f"{self.cfg.run}: the controller dropped an event that broke its core {POISON_AFTER} "
                    f"times ({type(ev).__name__}); a bug to report, see the controller's log",
                    "critical",
                )
                if future is not None and ev is event:
                    future.set_exception(CoreRebuilding("the request broke the controller's core; dropped"))
                    future = operator = None
                continue
            try:
                batch = self.core.handle(ev, now)
            except TransitionError as exc:
                log.warning("core refused %s: %s", type(ev).__name__, exc)
                continue
            except Exception as exc:
                log.exception("core failed on %s; it may be half-mutated", type(ev).__name__)
                if future is not None:
                    future.set_exception(CoreRebuilding("the controller is rebuilding its view; ask again"))
                raise _CoreBroken(ev) from exc
            if not self._certain():
                # The batch is neither logged nor executed: the next leader rebuilds from the store.
                raise _SteppedDown
            acted = acted or bool(batch)
            pending.extend(self.executor.execute(batch))
        if acted:
            self._reconcile_claims()
        self._publish_status(now)
        if operator is not None:
            node = operator.event.node
            operator.future.set_result(self.pool_state(node) if node in self.core.pool.nodes else None)

    def _reconcile_claims(self) -> None:
        """Give back the nodes the core let go of; take the out-of-service ones it answers for and
        the launched attempt's (taken before its preflight already, unless adopted unclaimed)."""
        assert self.core is not None and self.leadership is not None
        core = self.core
        take = [n for n, p in core.pool.nodes.items() if p.state in OUT_OF_SERVICE]
        if self.executor is not None:  # a launched attempt's nodes (one adopted from a controller
            take.extend(self.executor.attempt_nodes)  # that took no claims: an older version)
        self.claims.reconcile(core.holds(), take, self.leadership)

    def _publish_status(self, now: float) -> None:
        assert self.core is not None
        st = self.core.status(now)
        self.status = controller_pb2.RunStatus(
            run=self.cfg.run,
            phase=_PHASES.get(st.state.name, controller_pb2.RUN_PHASE_UNSPECIFIED),
            attempt=st.attempt,
            current_step=st.job_step,
            last_committed_step=st.latest_committed,
            restart_budget_left=max(0, st.restart_budget - st.restarts_used),
            since_last_progress_s=st.since_last_progress_s,
            nodes=list(st.nodes),
            rendezvous_id=st.rendezvous_id,
            reason=st.failure or st.state.value,
            waiting_for_nodes=st.waiting_for_nodes,
            waiting_since=st.waiting_since or 0.0,
            leader=self.cfg.identity,
            fence=int(self.leadership.fence) if self.leadership is not None else 0,
            claimed_nodes=len(self.claims.held()),
        )
        outcome = _OUTCOMES.get(st.state.name)
        if outcome is not None and self.outcome is None:
            self.outcome = outcome
            self.tasks.submit(self._finish, outcome)

    def pool_state(self, node: str) -> common_pb2.PoolState.ValueType:
        pn = self.core.pool.nodes.get(node) if self.core is not None else None
        return pn.state.proto if pn is not None else common_pb2.POOL_STATE_UNSPECIFIED

    def submit_and_wait(
        self, event: OperatorQuarantine | OperatorRelease
    ) -> Future[common_pb2.PoolState.ValueType | None]:
        """Queue an operator event; the future gets the node's pool state after the core acted."""
        fut: Future[common_pb2.PoolState.ValueType | None] = Future()
        self.events.put(_Operator(event=event, future=fut))
        return fut

    def submit(self, event: Event) -> None:
        """Queue an event from outside (operator requests go through the core like everything else)."""
        self.events.put(event)

    def _write_spec(self) -> None:
        assert self.leadership is not None
        spec = store_pb2.RunSpec(
            run=self.cfg.run,
            nodes=self.nodes,
            command=list(self.cfg.command),
            env=dict(self.cfg.env),
            max_attempts=self.restart_budget,
            created_at=self.clock(),
        )
        self.store.fenced_put(self.keys.spec(self.cfg.run), spec.SerializeToString(), self.leadership)

    # -- the view -----------------------------------------------------------------------------

    def _relist(self, *, fresh_core: bool = False) -> int:
        """List the store, feed the core its StoreListed (then the progress and exits it missed); returns the revision.
        fresh_core: a new core, which also gets the loss history from the event log (a relist after
        a watch gap keeps the core, and its history)."""
        assert self.executor is not None
        k, run = self.keys, self.cfg.run
        nodes, rev = self.store.get_prefix(k.nodes_prefix())
        listing = Listing(
            nodes=tuple(nodes),
            pool=tuple(self.store.get_prefix(k.base + "pool/")[0]),
            reputation=tuple(self.store.get_prefix(k.base + "reputation/")[0]),
            attempt=self.store.get(k.attempt(run)),
            checkpoints=tuple(self.store.get_prefix(k.checkpoints_prefix(run))[0]),
            stop=self.store.get(k.stop(run)),
            progress=tuple(self.store.get_prefix(k.progress_prefix(run))[0]),
            now=self.clock(),
            policy=self.store.get(k.policy(run)),
            claims=tuple(self.store.get_prefix(k.claims_prefix())[0]),
            memory=self.store.get(k.memory(run)),
        )
        elsewhere = self.claims.load(listing.claims)  # this run's claims (a predecessor's too) are its own
        snap, addresses, follow, attempt = self.translator.snapshot(listing, elsewhere)
        if fresh_core:
            losses, launched = read_history(self.cfg.event_log_path, run)
            snap = replace(snap, losses=losses, logged_attempt=launched)
        self._apply(addresses)
        if attempt is not None:
            self.executor.attempt = int(attempt.attempt)
            self.executor.attempt_nodes = {n: i for i, n in enumerate(attempt.nodes)}
        self._feed(snap, listing.now)
        for ev in follow:
            self.events.put(ev)
        return rev

    def _apply(self, addresses: Addresses) -> None:
        for node in addresses.forget:
            self.agents.forget(node)
        for node, (address, registration) in addresses.set.items():
            self.agents.set_address(node, address, registration)

    def _start_watches(self, start_revision: int) -> None:
        k = self.keys
        # Disjoint prefixes: each change is translated once (a watch of the run's whole prefix beside
        # its progress prefix fed every progress write to the core twice). Of the run's other keys the
        # translator reads the stop request and the policy.
        for prefix in (
            k.nodes_prefix(),
            k.progress_prefix(self.cfg.run),
            k.base + "evidence/",
            k.stop(self.cfg.run),
            k.policy(self.cfg.run),
            k.claims_prefix(),
        ):
            self._watches.append(self.store.watch_prefix(prefix, start_revision, self._on_watch))

    def _cancel_watches(self) -> None:
        for w in self._watches:
            with contextlib.suppress(StoreError):
                w.cancel()
        self._watches.clear()

    def _restart_watches(self, start_revision: int) -> None:
        self._cancel_watches()
        self._start_watches(start_revision)

    def _on_watch(self, item: WatchEvent | Relisted) -> None:
        """Watch thread: translate store events into core events. A bad value is dropped, alone."""
        if isinstance(item, Relisted):
            self.events.put(_Relist())
            return
        try:
            events, addresses = self.translator.watch_event(item)
        except ValueError as exc:
            log.warning("ignoring bad value at %s: %s", item.key, exc)
            return
        self._apply(addresses)
        for ev in events:
            if isinstance(ev, NodeClaimed) and not ev.run:
                ev = self._with_record(ev)
            self.events.put(ev)

    def _with_record(self, ev: NodeClaimed) -> NodeClaimed:
        """A node given back by another run, with the record that run wrote before it gave it back
        (its strikes and holds follow it); without one if the store cannot say now (the next relist)."""
        k = self.keys
        try:
            rec = record_view(self.store.get(k.pool(ev.node)), self.store.get(k.reputation(ev.node)))
        except StoreError as exc:
            log.warning("reading the record of %s (given back): %s", ev.node, exc)
            return ev
        return NodeClaimed(node=ev.node, record=rec) if rec is not None and rec.node == ev.node else ev

    def _check_adopted(self, executor: Executor, translator: Translator) -> None:
        """After a takeover: does every node of the adopted attempt actually run it?

        Worker exits arrive on the progress watch (the agent writes them into its NodeProgress), and
        a dead node by its lease DELETE, so nothing is polled while an attempt runs. One case has no
        record at all: the previous leader wrote the attempt record and died before its launch RPCs
        reached some agents. Once the grace for in-flight launches has passed, each node of the
        adopted attempt is asked once; a node with no worker of that attempt counts as exited."""
        adopted = self._adopted
        if adopted is None:
            return
        attempt, since = adopted
        self.stopping.wait(max(0.0, since + ADOPT_GRACE_S - time.monotonic()))
        pending = set(executor.attempt_nodes)
        give_up = time.monotonic() + ADOPT_CHECK_S
        while (
            pending
            and self.is_leader.is_set()
            and not self.stopping.is_set()
            and executor is self.executor
            and executor.attempt == attempt
        ):
            for node in sorted(pending):
                if translator.has_exited(node, attempt) or node not in executor.attempt_nodes:
                    pending.discard(node)
            asking = sorted(pending)
            answers = self.agents.gather(self.agents.status_async(n, timeout_s=2.0) for n in asking)
            for node, (out, resp) in zip(asking, answers, strict=True):
                if not out.ok or resp is None:
                    continue  # unreachable for now; if it is gone, its lease says so (NodeLost)
                pending.discard(node)
                if not any(w.run == self.cfg.run and w.attempt == attempt for w in resp.workers):
                    translator.mark_exited(node, attempt)
                    self.events.put(
                        AttemptExited(
                            node=node,
                            attempt=attempt,
                            detail="no worker of this attempt on the node: adopted at "
                            "takeover, but the previous leader's launch never reached it",
                            never_started=True,
                        )
                    )
            if pending and time.monotonic() > give_up:
                log.warning(
                    "adopted attempt %d: nodes %s never answered; their leases or the hang detector decide",
                    attempt,
                    sorted(pending),
                )
                return
            if pending:
                self.stopping.wait(0.5)
