"""The live controller: the thin shell around the sans-IO supervisor core.

raft's split: `controller.supervisor.machine.Supervisor` is the logic (no sockets, clock or threads); this module
is the goroutine-shell. It owns every side effect, and nothing else:

* **Leadership.** It campaigns in etcd; only the leader acts. Its fence (the election key's create
  revision) goes into every attempt record and every fenced write, so a stale leader cannot launch.
* **Level-triggered view.** On becoming leader, and after any watch gap (a compacted revision, a
  lost etcd), it lists the store and hands the core a `Snapshot`, then watches from that revision.
* **One loop.** Watch callbacks, RPC results and timers only enqueue events; a single thread
  pops them, calls `core.handle(event, now)`, and executes the batch in order, appending each
  event to the log (fsync) before the actions it explains.
* **Slow work off the loop.** Agent RPCs (preflight, launch, stop, dump collection) run in a
  thread pool with deadlines; their outcomes come back as events.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller.live.agents import AgentClients
from controller.live.paging import Pager
from controller.supervisor import types as t
from runwarden.eventlog import EventLog
from runwarden.store import Relisted, Store, StoreError, WatchEvent
from runwarden.v1 import agent_pb2, common_pb2, controller_pb2, events_pb2, store_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class ShellConfig:
    """What the shell needs beyond the core's policy."""

    run: str
    command: tuple[str, ...]             # what each rank runs (torchrun wraps it)
    run_dir: Path                        # event log, checkpoints for the local backend
    identity: str = field(default_factory=lambda: f"{socket.gethostname()}-{time.time_ns() % 10**6}")
    election_ttl_s: float = 3.0
    tick_s: float = 0.25
    rpc_timeout_s: float = 10.0
    env: tuple[tuple[str, str], ...] = ()
    procs_per_node: int = 1
    rdzv_host: str = "127.0.0.1"
    torchrun: tuple[str, ...] = (sys.executable, "-m", "torch.distributed.run")
    dump_timeout_s: float = 3.0

    @property
    def event_log_path(self) -> Path:
        return self.run_dir / "events.jsonl"


# After a takeover, launch RPCs the dead leader had in flight may still land for this long.
ADOPT_GRACE_S = 2.0
# ... and the adopted attempt's nodes are asked whether they run it for at most this long.
ADOPT_CHECK_S = 60.0


class _Relist:
    """Marker on the queue: the view has a gap; list the store and send a Snapshot."""


@dataclass(frozen=True, slots=True, kw_only=True)
class _Operator:
    """An operator request on the queue, with the future its API call waits on."""

    event: Any
    future: Future[Any]


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


