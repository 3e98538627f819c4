"""The store: the project's only door to etcd.

Only this module imports the etcd client (``pyetcd``, from etcd-sdk-python); it uses the client's
generated gRPC stubs directly, for quick reconnects after an etcd restart, per-call deadlines,
re-login after a forgotten auth token and full control of the watch stream. `Store` is the front
door every process uses; reads are retried, writes are not, and every failure is a one-line
``StoreError``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
from pyetcd import etcdrpc  # the generated etcd v3 API stubs
from pyetcd.etcdrpc import kv_pb2

from runwarden.keys import KeySchema
from runwarden.store.config import Endpoint, StoreConfig
from runwarden.store.election import Leadership, campaign
from runwarden.store.lease import LeaseKeeper
from runwarden.store.types import (
    Compare,
    Delete,
    EventType,
    KeyValue,
    Lease,
    NotLeader,
    Put,
    RevisionCompacted,
    StoreError,
    StoreUnavailable,
    TxnResult,
    WatchBatch,
    WatchEvent,
)
from runwarden.store.watch import Watch, WatchCallback

__all__ = ["Store", "WatchStream"]

_log = logging.getLogger(__name__)
T = TypeVar("T")

# Reconnect within a second of etcd coming back (grpc's default backoff grows to 120 s); ping a
# silent connection so a half-open one is noticed (etcd refuses pings more often than every 5 s).
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.enable_http_proxy", 0),  # etcd is never behind an HTTP proxy; *_proxy variables must not apply
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]

_UNAVAILABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


# ----------------------------------------------------------------------------------------- connection


def _details(err: grpc.RpcError) -> str:
    text = (err.details() if hasattr(err, "details") else None) or str(err)
    text = " ".join(text.split())
    return text[:300]


def _code(err: grpc.RpcError) -> grpc.StatusCode | None:
    return err.code() if hasattr(err, "code") else None


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise StoreError(f"cannot read store TLS {what} {path!r}: {err.strerror or err}") from None


def _looks_like_tls_failure(details: str) -> bool:
    lowered = details.lower()
    return any(
        word in lowered for word in ("ssl", "tls", "tsi_", "handshake", "certificate", "socket closed")
    )


def _tls_hint(config: StoreConfig, lowered_details: str) -> str:
    if "certificate_verify_failed" in lowered_details or "local issuer" in lowered_details:
        return "the server's certificate is not signed by ca_file"
    if config.cert_file is None:
        return "no client certificate was offered; set cert_file and key_file if the server demands one"
    return "the server refused the handshake; check ca_file, cert_file and key_file"


class _Connection:
    """One gRPC channel per endpoint, the current endpoint, and the auth token. Thread-safe."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.endpoints = config.parsed_endpoints()
        self._credentials = self._channel_credentials(config)
        self._lock = threading.Lock()
        self._channels: dict[int, grpc.Channel] = {}
        self._stubs: dict[tuple[int, str], Any] = {}
        self._index = 0
        self._token: str | None = None
        self._closed = False

    @staticmethod
    def _channel_credentials(config: StoreConfig) -> grpc.ChannelCredentials | None:
        if not config.secure:
            return None
        ca = _read(config.ca_file, "ca_file") if config.ca_file else None
        cert = _read(config.cert_file, "cert_file") if config.cert_file else None
        key = _read(config.key_file, "key_file") if config.key_file else None
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    @property
    def index(self) -> int:
        with self._lock:
            return self._index

    def address(self, index: int | None = None) -> str:
        return self.endpoints[self.index if index is None else index].address

    def stub(self, kind: str, index: int | None = None) -> Any:
        with self._lock:
            if self._closed:
                raise StoreError("the store is closed")
            index = self._index if index is None else index
            stub = self._stubs.get((index, kind))
            if stub is None:
                channel = self._channels.get(index)
                if channel is None:
                    channel = self._channels[index] = self._open(self.endpoints[index])
                stub = self._stubs[(index, kind)] = getattr(etcdrpc, f"{kind}Stub")(channel)
            return stub

    def _open(self, endpoint: Endpoint) -> grpc.Channel:
        if self._credentials is None:
            return grpc.insecure_channel(endpoint.address, options=_CHANNEL_OPTIONS)
        return grpc.secure_channel(endpoint.address, self._credentials, options=_CHANNEL_OPTIONS)

    def use(self, index: int) -> None:
        with self._lock:
            self._index = index

    def rotate_from(self, failed_index: int) -> None:
        """After a failure on ``failed_index``, send the next call to the next endpoint."""
        with self._lock:
            if self._index == failed_index and len(self.endpoints) > 1:
                self._index = (failed_index + 1) % len(self.endpoints)

    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        token = self._token
        return None if token is None else (("token", token),)

    def authenticate(self, index: int | None = None, *, wait: bool = True) -> None:
        """Log in (again) with the configured user; etcd forgets tokens on restart and after idling."""
        if self.config.user is None:
            return
        request = etcdrpc.AuthenticateRequest(name=self.config.user, password=self.config.password or "")
        reply = self.stub("Auth", index).Authenticate(
            request, timeout=self.config.timeout_s, wait_for_ready=wait
        )
        self._token = reply.token

    def token_rejected(self, err: grpc.RpcError) -> bool:
        if self.config.user is None:
            return False
        details = _details(err).lower()
        return (
            _code(err) == grpc.StatusCode.UNAUTHENTICATED
            or "auth token" in details
            or "auth store is old" in details
        )

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels, self._channels, self._stubs = list(self._channels.values()), {}, {}
        for channel in channels:
            channel.close()


