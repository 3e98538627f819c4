"""Claims: which run holds each node of a fleet that several runs share (one etcd root).

A node belongs to one run at a time, named by its claim ``<root>/v1/claims/<node>`` (a `NodeClaim`);
only that run launches on it, preflights or burns it in, and writes its pool entry and reputation.
Every change is a fenced transaction (a claim is taken only if absent, given back only if still this
run's), and the attempt record's write compares every node's claim too (controller/live/executor.py):
two runs can never both launch on one node. `Claims` is the live controller's side; the API's
`controllerctl claims release` uses `release_by_operator`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from runwarden.keys import LEGACY_ELECTION
from runwarden.store import Compare, Delete, KeyValue, Leadership, Put, Store, StoreError
from runwarden.v1 import store_pb2

log = logging.getLogger(__name__)

BID_WINDOW_S = 0.3  # asks this close together are decided by priority
# An attempt record's transaction compares each node's claim up to this many nodes (with the fence and
# the record's own compare, within etcd's default --max-txn-ops of 128); past it, one prefix compare.
PER_NODE_COMPARES = 100
# Nodes a claim transaction takes (the fence and one compare each: within the same 128).
CLAIM_CHUNK = 100


def read_claim(kv: KeyValue | None) -> store_pb2.NodeClaim | None:
    """A stored claim; None for no key or an unreadable value (which holds the node for nobody)."""
    if kv is None:
        return None
    claim = store_pb2.NodeClaim()
    try:
        claim.ParseFromString(kv.value)
    except DecodeError:
        return None
    return claim if claim.run else None


@dataclass(frozen=True, slots=True, kw_only=True)
class Refused:
    """A node this run could not take, and why (the run that holds or out-bid it, or the store)."""

    node: str
    reason: str
    temporary: bool = True


class Claims:
    """This run's claims, as this controller knows them (node -> the claim's mod revision).

    Thread-safe: the loop gives back and takes out-of-service nodes; pool threads take the nodes of
    an attempt before their preflight. Rebuilt from the store at every relist (`load`).

    **Who gets a free node first: priority, then first come.** A run asking for free nodes first puts
    a bid per node, ``<root>/v1/bids/<node>/<run>`` (under its leader's lease, so a dead run's bid goes
    with it), waits `bid_window_s`, then reads the node's bids: it takes the node only if no bid beats
    its own (a higher priority, or the same priority put earlier: a lower create revision). Asks within
    one bid window of each other are decided by priority; a later ask finds the node claimed. Either way
    the create-if-absent transaction is the guarantee: a loser's transaction fails, it never holds the
    node. A loser is told which run won; its core picks the next spare (or the queue). With no other
    run's controller under the root there is nobody to out-bid, and no window is waited.

    **Why claims are persistent, not under the leader's lease.** A claim under the leader's lease would
    vanish whenever the leader dies, for the few seconds until its standby takes over and takes the
    claims again; in that window another run could claim the running attempt's nodes and launch on
    them. So a claim belongs to the *run*, not to one controller process: it outlives a leader change
    (the standby finds the run's claims and adopts them with its attempt), and it is given back
    explicitly: when the node leaves the run (its core no longer holds it: it went back to the spare
    pool after burn-in, or was replaced), and all of them when the run ends. A run that disappears
    without ending (its controllers all removed) leaves its claims; an operator gives them back with
    ``controllerctl claims release NODE`` (or ``--run RUN``), which only a run's absence justifies.
    """

    def __init__(
        self,
        store: Store,
        run: str,
        *,
        priority: int = 0,
        identity: str = "",
        bid_window_s: float = BID_WINDOW_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.keys = store.keys
        self.run = run
        self.priority = priority
        self.identity = identity
        self.bid_window_s = bid_window_s
        self.clock = clock
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}

    # -- the view ------------------------------------------------------------------------------

    def load(self, kvs: Iterable[KeyValue]) -> dict[str, str]:
        """A listing of claims/: this run's become its held claims; returns the other runs' (node -> run)."""
        mine: dict[str, int] = {}
        others: dict[str, str] = {}
        prefix = self.keys.claims_prefix()
        for kv in kvs:
            claim = read_claim(kv)
            try:
                node = self.keys.name_under(prefix, kv.key)
            except ValueError:
                continue
            if claim is None:
                continue
            if claim.run == self.run:
                mine[node] = kv.mod_revision
            else:
                others[node] = claim.run
        with self._lock:
            self._held = mine
        return others

    def held(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._held)

    def holds(self, node: str) -> bool:
        with self._lock:
            return node in self._held

    def compares(self, nodes: Iterable[str]) -> list[Compare] | str:
        """For the attempt record's transaction: every node's claim is still this run's; or why not.

        Up to PER_NODE_COMPARES nodes, a compare per claim. A larger attempt (etcd refuses a
        transaction of more than its `--max-txn-ops`, 128 by default) reads the claims now and
        compares the whole claims prefix as unwritten since that read: another run's claim of any of
        the nodes would be a write, so it fails the transaction as the per-node compares would; so
        does any other claim written meanwhile, and the launch is tried again."""
        wanted = list(dict.fromkeys(nodes))
        with self._lock:
            missing = [n for n in wanted if n not in self._held]
            if missing:
                return f"not claimed by run {self.run}: {', '.join(sorted(missing))}"
            if len(wanted) <= PER_NODE_COMPARES:
                return [Compare(key=self.keys.claim(n), mod_revision=self._held[n]) for n in wanted]
        prefix = self.keys.claims_prefix()
        try:
            kvs, revision = self.store.get_prefix(prefix)
        except StoreError as exc:
            return f"claims unreadable: {exc}"
        holders = {}
        for kv in kvs:
            claim = read_claim(kv)
            with contextlib.suppress(ValueError):
                holders[self.keys.name_under(prefix, kv.key)] = claim.run if claim is not None else ""
        lost = sorted(n for n in wanted if holders.get(n) != self.run)
        if lost:
            with self._lock:
                for n in lost:
                    self._held.pop(n, None)
            return f"not claimed by run {self.run} any more: {', '.join(lost)}"
        return [Compare(key=prefix, prefix=True, written_before=revision + 1)]

    # -- taking --------------------------------------------------------------------------------

    def take(self, nodes: Iterable[str], leadership: Leadership) -> list[Refused]:
        """Claim every node of `nodes` for this run (held ones are kept as they are); the refused."""
        wanted = [n for n in dict.fromkeys(nodes) if not self.holds(n)]
        if not wanted:
            return []
        refused: list[Refused] = []
        bid = store_pb2.ClaimBid(
            run=self.run, priority=self.priority, asked_at=self.clock()
        ).SerializeToString()
        contested = self._others_contend()
        if contested:
            try:
                for node in wanted:
                    self.store.put(self.keys.bid(node, self.run), bid, lease=leadership.lease)
            except StoreError as exc:
                self._withdraw(wanted)
                return [Refused(node=n, reason=f"bid not placed: {exc}") for n in wanted]
            time.sleep(self.bid_window_s)
        if not contested:  # nobody can out-bid this run: many nodes a transaction
            return self._create_all(wanted, leadership)
        bids_left = set(wanted)
        try:
            for node in wanted:
                beaten = self._beaten_by(node) if contested else ""
                if beaten:
                    refused.append(
                        Refused(node=node, reason=f"run {beaten} asked for it at once with priority")
                    )
                    continue
                why, bid_gone = self._create(node, leadership, withdraw_bid=contested)
                if bid_gone:
                    bids_left.discard(node)
                if why:
                    refused.append(Refused(node=node, reason=why))
        finally:
            self._withdraw(sorted(bids_left))
        return refused

    def take_now(self, node: str, leadership: Leadership) -> str:
        """Claim one node without a bid (an out-of-service node this run answers for); "" or why not."""
        if self.holds(node):
            return ""
        return self._create(node, leadership, withdraw_bid=False)[0]

    def _others_contend(self) -> bool:
        """Whether another run's controller contends under this root (else nobody can out-bid us)."""
        try:
            kvs, _ = self.store.get_prefix(self.keys.elections_prefix())
        except StoreError:
            return True
        prefix = self.keys.elections_prefix()
        names = {kv.key[len(prefix) :].split("/", 1)[0] for kv in kvs}
        return bool(names - {self.run, LEGACY_ELECTION})

    def _beaten_by(self, node: str) -> str:
        """The run whose bid for `node` beats this run's ("" if none): higher priority, then earlier."""
        try:
            kvs, _ = self.store.get_prefix(self.keys.bids_prefix(node))
        except StoreError:
            return ""  # the create below decides
        mine = next((kv for kv in kvs if kv.key == self.keys.bid(node, self.run)), None)
        if mine is None:
            return ""
        best_run, best = self.run, (-self.priority, mine.create_revision)
        for kv in kvs:
            rival = store_pb2.ClaimBid()
            try:
                rival.ParseFromString(kv.value)
            except DecodeError:
                continue
            if not rival.run or rival.run == self.run:
                continue
            rank = (-rival.priority, kv.create_revision)
            if rank < best:
                best_run, best = rival.run, rank
        return "" if best_run == self.run else best_run

    def _create_all(self, nodes: list[str], leadership: Leadership) -> list[Refused]:
        """Take every node of `nodes` no run holds, `CLAIM_CHUNK` a transaction (the fence and each
        claim absent); a chunk that one held node fails is taken node by node, each answered alone."""
        refused: list[Refused] = []
        for i in range(0, len(nodes), CLAIM_CHUNK):
            chunk = nodes[i : i + CLAIM_CHUNK]
            now = self.clock()
            puts = [
                Put(
                    key=self.keys.claim(node),
                    value=store_pb2.NodeClaim(
                        node=node,
                        run=self.run,
                        priority=self.priority,
                        claimed_at=now,
                        claimed_by=self.identity,
                    ).SerializeToString(),
                )
                for node in chunk
            ]
            compares = [self.store.fence(leadership), *(Compare(key=p.key, absent=True) for p in puts)]
            try:
                result = self.store.txn(f"claim {len(chunk)} nodes", compares, puts)
            except StoreError as exc:
                refused += [Refused(node=n, reason=f"claim not taken: {exc}") for n in chunk]
                continue
            if result.succeeded:
                with self._lock:
                    self._held.update(dict.fromkeys(chunk, result.revision))
                log.info(
                    "run %s claimed %s",
                    self.run,
                    chunk[0] if len(chunk) == 1 else f"{len(chunk)} nodes: {chunk[0]}..{chunk[-1]}",
                )
                continue
            for node in chunk:
                why, _ = self._create(node, leadership, withdraw_bid=False)
                if why:
                    refused.append(Refused(node=node, reason=why))
        return refused

    def _create(self, node: str, leadership: Leadership, *, withdraw_bid: bool) -> tuple[str, bool]:
        """Take `node` if no run holds it: ("" or why not, whether the bid went with the claim)."""
        key = self.keys.claim(node)
        claim = store_pb2.NodeClaim(
            node=node, run=self.run, priority=self.priority, claimed_at=self.clock(), claimed_by=self.identity
        )
        ops: list[Put | Delete] = [Put(key=key, value=claim.SerializeToString())]
        if withdraw_bid:
            ops.append(Delete(key=self.keys.bid(node, self.run)))
        try:
            result = self.store.txn(
                f"claim {node}", [self.store.fence(leadership), Compare(key=key, absent=True)], ops
            )
            if result.succeeded:
                with self._lock:
                    self._held[node] = result.revision
                log.info("run %s claimed %s", self.run, node)
                return "", withdraw_bid
            kv = self.store.get(key)
        except StoreError as exc:
            return f"claim not taken: {exc}", False
        holder = read_claim(kv)
        if kv is not None and holder is not None and holder.run == self.run:
            with self._lock:  # an earlier leader of this run took it: the run's, so this leader's
                self._held[node] = kv.mod_revision
            return "", False
        if leadership.lost.is_set():
            return "claim not taken: this controller no longer leads", False
        if holder is not None:
            return f"claimed by run {holder.run}", False
        return "claim not taken (its key is unreadable, or the fence refused)", False

    def _withdraw(self, nodes: Iterable[str]) -> None:
        for node in nodes:
            try:
                self.store.delete(self.keys.bid(node, self.run))
            except StoreError as exc:  # under the leader's lease: it goes with the lease at worst
                log.debug("withdrawing the bid for %s: %s", node, exc)

    # -- giving back ---------------------------------------------------------------------------

    def release(self, node: str, leadership: Leadership) -> bool:
        """Give `node` back to the shared pool if this run still holds it; False if not done."""
        with self._lock:
            revision = self._held.get(node)
        if revision is None:
            return False
        key = self.keys.claim(node)
        try:
            result = self.store.txn(
                f"give back {node}",
                [self.store.fence(leadership), Compare(key=key, mod_revision=revision)],
                [Delete(key=key)],
            )
        except StoreError as exc:
            log.warning("giving %s back failed (kept for now): %s", node, exc)
            return False
        if result.succeeded or not leadership.lost.is_set():
            # refused while leading: the claim changed under us (an operator gave it back): not ours
            with self._lock:
                self._held.pop(node, None)
        if result.succeeded:
            log.info("run %s gave %s back", self.run, node)
        return result.succeeded

    def reconcile(
        self, wanted: frozenset[str], out_of_service: Iterable[str], leadership: Leadership
    ) -> None:
        """After a batch: give back what the core no longer holds; take the out-of-service nodes it
        answers for (the nodes of an attempt are taken before their preflight, with bids)."""
        for node in sorted(self.held() - wanted):
            self.release(node, leadership)
        for node in sorted(set(out_of_service) & wanted - self.held()):
            why = self.take_now(node, leadership)
            if why:
                log.info("out-of-service %s not claimed: %s", node, why)


def release_by_operator(store: Store, *, node: str = "", run: str = "") -> list[str]:
    """`controllerctl claims release`: give back the claim of `node`, or every claim of `run` (a run
    that is gone without ending). Compares each claim's revision: a claim retaken meanwhile stays."""
    keys = store.keys
    kvs, _ = store.get_prefix(keys.claims_prefix())
    released = []
    for kv in kvs:
        claim = read_claim(kv)
        name = kv.key[len(keys.claims_prefix()) :]
        if (node and name != node) or (run and (claim is None or claim.run != run)):
            continue
        if store.txn(
            f"release {name}", [Compare(key=kv.key, mod_revision=kv.mod_revision)], [Delete(key=kv.key)]
        ).succeeded:
            released.append(name)
    return released
