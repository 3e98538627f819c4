"""Liveness: the node key lives under the agent's lease; a lost lease is re-registered at once.

The store's LeaseKeeper refreshes the lease every TTL/3 in the background and sets `.lost` when a
refresh finds the lease gone (expired during an etcd outage or a long pause). Then this module
grants a new lease and puts the node record again, retrying with backoff while etcd is down.

**Self-fencing.** Once the keeper can no longer vouch for the lease (`certain_for() <= 0`: no refresh
sent within the last TTL was answered, so etcd has or may have expired it) or says it is gone, the
controller counts the node lost -- and may already be launching its replacement. So the lease is
given up at once: `on_fenced(reason)` is called (the agent stops its workers), `lease_held` is False
(no launch is accepted), and the agent re-registers as soon as etcd answers, revoking the old lease
first if it still exists, so the controller always sees the node leave and come back as a new node
(burn-in), never a silent resume.

An etcd outage is not a partition: everyone loses etcd at once, and the controller, which needs etcd
to launch, cannot replace anything meanwhile. A host cut off from etcd alone is: the controller
replaces it while its peers, still on the network, answer. So before it fences, the agent asks
`vouch(unconfirmed_s)` what the peers of its running attempt say about *their* leases
(`peers_cannot_renew`): peers that answer and have not renewed since this lease ran out cannot reach
etcd either, so the workers keep running (asked again every TTL/6). No peer answering is a
partition: fence. A peer renewed after this lease ran out: etcd answers others; this host fences
unless its own keeper renews within RECOVERY_TTLS x TTL of that first sight (etcd may just have come
back from everyone's outage, and the first agent to renew must not fence the rest). The fence thus
comes at most TTL + TTL/3 (a peer's keepalive) + TTL/2 + TTL/6 (the re-ask) + the ask's timeout
after the last renewal. Once etcd answers that the lease is gone, the agent fences whatever the
peers say.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from nodeagent.daemon.metrics import AgentMetrics
from runwarden.store import until_reachable
from runwarden.v1 import agent_pb2, agent_pb2_grpc, store_pb2

log = logging.getLogger(__name__)

# How often the lease is checked: the fence fires at most this long after the lease's TTL ran out.
POLL_S = 0.05
# Once peers renew while this lease does not, this many TTLs for this host's own keeper to renew
# before it fences: after an etcd outage for everyone, the first agent back must not fence the rest.
RECOVERY_TTLS = 0.5


class Registration:
    def __init__(
        self,
        *,
        store: Any,
        node: str,
        ttl_s: float,
        make_record: Callable[[], store_pb2.NodeRecord],
        metrics: AgentMetrics,
        on_fenced: Callable[[str], None] | None = None,
        vouch: Callable[[float], Verdict] | None = None,
    ) -> None:
        self._store = store
        self._node = node
        self._ttl_s = ttl_s
        self._make_record = make_record
        self._metrics = metrics
        self._lease: Any = None
        self._keeper: Any = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._on_fenced = on_fenced
        self._vouch = vouch
        self._vouched_until = 0.0  # peers could not renew either: etcd is down; ask again after
        self._others_renew_since: float | None = None  # first seen: peers renew, this lease does not
        self._fenced = False  # the current lease is given up (its TTL ran out unrenewed)
        self.registrations = 0
        self.fences = 0

    @property
    def lease_held(self) -> bool:
        keeper = self._keeper
        return keeper is not None and not keeper.lost.is_set() and not self._fenced

    @property
    def lease_id(self) -> int:
        return int(getattr(self._lease, "id", 0) or 0)

    def last_heartbeat_at(self) -> float | None:
        """Monotonic time etcd last confirmed the lease: when the last answered keepalive (or the grant)
        was sent. Peers compare it with their own (GetNodeStatus.last_heartbeat_age_s)."""
        keeper = self._keeper
        if keeper is None:
            return None
        return float(keeper.confirmed_at)

    def _expired(self) -> str:
        """Why the current lease must be given up now ("" while it is held and certainly alive)."""
        keeper = self._keeper
        if keeper is None or self._fenced:
            return ""
        if keeper.lost.is_set():
            return f"lease {self.lease_id:x} lost ({getattr(keeper, 'reason', '') or 'gone'})"
        left = keeper.certain_for()
        if left <= 0:
            ttl = float(getattr(self._lease, "ttl_s", self._ttl_s))
            return f"no lease renewal confirmed for {ttl - left:.2f} s (TTL {ttl:g} s)"
        return ""

    def _connected(self, reason: str) -> bool:
        """Whether an unconfirmed lease is an etcd outage rather than this host's own cut: peers of the
        running attempt answer and none has renewed its lease since this one ran out (see the module
        docstring). Never when etcd said the lease is gone: then the controller may already be
        replacing this node."""
        keeper = self._keeper
        if self._vouch is None or keeper is None or keeper.expired:
            return False
        now = time.monotonic()
        if now < self._vouched_until:
            return True
        verdict = self._vouch(now - keeper.confirmed_at)
        if verdict.others_renew:
            # etcd answers others. It may just have come back from an outage for everyone, with this
            # host's keeper about to renew too: it gets RECOVERY_TTLS x TTL from the first sight
            first = self._others_renew_since = self._others_renew_since or now
            if now - first >= RECOVERY_TTLS * self._ttl_s:
                log.warning("node %s: %s, and %s: etcd answers others; this host is cut off from it",
                            self._node, reason, verdict.why)  # fmt: skip
                return False
        elif not verdict.keep:
            log.warning("node %s: %s, and %s", self._node, reason, verdict.why)
            return False
        else:
            self._others_renew_since = None
        self._vouched_until = now + self._ttl_s / 6
        log.warning("node %s: %s, but %s: the workers keep running for now (asked again in %.2f s)",
                    self._node, reason, verdict.why, self._ttl_s / 6)  # fmt: skip
        return True

    def _keep_trying(self) -> None:
        """An etcd outage: the keeper gave up on silence, but the lease may well survive it (etcd
        restores leases with a fresh TTL after a restart); keep refreshing the same lease."""
        with self._lock:
            keeper = self._keeper
            if keeper is not None and keeper.lost.is_set() and not keeper.expired:
                self._keeper = self._store.keep_alive(self._lease, self._on_lost)
                # etcd has confirmed nothing since: the new keeper must not vouch for the lease, nor
                # tell asking peers it was renewed
                self._keeper.confirmed_at = keeper.confirmed_at

    def _fence(self, reason: str) -> None:
        """Give up the current lease: the workers stop (`on_fenced`), then re-registration."""
        with self._lock:
            if self._fenced:
                return
            self._fenced = True
            self.fences += 1
        self._metrics.lease_held.set(0)
        log.warning("node %s: %s: fencing itself", self._node, reason)
        if self._on_fenced is not None:
            try:
                self._on_fenced(reason)
            except Exception:
                log.exception("the self-fence callback failed")

    def start(self, wait_s: float = 0.0) -> None:
        """Register (trying again for up to `wait_s` while etcd is unreachable, then raising), then
        watch for a lost lease."""
        until_reachable(self._register, wait_s, f"registering node {self._node}")
        self._thread = threading.Thread(target=self._loop, name="liveness", daemon=True)
        self._thread.start()

    def update(self) -> None:
        """Put the node record again under the current lease (state or preflight changed)."""
        with self._lock:
            lease = self._lease
            if lease is None or not self.lease_held:
                return
            record = self._make_record()
            record.lease_id = self.lease_id
        try:
            self._store.put(self._store.keys.node(self._node), record.SerializeToString(), lease=lease)
        except Exception as exc:
            log.warning("node record update failed: %s", exc)

    def stop(self, *, revoke: bool = True) -> None:
        self._closed.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            if self._keeper is not None:
                self._keeper.stop()
            if revoke and self._lease is not None:
                try:
                    self._store.revoke(self._lease)
                except Exception as exc:
                    log.warning("lease revoke failed (it expires by itself): %s", exc)
            self._metrics.lease_held.set(0)

    def _on_lost(self, *args: Any) -> None:
        self._metrics.lease_held.set(0)
        self._wake.set()

    def _register(self) -> None:
        with self._lock:
            old = self._lease
            if self._keeper is not None:
                self._keeper.stop()
            if old is not None:
                # The node leaves before it comes back: if the old lease outlived its TTL (etcd was
                # slow, not gone), revoking it deletes the node key, so the controller sees a new node.
                try:
                    self._store.revoke(old)
                except Exception as exc:
                    log.debug("revoking the old lease %x failed: %s", int(getattr(old, "id", 0) or 0), exc)
            lease = self._store.grant_lease(self._ttl_s)
            self._lease = lease
            record = self._make_record()
            record.lease_id = self.lease_id
            record.registered_at = time.time()
            self._store.put(self._store.keys.node(self._node), record.SerializeToString(), lease=lease)
            self._keeper = self._store.keep_alive(lease, self._on_lost)
            self._fenced = False
            self.registrations += 1
        self._metrics.registrations.inc()
        self._metrics.lease_held.set(1)
        log.info("registered node %s under lease %x (TTL %.1f s)", self._node, self.lease_id, self._ttl_s)

    def _loop(self) -> None:
        delay = 0.1
        while not self._closed.is_set():
            self._wake.wait(timeout=POLL_S)
            self._wake.clear()
            if self._closed.is_set():
                return
            reason = self._expired()
            if not reason:
                self._others_renew_since = None  # renewed (or fenced): a later cut starts afresh
            if reason and self._connected(reason):
                self._keep_trying()
                continue
            if reason:
                self._fence(reason)
            if self.lease_held:
                delay = 0.1
                continue
            log.warning("node %s lost its lease %x: re-registering now", self._node, self.lease_id)
            try:
                self._register()
                delay = 0.1
            except Exception as exc:
                log.warning("re-registration failed (retry in %.1f s): %s", delay, exc)
                self._closed.wait(delay)
                delay = min(delay * 2, self._ttl_s / 3)
                self._wake.set()


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    """What the peers say about an unconfirmed lease. `keep`: nobody reaches etcd (the control plane's
    fault), the workers may keep running. `others_renew`: a peer renewed after this lease ran out."""

    keep: bool
    others_renew: bool = False
    why: str


def peers_cannot_renew(ages: dict[str, float | None], *, unconfirmed_s: float, ttl_s: float) -> Verdict:
    """The vouch's rule. `ages`: per peer that answered, how long ago etcd confirmed its lease (None:
    it has no store); this host's lease has gone unconfirmed for `unconfirmed_s`, so it ran out
    `unconfirmed_s - ttl_s` ago. A peer confirmed since then: etcd answers others (others_renew). No
    peer answered: this host is cut off from them too. Peers answer and none renewed since: keep."""
    ran_out = unconfirmed_s - ttl_s
    renewed = {p: a for p, a in ages.items() if a is not None and a < ran_out}
    if renewed:
        peer = min(renewed, key=lambda p: renewed[p])
        why = f"peer {peer} renewed its lease {ran_out - renewed[peer]:.2f} s after this host's ran out"
        return Verdict(keep=False, others_renew=True, why=why)
    if not ages:
        return Verdict(keep=False, why="no peer answers")
    return Verdict(keep=True, why=f"peers {', '.join(sorted(ages))} answer and none renewed since")


class PeerLeases:
    """Asks peer agents how long ago etcd last confirmed *their* leases (GetNodeStatus's
    last_heartbeat_age_s), all at once; one cached channel per peer. With TLS the agent's own server
    certificate is its client certificate (the cluster CA issues server certificates for both ends)."""

    def __init__(self, creds: grpc.ChannelCredentials | None, timeout_s: float) -> None:
        self._creds = creds
        self._timeout_s = timeout_s
        self._lock = threading.Lock()  # the launch sets the peers, the liveness thread asks them
        self._stubs: dict[str, tuple[grpc.Channel, agent_pb2_grpc.NodeAgentStub]] = {}

    def connect(self, peers: tuple[str, ...]) -> dict[str, agent_pb2_grpc.NodeAgentStub]:
        """A stub per peer, its channel connecting in the background; channels of others are closed."""
        with self._lock:
            for gone in set(self._stubs) - set(peers):
                self._stubs.pop(gone)[0].close()
            for peer in peers:
                if peer not in self._stubs:
                    channel = (
                        grpc.secure_channel(peer, self._creds) if self._creds else grpc.insecure_channel(peer)
                    )
                    grpc.channel_ready_future(channel)  # starts connecting; nobody waits for it
                    self._stubs[peer] = (channel, agent_pb2_grpc.NodeAgentStub(channel))
            return {peer: self._stubs[peer][1] for peer in peers}

    def ages(self, peers: tuple[str, ...]) -> dict[str, float | None]:
        """Per peer that answered within the timeout: its lease's confirmed age in seconds (None: it has
        no store). Peers that did not answer are absent."""
        calls = {}
        for peer, stub in self.connect(peers).items():
            try:
                calls[peer] = stub.GetNodeStatus.future(
                    agent_pb2.GetNodeStatusRequest(), timeout=self._timeout_s
                )
            except ValueError:  # its channel was closed meanwhile: a new launch changed the peers
                continue
        ages: dict[str, float | None] = {}
        for peer, call in calls.items():
            try:
                age = call.result().last_heartbeat_age_s
            except grpc.RpcError:
                continue
            ages[peer] = age if age >= 0 else None
        return ages

    def close(self) -> None:
        with self._lock:
            for channel, _ in self._stubs.values():
                channel.close()
            self._stubs.clear()
