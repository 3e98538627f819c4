"""The node pool: spare / assigned / quarantined / burn-in / held, and per-node reputation.

Pure bookkeeping (no IO): the core decides *when* to move a node; this module keeps the rules of
*where* it may go, as the only moves it offers (`LEGAL` is the graph; a move outside it raises):

    SPARE --assign--> ASSIGNED --unassign--> SPARE
    any --quarantine--> QUARANTINED, or HELD (fatal evidence: needs repair; a second failure within
                        the hold window; or an operator)
    QUARANTINED --start_burn_in--> BURN_IN --burn_in_result--> SPARE (N passes in a row) | QUARANTINED (a failure)
                 (not while a failed burn-in waits for a repair: a new lease, or an operator)
    QUARANTINED | HELD | BURN_IN --operator_release--> BURN_IN
    QUARANTINED | HELD | BURN_IN --strike_off--> SPARE (quarantined for a fault not its own: a crash loop's victim)
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from controller.supervisor.policy import SupervisorConfig
from runwarden.evidence import is_fatal
from runwarden.v1 import common_pb2

MAX_FAILURE_TIMES = 32


def needs_repair(evidence: Iterable[common_pb2.Evidence]) -> bool:
    """Whether a quarantine on this evidence holds the node until it is repaired (no burn-in)."""
    return any(is_fatal(e) for e in evidence)


class PoolState(enum.Enum):
    """Where a node is; the value is the wire enum (`runwarden.v1.PoolState`)."""

    SPARE = common_pb2.POOL_STATE_SPARE
    ASSIGNED = common_pb2.POOL_STATE_ASSIGNED
    QUARANTINED = common_pb2.POOL_STATE_QUARANTINED
    BURN_IN = common_pb2.POOL_STATE_BURN_IN
    HELD = common_pb2.POOL_STATE_HELD

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", "-")

    @property
    def proto(self) -> common_pb2.PoolState.ValueType:
        return common_pb2.PoolState.ValueType(self.value)


S = PoolState
LEGAL: dict[PoolState, frozenset[PoolState]] = {
    S.SPARE: frozenset({S.ASSIGNED, S.QUARANTINED, S.HELD}),
    S.ASSIGNED: frozenset({S.SPARE, S.QUARANTINED, S.HELD}),
    S.QUARANTINED: frozenset({S.QUARANTINED, S.HELD, S.BURN_IN, S.SPARE}),
    S.BURN_IN: frozenset({S.BURN_IN, S.SPARE, S.QUARANTINED, S.HELD}),
    S.HELD: frozenset({S.HELD, S.BURN_IN, S.SPARE}),
}
OUT_OF_SERVICE = frozenset({S.QUARANTINED, S.BURN_IN, S.HELD})


class IllegalPoolMove(RuntimeError):
    """A move outside `LEGAL`: a bug in the caller, never bad input."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeRecordView:
    """A node's persisted pool entry + reputation, as read back from the store."""

    node: str
    pool_state: int = common_pb2.POOL_STATE_SPARE
    reason: str = ""
    burn_in_passes: int = 0
    operator_hold: bool = False
    failure_times: tuple[float, ...] = ()
    straggler_flags: int = 0
    preflight_rejections: int = 0
    evidence: tuple[common_pb2.Evidence, ...] = ()  # why it is quarantined (PoolEntry.evidence)
    evidence_kinds: tuple[
        int, ...
    ] = ()  # fatal evidence kinds seen, oldest first (Reputation.evidence_kinds)
    known_since: float = 0.0  # first registration seen (Reputation.known_since; 0: unknown)
    repaired_at: float = 0.0  # an operator's last repair or release (Reputation.repaired_at; 0: never)
    # its last burn-in failed then: it waits for a repair (PoolEntry.awaiting_repair_since; 0: not)
    awaiting_repair_since: float = 0.0


