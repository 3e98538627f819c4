"""The Controller gRPC API: what `controllerctl`, dashboards and `grpcurl` talk to.

The servicer is a thin, validating adapter over a `ControllerView` (the live controller shell
implements it; `controller.api.store_view.StoreBackedView` implements it from etcd for tools and tests).
Rules:

* every request field is validated first; a bad one is INVALID_ARGUMENT with a one-line reason;
* with TLS, the client certificate decides the role (`AccessPolicy`): read-only callers may use
  the Get/List/Watch RPCs; QuarantineNode, ReleaseNode and RequestStop need an admin certificate
  and are otherwise PERMISSION_DENIED. Plaintext is only served on loopback (demo, tests);
* the servicer never crashes on a view failure: it becomes UNAVAILABLE / NOT_FOUND /
  FAILED_PRECONDITION / INTERNAL with a message;
* goodput and events come from the event log file, read by the same code as `controllerctl
  goodput --log` (`controller.goodput.report.compute_goodput`).
"""

from __future__ import annotations

import enum
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from controller.goodput.report import compute_goodput
from runwarden.eventlog import decode_line, read_events
from runwarden.keys import validate_name
from runwarden.net import is_loopback_address
from runwarden.v1 import common_pb2, controller_pb2, controller_pb2_grpc, events_pb2

log = logging.getLogger(__name__)

SERVICE_NAME = "runwarden.v1.Controller"
DEFAULT_EVENT_LIMIT = 1000
MAX_EVENT_LIMIT = 100_000
MAX_REASON_CHARS = 512
WATCH_POLL_S = 0.2

T = TypeVar("T")


class ViewNotFound(LookupError):
    """The node or run named in a request does not exist."""


class ViewUnavailable(RuntimeError):
    """The view's backing store did not answer; worth retrying."""


class ViewRefused(RuntimeError):
    """The request is valid but cannot be done in the current state (e.g. releasing a spare)."""


class ControllerView(Protocol):
    """What the API needs from the controller. Methods may raise the View* errors above."""

    @property
    def event_log_path(self) -> Path: ...

    def run_statuses(self) -> Sequence[controller_pb2.RunStatus]: ...

    def node_infos(self) -> Sequence[controller_pb2.NodeInfo]: ...

    def leader(self) -> tuple[str, int]:
        """The leader's identity and fencing token ("", 0 when unknown)."""
        ...

    def quarantine(self, node: str, reason: str, actor: str) -> common_pb2.PoolState.ValueType: ...

    def release(self, node: str, reason: str, actor: str) -> common_pb2.PoolState.ValueType: ...

    def request_stop(self, run: str, reason: str, actor: str) -> bool: ...


class Role(enum.Enum):
    READ_ONLY = "read-only"
    ADMIN = "admin"


@dataclass(frozen=True, slots=True, kw_only=True)
class AccessPolicy:
    """Who is admin. A verified client certificate is admin when its common name is in
    `admin_names` or its subject's organization (O=) is in `admin_organizations`; any other
    certificate the CA signed is read-only. Plaintext callers (loopback only) get `plaintext_role`."""

    admin_names: frozenset[str] = frozenset()
    admin_organizations: frozenset[str] = frozenset({"runwarden:admin"})
    plaintext_role: Role = Role.ADMIN


@dataclass(frozen=True, slots=True, kw_only=True)
class Caller:
    role: Role
    identity: str  # the certificate's CN, or the peer address for plaintext


def _first(ctx: Mapping[str, object], key: str) -> str:
    # grpc-stubs types the values as bytes; at run time each is a list of bytes
    values = ctx.get(key) or []
    value = values if isinstance(values, bytes) else next(iter(values), b"")  # type: ignore[call-overload]
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else ""


def _subject_organizations(subject: str) -> set[str]:
    # gRPC's x509_subject is RFC 2253 style ("CN=alice,O=runwarden:admin"); escaped commas are rare
    # in organization names and would only make a certificate read-only, never admin.
    out = set()
    for part in subject.split(","):
        key, _, value = part.strip().partition("=")
        if key.strip().upper() == "O":
            out.add(value.strip())
    return out


