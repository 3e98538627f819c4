"""etcd values -> core events: the shell's one boundary with the store's contents.

Pure given its own memory (the known nodes, the current attempt's rank -> node map, the exits and
checkpoint outcomes already reported): a value in, events out, no I/O. Bad input from outside (a
value that does not parse, a name the events refuse) raises `ValueError`; the caller logs it and
drops that one value, and everything else carries on.

`Translator` is shared by the watch threads and the loop thread; its methods take its lock.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

import runwarden
from controller.api import policy as policy_store
from controller.backends.local import Rendezvous
from controller.supervisor.events import (
    AttemptExited,
    CheckpointCommitted,
    CheckpointFailed,
    CheckpointInvalid,
    Event,
    EvidenceObserved,
    NodeClaimed,
    NodeDraining,
    NodeJoined,
    NodeLost,
    PolicyChanged,
    ProgressObserved,
    RankSample,
    StopRequested,
    StoreListed,
    proto_losses,
)
from controller.supervisor.pool import NodeRecordView
from runwarden.keys import KeySchema
from runwarden.store import KeyValue, WatchEvent
from runwarden.v1 import agent_pb2, common_pb2, store_pb2
from runwarden.version import agent_skew

_M = TypeVar("_M", bound=Message)
log = logging.getLogger(__name__)


def parse(cls: type[_M], data: bytes, what: str = "") -> _M:
    """Parse one stored value; ValueError (bad input) if it is not a `cls`."""
    msg = cls()
    try:
        msg.ParseFromString(data)
    except (DecodeError, RuntimeError) as exc:  # RuntimeError: the pure-Python decoder on recursion
        raise ValueError(f"{what or cls.__name__}: not a {cls.__name__}: {exc}") from None
    return msg


@dataclass(frozen=True, slots=True, kw_only=True)
class Addresses:
    """Agent channel changes a translation asks for: set (node -> its agent's address and the lease
    it registered under: a new registration gets a new channel) and forget (the node is gone)."""

    set: dict[str, tuple[str, int]] = field(default_factory=dict)
    forget: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Listing:
    """What a relist read from the store, raw (the loop does the I/O, `Translator.snapshot` the rest)."""

    nodes: tuple[KeyValue, ...]
    pool: tuple[KeyValue, ...]
    reputation: tuple[KeyValue, ...]
    attempt: KeyValue | None
    checkpoints: tuple[KeyValue, ...]
    stop: KeyValue | None
    progress: tuple[KeyValue, ...]
    now: float
    policy: KeyValue | None = None  # the run's stored supervisor policy
    claims: tuple[KeyValue, ...] = ()  # claims/: which run holds each node of the shared fleet
    memory: KeyValue | None = None  # runs/<run>/memory: the supervisor's memory of the run


class Translator:
    def __init__(
        self,
        keys: KeySchema,
        run: str,
        *,
        procs_per_node: int = 1,
        controller_version: str = runwarden.__version__,
    ) -> None:
        self.keys = keys
        self.run = run
        self.procs_per_node = procs_per_node
        self.controller_version = controller_version
        # node -> why this controller does not drive its agent's version (runwarden.version): such a
        # node drains for that reason (no placement, no strike; an attempt it runs in stops as planned)
        self.left_out: dict[str, str] = {}
        self._lock = threading.Lock()
        self.known_nodes: dict[str, store_pb2.NodeRecord] = {}
        self.attempt = 0  # the attempt whose ranks `rank_to_node` maps
        self.rank_to_node: dict[int, str] = {}  # global rank (torch's RANK) -> node, of `attempt`
        self.exited: set[tuple[str, int]] = set()  # (node, attempt) whose exit was reported
        self.committed_seen = -1
        self.committed_attempt = 0  # the attempt whose rank reported committed_seen
        self._ckpt_failures: set[tuple[int, int]] = set()
        self._invalid: set[tuple[int, int]] = set()  # (attempt, step) whose refused load was reported
        self.claim_holders: dict[str, str] = {}  # node -> the run its claim names (every run's)

    # -- relist --------------------------------------------------------------------------------

    def snapshot(
        self, listing: Listing, claimed_elsewhere: dict[str, str] | None = None
    ) -> tuple[StoreListed, Addresses, list[Event], store_pb2.AttemptRecord | None]:
        """The StoreListed of a listing, the agent addresses it names, the current attempt's progress
        and the exits written while no leader watched (level-triggered: they follow the StoreListed),
        and the attempt record."""
        with self._lock:
            alive: dict[str, int] = {}
            addresses: dict[str, tuple[str, int]] = {}
            draining: dict[str, str] = {}
            for kv in listing.nodes:
                rec = _try(store_pb2.NodeRecord, kv.value)
                if rec is None or not rec.node:
                    continue
                self.known_nodes[rec.node] = rec
                if why := self._drain_reason(rec):
                    draining[rec.node] = why
                addresses[rec.node] = (rec.address, rec.lease_id)
                alive[rec.node] = max(1, rec.local_ranks or self.procs_per_node)
            reps = {kv.key.rsplit("/", 1)[-1]: kv for kv in listing.reputation}
            records = []
            for kv in listing.pool:
                rec_view = record_view(kv, reps.get(kv.key.rsplit("/", 1)[-1]))
                if rec_view is not None:
                    records.append(rec_view)
            self.claim_holders = {}
            for kv in listing.claims:
                claim = _try(store_pb2.NodeClaim, kv.value)
                if claim is not None and claim.node and claim.run:
                    self.claim_holders[claim.node] = claim.run
            attempt = _try(store_pb2.AttemptRecord, listing.attempt.value) if listing.attempt else None
            ckpts = [_try(store_pb2.CheckpointCommit, kv.value) for kv in listing.checkpoints]
            # a step a load refused keeps its record (why), and is no resume point
            committed = tuple(sorted(c.step for c in ckpts if c is not None and not c.invalid))
            if committed:
                self.committed_seen = max(self.committed_seen, committed[-1])
            stop = None
            if listing.stop is not None:
                req = _try(store_pb2.StopRequest, listing.stop.value)
                if req is not None:
                    stop = _stop_requested(req)
            follow: list[Event] = []
            if attempt is not None and attempt.attempt != self.attempt:
                self.attempt, self.rank_to_node = attempt.attempt, {}
            for kv in listing.progress:
                prog = _try(store_pb2.NodeProgress, kv.value)
                if prog is None or attempt is None or prog.attempt != attempt.attempt:
                    continue
                self._map_ranks(prog)
                if prog.ranks:
                    # where each node's ranks stand now: an adopted attempt whose ranks stopped
                    # advancing before this leader watched (a hang) has no later put to show it.
                    # Without the losses: a relist after a watch gap must not record them twice.
                    follow.append(
                        ProgressObserved(
                            node=prog.node,
                            attempt=prog.attempt,
                            ranks=tuple(RankSample.from_proto(r, losses=()) for r in prog.ranks),
                        )
                    )
                if prog.HasField("exit"):
                    follow.extend(self._exit_seen(prog))
            snap = StoreListed(
                alive=alive,
                records=tuple(records),
                attempt=attempt.attempt if attempt else 0,
                attempt_nodes=tuple(attempt.nodes) if attempt else (),
                resume_step=attempt.resume_step if attempt else -1,
                resume_snapshot=max(0, attempt.resume_snapshot_attempt) if attempt else 0,
                committed_steps=committed,
                stop_requested=stop,
                draining=draining,
                policy=self._stored_policy(listing.policy),
                claimed_elsewhere=dict(claimed_elsewhere or {}),
                memory=_try(store_pb2.SupervisorMemory, listing.memory.value) if listing.memory else None,
            )
        return snap, Addresses(set=addresses), follow, attempt

    # -- watch ---------------------------------------------------------------------------------

    def watch_event(self, item: WatchEvent) -> tuple[list[Event], Addresses]:
        """One watched change -> its events (in order) and any agent address change."""
        k = self.keys
        key, deleted = item.key, item.type.name == "DELETE"
        with self._lock:
            if key.startswith(k.nodes_prefix()):
                return self._node(key[len(k.nodes_prefix()) :], None if deleted else item.value)
            if key.startswith(k.progress_prefix(self.run)):
                if deleted:
                    return [], Addresses()
                return self._progress(parse(store_pb2.NodeProgress, item.value, key)), Addresses()
            if key.startswith(k.base + "evidence/"):
                if deleted:
                    return [], Addresses()
                rec = parse(store_pb2.EvidenceRecord, item.value, key)
                if not rec.evidence.node:
                    raise ValueError(f"{key}: evidence without a node")
                return [EvidenceObserved(evidence=rec.evidence)], Addresses()
            if key.startswith(k.claims_prefix()):
                return self._claim(k.name_under(k.claims_prefix(), key), None if deleted else item.value)
            if key == k.stop(self.run) and not deleted:
                return [_stop_requested(parse(store_pb2.StopRequest, item.value, key))], Addresses()
            if key == k.policy(self.run) and not deleted:  # a deleted policy: the core keeps its own
                return [policy_changed(item.value, key)], Addresses()
        return [], Addresses()

    def _claim(self, node: str, value: bytes | None) -> tuple[list[Event], Addresses]:
        """Another run took `node` (NodeClaimed with its run) or gave it back (NodeClaimed with run
        "": the shell adds the node's stored record before the core sees it). This run's own claims
        are no event: its shell took or gave them back itself."""
        was = self.claim_holders.pop(node, "")
        if value is None:
            return ([NodeClaimed(node=node)] if was and was != self.run else []), Addresses()
        claim = parse(store_pb2.NodeClaim, value, f"claim of {node}")
        if not claim.run:
            raise ValueError(f"claim of {node}: names no run")
        self.claim_holders[node] = claim.run
        if claim.run == self.run or claim.run == was:
            return [], Addresses()
        return [NodeClaimed(node=node, run=claim.run)], Addresses()

    def holder(self, node: str) -> str:
        """The run whose claim holds `node` as the watch last saw it ("" : none)."""
        with self._lock:
            return self.claim_holders.get(node, "")

    def _stored_policy(self, kv: KeyValue | None) -> PolicyChanged | None:
        if kv is None:
            return None
        try:
            return policy_changed(kv.value, kv.key)
        except ValueError as exc:  # keep deciding with the policy in force; `config apply` repairs it
            log.warning("ignoring the stored policy: %s", exc)
            return None

    def _node(self, node: str, value: bytes | None) -> tuple[list[Event], Addresses]:
        if value is None:
            self.known_nodes.pop(node, None)
            return [NodeLost(node=node)], Addresses(forget=(node,))
        rec = parse(store_pb2.NodeRecord, value, f"node {node}")
        prev = self.known_nodes.get(node)
        fresh = prev is None
        out: list[Event] = []
        if fresh:
            out.append(NodeJoined(node=node, local_ranks=max(1, rec.local_ranks or 1)))
        why, was = self._drain_reason(rec), self._drain_reason(prev, quiet=True) if prev is not None else ""
        if why != was:
            out.append(NodeDraining(node=node, reason=why))
        self.known_nodes[node] = rec
        # A re-registered agent (a new lease) gets a new channel (AgentClients.set_address); a node a
        # new leader sees again keeps its channel and the calls in flight on it.
        return out, Addresses(set={node: (rec.address, rec.lease_id)})

    def _drain_reason(self, rec: store_pb2.NodeRecord, *, quiet: bool = False) -> str:
        """Why the node of `rec` drains ("" when it does not): its agent's state says DRAINING, or
        its version is outside the skew rule (runwarden.version). A node this controller does not
        drive is still alive, so it is never seen as lost (no strike, no quarantine): it takes no
        placement, and an attempt it runs in ends with a planned stop and a spare in its place. One
        error log per node and reason."""
        skew = agent_skew(rec.agent_version, self.controller_version)
        if quiet:
            return f"version: {skew}" if skew else _drain_reason(rec)
        if not skew:
            self.left_out.pop(rec.node, None)
            return _drain_reason(rec)
        if self.left_out.get(rec.node) != skew:
            log.error("node %s is left out: %s", rec.node, skew)
            self.left_out[rec.node] = skew
        return f"version: {skew}"

    def _progress(self, prog: store_pb2.NodeProgress) -> list[Event]:
        out: list[Event] = []
        self._map_ranks(prog)
        for r in prog.ranks:
            if r.checkpoint_error and (prog.attempt, r.step) not in self._ckpt_failures:
                self._ckpt_failures.add((prog.attempt, r.step))
                out.append(
                    CheckpointFailed(
                        step=r.step, error=r.checkpoint_error, node=prog.node, attempt=prog.attempt
                    )
                )
            if (
                r.load_error
                and r.HasField("invalid_step")
                and (prog.attempt, r.invalid_step) not in self._invalid
            ):
                self._invalid.add((prog.attempt, r.invalid_step))
                out.append(
                    CheckpointInvalid(
                        step=r.invalid_step, error=r.load_error, node=prog.node, attempt=prog.attempt
                    )
                )
            if r.HasField("committed_step") and (
                r.committed_step > self.committed_seen or prog.attempt > self.committed_attempt
            ):
                # any rank: rank 0 reports a commit as it writes it, the others once they see its
                # marker (nodeagent.trainer.dcp), so a lost rank-0 host does not hide the newest commit.
                # Per attempt: after a rollback (a loss anomaly) a new attempt commits steps an
                # earlier one committed; the core drops the commits it already holds
                self.committed_seen = r.committed_step
                self.committed_attempt = max(self.committed_attempt, prog.attempt)
                out.append(
                    CheckpointCommitted(
                        step=r.committed_step,
                        attempt=prog.attempt,
                        save_duration_s=_save_stall(prog, r.committed_step),
                    )
                )
        out.append(
            ProgressObserved(
                node=prog.node,
                attempt=prog.attempt,
                ranks=tuple(RankSample.from_proto(r, losses=_losses(prog, r)) for r in prog.ranks),
            )
        )
        if prog.HasField("exit"):
            out.extend(self._exit_seen(prog))  # the node's last progress, then its exit
        return out

    def _map_ranks(self, prog: store_pb2.NodeProgress) -> None:
        """Each rank's node as torch placed it: the RANK the rank itself reported, through the agent
        of the node it runs on. Never the node rank the controller asked for: c10d may give global
        rank 0 to any node. A late write of an earlier attempt changes nothing."""
        if prog.attempt < self.attempt:
            return
        if prog.attempt > self.attempt:
            self.attempt, self.rank_to_node = prog.attempt, {}
        for r in prog.ranks:
            self.rank_to_node[r.rank] = prog.node

    def _exit_seen(self, prog: store_pb2.NodeProgress) -> list[Event]:
        """A node's workers of an attempt ended (its agent wrote the exit into its progress)."""
        if (prog.node, prog.attempt) in self.exited:
            return []
        self.exited.add((prog.node, prog.attempt))
        return [_attempt_exited(prog.node, prog.attempt, prog.exit)]

    # -- what the RPC side reports -------------------------------------------------------------

    def exit_from_stop(
        self, node: str, attempt: int, answer: agent_pb2.StopWorkersResponse
    ) -> AttemptExited | None:
        """The exit of `node`'s workers of `attempt` as its StopWorkers answer gives it, unless the
        progress watch brought it first (then None; and the record that comes after this one is
        dropped the same way). An unplanned stop's relaunch waits for every host's exit: taken from
        the answers, it does not also wait for each exit record's round trip through etcd (2,048
        writes, and as many watch events, at 2,048 hosts)."""
        with self._lock:
            for w in answer.stopped:
                if w.attempt != attempt or w.running or not w.HasField("exit"):
                    continue
                if (node, attempt) in self.exited:
                    return None
                self.exited.add((node, attempt))
                return _attempt_exited(node, attempt, w.exit)
        return None

    def mark_exited(self, node: str, attempt: int) -> None:
        """No worker of `attempt` runs on `node` (its launch failed, or it was never launched)."""
        with self._lock:
            self.exited.add((node, attempt))

    def has_exited(self, node: str, attempt: int) -> bool:
        """Whether `node`'s workers of `attempt` have ended: their exit was seen, or a later attempt
        has begun (new_attempt forgets the older exits; whoever still waits on one must not wait on)."""
        with self._lock:
            return (node, attempt) in self.exited or attempt < self.attempt

    def new_attempt(self, attempt: int) -> None:
        with self._lock:
            self.exited = {e for e in self.exited if e[1] >= attempt}
            if attempt > self.attempt:
                self.attempt, self.rank_to_node = attempt, {}

    def ranks(self) -> dict[int, str]:
        """Global rank -> node as torch assigned it: from the RANK each rank reported through its
        node's agent (c10d may give global rank 0 to any node, whatever node rank it was asked for)."""
        with self._lock:
            return dict(self.rank_to_node)

    def rendezvous(self, node: str) -> Rendezvous | None:
        """Where `node` hosts torchrun's c10d store when it is node rank 0, as its node record says;
        None when the node is unknown or its agent reports none (an older agent)."""
        with self._lock:
            rec = self.known_nodes.get(node)
        if rec is None or not rec.torch_host or not 0 < rec.rdzv_port <= 65535:
            return None
        return Rendezvous(host=rec.torch_host, port=rec.rdzv_port)


MAX_RECENT_LOSSES = 64  # per rank per write, as the agent sends them (nodeagent/daemon/progress.py)


def _losses(prog: store_pb2.NodeProgress, r: common_pb2.RankProgress) -> tuple[tuple[int, float], ...]:
    """A rank's (step, loss) list, each bad pair dropped alone with a log line (a negative step);
    NaN and infinite losses are reports (the loss rules' signal), kept."""
    pairs = proto_losses(r)
    if not pairs:
        return ()
    kept = tuple((s, v) for s, v in pairs if s >= 0)
    if len(kept) < len(pairs):
        bad = sorted({s for s, _ in pairs if s < 0})[:5]
        log.warning(
            "progress of %s (attempt %d) rank %d: %d loss(es) at negative steps %s dropped",
            prog.node,
            prog.attempt,
            r.rank,
            len(pairs) - len(kept),
            bad,
        )
    if len(kept) > MAX_RECENT_LOSSES:
        log.warning(
            "progress of %s (attempt %d) rank %d: %d losses, over %d: the newest %d kept",
            prog.node,
            prog.attempt,
            r.rank,
            len(kept),
            MAX_RECENT_LOSSES,
            MAX_RECENT_LOSSES,
        )
        kept = kept[-MAX_RECENT_LOSSES:]
    return kept


MAX_SAVE_STALL_S = 86_400.0  # a save that blocked training longer than a day is a bad report


def _save_stall(prog: store_pb2.NodeProgress, step: int) -> float:
    """How long the save of commit `step` blocked training: the longest of the stalls the node's
    ranks report with it (RankProgress.save_stall_s; the ranks wait for each other in the save).
    One that is not a number in [0, MAX_SAVE_STALL_S] counts as 0 with a log line: the commit
    itself stands."""
    longest = 0.0
    for r in prog.ranks:
        if not r.HasField("committed_step") or r.committed_step != step:
            continue
        stall = r.save_stall_s
        if math.isfinite(stall) and 0.0 <= stall <= MAX_SAVE_STALL_S:
            longest = max(longest, stall)
        else:
            log.warning(
                "progress of %s (attempt %d) rank %d: save stall %r of checkpoint %d is not in "
                "[0, %g] s: counted as 0",
                prog.node,
                prog.attempt,
                r.rank,
                stall,
                step,
                MAX_SAVE_STALL_S,
            )
    return longest


def record_view(pool: KeyValue | None, reputation: KeyValue | None) -> NodeRecordView | None:
    """A node's stored pool entry and reputation as the core reads them; None without a readable entry."""
    entry = _try(store_pb2.PoolEntry, pool.value) if pool is not None else None
    if entry is None or not entry.node:
        return None
    rep = (
        _try(store_pb2.Reputation, reputation.value) if reputation is not None else None
    ) or store_pb2.Reputation()
    return NodeRecordView(
        node=entry.node,
        pool_state=entry.state or common_pb2.POOL_STATE_SPARE,
        reason=entry.reason,
        burn_in_passes=entry.burn_in_passes,
        operator_hold=entry.operator_hold,
        failure_times=tuple(rep.failure_times),
        straggler_flags=rep.straggler_flags,
        preflight_rejections=rep.preflight_rejections,
        evidence=tuple(entry.evidence),
        evidence_kinds=tuple(rep.evidence_kinds),
        known_since=rep.known_since,
        repaired_at=rep.repaired_at if math.isfinite(rep.repaired_at) else 0.0,
        awaiting_repair_since=(
            entry.awaiting_repair_since if math.isfinite(entry.awaiting_repair_since) else 0.0
        ),
    )


def policy_changed(data: bytes, where: str) -> PolicyChanged:
    """A stored policy record as the core's event (ValueError, a ConfigError, for a bad one)."""
    cfg, rec = policy_store.decode(data, where)
    return PolicyChanged(config=cfg, changed_by=_text(rec.changed_by), reason=_text(rec.reason))


def _stop_requested(req: store_pb2.StopRequest) -> StopRequested:
    return StopRequested(
        reason=req.reason or "stop requested", requested_by=req.requested_by, relaunch=req.relaunch
    )


def _try(cls: type[_M], data: bytes) -> _M | None:
    """Parse for a relist: a bad value is skipped (the watch reports it when it changes)."""
    try:
        return parse(cls, data)
    except ValueError:
        return None


_MAX_TEXT = 500


def _attempt_exited(node: str, attempt: int, e: common_pb2.ExitStatus) -> AttemptExited:
    return AttemptExited(
        node=node,
        attempt=attempt,
        exit_code=e.exit_code if e.HasField("exit_code") else None,
        signal=e.signal if e.HasField("signal") else None,
        ended_at=e.ended_at or None,
        detail=e.detail,
        planned_stop=_text(e.planned_stop),
    )


def _text(value: str) -> str:
    """A reason from outside (an agent's record), as one printable line of bounded length."""
    line = "".join(c if c.isprintable() else " " for c in value).strip()
    return line[:_MAX_TEXT]


def _drain_reason(rec: store_pb2.NodeRecord) -> str:
    """Why the node drains ("" when it does not): its agent's state says DRAINING."""
    if rec.state != common_pb2.NODE_STATE_DRAINING:
        return ""
    return _text(rec.drain_reason) or "draining (no reason given)"