@dataclass(slots=True)
class PoolNode:
    name: str
    alive: bool = False
    draining: str = ""  # why the node is leaving (its agent's record says); not durable pool state
    local_ranks: int = 1
    state: PoolState = PoolState.SPARE
    reason: str = ""
    burn_in_passes: int = 0
    operator_hold: bool = False
    failure_times: list[float] = field(default_factory=list)
    straggler_flags: int = 0
    preflight_rejections: int = 0
    evidence: list[tuple[float, common_pb2.Evidence]] = field(default_factory=list)  # (received, ev), bounded
    quarantine_evidence: list[common_pb2.Evidence] = field(default_factory=list)
    evidence_kinds: list[int] = field(default_factory=list)  # bounded, oldest first
    known_since: float | None = None  # first registration seen (durable: Reputation.known_since)
    repaired_at: float = 0.0  # an operator's last repair or release (durable); 0: never
    awaiting_repair_since: float = 0.0  # its last burn-in failed then (durable); 0: not waiting
    elsewhere: str = ""  # the other run that holds the node's claim now: never picked here
    registered_at: float | None = None  # its current lease's registration, as seen here
    checked_at: float | None = None  # its last passing preflight or burn-in since then (not durable)
    evidence_at: float | None = None  # the last evidence about the node (not its job) came then

    def view(self) -> NodeRecordView:
        return NodeRecordView(
            node=self.name,
            pool_state=self.state.value,
            reason=self.reason,
            burn_in_passes=self.burn_in_passes,
            operator_hold=self.operator_hold,
            failure_times=tuple(self.failure_times),
            straggler_flags=self.straggler_flags,
            preflight_rejections=self.preflight_rejections,
            evidence=tuple(self.quarantine_evidence),
            evidence_kinds=tuple(self.evidence_kinds),
            known_since=self.known_since or 0.0,  # the wire's 0 is "unknown"
            repaired_at=self.repaired_at,
            awaiting_repair_since=self.awaiting_repair_since,
        )