def caller_of(context: grpc.ServicerContext, policy: AccessPolicy) -> Caller:
    ctx = context.auth_context()
    if _first(ctx, "transport_security_type") != "ssl":
        return Caller(role=policy.plaintext_role, identity=context.peer())
    cn = _first(ctx, "x509_common_name")
    orgs = _subject_organizations(_first(ctx, "x509_subject"))
    admin = cn in policy.admin_names or bool(orgs & policy.admin_organizations)
    return Caller(role=Role.ADMIN if admin else Role.READ_ONLY, identity=cn or context.peer())


class _Invalid(ValueError):
    pass


def _name(value: str, what: str) -> str:
    try:
        return validate_name(value, what)
    except ValueError as exc:
        raise _Invalid(str(exc)) from None


def _reason(value: str, *, required: bool) -> str:
    text = value.strip()
    if required and not text:
        raise _Invalid("reason must not be empty: say why, it goes into the event log")
    if len(text) > MAX_REASON_CHARS:
        raise _Invalid(f"reason is {len(text)} characters; the limit is {MAX_REASON_CHARS}")
    if any(ord(c) < 32 for c in text):
        raise _Invalid("reason must be one line without control characters")
    return text


def _kinds(values: Sequence[int]) -> frozenset[int]:
    valid = set(events_pb2.EventKind.values()) - {events_pb2.EVENT_KIND_UNSPECIFIED}
    for k in values:
        if k not in valid:
            raise _Invalid(f"unknown event kind {k}")
    return frozenset(values)


# Unix seconds beyond this (year ~5138) are not a time any log holds; the bound also keeps the
# goodput function's integer microseconds finite.
MAX_UNIX_S = 1e11


def _since(value: float) -> float:
    if not math.isfinite(value) or not 0 <= value <= MAX_UNIX_S:
        raise _Invalid(f"since must be unix seconds in [0, {MAX_UNIX_S:g}], got {value}")
    return value


def _matches(ev: events_pb2.Event, run: str, kinds: frozenset[int]) -> bool:
    return (not run or ev.run == run) and (not kinds or ev.kind in kinds)