# ------------------------------------------------------------------------------------ connect checks


def _probe(conn: _Connection, index: int) -> None:
    """Log in and read the root on one endpoint, turning every failure into a one-line StoreError."""
    config, address = conn.config, conn.address(index)
    request = etcdrpc.RangeRequest(key=config.root.encode(), count_only=True)
    try:
        conn.authenticate(index, wait=False)
        conn.stub("KV", index).Range(
            request, timeout=config.timeout_s, metadata=conn.metadata(), wait_for_ready=False
        )
    except grpc.RpcError as err:
        raise _connect_error(config, address, err) from None


def _connect_error(config: StoreConfig, address: str, err: grpc.RpcError) -> StoreError:
    code, details = _code(err), _details(err)
    lowered = details.lower()
    if code == grpc.StatusCode.UNAVAILABLE:
        if config.secure and _looks_like_tls_failure(details):
            return StoreUnavailable(
                f"TLS connection to etcd at {address} refused ({_tls_hint(config, lowered)}): {details}"
            )
        if not config.secure and "socket closed" in lowered:
            return StoreUnavailable(
                f"etcd at {address} closed the connection; does it expect TLS "
                f"(set ca_file, cert_file, key_file)? {details}"
            )
        return StoreUnavailable(f"cannot reach etcd at {address}: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return StoreUnavailable(f"etcd at {address} did not answer within {config.timeout_s:g} s")
    if "authentication failed" in lowered or "invalid user id or password" in lowered:
        return StoreError(f"etcd at {address} rejected the credentials of user {config.user!r}")
    if "authentication is not enabled" in lowered:
        return StoreError(
            f"credentials were given but etcd at {address} does not have authentication enabled"
        )
    if "user name is empty" in lowered or code == grpc.StatusCode.UNAUTHENTICATED:
        return StoreError(f"etcd at {address} requires authentication; configure user and password")
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return StoreError(f"etcd user {config.user!r} may not read {config.root} at {address}")
    name = code.name if code is not None else "UNKNOWN"
    return StoreError(f"etcd at {address} refused the connection check: {name}: {details}")


# ---------------------------------------------------------------------------------------------- store


# How long a daemon (agent, controller) keeps trying an unreachable etcd at start before it exits and
# systemd starts it again: a host booting before its etcd, or one too busy to finish a handshake in
# the store's timeout. The agent spends it at most twice (connect, then its first registration) beside
# its parked groups' 20 s: 80 s, within systemd's default start timeout of 90 s.
START_WAIT_S = 30.0


def until_reachable(attempt: Callable[[], T], wait_s: float, what: str) -> T:
    """`attempt()`, tried again while etcd is unavailable (back-off 0.5 s doubling to 5 s) until
    `wait_s` has passed; then its StoreUnavailable is raised. Any other error is raised at once."""
    deadline = time.monotonic() + wait_s
    pause = 0.5
    while True:
        try:
            return attempt()
        except StoreUnavailable as err:
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            _log.warning("%s: %s; trying again for up to %.0f s", what, err, left)
            time.sleep(min(pause, left))
            pause = min(pause * 2, 5.0)


def _prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's range_end for a prefix)."""
    trimmed = prefix.rstrip(b"\xff")
    if not trimmed:
        return b"\x00"  # the whole keyspace
    return trimmed[:-1] + bytes([trimmed[-1] + 1])


def _enc(key: str) -> bytes:
    return key.encode("utf-8", "surrogateescape")


def _dec(key: bytes) -> str:
    return key.decode("utf-8", "surrogateescape")


def _key_value(kv: Any) -> KeyValue:
    return KeyValue(
        key=_dec(kv.key),
        value=bytes(kv.value),
        mod_revision=kv.mod_revision,
        create_revision=kv.create_revision,
        lease=kv.lease,
        version=kv.version,
    )


def _watch_event(event: Any) -> WatchEvent:
    kind = EventType.DELETE if event.type == kv_pb2.Event.DELETE else EventType.PUT
    kv = event.kv
    return WatchEvent(
        type=kind,
        key=_dec(kv.key),
        value=bytes(kv.value),
        mod_revision=kv.mod_revision,
        create_revision=kv.create_revision,
        lease=kv.lease,
    )


class WatchStream:
    """One raw etcd watch stream; runwarden.store.watch.Watch resumes these across disconnects."""

    def __init__(self, store: Store, prefix: str, start_revision: int) -> None:
        self._store = store
        self._prefix = prefix
        self._closed = threading.Event()
        key = _enc(prefix)
        create = etcdrpc.WatchCreateRequest(
            key=key, range_end=_prefix_end(key), start_revision=start_revision, progress_notify=True
        )
        self._first = etcdrpc.WatchRequest(create_request=create)
        self._index = store.conn.index
        stub = store.conn.stub("Watch", self._index)
        self._call = stub.Watch(self._requests(), metadata=store.conn.metadata(), wait_for_ready=False)

    def _requests(self) -> Iterator[Any]:
        yield self._first
        self._closed.wait()  # keep the request side open until cancel(); then half-close

    def batches(self) -> Iterator[WatchBatch]:
        """Yield batches; raise StoreUnavailable on disconnect, RevisionCompacted, or StoreError."""
        try:
            for reply in self._call:
                if reply.compact_revision:
                    raise RevisionCompacted(
                        f"watch of {self._prefix}: revision compacted (oldest kept {reply.compact_revision})",
                        reply.compact_revision,
                    )
                if reply.canceled:
                    raise StoreError(
                        f"etcd canceled the watch of {self._prefix}: {reply.cancel_reason or 'no reason'}"
                    )
                events = tuple(_watch_event(e) for e in reply.events)
                yield WatchBatch(events=events, revision=reply.header.revision, created=reply.created)
        except grpc.RpcError as err:
            if self._closed.is_set():
                return
            if _code(err) in _UNAVAILABLE_CODES:
                self._store.conn.rotate_from(self._index)
            raise self._store.translate(err, f"watch {self._prefix}", self._index) from None
        if not self._closed.is_set():
            raise StoreUnavailable(
                f"etcd at {self._store.conn.address(self._index)} ended the watch of {self._prefix}"
            )

    def cancel(self) -> None:
        self._closed.set()
        self._call.cancel()


class Store:
    """A connected etcd client. Build with ``Store.connect(config)``; ``close()`` when done.

    * Reads (``get``, ``get_prefix``, ``revision``) are retried while etcd is unavailable, until
      ``timeout_s``. Writes are not retried (a write cut off mid-flight may or may not have applied):
      they raise ``StoreUnavailable`` and the caller decides.
    * Every failure is a ``StoreError`` whose message is one line and never holds a password or token.
    * Background work (lease keepalive, watches, elections) lives in runwarden.store.lease,
      runwarden.store.watch and runwarden.store.election; ``Store`` is the front door to all of it.
      Those modules know the store only through small protocols, so imports flow one way:
      types <- config <- lease, watch <- election <- client.
    """

    def __init__(self, config: StoreConfig, conn: _Connection) -> None:
        self.config = config
        self.conn = conn
        self.keys = KeySchema(config.root)
        self._lock = threading.Lock()
        self._keepers: set[LeaseKeeper] = set()
        self._watches: set[Watch] = set()
        self._closed = False

    @classmethod
    def connect(cls, config: StoreConfig, *, wait_s: float = 0.0) -> Store:
        """Connect and check reachability, TLS and credentials; StoreError with one line if not.

        `wait_s`: while no endpoint answers, try again for this long (a daemon starting with its
        host, or on a host too busy to finish a handshake in `timeout_s`); a TLS or credential
        failure is never retried."""
        return until_reachable(lambda: cls._connect_once(config), wait_s, "connecting")

    @classmethod
    def _connect_once(cls, config: StoreConfig) -> Store:
        conn = _Connection(config)
        failures: list[str] = []
        for index in range(len(conn.endpoints)):
            try:
                _probe(conn, index)
            except StoreUnavailable as err:
                failures.append(str(err))
                continue
            except StoreError:
                conn.close()
                raise
            conn.use(index)
            return cls(config, conn)
        conn.close()
        raise StoreUnavailable("; ".join(failures))

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop this store's watches and keepalives (leases are left to expire) and close the channels."""
        with self._lock:
            self._closed = True
            watches, keepers = list(self._watches), list(self._keepers)
        for watch in watches:
            watch.cancel()
        for keeper in keepers:
            keeper.stop()
        self.conn.close()

    # ------------------------------------------------------------------------------------- plumbing

    def translate(
        self, err: grpc.RpcError, what: str, index: int | None = None, timeout_s: float | None = None
    ) -> StoreError:
        code, details = _code(err), _details(err)
        timeout = self.config.timeout_s if timeout_s is None else timeout_s
        address = self.conn.address(index)
        if code == grpc.StatusCode.UNAVAILABLE:
            return StoreUnavailable(f"etcd {what}: {address} unavailable ({details})")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return StoreUnavailable(f"etcd {what}: {address} did not answer within {timeout:g} s")
        name = code.name if code is not None else "UNKNOWN"
        return StoreError(f"etcd {what} at {address} failed: {name}: {details}")

    def call(
        self, what: str, kind: str, method: str, request: Any, *, retry: bool, timeout_s: float | None = None
    ) -> Any:
        """One unary RPC with a deadline; reads (``retry``) are retried while etcd is unavailable."""
        timeout = self.config.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        relogged, delay = False, 0.05
        while True:
            index = self.conn.index
            remaining = max(deadline - time.monotonic(), 0.01)
            try:
                rpc = getattr(self.conn.stub(kind, index), method)
                return rpc(request, timeout=remaining, metadata=self.conn.metadata(), wait_for_ready=True)
            except grpc.RpcError as err:
                if not relogged and self.conn.token_rejected(err):
                    relogged = True
                    self._relogin(what, index)
                    continue
                if _code(err) in _UNAVAILABLE_CODES:
                    self.conn.rotate_from(index)
                    if retry and deadline - time.monotonic() > delay:
                        time.sleep(delay)
                        delay = min(delay * 2, 0.5)
                        continue
                raise self.translate(err, what, index, timeout) from None

    def _relogin(self, what: str, index: int) -> None:
        try:
            self.conn.authenticate(index)
        except grpc.RpcError as err:
            raise self.translate(err, f"{what} (logging in again)", index) from None

    def relogin_if_needed(self, err: StoreError) -> None:
        """Called by long-lived streams: log in again if the failure looks like a forgotten token."""
        text = str(err).lower()
        if self.config.user is not None and ("auth token" in text or "unauthenticated" in text):
            with contextlib.suppress(grpc.RpcError):  # the stream's retry loop tries again
                self.conn.authenticate()

    # ------------------------------------------------------------------------------------ key-value

    def get(self, key: str) -> KeyValue | None:
        reply = self.call(f"get {key}", "KV", "Range", etcdrpc.RangeRequest(key=_enc(key)), retry=True)
        return _key_value(reply.kvs[0]) if reply.kvs else None

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` sorted by key, and the revision they were read at."""
        key = _enc(prefix)
        request = etcdrpc.RangeRequest(
            key=key,
            range_end=_prefix_end(key),
            sort_order=etcdrpc.RangeRequest.ASCEND,
            sort_target=etcdrpc.RangeRequest.KEY,
        )
        reply = self.call(f"get prefix {prefix}", "KV", "Range", request, retry=True)
        return [_key_value(kv) for kv in reply.kvs], reply.header.revision

    def revision(self) -> int:
        """The store's current revision."""
        request = etcdrpc.RangeRequest(key=_enc(self.config.root), count_only=True)
        return int(self.call("read revision", "KV", "Range", request, retry=True).header.revision)

    def put(self, key: str, value: bytes, lease: Lease | int | None = None) -> int:
        """Write ``value``; returns the revision of the write. Not retried (see `Store`)."""
        request = etcdrpc.PutRequest(key=_enc(key), value=_as_bytes(value), lease=_lease_id(lease))
        return int(self.call(f"put {key}", "KV", "Put", request, retry=False).header.revision)

    def delete(self, key: str) -> bool:
        """Delete one key; True if it existed."""
        request = etcdrpc.DeleteRangeRequest(key=_enc(key))
        return bool(self.call(f"delete {key}", "KV", "DeleteRange", request, retry=False).deleted)

    def cas(
        self, key: str, value: bytes, expected_mod_revision: int, lease: Lease | int | None = None
    ) -> bool:
        """Put ``value`` only if ``key``'s mod revision is ``expected_mod_revision`` (0: must not exist)."""
        if expected_mod_revision == 0:
            compare = etcdrpc.Compare(
                key=_enc(key), target=etcdrpc.Compare.VERSION, result=etcdrpc.Compare.EQUAL, version=0
            )
        else:
            compare = etcdrpc.Compare(
                key=_enc(key),
                target=etcdrpc.Compare.MOD,
                result=etcdrpc.Compare.EQUAL,
                mod_revision=expected_mod_revision,
            )
        put = etcdrpc.PutRequest(key=_enc(key), value=_as_bytes(value), lease=_lease_id(lease))
        return self._txn(f"cas {key}", compare, put)[0]

    def fenced_put(
        self, key: str, value: bytes, leadership: Leadership, lease: Lease | int | None = None
    ) -> int:
        """Put only while ``leadership`` holds: its key still exists with the create revision ``fence``.

        Returns the revision of the write. A stale leader is refused with ``NotLeader`` (a StoreError)
        and its ``leadership.lost`` is set.
        """
        compare = etcdrpc.Compare(
            key=_enc(leadership.key),
            target=etcdrpc.Compare.CREATE,
            result=etcdrpc.Compare.EQUAL,
            create_revision=leadership.fence,
        )
        put = etcdrpc.PutRequest(key=_enc(key), value=_as_bytes(value), lease=_lease_id(lease))
        succeeded, revision = self._txn(f"fenced put {key}", compare, put)
        if not succeeded:
            leadership.mark_lost(f"fenced put of {key} refused")
            raise NotLeader(
                f"fenced put of {key} refused: leadership of {leadership.name!r} (fence {leadership.fence}) "
                "is gone or superseded"
            )
        return revision

    def txn(self, what: str, compares: Sequence[Compare], ops: Sequence[Put | Delete]) -> TxnResult:
        """Apply every op of ``ops`` atomically if every compare holds, else none. Not retried.

        ``fence(leadership)`` is the compare that makes a transaction a fenced write."""
        request = etcdrpc.TxnRequest(
            compare=[_compare(c) for c in compares], success=[_op(op) for op in ops], failure=[]
        )
        reply = self.call(what, "KV", "Txn", request, retry=False)
        return TxnResult(succeeded=bool(reply.succeeded), revision=int(reply.header.revision))

    @staticmethod
    def fence(leadership: Leadership) -> Compare:
        """The compare that holds only while ``leadership`` does (its key, created at ``fence``)."""
        return Compare(key=leadership.key, create_revision=leadership.fence)

    def _txn(self, what: str, compare: Any, put: Any) -> tuple[bool, int]:
        request = etcdrpc.TxnRequest(
            compare=[compare], success=[etcdrpc.RequestOp(request_put=put)], failure=[]
        )
        reply = self.call(what, "KV", "Txn", request, retry=False)
        return bool(reply.succeeded), int(reply.header.revision)

    def compact(self, revision: int) -> None:
        """Drop history before ``revision`` (watches older than it get relisted)."""
        request = etcdrpc.CompactionRequest(revision=revision, physical=True)
        self.call(f"compact to {revision}", "KV", "Compact", request, retry=False)

    # --------------------------------------------------------------------------------------- leases

    def grant_lease(self, ttl_s: float) -> Lease:
        """A new lease of ``ttl_s`` seconds (etcd counts whole seconds; rounded up, at least 1)."""
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float) or not ttl_s > 0:
            raise StoreError(f"lease TTL must be a positive number of seconds, got {ttl_s!r}")
        ttl = max(1, int(-(-ttl_s // 1)))
        reply = self.call(
            "grant lease", "Lease", "LeaseGrant", etcdrpc.LeaseGrantRequest(TTL=ttl), retry=False
        )
        if reply.error:
            raise StoreError(f"etcd refused a lease of {ttl} s: {reply.error}")
        return Lease(id=int(reply.ID), ttl_s=int(reply.TTL))

    def refresh_lease(self, lease: Lease, timeout_s: float | None = None) -> int:
        """One keepalive: the TTL etcd granted again, 0 if the lease is gone (expired or revoked)."""
        timeout = self.config.timeout_s if timeout_s is None else timeout_s
        index = self.conn.index
        request = etcdrpc.LeaseKeepAliveRequest(ID=lease.id)
        for attempt in range(2):
            call = self.conn.stub("Lease", index).LeaseKeepAlive(
                iter([request]), timeout=timeout, metadata=self.conn.metadata(), wait_for_ready=True
            )
            try:
                for reply in call:
                    return int(reply.TTL)
                raise StoreUnavailable(
                    f"etcd at {self.conn.address(index)} closed the keepalive of lease {lease.id:x}"
                )
            except grpc.RpcError as err:
                if attempt == 0 and self.conn.token_rejected(err):
                    self._relogin(f"keepalive lease {lease.id:x}", index)
                    continue
                if _code(err) in _UNAVAILABLE_CODES:
                    self.conn.rotate_from(index)
                raise self.translate(err, f"keepalive lease {lease.id:x}", index, timeout) from None
            finally:
                call.cancel()
        raise AssertionError("unreachable")

    def lease_ttl(self, lease: Lease | int) -> int:
        """Seconds left on a lease; -1 if it does not exist (any more)."""
        request = etcdrpc.LeaseTimeToLiveRequest(ID=_lease_id(lease))
        return int(self.call("lease time-to-live", "Lease", "LeaseTimeToLive", request, retry=True).TTL)

    def revoke(self, lease: Lease | int) -> None:
        """Revoke a lease (its keys are deleted). A lease already gone is not an error."""
        request = etcdrpc.LeaseRevokeRequest(ID=_lease_id(lease))
        try:
            self.call("revoke lease", "Lease", "LeaseRevoke", request, retry=False)
        except StoreError as err:
            if "lease not found" not in str(err):
                raise

    def keep_alive(self, lease: Lease, on_lost: Callable[[], None] | None = None) -> LeaseKeeper:
        """Refresh ``lease`` every ttl/3 in a background thread until ``.stop()``.

        Loss (etcd answers TTL 0, or no successful refresh for a whole TTL) sets ``.lost``, records
        ``.reason`` and calls ``on_lost()`` once, from the keeper's thread; then the keeper ends.
        """
        keeper = LeaseKeeper(self, lease, on_lost)
        self._track(self._keepers, keeper)
        keeper.start()
        return keeper

    # --------------------------------------------------------------------------- watch and election

    def open_watch_stream(self, prefix: str, start_revision: int) -> WatchStream:
        return WatchStream(self, prefix, start_revision)

    def watch_prefix(self, prefix: str, start_revision: int | None, callback: WatchCallback) -> Watch:
        """Deliver every change under ``prefix`` to ``callback``, in order, exactly once, from a thread.

        ``start_revision`` is the first revision delivered (etcd's inclusive meaning): after
        ``get_prefix`` returned revision R, pass R + 1. None means "changes after now". The watch
        resumes from the last delivered revision + 1 after any disconnect; if that revision was
        compacted it delivers ``Relisted(kvs, revision)`` and goes on from there. ``.cancel()`` ends it.
        """
        first = self.revision() + 1 if start_revision is None else start_revision
        if first < 1:
            raise StoreError(f"watch start revision must be >= 1, got {first}")
        watch = Watch(self, prefix, first, callback)
        self._track(self._watches, watch)
        watch.start()
        return watch

    def campaign(self, name: str, value: bytes, ttl_s: float, timeout_s: float) -> Leadership:
        """Become leader of election ``name`` (lowest create revision under the election prefix wins).

        Blocks until leader (returns a ``Leadership`` whose ``fence`` is the winning key's create
        revision) or raises ``CampaignTimeout`` after ``timeout_s``, withdrawing the contender key.
        """
        return campaign(self, name, _as_bytes(value), ttl_s, timeout_s)

    def leader(self, name: str) -> KeyValue | None:
        """The current leader's key of election ``name`` (its value is what the leader put), or None."""
        kvs, _ = self.get_prefix(self.keys.election(name))
        return min(kvs, key=lambda kv: kv.create_revision) if kvs else None

    def _track(self, group: set[Any], item: Any) -> None:
        with self._lock:
            if self._closed:
                raise StoreError("the store is closed")
            group.add(item)

    def untrack(self, item: LeaseKeeper | Watch) -> None:
        with self._lock:
            if isinstance(item, LeaseKeeper):
                self._keepers.discard(item)
            else:
                self._watches.discard(item)


def _compare(c: Compare) -> Any:
    key = _enc(c.key)
    if c.written_before is not None:
        return etcdrpc.Compare(
            key=key,
            range_end=_prefix_end(key),
            target=etcdrpc.Compare.MOD,
            result=etcdrpc.Compare.LESS,
            mod_revision=c.written_before,
        )
    if c.absent:
        return etcdrpc.Compare(
            key=key, target=etcdrpc.Compare.VERSION, result=etcdrpc.Compare.EQUAL, version=0
        )
    if c.mod_revision is not None:
        return etcdrpc.Compare(
            key=key, target=etcdrpc.Compare.MOD, result=etcdrpc.Compare.EQUAL, mod_revision=c.mod_revision
        )
    return etcdrpc.Compare(
        key=key,
        target=etcdrpc.Compare.CREATE,
        result=etcdrpc.Compare.EQUAL,
        create_revision=c.create_revision,
    )


def _op(op: Put | Delete) -> Any:
    if isinstance(op, Put):
        return etcdrpc.RequestOp(
            request_put=etcdrpc.PutRequest(key=_enc(op.key), value=_as_bytes(op.value), lease=op.lease)
        )
    return etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=_enc(op.key)))


def _as_bytes(value: bytes | bytearray | memoryview | str) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def _lease_id(lease: Lease | int | None) -> int:
    if lease is None:
        return 0
    return lease.id if isinstance(lease, Lease) else int(lease)