class Pool:
    """All nodes the controller knows, by name. Its rules:

    * a quarantined node returns only through burn-in: `burn_in_passes` consecutive full-preflight
      passes (a failure restarts the count and waits for a repair: re-registration or an operator);
    * a node quarantined on fatal evidence (`runwarden.evidence.is_fatal`: a GPU off the bus, an
      uncorrectable ECC error, a row-remap failure, a fatal Xid) is HELD as *needs repair*: a burn-in
      of a GPU that fell off the bus means nothing until it was reset, reseated or rebooted, so it gets
      none until an operator (or a repair hook, through the API) marks it repaired; then burn-in;
    * a node with `hold_after_failures` failures within `hold_window_s` is HELD: no burn-in, out until
      an operator releases it (operator release puts it into burn-in, like any quarantined node);
    * spares are picked best reputation first: fewest recent failures (a node that failed recently is
      the last choice), then golden hosts (clean for `golden_after_s` since first seen or last failure,
      no straggler flag or preflight rejection) before the merely clean, then the lifetime record
      (failures, straggler flags, preflight rejections), then name, for determinism. Empty node ranks
      fill lowest first, so node rank 0 (the rendezvous store's host) gets the best node available."""

    def __init__(self, cfg: SupervisorConfig) -> None:
        self._cfg = cfg
        self.nodes: dict[str, PoolNode] = {}
        self._free: set[str] = set()  # alive and SPARE: O(1) membership for picking

    def reconfigure(self, cfg: SupervisorConfig) -> None:
        """The policy changed live (controller/supervisor/reconfigure.py): hold windows, burn-in
        passes and golden hosts are judged with `cfg` from now on."""
        self._cfg = cfg

    # --- membership ---------------------------------------------------------------------------

    def get(self, name: str) -> PoolNode:
        node = self.nodes.get(name)
        if node is None:
            node = self.nodes[name] = PoolNode(name=name)
        return node

    def _sync(self, node: PoolNode) -> None:
        if node.alive and not node.draining and not node.elsewhere and node.state is PoolState.SPARE:
            self._free.add(node.name)
        else:
            self._free.discard(node.name)

    def _move(self, node: PoolNode, to: PoolState) -> None:
        if to is not node.state and to not in LEGAL[node.state]:
            raise IllegalPoolMove(f"{node.name}: {node.state.label} -> {to.label} is not a pool move")
        node.state = to
        self._sync(node)

    def set_alive(
        self, name: str, alive: bool, local_ranks: int | None = None, now: float | None = None
    ) -> PoolNode:
        """`now` (a registration): starts the node's known history the first time it is seen."""
        node = self.get(name)
        if alive and now is not None:
            if node.known_since is None:
                node.known_since = now
            if not node.alive:
                node.registered_at = now  # a new lease: a host that restarted is checked again
        if not alive:
            node.checked_at = None
        node.alive = alive
        if local_ranks is not None:
            node.local_ranks = local_ranks
        self._sync(node)
        return node

    def set_draining(self, name: str, reason: str) -> PoolNode:
        """A drain (reason) or its end (""): the node takes no new placement while it drains."""
        node = self.get(name)
        node.draining = reason
        self._sync(node)
        return node

    def set_elsewhere(self, name: str, run: str) -> PoolNode:
        """Another run holds the node's claim (`run`), or none does (""): only a node no other run
        holds is free here (the shared spare pool, controller/fleet/claims.py)."""
        node = self.get(name)
        node.elsewhere = run
        self._sync(node)
        return node

    def load(self, records: Iterable[NodeRecordView]) -> None:
        for r in records:
            node = self.get(r.node)
            # assignment is not durable pool state: the attempt record says which nodes run (see adopt)
            known = r.pool_state in PoolState._value2member_map_ and r.pool_state != PoolState.ASSIGNED.value
            node.state = PoolState(r.pool_state) if known else PoolState.SPARE
            node.reason, node.burn_in_passes, node.operator_hold = r.reason, r.burn_in_passes, r.operator_hold
            node.failure_times = list(r.failure_times)[-MAX_FAILURE_TIMES:]
            node.straggler_flags, node.preflight_rejections = r.straggler_flags, r.preflight_rejections
            node.quarantine_evidence = list(r.evidence)[-8:]
            node.evidence_kinds = list(r.evidence_kinds)[-MAX_FAILURE_TIMES:]
            # the store's is the older memory unless it never had one (then keep what was seen here)
            node.known_since = r.known_since if r.known_since else node.known_since
            node.repaired_at = r.repaired_at
            node.awaiting_repair_since = r.awaiting_repair_since
            self._sync(node)

    def free_count(self) -> int:
        return len(self._free)

    def free_names(self) -> list[str]:
        """The alive spares no run uses now (unordered)."""
        return list(self._free)

    def usable(self, name: str) -> bool:
        node = self.nodes.get(name)
        return (
            node is not None
            and node.alive
            and not node.draining
            and not node.elsewhere
            and node.state in (PoolState.SPARE, PoolState.ASSIGNED)
        )

    # --- assignment ---------------------------------------------------------------------------

    def assign(self, name: str) -> None:
        """SPARE -> ASSIGNED: the node takes a slot of the attempt being prepared (or adopted)."""
        node = self.get(name)
        if node.state is not PoolState.ASSIGNED:
            self._move(node, PoolState.ASSIGNED)

    def unassign(self, name: str) -> bool:
        """ASSIGNED -> SPARE (the attempt ended or dropped it); False when it was not assigned."""
        node = self.get(name)
        if node.state is not PoolState.ASSIGNED:
            return False
        self._move(node, PoolState.SPARE)
        return True

    # --- reputation ---------------------------------------------------------------------------

    def recent_failures(self, node: PoolNode, now: float) -> int:
        """Failures within the hold window and since the node's last repair (what holds it)."""
        return sum(
            1
            for t in node.failure_times
            if now - t <= self._cfg.hold_window_s and (not node.repaired_at or t > node.repaired_at)
        )

    def clean_for(self, node: PoolNode, now: float) -> float:
        """Seconds of known history with no failure, straggler flag or preflight rejection (0: none).

        Flags and rejections carry no time, so a node that has any is never clean for long."""
        if node.known_since is None or node.straggler_flags or node.preflight_rejections:
            return 0.0
        repaired = [node.repaired_at] if node.repaired_at else []
        return max(0.0, now - max([node.known_since, *repaired, *node.failure_times]))

    def golden(self, node: PoolNode, now: float) -> bool:
        """A long clean history: the first choice for a replacement and for node rank 0 (whose host
        holds the rendezvous store, so its loss costs the most)."""
        after = self._cfg.golden_after_s
        return after > 0 and self.clean_for(node, now) >= after

    def score(self, node: PoolNode, now: float) -> tuple[int, bool, int, int, str]:
        """Lower is better: recent failures first (a node that failed recently is the last choice),
        then golden hosts before the merely clean, then lifetime record, then name (determinism)."""
        return (
            self.recent_failures(node, now),
            not self.golden(node, now),
            len(node.failure_times) + node.straggler_flags,
            node.preflight_rejections,
            node.name,
        )

    def record_note(self, name: str, now: float) -> str:
        """Why a node was a good or a last-resort choice, for the event log."""
        node = self.get(name)
        recent = self.recent_failures(node, now)
        if self.golden(node, now):
            return f"golden host: clean for {self.clean_for(node, now) / 86400:.1f} days"
        if (
            not recent
            and not node.failure_times
            and not node.straggler_flags
            and not node.preflight_rejections
        ):
            return "clean record"
        parts = [f"{recent} failure(s) within {self._cfg.hold_window_s / 86400:g} days"] if recent else []
        if node.straggler_flags:
            parts.append(f"{node.straggler_flags} straggler flag(s)")
        if node.preflight_rejections:
            parts.append(f"{node.preflight_rejections} preflight rejection(s)")
        if not parts:
            parts.append(f"{len(node.failure_times)} older failure(s)")
        if node.repaired_at:
            parts.append(f"repaired {(now - node.repaired_at) / 3600:.1f} h ago")
        return "best left: " + ", ".join(parts)

    def pick_spares(self, count: int, now: float, exclude: Iterable[str] = ()) -> list[str]:
        """Up to `count` free nodes, best reputation first, none of `exclude`."""
        if count <= 0:
            return []
        skip = set(exclude)
        ranked = sorted(
            (self.nodes[n] for n in self._free if n not in skip), key=lambda n: self.score(n, now)
        )
        return [n.name for n in ranked[:count]]

    def add_evidence(self, name: str, ev: common_pb2.Evidence, now: float) -> None:
        node = self.get(name)
        horizon = now - self._cfg.evidence_window_s
        node.evidence = [(at, e) for at, e in node.evidence[-15:] if at >= horizon] + [(now, ev)]
        if ev.severity != common_pb2.SEVERITY_APPLICATION:  # about the node, not its job
            node.evidence_at = now

    def evidence_since(self, name: str, since: float) -> list[common_pb2.Evidence]:
        return [e for at, e in self.get(name).evidence if at >= since]

    # --- quarantine / burn-in / release -------------------------------------------------------

    def quarantine(
        self,
        name: str,
        now: float,
        reason: str,
        *,
        count_failure: bool = True,
        operator: bool = False,
        evidence: Iterable[common_pb2.Evidence] = (),
    ) -> PoolNode:
        """Quarantine; a second failure within the hold window (or an operator) makes it HELD."""
        node = self.get(name)
        node.quarantine_evidence = list(evidence)[-8:]
        node.evidence_kinds = [*node.evidence_kinds, *(e.kind for e in node.quarantine_evidence)][
            -MAX_FAILURE_TIMES:
        ]
        if count_failure:
            node.failure_times = [*node.failure_times, now][-MAX_FAILURE_TIMES:]
        # a held node stays held (only an operator lets it back), whatever the new failure is
        held = (
            operator
            or node.state is PoolState.HELD
            or needs_repair(node.quarantine_evidence)
            or self.recent_failures(node, now) >= self._cfg.hold_after_failures
        )
        node.operator_hold = node.operator_hold or operator
        self._move(node, PoolState.HELD if held else PoolState.QUARANTINED)
        node.reason = reason
        node.burn_in_passes = 0
        return node

    def start_burn_in(self, name: str, *, repaired: bool = False) -> bool:
        """QUARANTINED (or BURN_IN) and alive -> BURN_IN. Returns whether a burn-in run should start.

        A node whose last burn-in failed waits for a repair: no burn-in (a relist, a new leader, a
        claim given back) until `repaired` (it registered again: a new lease, it rebooted) or an
        operator's release (BURN_IN, repaired_at after the failure)."""
        node = self.get(name)
        if node.state not in (PoolState.QUARANTINED, PoolState.BURN_IN) or not node.alive:
            return False
        if repaired:
            node.awaiting_repair_since = 0.0
        elif node.state is PoolState.QUARANTINED and self.awaits_repair(node):
            return False
        self._move(node, PoolState.BURN_IN)
        node.awaiting_repair_since = 0.0
        return True

    def awaits_repair(self, node: PoolNode) -> bool:
        """Its last burn-in failed and nothing since repaired it or quarantined it anew (a later
        failure is a new quarantine, burned in as any)."""
        since = node.awaiting_repair_since
        return since > 0 and node.repaired_at <= since and all(t <= since for t in node.failure_times)

    def burn_in_result(
        self, name: str, passed: bool, failed_checks: Iterable[str] = (), now: float = 0.0
    ) -> str:
        """ "released" (N passes in a row: SPARE), "again" (passed, more to go), "failed" (QUARANTINED,
        waiting for a repair since `now`), or "stale" (the node left burn-in meanwhile, e.g. an
        operator held it: the result means nothing)."""
        node = self.get(name)
        if node.state is not PoolState.BURN_IN:
            return "stale"
        if not passed:
            node.burn_in_passes = 0
            node.preflight_rejections += 1
            self._move(node, PoolState.QUARANTINED)
            node.reason = f"burn-in failed: {', '.join(failed_checks) or '?'}"
            node.awaiting_repair_since = max(now, 1e-9)  # > 0 even at time 0: it waits
            return "failed"
        node.burn_in_passes += 1
        if node.burn_in_passes >= self._cfg.burn_in_passes:
            self._move(node, PoolState.SPARE)
            node.reason, node.burn_in_passes = "", 0
            node.quarantine_evidence = []
            node.awaiting_repair_since = 0.0
            return "released"
        return "again"

    def strike_off(self, name: str, at: float, now: float) -> bool:
        """Undo the quarantine of `name` struck at `at` (the fault was not the node's: a crash loop
        rotated it): the strike leaves its record, and it is a spare again unless something else
        keeps it out (an operator's hold, fatal evidence, other recent failures). False when there
        was no such strike."""
        node = self.get(name)
        if at not in node.failure_times:
            return False
        node.failure_times.remove(at)
        if node.state not in OUT_OF_SERVICE:
            return True
        if (
            node.operator_hold
            or needs_repair(node.quarantine_evidence)
            or self.recent_failures(node, now) >= self._cfg.hold_after_failures
        ):
            return True
        self._move(node, PoolState.SPARE)
        node.reason, node.burn_in_passes, node.quarantine_evidence = "", 0, []
        return True

    def operator_release(self, name: str, now: float) -> PoolNode:
        """An operator's release or repair: burn-in next. The failures stay on record (reputation,
        golden hosts); only those after `now` count toward the next hold."""
        node = self.get(name)
        node.operator_hold = False
        node.repaired_at = now
        if node.state in OUT_OF_SERVICE:
            self._move(node, PoolState.BURN_IN)
        node.burn_in_passes = 0
        return node