class ControllerServicer(controller_pb2_grpc.ControllerServicer):
    def __init__(
        self, view: ControllerView, policy: AccessPolicy | None = None, *, poll_s: float = WATCH_POLL_S,
        max_watches: int = 8,
    ) -> None:
        self._view = view
        self._policy = policy or AccessPolicy()
        self._poll_s = poll_s
        # Each WatchEvents stream holds a server thread while it follows the log: cap them below the
        # pool size so followers can never starve status calls (extras get RESOURCE_EXHAUSTED).
        self._max_watches = max_watches
        self._watches = threading.BoundedSemaphore(max_watches)

    # -- helpers ---------------------------------------------------------------------------------

    def _admin(self, context: grpc.ServicerContext, what: str) -> Caller:
        caller = caller_of(context, self._policy)
        if caller.role is not Role.ADMIN:
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{what} needs an admin certificate; {caller.identity!r} is read-only",
            )
        return caller

    def _call(self, context: grpc.ServicerContext, fn: Callable[[], T]) -> T:
        """Run a request body, turning validation and view errors into status codes."""
        try:
            return fn()
        except _Invalid as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except ViewNotFound as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except ViewUnavailable as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except ViewRefused as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except OSError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot read the event log: {exc.strerror or exc}")
        raise AssertionError("unreachable: abort raises")

    # -- reads -----------------------------------------------------------------------------------

    def GetStatus(
        self, request: controller_pb2.GetStatusRequest, context: grpc.ServicerContext
    ) -> controller_pb2.GetStatusResponse:
        def body() -> controller_pb2.GetStatusResponse:
            run = _name(request.run, "run") if request.run else ""
            runs = [r for r in self._view.run_statuses() if not run or r.run == run]
            if run and not runs:
                raise ViewNotFound(f"no run named {run!r}")
            leader, fence = self._view.leader()
            return controller_pb2.GetStatusResponse(runs=runs, leader=leader, fence=fence)

        return self._call(context, body)

    def ListNodes(
        self, request: controller_pb2.ListNodesRequest, context: grpc.ServicerContext
    ) -> controller_pb2.ListNodesResponse:
        return self._call(
            context,
            lambda: controller_pb2.ListNodesResponse(
                nodes=sorted(self._view.node_infos(), key=lambda n: n.node)
            ),
        )

    def GetNode(
        self, request: controller_pb2.GetNodeRequest, context: grpc.ServicerContext
    ) -> controller_pb2.GetNodeResponse:
        def body() -> controller_pb2.GetNodeResponse:
            node = _name(request.node, "node")
            for info in self._view.node_infos():
                if info.node == node:
                    return controller_pb2.GetNodeResponse(node=info)
            raise ViewNotFound(f"no node named {node!r}")

        return self._call(context, body)

    def ListEvents(
        self, request: controller_pb2.ListEventsRequest, context: grpc.ServicerContext
    ) -> controller_pb2.ListEventsResponse:
        def body() -> controller_pb2.ListEventsResponse:
            run = _name(request.run, "run") if request.run else ""
            kinds = _kinds(request.kinds)
            since = _since(request.since)
            if not 0 <= request.limit <= MAX_EVENT_LIMIT:
                raise _Invalid(f"limit must be 0..{MAX_EVENT_LIMIT}, got {request.limit}")
            limit = request.limit or DEFAULT_EVENT_LIMIT
            events = [
                e
                for e in read_events(self._view.event_log_path).events
                if _matches(e, run, kinds) and e.ts >= since
            ]
            return controller_pb2.ListEventsResponse(events=events[-limit:])

        return self._call(context, body)

    def WatchEvents(
        self, request: controller_pb2.WatchEventsRequest, context: grpc.ServicerContext
    ) -> Iterator[controller_pb2.WatchEventsResponse]:
        def check() -> tuple[str, frozenset[int]]:
            if request.after_seq < 0:
                raise _Invalid(f"after_seq must be >= 0, got {request.after_seq}")
            return (_name(request.run, "run") if request.run else ""), _kinds(request.kinds)

        run, kinds = self._call(context, check)
        if not self._watches.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{self._max_watches} event streams are open already; try again later")
        try:
            for ev in follow_events(
                self._view.event_log_path,
                after_seq=request.after_seq,
                active=context.is_active,
                poll_s=self._poll_s,
            ):
                if _matches(ev, run, kinds):
                    yield controller_pb2.WatchEventsResponse(event=ev)
        finally:
            self._watches.release()

    def GetGoodput(
        self, request: controller_pb2.GetGoodputRequest, context: grpc.ServicerContext
    ) -> controller_pb2.GetGoodputResponse:
        def body() -> controller_pb2.GetGoodputResponse:
            run = _name(request.run, "run") if request.run else ""
            if request.by not in ("", "cause", "week"):
                raise _Invalid(f"by must be 'cause' or 'week', got {request.by!r}")
            since = _since(request.since) or None
            events = read_events(self._view.event_log_path).events
            if run and not any(e.run == run for e in events):
                raise ViewNotFound(f"no events for run {run!r} in the event log")
            until = time.time() if _run_is_open(events, run) else None
            report = compute_goodput(events, run=run, since=since, until=until).to_proto()
            if request.by == "cause":
                del report.weeks[:]
            elif request.by == "week":
                del report.lost_by_cause[:]
            return controller_pb2.GetGoodputResponse(report=report)

        return self._call(context, body)

    # -- writes (admin only) ---------------------------------------------------------------------

    def QuarantineNode(
        self, request: controller_pb2.QuarantineNodeRequest, context: grpc.ServicerContext
    ) -> controller_pb2.QuarantineNodeResponse:
        caller = self._admin(context, "QuarantineNode")
        return self._call(
            context,
            lambda: controller_pb2.QuarantineNodeResponse(
                pool_state=self._view.quarantine(
                    _name(request.node, "node"), _reason(request.reason, required=True), caller.identity
                )
            ),
        )

    def ReleaseNode(
        self, request: controller_pb2.ReleaseNodeRequest, context: grpc.ServicerContext
    ) -> controller_pb2.ReleaseNodeResponse:
        caller = self._admin(context, "ReleaseNode")
        return self._call(
            context,
            lambda: controller_pb2.ReleaseNodeResponse(
                pool_state=self._view.release(
                    _name(request.node, "node"),
                    _reason(request.reason, required=False) or "operator release",
                    caller.identity,
                )
            ),
        )

    def RequestStop(
        self, request: controller_pb2.ControllerRequestStopRequest, context: grpc.ServicerContext
    ) -> controller_pb2.ControllerRequestStopResponse:
        caller = self._admin(context, "RequestStop")
        return self._call(
            context,
            lambda: controller_pb2.ControllerRequestStopResponse(
                accepted=self._view.request_stop(
                    _name(request.run, "run"),
                    _reason(request.reason, required=False) or "operator stop",
                    caller.identity,
                )
            ),
        )