class LiveController:
    """Runs one controller process: campaign, reconcile, then drive the core until stopped."""

    def __init__(
        self,
        cfg: ShellConfig,
        store: Store,
        core_factory: Callable[[], Any],
        *,
        agents: AgentClients | None = None,
        pager: Pager | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.keys = store.keys
        self._core_factory = core_factory
        self.core: Any = None
        probe = core_factory()
        self.nodes = int(probe.plan.nodes)
        self.restart_budget = int(probe.cfg.restart_budget)
        self.agents = agents or AgentClients()
        self.pager = pager or Pager()
        self.clock = clock
        self.events: queue.Queue[Any] = queue.Queue()
        self.timers: dict[str, float] = {}
        self.pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="rpc")
        self.stopping = threading.Event()
        self.leadership: Any = None
        self.eventlog: EventLog | None = None
        self._watches: list[Any] = []
        self._known_nodes: dict[str, store_pb2.NodeRecord] = {}
        self._attempt_nodes: dict[str, int] = {}   # node -> node rank of the current attempt
        self._attempt = 0
        self._exited: set[tuple[str, int]] = set()
        self._rank_to_node: dict[int, str] = {}
        self._committed_seen = -1
        self._adopted: tuple[int, float] | None = None
        self._ckpt_failures: set[tuple[int, int]] = set()
        self.listeners: list[Callable[[events_pb2.Event], None]] = []
        self.is_leader = threading.Event()
        self.status: controller_pb2.RunStatus | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    def run(self) -> None:
        """Campaign, then lead until `stop()`; on losing leadership, campaign again."""
        while not self.stopping.is_set():
            try:
                self.leadership = self.store.campaign(
                    "controller", self.cfg.identity.encode(), self.cfg.election_ttl_s, timeout_s=1.0
                )
            except StoreError as exc:
                log.debug("campaign: %s", exc)
                continue
            log.info("%s is the leader (fence %d)", self.cfg.identity, self.leadership.fence)
            try:
                self._lead()
            finally:
                self.is_leader.clear()
                for w in self._watches:
                    with contextlib.suppress(Exception):
                        w.cancel()
                self._watches.clear()
                if self.eventlog is not None:
                    self.eventlog.close()
                    self.eventlog = None
                with contextlib.suppress(Exception):
                    self.leadership.resign()

    def stop(self) -> None:
        self.stopping.set()
        self.events.put(t.Tick())

    def close(self) -> None:
        self.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.agents.close()

    # -- leading ------------------------------------------------------------------------------

    def _lead(self) -> None:
        self.eventlog = EventLog(self.cfg.event_log_path)
        self.core = self._core_factory()
        self.events = queue.Queue()
        self.timers.clear()
        self._write_spec()
        revision = self._relist()
        # An attempt found in the store was launched by an earlier leader; it may never have reached
        # the agents (that leader died between the record and the RPCs). `_check_adopted` asks them.
        self._adopted = (self._attempt, time.monotonic()) if self._attempt else None
        self._start_watches(revision + 1)
        self.is_leader.set()
        threading.Thread(target=self._check_adopted, name="adopt-check", daemon=True).start()
        next_tick = self.clock()
        while not self.stopping.is_set():
            if self.leadership.lost.is_set():
                log.warning("leadership lost; stepping down")
                return
            now = self.clock()
            due = min([next_tick, *self.timers.values()])
            try:
                item = self.events.get(timeout=max(0.0, min(due - now, self.cfg.tick_s)))
            except queue.Empty:
                item = None
            now = self.clock()
            if isinstance(item, _Relist):
                try:
                    rev = self._relist()
                except StoreError as exc:
                    log.warning("relist failed: %s", exc)
                    self._feed(t.ControlPlaneLost(), now)
                    time.sleep(0.5)
                    self.events.put(_Relist())
                    continue
                self._restart_watches(rev + 1)
                continue
            if item is not None:
                self._feed(item, now)
            fired = [k for k, at in self.timers.items() if at <= now]
            for k in fired:
                del self.timers[k]
            if fired or now >= next_tick:
                next_tick = now + self.cfg.tick_s
                self._feed(t.Tick(), now)

    def _feed(self, event: Any, now: float) -> None:
        future: Future[Any] | None = None
        if isinstance(event, _Operator):
            event, future = event.event, event.future
        if isinstance(event, t.CheckpointCommitted):
            self._record_commit(event, now)
        try:
            actions = self.core.handle(event, now)
        except Exception as exc:
            # An event the core refuses (bad data from outside, no rule in this state) is logged,
            # never fatal: the loop must keep supervising.
            log.warning("core refused %s: %s", type(event).__name__, exc)
            actions = []
        for action in actions:
            if not self._execute(action, now):
                break
        if isinstance(event, t.StopRequested) and event.relaunch:
            # Handled (and logged) once: a later Snapshot must not stop the relaunched attempt again.
            # A stop that ends the run stays, so a restarted controller does not relaunch it.
            with contextlib.suppress(StoreError):
                self.store.delete(self.keys.stop(self.cfg.run))
        self._publish_status(now)
        if future is not None:
            node = getattr(event, "node", "")
            future.set_result(self.pool_state(node) if node in self.core.pool.nodes else None)

    def _publish_status(self, now: float) -> None:
        st = self.core.status(now)
        self.status = controller_pb2.RunStatus(
            run=self.cfg.run, phase=_PHASES.get(st.state.name, controller_pb2.RUN_PHASE_UNSPECIFIED),
            attempt=st.attempt, current_step=st.job_step, last_committed_step=st.latest_committed,
            restart_budget_left=max(0, st.restart_budget - st.restarts_used),
            since_last_progress_s=st.since_last_progress_s, nodes=list(st.nodes), rendezvous_id=st.rendezvous_id,
            reason=st.failure or st.state.value)

    def pool_state(self, node: str) -> int:
        pn = self.core.pool.nodes.get(node) if self.core is not None else None
        return int(pn.state) if pn is not None else common_pb2.POOL_STATE_UNSPECIFIED

    def submit_and_wait(self, event: Any) -> Future[Any]:
        """Queue an operator event; the future gets the node's pool state after the core acted."""
        fut: Future[Any] = Future()
        self.events.put(_Operator(event=event, future=fut))
        return fut

    def _write_spec(self) -> None:
        spec = store_pb2.RunSpec(run=self.cfg.run, nodes=self.nodes, command=list(self.cfg.command),
                                 env=dict(self.cfg.env), max_attempts=self.restart_budget, created_at=self.clock())
        self.store.fenced_put(self.keys.spec(self.cfg.run), spec.SerializeToString(), self.leadership)

    def _record_commit(self, event: t.CheckpointCommitted, now: float) -> None:
        rec = store_pb2.CheckpointCommit(run=self.cfg.run, step=event.step, path=event.path, committed_at=now,
                                         attempt=event.attempt, save_duration_s=event.save_duration_s)
        try:
            self.store.fenced_put(self.keys.checkpoint(self.cfg.run, event.step), rec.SerializeToString(),
                                  self.leadership)
        except StoreError as exc:
            log.warning("recording checkpoint %d failed: %s", event.step, exc)

    # -- the view -----------------------------------------------------------------------------

    def _relist(self) -> int:
        k = self.keys
        nodes, rev = self.store.get_prefix(k.nodes_prefix())
        alive: dict[str, int] = {}
        for kv in nodes:
            rec = _parse(store_pb2.NodeRecord, kv.value)
            if rec is None or not rec.node:
                continue
            self._known_nodes[rec.node] = rec
            self.agents.set_address(rec.node, rec.address)
            alive[rec.node] = max(1, rec.local_ranks or self.cfg.procs_per_node)
        records = []
        pool_kvs, _ = self.store.get_prefix(k.base + "pool/")
        reps = {kv.key.rsplit("/", 1)[-1]: _parse(store_pb2.Reputation, kv.value)
                for kv in self.store.get_prefix(k.base + "reputation/")[0]}
        for kv in pool_kvs:
            entry = _parse(store_pb2.PoolEntry, kv.value)
            if entry is None or not entry.node:
                continue
            rep = reps.get(entry.node) or store_pb2.Reputation()
            records.append(t.NodeRecordView(
                node=entry.node, pool_state=entry.state or common_pb2.POOL_STATE_SPARE, reason=entry.reason,
                burn_in_passes=entry.burn_in_passes, operator_hold=entry.operator_hold,
                failure_times=tuple(rep.failure_times), straggler_flags=rep.straggler_flags,
                preflight_rejections=rep.preflight_rejections, evidence=tuple(entry.evidence),
                evidence_kinds=tuple(rep.evidence_kinds)))
        attempt_kv = self.store.get(k.attempt(self.cfg.run))
        attempt = _parse(store_pb2.AttemptRecord, attempt_kv.value) if attempt_kv else None
        ckpts = [_parse(store_pb2.CheckpointCommit, kv.value)
                 for kv in self.store.get_prefix(k.checkpoints_prefix(self.cfg.run))[0]]
        committed = tuple(sorted(c.step for c in ckpts if c is not None))
        if committed:
            self._committed_seen = max(self._committed_seen, committed[-1])
        stop_kv = self.store.get(k.stop(self.cfg.run))
        stop = None
        if stop_kv is not None:
            req = _parse(store_pb2.StopRequest, stop_kv.value)
            if req is not None:
                stop = t.StopRequested(reason=req.reason or "stop requested", requested_by=req.requested_by,
                                     relaunch=req.relaunch)
        progress_nodes = []
        now = self.clock()
        exits = []
        for kv in self.store.get_prefix(k.progress_prefix(self.cfg.run))[0]:
            prog = _parse(store_pb2.NodeProgress, kv.value)
            if prog and attempt and prog.attempt == attempt.attempt and prog.HasField("exit"):
                exits.append(prog)  # level-triggered: exits written while no leader was watching
            elif prog and attempt and prog.attempt == attempt.attempt and now - prog.written_at < 30:
                progress_nodes.append(prog.node)
        if attempt is not None:
            self._attempt = attempt.attempt
            self._attempt_nodes = {n: i for i, n in enumerate(attempt.nodes)}
        snap = t.Snapshot(
            alive=alive, records=tuple(records),
            attempt=attempt.attempt if attempt else 0,
            attempt_nodes=tuple(attempt.nodes) if attempt else (),
            resume_step=attempt.resume_step if attempt else -1,
            committed_steps=committed, stop_requested=stop, progress_nodes=tuple(progress_nodes))
        self._feed(snap, now)
        for prog in exits:
            self._exit_seen(prog)
        return rev

    def _exit_seen(self, prog: store_pb2.NodeProgress) -> None:
        """A node's workers of an attempt ended (its agent wrote the exit into its progress)."""
        if (prog.node, prog.attempt) in self._exited:
            return
        self._exited.add((prog.node, prog.attempt))
        e = prog.exit
        self.events.put(t.AttemptExited(
            node=prog.node, attempt=prog.attempt, exit_code=e.exit_code if e.HasField("exit_code") else None,
            signal=e.signal if e.HasField("signal") else None, ended_at=e.ended_at or None, detail=e.detail))

    def _start_watches(self, start_revision: int) -> None:
        k = self.keys
        prefixes: Sequence[str] = (
            k.nodes_prefix(), k.progress_prefix(self.cfg.run), k.base + "evidence/", k.run_prefix(self.cfg.run)
        )
        for prefix in prefixes:
            self._watches.append(self.store.watch_prefix(prefix, start_revision, self._on_watch))

    def _restart_watches(self, start_revision: int) -> None:
        for w in self._watches:
            with contextlib.suppress(Exception):
                w.cancel()
        self._watches.clear()
        self._start_watches(start_revision)

    def _on_watch(self, item: WatchEvent | Relisted) -> None:
        """Watch thread: translate store events into core events; never raises."""
        if isinstance(item, Relisted):
            self.events.put(_Relist())
            return
        try:
            ev = self._translate(item)
        except Exception as exc:
            log.warning("ignoring bad value at %s: %s", item.key, exc)
            return
        if ev is not None:
            self.events.put(ev)

    def _translate(self, item: WatchEvent) -> Any:
        k = self.keys
        key, deleted = item.key, item.type.name == "DELETE"
        if key.startswith(k.nodes_prefix()):
            node = key[len(k.nodes_prefix()):]
            if deleted:
                self._known_nodes.pop(node, None)
                self.agents.forget(node)
                return t.NodeLost(node=node)
            rec = _parse(store_pb2.NodeRecord, item.value)
            if rec is None:
                raise ValueError("not a NodeRecord")
            fresh = node not in self._known_nodes
            self._known_nodes[node] = rec
            if fresh:
                # A re-registered agent gets a new channel: the old one may sit in gRPC's reconnect
                # backoff after the agent died and fail the next RPC (its burn-in) at once.
                self.agents.forget(node)
            self.agents.set_address(node, rec.address)
            return t.NodeJoined(node=node, local_ranks=max(1, rec.local_ranks or 1)) if fresh else None
        if key.startswith(k.progress_prefix(self.cfg.run)):
            if deleted:
                return None
            prog = _parse(store_pb2.NodeProgress, item.value)
            if prog is None:
                raise ValueError("not a NodeProgress")
            for r in prog.ranks:
                self._rank_to_node[r.rank] = prog.node
                if r.checkpoint_error and (prog.attempt, r.step) not in self._ckpt_failures:
                    self._ckpt_failures.add((prog.attempt, r.step))
                    self.events.put(t.CheckpointFailed(step=r.step, error=r.checkpoint_error, node=prog.node,
                                                       attempt=prog.attempt))
                if r.rank == 0 and r.HasField("committed_step") and r.committed_step > self._committed_seen:
                    self._committed_seen = r.committed_step
                    self.events.put(t.CheckpointCommitted(step=r.committed_step, attempt=prog.attempt))
            observed = t.ProgressObserved(node=prog.node, attempt=prog.attempt,
                                          ranks=tuple(t.RankSample.from_proto(r) for r in prog.ranks))
            if prog.HasField("exit"):
                self.events.put(observed)  # the node's last progress, then its exit
                self._exit_seen(prog)
                return None
            return observed
        if key.startswith(k.base + "evidence/"):
            if deleted:
                return None
            rec = _parse(store_pb2.EvidenceRecord, item.value)
            if rec is None or not rec.evidence.node:
                raise ValueError("not an EvidenceRecord")
            return t.EvidenceObserved(evidence=rec.evidence)
        if key == k.stop(self.cfg.run) and not deleted:
            req = _parse(store_pb2.StopRequest, item.value)
            if req is None:
                raise ValueError("not a StopRequest")
            return t.StopRequested(reason=req.reason or "stop requested", requested_by=req.requested_by,
                                   relaunch=req.relaunch)
        return None

    # -- actions ------------------------------------------------------------------------------

    def _execute(self, action: Any, now: float) -> bool:
        """Execute one action; False stops the batch (an unlogged action must not happen)."""
        if isinstance(action, t.AppendEvent):
            assert self.eventlog is not None
            try:
                written = self.eventlog.append(action.event)
            except Exception as exc:
                log.error("event log append failed, batch abandoned: %s", exc)
                return False
            for listener in list(self.listeners):
                with contextlib.suppress(Exception):
                    listener(written)
            return True
        if isinstance(action, t.SetTimer):
            self.timers[action.key] = action.at
        elif isinstance(action, t.RunPreflight):
            for node in action.nodes:
                self._submit(self._preflight, node, action.mode, action.timeout_s)
        elif isinstance(action, t.Launch):
            return self._launch(action)
        elif isinstance(action, t.StopAttempt):
            for node in action.nodes:
                self._submit(self._stop_node, node, action)
        elif isinstance(action, t.CollectDumps):
            self._submit(self._collect, action)
        elif isinstance(action, t.PersistNode):
            self._persist(action.record)
        elif isinstance(action, t.Page):
            self.pager.page(action.reason, action.severity)
        elif isinstance(action, t.Quarantine | t.Release | t.TakeSpare | t.AllocateFromQueue):
            # Pool state is persisted by PersistNode; the local backend has no scheduler to tell.
            # A scheduler backend (Slurm drain, Kubernetes taint) hooks in here.
            log.info("%s", action)
        else:
            log.warning("unknown action %r", action)
        return True

    def _persist(self, rec: t.NodeRecordView) -> None:
        entry = store_pb2.PoolEntry(node=rec.node, state=common_pb2.PoolState.ValueType(rec.pool_state), reason=rec.reason,
                                    burn_in_passes=rec.burn_in_passes, operator_hold=rec.operator_hold,
                                    since=self.clock(), run=self.cfg.run, evidence=list(rec.evidence[-16:]))
        rep = store_pb2.Reputation(node=rec.node, failures=len(rec.failure_times),
                                   failure_times=list(rec.failure_times[-32:]),
                                   straggler_flags=rec.straggler_flags,
                                   preflight_rejections=rec.preflight_rejections, updated_at=self.clock(),
                                   evidence_kinds=[common_pb2.EvidenceKind.ValueType(k) for k in rec.evidence_kinds[-32:]])
        try:
            self.store.fenced_put(self.keys.pool(rec.node), entry.SerializeToString(), self.leadership)
            self.store.fenced_put(self.keys.reputation(rec.node), rep.SerializeToString(), self.leadership)
        except StoreError as exc:
            log.warning("persisting %s failed: %s", rec.node, exc)

    def _launch(self, action: t.Launch) -> bool:
        fence = int(self.leadership.fence)
        nodes = [nr.node for nr in sorted(action.nodes, key=lambda nr: nr.node_rank)]
        record = store_pb2.AttemptRecord(
            run=action.run, attempt=action.attempt, rendezvous_id=action.rendezvous_id, nodes=nodes,
            resume_step=action.resume_step, launched_at=self.clock(), leader_fence=fence)
        key = self.keys.attempt(action.run)
        try:
            cur = self.store.get(key)
            if cur is not None:
                prev = _parse(store_pb2.AttemptRecord, cur.value)
                if prev is not None and prev.attempt >= action.attempt:
                    log.error("attempt %d already recorded (have %d): another leader launched", action.attempt,
                              prev.attempt)
                    return False
            ok = self.store.cas(key, record.SerializeToString(), cur.mod_revision if cur else 0)
        except StoreError as exc:
            log.error("attempt record write failed: %s", exc)
            return False
        if not ok or self.leadership.lost.is_set():
            log.error("attempt %d refused by fencing", action.attempt)
            return False
        self._attempt = action.attempt
        self._attempt_nodes = {nr.node: nr.node_rank for nr in action.nodes}
        self._exited = {e for e in self._exited if e[1] >= action.attempt}
        port = _free_port()
        for nr in action.nodes:
            argv = [
                *self.cfg.torchrun,
                f"--nnodes={len(action.nodes)}",
                f"--nproc-per-node={self.cfg.procs_per_node}",
                f"--node-rank={nr.node_rank}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.cfg.rdzv_host}:{port}",
                f"--rdzv-id={action.rendezvous_id}",
                f"--rdzv-conf=is_host={'true' if nr.node_rank == 0 else 'false'}",
                "--max-restarts=0",
                *self.cfg.command,
            ]
            env = dict(self.cfg.env)
            env.update({"RUNWARDEN_RESUME_STEP": str(action.resume_step), "RUNWARDEN_NODE": nr.node})
            req = agent_pb2.LaunchWorkersRequest(
                run=action.run, attempt=action.attempt, rendezvous_id=action.rendezvous_id, argv=argv, env=env,
                node_rank=nr.node_rank, nnodes=len(action.nodes), resume_step=action.resume_step,
                leader_fence=fence)
            self._submit(self._launch_node, nr.node, req)
        return True

    def _submit(self, fn: Callable[..., None], *args: Any) -> None:
        """Run slow work off the loop; an unexpected error is logged, never lost silently."""

        def guarded() -> None:
            try:
                fn(*args)
            except Exception:
                log.exception("%s failed", getattr(fn, "__name__", fn))

        self.pool.submit(guarded)

    def _launch_node(self, node: str, req: agent_pb2.LaunchWorkersRequest) -> None:
        out = self.agents.launch(node, req, self.cfg.rpc_timeout_s)
        if not out.ok:
            self._exited.add((node, req.attempt))
            self.events.put(t.AttemptExited(node=node, attempt=req.attempt, exit_code=127,
                                            detail=f"launch failed: {out.error}"))

    def _preflight(self, node: str, mode: str, timeout_s: float) -> None:
        out = self.agents.run_preflight(node, mode, timeout_s)
        failed = tuple(r.name for r in out.failed) or ((f"rpc: {out.error}",) if not out.ok else ())
        self.events.put(t.PreflightResult(node=node, passed=out.ok and out.summary.passed, mode=mode,
                                          failed_checks=failed, duration_s=out.summary.duration_s))

    def _stop_node(self, node: str, action: t.StopAttempt) -> None:
        if action.planned:
            self.agents.request_stop(node, self.cfg.run, action.reason)
            deadline = time.monotonic() + action.grace_s  # ends as soon as the exit is seen
            while time.monotonic() < deadline and (node, action.attempt) not in self._exited:
                time.sleep(0.2)
        self.agents.stop(node, self.cfg.run, action.attempt, grace_s=2.0 if action.planned else action.grace_s)

    def _collect(self, action: t.CollectDumps) -> None:
        """Dumps from every live rank of the attempt, analysed by the flight-recorder rule only.

        The core ranks this answer below hardware evidence and above heartbeats; a rank that
        could not answer (stopped, dead) is "no dump", which is itself evidence."""
        from controller.supervisor import flight_recorder as attr  # the shell runs without dumps too

        rank_dumps: list[agent_pb2.RankDump] = []
        missing: list[str] = []
        rank_to_node = dict(self._rank_to_node)
        # All nodes at once, each rank given most of the core's deadline: a stopped rank costs its
        # timeout once, not once per node, and the answer arrives before the core gives up on it.
        per_rank_s = max(0.5, action.timeout_s * 0.6)
        with ThreadPoolExecutor(max_workers=min(32, max(1, len(action.nodes)))) as ex:
            answers = list(ex.map(lambda n: (n, *self.agents.collect_dumps(n, self.cfg.run, per_rank_s)),
                                  action.nodes))
        for node, out, resp in answers:
            if not out.ok or resp is None:
                missing.append(node)
                for rank, n in rank_to_node.items():
                    if n == node:
                        rank_dumps.append(agent_pb2.RankDump(rank=rank, ok=False, error=f"agent: {out.error}"))
                continue
            for d in resp.dumps:
                rank_to_node.setdefault(d.rank, node)
                rank_dumps.append(d)
        try:
            dumps, no_dump = attr.dumps_from_rank_dumps(rank_dumps)
            attribution: Any = attr.attribute(rank_to_node=rank_to_node, dumps=dumps, no_dump=no_dump,
                                              stopped=attr.stopped_ranks(rank_dumps))
        except Exception as exc:
            log.warning("flight-recorder attribution failed: %s", exc)
            attribution = t.Attribution()
        self.events.put(t.DumpsCollected(attempt=action.attempt, attribution=attribution,
                                         missing_nodes=tuple(missing)))

    def _check_adopted(self) -> None:
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
        pending = set(self._attempt_nodes)
        give_up = time.monotonic() + ADOPT_CHECK_S
        while pending and self.is_leader.is_set() and not self.stopping.is_set() and self._attempt == attempt:
            for node in sorted(pending):
                if (node, attempt) in self._exited or node not in self._attempt_nodes:
                    pending.discard(node)
                    continue
                out, resp = self.agents.status(node, timeout_s=2.0)
                if not out.ok or resp is None:
                    continue  # unreachable for now; if it is gone, its lease says so (NodeLost)
                pending.discard(node)
                if not any(w.run == self.cfg.run and w.attempt == attempt for w in resp.workers):
                    self._exited.add((node, attempt))
                    self.events.put(t.AttemptExited(
                        node=node, attempt=attempt, detail="no worker of this attempt on the node: adopted at "
                        "takeover, but the previous leader's launch never reached it"))
            if pending and time.monotonic() > give_up:
                log.warning("adopted attempt %d: nodes %s never answered; their leases or the hang "
                            "detector decide", attempt, sorted(pending))
                return
            if pending:
                self.stopping.wait(0.5)

    # -- operator requests (from the API; they go through the core like everything else) -----

    def submit(self, event: Any) -> None:
        self.events.put(event)


def _parse(cls: Any, data: bytes) -> Any:
    msg = cls()
    try:
        msg.ParseFromString(data)
    except Exception:
        return None
    return msg


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
