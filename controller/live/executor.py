"""Executing a `Batch` in the order its contract states (controller/supervisor/actions.py).

The live controller's loop (controller/live/loop.py) hands each batch to `Executor.execute`: the
batch's entries are appended to the event log first (nothing is lost if the append fails), then
the actions run in order; what is due at once comes back as answers the loop feeds to the core in
the same iteration, slow work (agent RPCs) runs off the loop and its results come back as events.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import assert_never

from google.protobuf.message import DecodeError

import runwarden
from controller.backends.agents import AgentClients, PreflightOutcome
from controller.backends.base import AttemptSpec, BackendError, Scheduler, StaticFleet
from controller.backends.local import LaunchIncomplete, LocalBackend
from controller.fleet.claims import Claims, read_claim
from controller.live import bandwidth
from controller.live.paging import Pager
from controller.live.tasks import TaskPool
from controller.live.translate import Translator, parse
from controller.supervisor import flight_recorder
from controller.supervisor.actions import (
    Action,
    AllocateFromQueue,
    Batch,
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
from controller.supervisor.events import (
    ActionFailed,
    BandwidthMeasured,
    DumpsCollected,
    Event,
    NodeLaunchPath,
    PreflightResult,
    WorkersStarted,
)
from controller.supervisor.pool import NodeRecordView
from controller.supervisor.timers import Timers
from runwarden.eventlog import EventLog, EventLogError, LogEntry
from runwarden.store import Compare, KeyValue, Leadership, Put, Store, StoreError
from runwarden.v1 import agent_pb2, common_pb2, store_pb2

log = logging.getLogger(__name__)

# A planned stop waits for the node's exit this often; a node's hard stop gets this long to kill.
# An unplanned stop (a failed attempt) gets no longer between TERM and KILL either: ranks treat TERM
# as a stop request (nodeagent.trainer), but a failed attempt's ranks are mostly blocked in a
# collective where no Python handler runs, and what they could save is committed already. The
# core still waits up to its stop_grace_s for the exits.
_EXIT_POLL_S = 0.2
# Tries of the attempt record's transaction when its prefix compare of the claims meets another claim.
_RECORD_TRIES = 3
_HARD_STOP_GRACE_S = 2.0
# An unplanned stop asks warm workers to keep their processes: the ranks leave their collectives and
# park again, holding their state for the next attempt (StopWorkersRequest.park_within_s); a rank
# still inside the attempt after this long is killed with its group. Cold workers stop as always.
_PARK_WITHIN_S = 3.0
# Node records a persist transaction writes: 2 puts each, under etcd's default 128 operations a txn.
_PERSIST_CHUNK = 60


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSettings:
    """What execution needs to know about the run (from the shell's config)."""

    run: str
    command: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    procs_per_node: int
    rpc_timeout_s: float


class Executor:
    """Carries out one leader term's batches. Built anew whenever the shell (re)builds its core.

    1. Append the batch's entries to the event log (fsync), after any entries an earlier failed append
       left unwritten. If the append fails, the entries are kept (appended first next time: nothing is
       lost), no action runs except `SetTimer`, and each skipped action is answered at once with
       `ActionFailed(temporary=True, reason="event log append failed: ...")`.
    2. Execute the actions in order, one `match` over the `Action` union. `Launch` writes the attempt
       record with a compare-and-swap first, in one transaction with the leader's fence and every
       node's claim (each must still be this run's: controller/fleet/claims.py); a refused transaction
       or a failed write is answered at once with `ActionFailed(temporary=False)` and a relist (the
       StoreListed raises the core's attempt number past the stored record). The workers are then started
       through the `Backend`, off the loop. `RunPreflight` first claims its nodes for the run; a node
       another run holds (or out-bids us for) is answered with `ActionFailed(node=..., temporary=True)`,
       and the core picks the next spare. `PersistNode` writes a node's record only while this run
       holds its claim, or no run does (in one fenced transaction that compares the claim).

    `execute` returns the answers that are due at once; the loop feeds them to the core in the same
    iteration. Slow work (agent RPCs) runs in a thread pool, and its results come back on the queue:
    `PreflightResult`, `DumpsCollected`, `BandwidthMeasured`, `AttemptExited`, or `ActionFailed` for what
    could not be done.
    """

    def __init__(
        self,
        settings: RunSettings,
        *,
        store: Store,
        leadership: Leadership,
        eventlog: EventLog,
        timers: Timers,
        backend: LocalBackend,
        agents: AgentClients,
        pager: Pager,
        translator: Translator,
        claims: Claims | None = None,
        tasks: TaskPool,
        scheduler: Scheduler | None = None,
        allocated: threading.Event | None = None,
        stopping: threading.Event | None = None,
        post: Callable[[Event], None],
        relist: Callable[[], None],
        listeners: list[Callable[[LogEntry], None]],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.s = settings
        self.store = store
        self.keys = store.keys
        self.leadership = leadership
        self.eventlog = eventlog
        self.timers = timers
        self.backend = backend
        self.agents = agents
        self.pager = pager
        self.translator = translator
        self.claims = claims or Claims(store, settings.run)
        self.tasks = tasks
        self.scheduler: Scheduler = scheduler or StaticFleet()
        self.kept_out: set[str] = set()  # quarantined through the scheduler: never asked of the queue
        self.save_commit_s = 0.0  # the longest checkpoint save + commit seen (the stop must fit it)
        self.allocated = allocated or threading.Event()  # the leader's allocation is granted
        self.stopping = stopping or threading.Event()  # the controller is exiting: no waits go on
        self.post = post  # an event for the loop's queue (RPC results, from rpc_pool threads)
        self.relist = relist  # ask the loop to list the store and send a StoreListed
        self.listeners = listeners
        self.clock = clock
        self.unwritten: list[LogEntry] = []  # entries of a batch whose append failed
        self.attempt = 0
        self.attempt_nodes: dict[str, int] = {}  # node -> node rank of the current attempt
        # node -> its unplanned stop, done once the node answered (or its RPC failed): a later launch
        # or preflight of the node waits for it (a lost node's relaunch is decided as the stop begins)
        self.stops_in_flight: dict[str, Future[None]] = {}

    # -- the batch -----------------------------------------------------------------------------

    def execute(self, batch: Batch) -> list[Event]:
        """Log, then act; returns the answers due at once (fed to the core in the same iteration)."""
        self.unwritten.extend(batch.entries)
        try:
            self._append_unwritten()
        except EventLogError as exc:
            log.error(
                "event log append failed (%d entries kept for the next append): %s", len(self.unwritten), exc
            )
            answers: list[Event] = []
            for action in batch.actions:
                if isinstance(action, SetTimer):
                    self.timers.set(action.key, action.at)
                else:
                    answers.append(
                        ActionFailed(action=action, temporary=True, reason=f"event log append failed: {exc}")
                    )
            return answers
        answers = []
        persisting: list[NodeRecordView] = []  # consecutive PersistNode actions: written together
        handover = self._handover(batch.actions)
        for action in memory_first(batch.actions):
            if isinstance(action, PersistNode):
                persisting.append(action.record)
                continue
            if persisting:
                self._persist_all(persisting)
                persisting = []
            answers.extend(self._execute(action, handover))
        if persisting:
            self._persist_all(persisting)
        return answers

    def _append_unwritten(self) -> None:
        """The batch's entries (and any a failed append left) in one write and one fsync."""
        if not self.unwritten:
            return
        written = self.eventlog.append_all(self.unwritten)
        self.unwritten.clear()
        for entry in written:
            for listener in list(self.listeners):
                try:
                    listener(entry)
                except Exception:  # a subscriber's bug must not stop the log or the batch
                    log.exception("event listener failed")

    def _handover(self, actions: Sequence[Action]) -> Handover:
        """The nodes whose unplanned stop the batch's relaunch carries (LaunchWorkersRequest.stop_older):
        one call per surviving host, not a stop and then a launch. A lost node's failure is decided
        as its stop begins, so its relaunch comes in the stop's batch; at 2,048 hosts the separate
        stops were 2,047 more calls from one loop before the launches could follow."""
        stop = next((a for a in actions if isinstance(a, StopAttempt) and not a.planned), None)
        launch = next((a for a in actions if isinstance(a, Launch)), None)
        if stop is None or launch is None or stop.attempt != self.attempt or launch.attempt <= stop.attempt:
            return Handover(stop=None, nodes=frozenset())
        relaunched = {nr.node for nr in launch.nodes}
        return Handover(
            stop=stop, nodes=frozenset(n for n in stop.nodes if n in relaunched and self.agents.address(n))
        )

    def _execute(self, action: Action, handover: Handover) -> list[Event]:
        match action:
            case SetTimer():
                self.timers.set(action.key, action.at)
            case RunPreflight():
                self.tasks.submit(self._claim_then_preflight, action)
            case Launch():
                failed = self._launch(action, handover)
                if failed and handover.stop is not None and handover.nodes:
                    self._stop_now(handover.stop, sorted(handover.nodes))  # not launched: stopped as asked
                return failed
            case StopAttempt() if action.planned:
                self.tasks.submit(self._stop, action)
            case StopAttempt():
                self._stop_now(action, [n for n in action.nodes if n not in handover.nodes])
            case CollectDumps():
                self.tasks.submit(self._collect, action)
            case MeasureBandwidth():
                self.tasks.submit(self._measure_bandwidth, action)
            case PersistNode():
                self._persist(action.record)
            case PersistCheckpoint():
                self._persist_checkpoint(action)
            case PersistMemory():
                self._persist_memory(action)
            case Page():
                self.pager.page(action.reason, action.severity)
            case Quarantine():
                # The pool state is persisted by PersistNode; the scheduler keeps the node out of its
                # own placements too (a Slurm drain, a Kubernetes taint, off the Ray placement).
                self.kept_out.add(action.node)
                self.tasks.submit(self._tell_scheduler, action)
            case Release():
                self.kept_out.discard(action.node)
                self.tasks.submit(self._tell_scheduler, action)
            case AllocateFromQueue():
                self.tasks.submit(self._request_nodes, action, tuple(sorted(self.kept_out)))
            case TakeSpare():
                log.info("%s", action)  # the spare is already ours: inside the allocation
            case _:
                assert_never(action)
        return []

    # -- the scheduler ---------------------------------------------------------------------------

    def _tell_scheduler(self, action: Quarantine | Release) -> None:
        """The pool's decision, told to the scheduler too; a failure is reported, the pool stands."""
        what = "quarantine" if isinstance(action, Quarantine) else "release"
        try:
            if isinstance(action, Quarantine):
                self.scheduler.quarantine(action.node, action.reason)
            elif not self.scheduler.release(action.node):
                log.warning(
                    "%s: %s holds it (not runwarden): left as it is", action.node, self.scheduler.name
                )
        except BackendError as exc:
            self.post(
                ActionFailed(
                    action=action,
                    temporary=True,
                    node=action.node,
                    reason=f"{what} via {self.scheduler.name}: {exc}",
                )
            )

    def _request_nodes(self, action: AllocateFromQueue, exclude: tuple[str, ...]) -> None:
        if not self.allocated.is_set():
            # The allocation's own agents are still coming: an ask now would take nodes twice over.
            self.post(
                ActionFailed(action=action, temporary=True, reason="the run's allocation is not granted yet")
            )
            return
        try:
            req = self.scheduler.request_nodes(action.count, exclude=exclude, reason=action.reason)
        except BackendError as exc:
            self.post(
                ActionFailed(action=action, temporary=True, reason=f"queue via {self.scheduler.name}: {exc}")
            )
            return
        log.info("asked %s's queue for %d node(s): %s", self.scheduler.name, req.count, req.id)

    # -- launch --------------------------------------------------------------------------------

    def _launch(self, action: Launch, handover: Handover) -> list[Event]:
        t0 = time.monotonic()
        fence = int(self.leadership.fence)
        launched_at = self.clock()
        ordered = sorted(action.nodes, key=lambda nr: nr.node_rank)
        try:
            spec = AttemptSpec(
                run=action.run,
                attempt=action.attempt,
                nodes=tuple(nr.node for nr in ordered),
                command=self.s.command,
                env={**dict(self.s.env), **_snapshot_env(action)},
                resume_step=action.resume_step,
                procs_per_node=self.s.procs_per_node,
                leader_fence=fence,
                cold=action.cold,
                launched_at=launched_at,
            )
        except BackendError as exc:
            return [self._not_launched(action, f"attempt {action.attempt} cannot be launched: {exc}")]
        try:
            self.scheduler.check_stop_fits(self.save_commit_s)
        except BackendError as exc:
            self.pager.page(f"attempt {action.attempt} not launched: {exc}", "critical")
            return [self._not_launched(action, f"attempt {action.attempt} cannot be launched: {exc}")]
        record = store_pb2.AttemptRecord(
            run=action.run,
            attempt=action.attempt,
            rendezvous_id=action.rendezvous_id,
            nodes=list(spec.nodes),
            resume_step=action.resume_step,
            launched_at=launched_at,
            leader_fence=fence,
            resume_snapshot_attempt=action.resume_snapshot,
            controller_version=runwarden.__version__,
        )
        key = self.keys.attempt(action.run)
        # A node vouched for without a preflight now (a pre-validated spare) was not claimed by one:
        # claimed here, before the attempt record compares every node's claim.
        refused = self.claims.take(spec.nodes, self.leadership)
        if refused:
            self.relist()
            why = "; ".join(f"{r.node}: {r.reason}" for r in refused)
            return [
                self._not_launched(action, f"attempt {action.attempt} cannot be launched: not claimed: {why}")
            ]
        ok = False
        for _ in range(_RECORD_TRIES):
            claimed = self.claims.compares(spec.nodes)
            if isinstance(claimed, str):
                self.relist()
                return [self._not_launched(action, f"attempt {action.attempt} cannot be launched: {claimed}")]
            try:
                cur = self.store.get(key)
                if cur is not None:
                    prev = _attempt_of(cur.value)
                    if prev >= action.attempt:
                        self.relist()
                        return [
                            self._not_launched(
                                action,
                                f"attempt {action.attempt} refused: the store already "
                                f"records attempt {prev} (another leader launched)",
                            )
                        ]
                ok = self.store.txn(
                    f"attempt record {action.attempt}",
                    [
                        self.store.fence(self.leadership),
                        Compare(key=key, mod_revision=cur.mod_revision)
                        if cur
                        else Compare(key=key, absent=True),
                        *claimed,
                    ],
                    [Put(key=key, value=record.SerializeToString())],
                ).succeeded
            except StoreError as exc:
                self.relist()
                return [
                    self._not_launched(
                        action, f"attempt {action.attempt}: attempt record write failed: {exc}"
                    )
                ]
            # A compare over the whole claims prefix (a large attempt) also fails for a claim of
            # another node written meanwhile: read the claims again and retry; per-node compares
            # failed for one of this attempt's own (or the fence, or the record): no retry.
            if ok or self.leadership.lost.is_set() or not any(c.prefix for c in claimed):
                break
        if not ok or self.leadership.lost.is_set():
            self.relist()
            return [
                self._not_launched(
                    action,
                    f"attempt {action.attempt} refused by fencing (the attempt record, the leadership "
                    "or a node's claim changed)",
                )
            ]
        self._retire_relaunch_stop()
        self.attempt = action.attempt
        self.attempt_nodes = {nr.node: nr.node_rank for nr in action.nodes}
        self.translator.new_attempt(action.attempt)
        self.tasks.submit(self._start_workers, action, spec, time.monotonic() - t0, handover)
        return []

    def _retire_relaunch_stop(self) -> None:
        """A relaunching stop request has done its work once the next attempt launches: delete it, so
        neither a later StoreListed nor an agent's watch stops the new attempt. Not before: the agents
        watch the key, and a stop deleted while the ranks still save would be withdrawn there. A stop
        that ends the run stays, so a restarted controller does not relaunch it."""
        key = self.keys.stop(self.s.run)
        try:
            cur = self.store.get(key)
            if cur is None:
                return
            req = store_pb2.StopRequest.FromString(cur.value)
            if req.relaunch:
                self.store.delete(key)
        except (StoreError, DecodeError) as exc:
            log.warning("could not retire the handled stop request: %s", exc)

    def _not_launched(self, action: Launch, reason: str) -> ActionFailed:
        log.error("%s", reason)
        return ActionFailed(action=action, temporary=False, reason=reason)

    def _start_workers(self, action: Launch, spec: AttemptSpec, record_s: float, handover: Handover) -> None:
        t0 = time.monotonic()
        stop = handover.stop
        stop_older = (
            {
                n: agent_pb2.StopOlder(
                    grace_s=min(stop.grace_s, _HARD_STOP_GRACE_S), park_within_s=_PARK_WITHIN_S
                )
                for n in handover.nodes
            }
            if stop is not None
            else {}
        )
        try:
            handle = self.backend.launch(spec, after=self._after_stop, stop_older=stop_older)
        except LaunchIncomplete as exc:
            for f in exc.failures:
                self.translator.mark_exited(f.node, action.attempt)
                self.post(
                    ActionFailed(
                        action=action, temporary=f.temporary, reason=f"launch failed: {f.reason}", node=f.node
                    )
                )
            # a launch refused before it stopped anything (no lease, draining, unreachable) leaves
            # the older attempt's ranks there: stopped as the stop asked
            unstopped = sorted(f.node for f in exc.failures if f.node in handover.nodes)
            if stop is not None and unstopped:
                self._stop_now(stop, unstopped)
            return
        except BackendError as exc:
            self.post(ActionFailed(action=action, temporary=False, reason=f"launch failed: {exc}"))
            if stop is not None and handover.nodes:
                self._stop_now(stop, sorted(handover.nodes))
            return
        paths = []
        for s in handle.started:  # what the agents said, from outside: a value the core refuses is dropped
            try:
                paths.append(NodeLaunchPath(node=s.node, path=s.path, detail=s.detail[:500]))
            except ValueError as exc:
                log.warning("launch path of %s not recorded: %s", s.node, exc)
        log.info(
            "attempt %d: launched on %d node(s) (%d stopping attempt %d first, in the same call): "
            "attempt record and claims %.2f s, then every node answered in %.2f s",
            action.attempt,
            len(spec.nodes),
            len(handover.nodes),
            stop.attempt if stop is not None else 0,
            record_s,
            time.monotonic() - t0,
        )
        if paths:
            self.post(WorkersStarted(attempt=action.attempt, nodes=tuple(paths)))

    # -- agent work ----------------------------------------------------------------------------

    def _claim_then_preflight(self, action: RunPreflight) -> None:
        """Claim the nodes for this run first (a node another run holds is never preflighted or
        burned in here); each refused node is answered on its own, the rest are preflighted."""
        refused = {r.node: r for r in self.claims.take(action.nodes, self.leadership)}
        for node in action.nodes:
            if node in refused:
                r = refused[node]
                log.info("%s not taken for %s: %s", node, action.purpose, r.reason)
                self.post(
                    ActionFailed(
                        action=action, temporary=r.temporary, node=node, reason=f"not claimed: {r.reason}"
                    )
                )
            else:
                call = self._preflight_after_stop(node, action)
                # no thread waits for it: the answer is posted from the agents' loop
                self.agents.submit(call).add_done_callback(
                    functools.partial(self._preflight_done, action, node)
                )

    async def _preflight_after_stop(self, node: str, action: RunPreflight) -> PreflightOutcome:
        """(the agents' loop) The node's preflight, once its stop in flight has answered: never beside
        the ranks it stops; the preflight's deadline counts from when it is sent."""
        await self._after_stop(node)
        return await self.agents.run_preflight_async(
            node, agent_pb2.RunPreflightRequest(mode=action.mode), action.timeout_s
        )

    def _preflight_done(self, action: RunPreflight, node: str, done: Future[PreflightOutcome]) -> None:
        try:
            out = done.result()
        except BaseException:  # a bug (or the clients closing): the core's preflight timer answers
            log.exception("preflight of %s", node)
            return
        if not out.ok:
            self.post(
                ActionFailed(
                    action=action,
                    temporary=out.rpc.temporary,
                    node=node,
                    reason=f"preflight rpc ({out.rpc.tries} tries): {out.rpc.error}",
                )
            )
            return
        self.post(
            PreflightResult(
                node=node,
                passed=out.summary.passed,
                mode=action.mode,
                failed_checks=tuple(r.name for r in out.failed),
                duration_s=out.summary.duration_s,
                inconclusive_checks=() if out.summary.passed else tuple(out.summary.inconclusive_checks),
            )
        )

    def _stop(self, action: StopAttempt) -> None:
        """A planned stop: ask every node to stop (finish the step, save, commit, exit), wait once for
        all their exits (one thread for the whole attempt, however many nodes), then stop every node
        (what still runs is ended; the rest answer at once)."""
        req = agent_pb2.RequestStopRequest(run=self.s.run, reason=action.reason)
        self.agents.gather(self.agents.request_stop_async(n, req) for n in action.nodes)
        # The stop also reaches the agents through the run's stop key; wait for the exits either way.
        deadline = time.monotonic() + action.grace_s  # ends as soon as every exit is seen
        running = list(action.nodes)
        while running and time.monotonic() < deadline:
            running = [n for n in running if not self.translator.has_exited(n, action.attempt)]
            if running and self.stopping.wait(_EXIT_POLL_S):
                return
        self.agents.gather(self._stop_node(action, n) for n in action.nodes)

    def _stop_now(self, action: StopAttempt, nodes: Sequence[str]) -> None:
        """An unplanned stop of `nodes` (the action's, less those its relaunch stops: `_handover`): every
        node at once, on the agents' loop (no thread waits), each node's stop registered before this
        returns, so that an action after it in this batch or a later one (the relaunch) finds it."""
        stopping = {n: Future[None]() for n in nodes}
        self.stops_in_flight.update(stopping)

        async def stop_all() -> None:
            async def one(node: str) -> None:
                try:
                    await self._stop_node(action, node)
                finally:
                    stopping[node].set_result(None)

            await asyncio.gather(*(one(n) for n in nodes))

        self.agents.submit(stop_all())

    async def _after_stop(self, node: str) -> None:
        """(the agents' loop) Until the node's unplanned stop in flight, if any, has answered."""
        stop = self.stops_in_flight.get(node)
        if stop is not None and not stop.done():
            await asyncio.wrap_future(stop)

    async def _stop_node(self, action: StopAttempt, node: str) -> None:
        """(the agents' loop)"""
        if not self.agents.address(node):
            # its lease expired and its address was forgotten: no agent to ask, and retrying "no
            # address" until the stop's deadline would only hold a thread
            log.info("stop of attempt %d: %s has no agent (lost); nothing to stop", action.attempt, node)
            return
        grace = min(action.grace_s, _HARD_STOP_GRACE_S)
        out, answer = await self.agents.stop_workers_async(
            node,
            agent_pb2.StopWorkersRequest(
                run=self.s.run,
                attempt=action.attempt,
                grace_s=grace,
                park_within_s=0.0 if action.planned else _PARK_WITHIN_S,
            ),
            grace + (0.0 if action.planned else _PARK_WITHIN_S) + self.s.rpc_timeout_s,
        )
        if not out.ok:
            self.post(
                ActionFailed(
                    action=action,
                    temporary=out.temporary,
                    node=node,
                    reason=f"stop rpc ({out.tries} tries): {out.error}",
                )
            )
        elif answer is not None and not action.planned and action.attempt == self.attempt:
            # The core waits for every node's exit; the answer has it (the agent answers once the
            # exit is recorded and a parked group is back). A planned stop's exits come through the
            # progress watch, which carries the ranks' stop reasons. Once the next attempt has
            # launched (a lost node's relaunch does not wait for them) they are old news: not posted.
            exited = self.translator.exit_from_stop(node, action.attempt, answer)
            if exited is not None:
                self.post(exited)

    def _collect(self, action: CollectDumps) -> None:
        """Dumps from every live rank of the attempt, analysed by the flight-recorder rule only.

        The core ranks this answer below hardware evidence and above heartbeats; a rank that
        could not answer (stopped, dead) is "no dump", which is itself evidence."""
        started = time.monotonic()
        rank_dumps: list[agent_pb2.RankDump] = []
        rank_to_node = self.translator.ranks()
        # All nodes at once, each rank given most of the core's deadline: a stopped rank costs its
        # timeout once, not once per node, and the answer arrives before the core gives up on it.
        per_rank_s = max(0.5, action.timeout_s * 0.6)
        req = agent_pb2.CollectFlightRecorderRequest(run=self.s.run, timeout_s=per_rank_s)
        answers = self.agents.gather(
            self.agents.collect_dumps_async(n, req, per_rank_s + 5.0) for n in action.nodes
        )
        for node, (out, resp) in zip(action.nodes, answers, strict=True):
            if not out.ok or resp is None:
                rank_dumps.extend(
                    agent_pb2.RankDump(rank=rank, ok=False, error=f"agent: {out.error}")
                    for rank, n in rank_to_node.items()
                    if n == node
                )
                continue
            for d in resp.dumps:
                rank_to_node.setdefault(d.rank, node)
                rank_dumps.append(d)
        collected = time.monotonic()
        try:
            verdict = flight_recorder.verdict_from_rank_dumps(rank_dumps, rank_to_node)
        except ValueError as exc:  # dumps are input from outside
            self.post(
                ActionFailed(action=action, temporary=False, reason=f"flight-recorder analysis failed: {exc}")
            )
            return
        self.post(DumpsCollected(attempt=action.attempt, verdict=verdict))
        log.info(
            "attempt %d: flight-recorder dumps of %d rank(s) from %d node(s) (%d with a dump) collected in "
            "%.2f s, analysed in %.2f s",
            action.attempt,
            len(rank_dumps),
            len(action.nodes),
            sum(d.ok for d in rank_dumps),
            collected - started,
            time.monotonic() - collected,
        )

    def _measure_bandwidth(self, action: MeasureBandwidth) -> None:
        """The set, then the ring pairs (controller.live.bandwidth), within the action's timeout.
        Nothing measured at all is a temporary ActionFailed: the core launches without the gate."""
        try:
            answer: BandwidthMeasured | str = bandwidth.run_gate(
                self.agents,
                action.nodes,
                action.timeout_s,
                iterations=action.iterations or bandwidth.ITERATIONS,
            )
        except Exception as exc:  # a bug here must not leave the core waiting out its timer
            log.exception("bandwidth gate")
            answer = f"the measurement failed: {type(exc).__name__}: {exc}"[:500]
        if isinstance(answer, str):
            log.warning("bandwidth gate on %s: %s", ", ".join(action.nodes), answer)
            self.post(ActionFailed(action=action, temporary=True, reason=answer))
            return
        self.post(answer)

    # -- the store -----------------------------------------------------------------------------

    def _persist_checkpoint(self, action: PersistCheckpoint) -> None:
        self.save_commit_s = max(self.save_commit_s, action.save_duration_s)
        rec = store_pb2.CheckpointCommit(
            run=self.s.run,
            step=action.step,
            path=action.path,
            committed_at=self.clock(),
            attempt=action.attempt,
            save_duration_s=action.save_duration_s,
            invalid=action.invalid,
        )
        try:
            self.store.fenced_put(
                self.keys.checkpoint(self.s.run, action.step), rec.SerializeToString(), self.leadership
            )
        except StoreError as exc:
            log.warning("recording checkpoint %d failed: %s", action.step, exc)

    def _persist_memory(self, action: PersistMemory) -> None:
        """The run's supervisor memory, fenced by this leadership (a deposed leader writes nothing)."""
        try:
            self.store.fenced_put(
                self.keys.memory(self.s.run), action.record.SerializeToString(), self.leadership
            )
        except StoreError as exc:
            log.warning(
                "recording the supervisor's memory failed: %s (written again at its next change)", exc
            )

    def _persist_all(self, records: Sequence[NodeRecordView]) -> None:
        """Node records, many in one transaction: a fleet's records (2,064 at a 2,048-host run's start)
        were a read and a transaction each, seconds of the loop's thread. One read of the claims, then
        `_PERSIST_CHUNK` nodes a transaction under the same compares as one node's; a chunk whose
        compares fail (a claim changed meanwhile) is written node by node, each deciding on its own."""
        records = list({rec.node: rec for rec in records}.values())  # a node twice: its last record
        if len(records) == 1:
            self._persist(records[0])
            return
        for rec in records:
            if self._out_of_service(rec) and not self.claims.holds(rec.node):
                self.claims.take_now(rec.node, self.leadership)
        try:
            kvs, _ = self.store.get_prefix(self.keys.claims_prefix())
        except StoreError as exc:
            log.warning("persisting %d node records failed: %s", len(records), exc)
            return
        claims = {kv.key: kv for kv in kvs}
        writes = []
        for rec in records:
            claim = self._compare_claim(rec, claims.get(self.keys.claim(rec.node)))
            if claim is not None:
                writes.append((rec, claim, self._record_puts(rec)))
        for i in range(0, len(writes), _PERSIST_CHUNK):
            chunk = writes[i : i + _PERSIST_CHUNK]
            try:
                ok = self.store.txn(
                    f"persist {len(chunk)} nodes",
                    [self.store.fence(self.leadership), *(claim for _, claim, _ in chunk)],
                    [put for _, _, puts in chunk for put in puts],
                ).succeeded
            except StoreError as exc:
                log.warning("persisting %d node records failed: %s", len(chunk), exc)
                continue
            if not ok:
                for rec, _, _ in chunk:
                    self._persist(rec)

    def _persist(self, rec: NodeRecordView) -> None:
        try:
            if self._out_of_service(rec) and not self.claims.holds(rec.node):
                self.claims.take_now(rec.node, self.leadership)
            claim = self._compare_claim(rec, self.store.get(self.keys.claim(rec.node)))
            if claim is None:
                return
            ok = self.store.txn(
                f"persist {rec.node}", [self.store.fence(self.leadership), claim], self._record_puts(rec)
            ).succeeded
            if not ok:
                log.info("%s's record not written: its claim or this leadership changed meanwhile", rec.node)
        except StoreError as exc:
            log.warning("persisting %s failed: %s", rec.node, exc)

    def _record_puts(self, rec: NodeRecordView) -> list[Put]:
        now = self.clock()
        entry = store_pb2.PoolEntry(
            node=rec.node,
            state=common_pb2.PoolState.ValueType(rec.pool_state),
            reason=rec.reason,
            burn_in_passes=rec.burn_in_passes,
            operator_hold=rec.operator_hold,
            awaiting_repair_since=rec.awaiting_repair_since,
            since=now,
            run=self.s.run,
            evidence=list(rec.evidence[-16:]),
        )
        rep = store_pb2.Reputation(
            node=rec.node,
            failures=len(rec.failure_times),
            failure_times=list(rec.failure_times[-32:]),
            straggler_flags=rec.straggler_flags,
            preflight_rejections=rec.preflight_rejections,
            updated_at=now,
            known_since=rec.known_since,
            repaired_at=rec.repaired_at,
            evidence_kinds=[common_pb2.EvidenceKind.ValueType(k) for k in rec.evidence_kinds[-32:]],
        )
        return [
            Put(key=self.keys.pool(rec.node), value=entry.SerializeToString()),
            Put(key=self.keys.reputation(rec.node), value=rep.SerializeToString()),
        ]

    @staticmethod
    def _out_of_service(rec: NodeRecordView) -> bool:
        return rec.pool_state not in (common_pb2.POOL_STATE_SPARE, common_pb2.POOL_STATE_ASSIGNED)

    def _compare_claim(self, rec: NodeRecordView, kv: KeyValue | None) -> Compare | None:
        """Only the run holding a node writes its record (or any run, while no run holds it; a node
        put out of service is claimed first, so the run that quarantined it answers for it). None:
        another run holds it, and its record is that run's to write. `kv`: the node's claim as read."""
        key = self.keys.claim(rec.node)
        if kv is None:
            return Compare(key=key, absent=True)
        holder = read_claim(kv)
        if holder is not None and holder.run == self.s.run:
            return Compare(key=key, mod_revision=kv.mod_revision)
        log.debug("%s's record is run %s's to write", rec.node, holder.run if holder else "?")
        return None

    def close(self) -> None:
        with contextlib.suppress(EventLogError):
            self.eventlog.close()


@dataclass(frozen=True, slots=True)
class Handover:
    """An unplanned stop whose `nodes` the relaunch in the same batch stops itself (`_handover`)."""

    stop: StopAttempt | None
    nodes: frozenset[str]


def memory_first(actions: Sequence[Action]) -> list[Action]:
    """A batch's actions in the order they run: the supervisor's memory first, the rest as the core
    emitted them. A leader killed in the middle of the batch has then written what the logged
    decisions counted (a crash loop's count, the budget) for its successor."""
    return [a for a in actions if isinstance(a, PersistMemory)] + [
        a for a in actions if not isinstance(a, PersistMemory)
    ]


def _attempt_of(value: bytes) -> int:
    """The attempt number a stored attempt record holds; an unreadable record counts as none."""
    try:
        return int(parse(store_pb2.AttemptRecord, value).attempt)
    except ValueError:
        return 0


def _snapshot_env(action: Launch) -> dict[str, str]:
    """What the ranks' Snapshotter reads (nodeagent.trainer.snapshot): the policy's interval, and
    the snapshot this attempt resumes from (RUNWARDEN_RESUME_STEP is its step)."""
    env = {"RUNWARDEN_SNAPSHOT_INTERVAL_S": f"{action.snapshot_interval_s:g}"}
    if action.resume_snapshot:
        env["RUNWARDEN_RESUME_SNAPSHOT"] = str(action.resume_snapshot)
    return env