def _run_is_open(events: Sequence[events_pb2.Event], run: str) -> bool:
    """A run without RUN_END is still allocated now: count it up to the present, not its last event."""
    runs = {e.run for e in events if not run or e.run == run}
    ended = {e.run for e in events if e.kind == events_pb2.EVENT_KIND_RUN_END}
    return bool(runs - ended)


def follow_events(
    path: Path, *, after_seq: int, active: Callable[[], bool], poll_s: float = WATCH_POLL_S
) -> Iterator[events_pb2.Event]:
    """Every event with seq > after_seq, then new ones as they are appended, while active().

    Only complete lines are parsed (a line being written is waited for); a bad line is skipped
    with a warning; a replaced or truncated file is re-read from the start, and the seq filter
    keeps that from repeating events.
    """
    offset = 0
    ident: tuple[int, int] | None = None
    pending = b""
    last_seq = after_seq
    while active():
        try:
            st = os.stat(path)
        except FileNotFoundError:
            time.sleep(poll_s)
            continue
        if ident != (st.st_dev, st.st_ino) or st.st_size < offset:
            ident, offset, pending = (st.st_dev, st.st_ino), 0, b""
        if st.st_size > offset:
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read(st.st_size - offset)
            offset += len(chunk)
            *lines, pending = (pending + chunk).split(b"\n")
            for raw in lines:
                if not raw.strip():
                    continue
                try:
                    ev = decode_line(raw)
                except ValueError as exc:
                    log.warning("event log %s: skipping a bad line: %s", path, exc)
                    continue
                if ev.seq > last_seq:
                    last_seq = ev.seq
                    yield ev
            continue
        time.sleep(poll_s)


# -- server ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerTLS:
    """PEM bytes for mutual TLS: the server's certificate and key, and the CA that signs clients."""

    cert_pem: bytes
    key_pem: bytes
    client_ca_pem: bytes

    @classmethod
    def from_files(cls, cert: str | Path, key: str | Path, client_ca: str | Path) -> ServerTLS:
        return cls(
            cert_pem=Path(cert).read_bytes(),
            key_pem=Path(key).read_bytes(),
            client_ca_pem=Path(client_ca).read_bytes(),
        )


def build_server(
    view: ControllerView,
    address: str,
    *,
    tls: ServerTLS | None = None,
    policy: AccessPolicy | None = None,
    max_workers: int = 16,
    poll_s: float = WATCH_POLL_S,
) -> tuple[grpc.Server, int]:
    """A started-ready (not yet started) server with the Controller, health and reflection services.

    Returns the server and the bound port. Plaintext is refused on a non-loopback address.
    """
    if tls is None and not is_loopback_address(address):
        raise ValueError(f"refusing to serve the Controller API in plaintext on {address}: configure TLS")
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="controller-api")
    )
    controller_pb2_grpc.add_ControllerServicer_to_server(
        ControllerServicer(view, policy, poll_s=poll_s, max_watches=max(1, max_workers // 2)), server
    )
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    names = (
        controller_pb2.DESCRIPTOR.services_by_name["Controller"].full_name,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)
    if tls is None:
        port = server.add_insecure_port(address)
    else:
        creds = grpc.ssl_server_credentials(
            [(tls.key_pem, tls.cert_pem)], root_certificates=tls.client_ca_pem, require_client_auth=True
        )
        port = server.add_secure_port(address, creds)
    if port == 0:
        raise OSError(f"cannot bind the Controller API to {address}")
    return server, port
