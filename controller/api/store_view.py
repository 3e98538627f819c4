"""A `ControllerView` read from etcd and the event log, for tools and tests.

It sees what the live controller writes (node records, pool entries, reputation, evidence, attempt
records, progress, checkpoints) and writes operator requests the way the controller reads them:
a pool entry with ``operator_hold`` for a quarantine, a pool entry in burn-in for a release, a
`StopRequest` under the run's stop key. Run phases are inferred (the live shell knows them
exactly): RUN_END in the event log, a stop key, fresh progress, an attempt record.
Every pool write is a compare-and-swap, so it never overwrites a concurrent controller update.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from controller.api import policy as policy_store
from controller.api.view import ViewInvalid, ViewNotFound, ViewRefused, ViewUnavailable
from controller.supervisor.policy import SupervisorConfig
from runwarden.config import ConfigError
from runwarden.eventlog import LogEntry, read_events
from runwarden.keys import LEGACY_ELECTION, run_election
from runwarden.store import KeyValue, Store, StoreError
from runwarden.v1 import common_pb2, controller_pb2, events_pb2, store_pb2

FRESH_PROGRESS_S = 60.0  # progress younger than this means the run is training
CAS_TRIES = 5

M = TypeVar("M", bound=Message)


def _parse(cls: type[M], kv: KeyValue | None) -> M | None:
    if kv is None:
        return None
    msg = cls()
    try:
        msg.ParseFromString(kv.value)
    except DecodeError:
        return None  # a corrupt value is shown as missing rather than failing the whole listing
    return msg


class StoreBackedView:
    def __init__(
        self, store: Store, event_log_path: str | Path, *, clock: Callable[[], float] = time.time
    ) -> None:
        self._store = store
        self._keys = store.keys
        self._event_log_path = Path(event_log_path)
        self._clock = clock

    @property
    def event_log_path(self) -> Path:
        return self._event_log_path

    def _prefix(self, prefix: str) -> list[KeyValue]:
        try:
            return self._store.get_prefix(prefix)[0]
        except StoreError as exc:
            raise ViewUnavailable(f"etcd: {exc}") from None

    def _get(self, key: str) -> KeyValue | None:
        try:
            return self._store.get(key)
        except StoreError as exc:
            raise ViewUnavailable(f"etcd: {exc}") from None

    # -- runs ------------------------------------------------------------------------------------

    def _run_names(self) -> list[str]:
        runs_prefix = self._keys.base + "runs/"
        names = {kv.key[len(runs_prefix) :].split("/", 1)[0] for kv in self._prefix(runs_prefix)}
        return sorted(n for n in names if n)

    def run_statuses(self) -> Sequence[controller_pb2.RunStatus]:
        """Every run under the root (several runs share one fleet), each with its own leader."""
        ended = {
            e.run: e
            for e in read_events(self._event_log_path).entries
            if e.kind == events_pb2.EVENT_KIND_RUN_END
        }
        claimed = self.claim_counts()
        statuses = [self._run_status(run, ended.get(run)) for run in self._run_names()]
        for status in statuses:
            status.leader, status.fence = self.run_leader(status.run)
            status.claimed_nodes = claimed.get(status.run, 0)
        return statuses

    def claim_holders(self) -> dict[str, str]:
        """node -> the run whose claim holds it (claims/: controller/fleet/claims.py)."""
        k = self._keys
        holders = {}
        for kv in self._prefix(k.claims_prefix()):
            claim = _parse(store_pb2.NodeClaim, kv)
            if claim is not None and claim.run:
                holders[k.name_under(k.claims_prefix(), kv.key)] = claim.run
        return holders

    def claim_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for run in self.claim_holders().values():
            counts[run] = counts.get(run, 0) + 1
        return counts

    def _run_status(self, run: str, end: LogEntry | None) -> controller_pb2.RunStatus:
        now = self._clock()
        spec = _parse(store_pb2.RunSpec, self._get(self._keys.spec(run)))
        attempt = _parse(store_pb2.AttemptRecord, self._get(self._keys.attempt(run)))
        memory = _parse(store_pb2.SupervisorMemory, self._get(self._keys.memory(run)))
        stop = _parse(store_pb2.StopRequest, self._get(self._keys.stop(run)))
        progress = [
            p
            for kv in self._prefix(self._keys.progress_prefix(run))
            if (p := _parse(store_pb2.NodeProgress, kv)) is not None
        ]
        commits = [
            c
            for kv in self._prefix(self._keys.checkpoints_prefix(run))
            if (c := _parse(store_pb2.CheckpointCommit, kv)) is not None
        ]
        number = attempt.attempt if attempt else 0
        current = [p for p in progress if p.attempt == number]
        steps = [r.step for p in current for r in p.ranks]
        last_write = max((p.written_at for p in current), default=0.0)
        status = controller_pb2.RunStatus(
            run=run,
            attempt=number,
            current_step=max(steps, default=-1),
            last_committed_step=max((c.step for c in commits), default=-1),
            restart_budget_left=budget_left(spec, memory, now),
            since_last_progress_s=max(0.0, now - last_write) if last_write else -1.0,
            nodes=list(attempt.nodes) if attempt else [],
            rendezvous_id=attempt.rendezvous_id if attempt else "",
        )
        status.phase, status.reason = self._phase(end, stop, attempt, last_write, now)
        return status

    @staticmethod
    def _phase(
        end: LogEntry | None,
        stop: store_pb2.StopRequest | None,
        attempt: store_pb2.AttemptRecord | None,
        last_write: float,
        now: float,
    ) -> tuple[controller_pb2.RunPhase.ValueType, str]:
        if end is not None:
            outcome = end.run_detail.outcome
            if outcome in ("completed", "stopped"):
                return controller_pb2.RUN_PHASE_COMPLETED, outcome
            return controller_pb2.RUN_PHASE_FAILED, outcome or end.message
        if stop is not None:
            return controller_pb2.RUN_PHASE_STOPPING, stop.reason
        if attempt is None:
            return controller_pb2.RUN_PHASE_PENDING, ""
        if last_write and now - last_write <= FRESH_PROGRESS_S:
            return controller_pb2.RUN_PHASE_RUNNING, ""
        return controller_pb2.RUN_PHASE_LAUNCHING, "no progress from this attempt yet"

    # -- nodes -----------------------------------------------------------------------------------

    def node_infos(self) -> Sequence[controller_pb2.NodeInfo]:
        k = self._keys
        records = {
            k.name_under(k.nodes_prefix(), kv.key): r
            for kv in self._prefix(k.nodes_prefix())
            if (r := _parse(store_pb2.NodeRecord, kv)) is not None
        }
        pool = {
            k.name_under(k.pool_prefix(), kv.key): e
            for kv in self._prefix(k.pool_prefix())
            if (e := _parse(store_pb2.PoolEntry, kv)) is not None
        }
        reps = {
            k.name_under(k.reputation_prefix(), kv.key): rp
            for kv in self._prefix(k.reputation_prefix())
            if (rp := _parse(store_pb2.Reputation, kv)) is not None
        }
        evidence: dict[str, list[common_pb2.Evidence]] = {}
        for kv in self._prefix(k.evidence_prefix()):
            rec = _parse(store_pb2.EvidenceRecord, kv)
            if rec is not None:
                evidence.setdefault(rec.evidence.node, []).append(rec.evidence)
        now = self._clock()
        holders = self.claim_holders()
        infos = [
            self._node_info(n, records.get(n), pool.get(n), reps.get(n), evidence.get(n, []), now)
            for n in sorted(set(records) | set(pool))
        ]
        members = self._attempt_members(set(holders.values()))
        for info in infos:
            info.claimed_by = holders.get(info.node, "")
            # The controller writes a node's pool entry when its standing changes, not when a slot
            # takes it: a spare in its claiming run's current attempt is that run's, assigned.
            spare = info.pool_state in (common_pb2.POOL_STATE_UNSPECIFIED, common_pb2.POOL_STATE_SPARE)
            if spare and info.node in members.get(info.claimed_by, ()):
                info.pool_state, info.run = common_pb2.POOL_STATE_ASSIGNED, info.claimed_by
        return infos

    def _attempt_members(self, runs: set[str]) -> dict[str, frozenset[str]]:
        """run -> the nodes of its current attempt (its attempt record)."""
        out = {}
        for run in runs:
            attempt = _parse(store_pb2.AttemptRecord, self._get(self._keys.attempt(run)))
            if attempt is not None:
                out[run] = frozenset(attempt.nodes)
        return out

    @staticmethod
    def _node_info(
        name: str,
        rec: store_pb2.NodeRecord | None,
        entry: store_pb2.PoolEntry | None,
        rep: store_pb2.Reputation | None,
        evidence: list[common_pb2.Evidence],
        now: float,
    ) -> controller_pb2.NodeInfo:
        info = controller_pb2.NodeInfo(node=name, alive=rec is not None, evidence=evidence[-20:])
        if rec is not None:
            info.address, info.state, info.gpu_count = rec.address, rec.state, rec.gpu_count
            info.agent_version = rec.agent_version
            info.last_preflight.CopyFrom(rec.last_preflight)
            info.last_heartbeat_age_s = max(0.0, now - rec.registered_at) if rec.registered_at else -1.0
        else:
            info.last_heartbeat_age_s = -1.0
        if entry is not None:
            info.pool_state, info.run, info.reason = entry.state, entry.run, entry.reason
        if rep is not None:
            info.failures, info.straggler_flags = rep.failures, rep.straggler_flags
            info.reputation_score = float(
                -(rep.failures * 10 + rep.straggler_flags + rep.preflight_rejections)
            )  # never -0
        return info

    # -- operator requests -----------------------------------------------------------------------

    def _update_pool(self, node: str, change: Callable[[store_pb2.PoolEntry], None]) -> store_pb2.PoolEntry:
        key = self._keys.pool(node)
        for _ in range(CAS_TRIES):
            kv = self._get(key)
            entry = _parse(store_pb2.PoolEntry, kv)
            if entry is None:
                if self._get(self._keys.node(node)) is None:
                    raise ViewNotFound(f"no node named {node!r}")
                entry = store_pb2.PoolEntry(node=node, state=common_pb2.POOL_STATE_SPARE)
            change(entry)
            try:
                if self._store.cas(key, entry.SerializeToString(), kv.mod_revision if kv else 0):
                    return entry
            except StoreError as exc:
                raise ViewUnavailable(f"etcd: {exc}") from None
        raise ViewUnavailable(f"pool entry of {node!r} kept changing; try again")

    def quarantine(self, node: str, reason: str, actor: str) -> common_pb2.PoolState.ValueType:
        def change(entry: store_pb2.PoolEntry) -> None:
            entry.state = common_pb2.POOL_STATE_QUARANTINED
            entry.operator_hold = True
            entry.reason = f"operator {actor}: {reason}"
            entry.since = self._clock()
            entry.burn_in_passes = 0

        return self._update_pool(node, change).state

    def release(self, node: str, reason: str, actor: str) -> common_pb2.PoolState.ValueType:
        def change(entry: store_pb2.PoolEntry) -> None:
            if entry.state in (common_pb2.POOL_STATE_SPARE, common_pb2.POOL_STATE_ASSIGNED):
                raise ViewRefused(f"node {node!r} is not quarantined or held; nothing to release")
            # Like any quarantined node it returns through burn-in, never straight into a run.
            entry.state = common_pb2.POOL_STATE_BURN_IN
            entry.operator_hold = False
            entry.reason = f"released by operator {actor}: {reason}"
            entry.since = self._clock()
            entry.burn_in_passes = 0

        return self._update_pool(node, change).state

    def request_stop(self, run: str, reason: str, actor: str, relaunch: bool = False) -> bool:
        if run not in self._run_names():
            raise ViewNotFound(f"no run named {run!r}")
        stop = store_pb2.StopRequest(
            run=run, reason=reason, requested_at=self._clock(), requested_by=actor, relaunch=relaunch
        )
        try:
            self._store.put(self._keys.stop(run), stop.SerializeToString())
        except StoreError as exc:
            raise ViewUnavailable(f"etcd: {exc}") from None
        return True

    # -- the supervisor policy (controller/api/policy.py) ----------------------------------------

    def _policy_run(self, run: str) -> str:
        names = self._run_names()
        if run and run not in names:
            raise ViewNotFound(f"no run named {run!r}")
        if run:
            return run
        if len(names) == 1:
            return names[0]
        if not names:
            raise ViewNotFound("no run is stored under this etcd root")
        raise ViewInvalid(f"several runs here ({', '.join(names)}): name one")

    def policy(self, run: str) -> controller_pb2.GetPolicyResponse:
        run = self._policy_run(run)
        try:
            stored = policy_store.read(self._store, run)
        except StoreError as exc:
            raise ViewUnavailable(f"etcd: {exc}") from None
        except ConfigError as exc:
            raise ViewRefused(
                f"the stored policy is bad ({exc}); replace it whole with config apply"
            ) from None
        if stored is None:
            raise ViewRefused(f"no policy stored for run {run!r} yet: no controller has led it")
        rec = stored.record
        return controller_pb2.GetPolicyResponse(
            run=run,
            values=rec.values,
            revision=stored.revision,
            changed_at=rec.changed_at,
            changed_by=rec.changed_by,
            reason=rec.reason,
        )

    def set_policy(
        self,
        run: str,
        values: Mapping[str, common_pb2.PolicyValue],
        *,
        replace: bool,
        actor: str,
        reason: str,
    ) -> controller_pb2.SetPolicyResponse:
        run = self._policy_run(run)
        try:
            proposed = policy_store.plain(values, "policy")
        except ConfigError as exc:
            raise ViewInvalid(str(exc)) from None

        def change(current: SupervisorConfig | None) -> SupervisorConfig:
            if current is None and not replace:
                raise ViewRefused(
                    f"no readable policy stored for run {run!r} (no controller has led it, or the record "
                    "is bad): only a whole policy can be written (config apply FILE)"
                )
            return policy_store.build(current, proposed, replace=replace, where="policy")

        try:
            diff, revision = policy_store.update(
                self._store, run, change, changed_by=actor, reason=reason, now=self._clock()
            )
        except ConfigError as exc:
            raise ViewInvalid(str(exc)) from None
        except policy_store.PolicyConflict as exc:
            raise ViewUnavailable(str(exc)) from None
        except StoreError as exc:
            raise ViewUnavailable(f"etcd: {exc}") from None
        return controller_pb2.SetPolicyResponse(changes=diff, revision=revision)

    def release_claims(self, *, node: str, run: str, actor: str) -> list[str]:
        """An operator gives back the claims of a run that is gone without ending (its claims
        outlive its controllers on purpose: controller/fleet/claims.py). A run with a leader is
        refused: it gives its nodes back itself, and a node taken from under a running attempt
        could be launched on by another run while its workers still run there."""
        from controller.fleet.claims import release_by_operator

        holders = self.claim_holders()
        if node and node not in holders:
            raise ViewNotFound(f"no run holds node {node!r}")
        owners = {holders[node]} if node else ({run} if run in holders.values() else set())
        if not owners:
            raise ViewNotFound(f"run {run!r} holds no node")
        for owner in owners:
            leader, _ = self.run_leader(owner)
            if leader:
                raise ViewRefused(f"run {owner!r} has a leader ({leader}); it gives its nodes back itself")
        try:
            return release_by_operator(self._store, node=node, run=run)
        except StoreError as exc:
            raise ViewUnavailable(f"etcd: {exc}") from None

    def drain(self, node: str, reason: str, actor: str, *, undo: bool = False) -> bool:
        raise ViewRefused("draining goes through a node's agent: ask a running controller")

    def run_leader(self, run: str) -> tuple[str, int]:
        """The leader of `run`'s election (its identity and fence), or ("", 0)."""
        contenders = self._prefix(self._keys.election(run_election(run)))
        if not contenders:
            return "", 0
        first = min(contenders, key=lambda kv: kv.create_revision)
        return first.value.decode("utf-8", "replace"), first.create_revision

    def leader(self) -> tuple[str, int]:
        """The leader when one controller's is meant: an older version's (the root's single
        election), else the only run's; ("", 0) when several runs lead (each run's is in its status)."""
        legacy = self.run_leader(LEGACY_ELECTION)
        if legacy[0]:
            return legacy
        leaders = [self.run_leader(run) for run in self._run_names()]
        leading = [lead for lead in leaders if lead[0]]
        return leading[0] if len(leading) == 1 else ("", 0)


def budget_left(spec: store_pb2.RunSpec | None, memory: store_pb2.SupervisorMemory | None, now: float) -> int:
    """The restart budget left, as the leader counts it: the budget less the failure restarts
    within its window (the supervisor's memory in the store); the whole budget before any."""
    if memory is None:
        return spec.max_attempts if spec else 0
    window = memory.restart_budget_window_s
    used = sum(1 for t in memory.restart_times if math.isfinite(t) and (not window or now - t < window))
    return max(0, memory.restart_budget - used)
