"""The Controller gRPC servicer: what `controllerctl`, dashboards and `grpcurl` talk to.

The servicer is a thin, validating adapter over a `ControllerView` (`controller.api.view`; the live
controller shell implements it, `controller.api.store_view.StoreBackedView` implements it from etcd
for tools and tests). `controller.api.access` decides roles; `controller.api.server` builds the
gRPC server. Rules:

* every request field is validated first; a bad one is INVALID_ARGUMENT with a one-line reason;
* with TLS, the client certificate decides the role (`AccessPolicy`): read-only callers may use
  the Get/List/Watch RPCs; QuarantineNode, ReleaseNode, RequestStop, DrainNode and SetPolicy need an admin certificate
  and are otherwise PERMISSION_DENIED. Plaintext is only served on loopback (demo, tests);
* the servicer never crashes on a view failure: it becomes UNAVAILABLE / NOT_FOUND /
  FAILED_PRECONDITION / INTERNAL with a message;
* goodput and events come from the event log file, read by the same code as `controllerctl
  goodput --log` (`controller.goodput.report.compute_goodput`).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import grpc

from controller.api.access import AccessPolicy, Caller, Role, caller_of
from controller.api.view import ControllerView, ViewInvalid, ViewNotFound, ViewRefused, ViewUnavailable
from controller.goodput.report import compute_goodput, normalise_by, shape_report
from runwarden.eventlog import LogEntry, decode_line, read_events
from runwarden.names import check_name
from runwarden.v1 import controller_pb2, controller_pb2_grpc, events_pb2

log = logging.getLogger(__name__)

DEFAULT_EVENT_LIMIT = 1000
MAX_EVENT_LIMIT = 100_000
MAX_REASON_CHARS = 512
MAX_POLICY_KEYS = 256  # SupervisorConfig has ~50 fields: a request with more is not a policy
WATCH_POLL_S = 0.2

T = TypeVar("T")


class _Invalid(ValueError):
    pass


def _name(value: str, what: str) -> str:
    try:
        return check_name(what, value)
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


def _matches(ev: LogEntry, run: str, kinds: frozenset[int]) -> bool:
    return (not run or ev.run == run) and (not kinds or ev.kind in kinds)


class ControllerServicer(controller_pb2_grpc.ControllerServicer):
    def __init__(
        self,
        view: ControllerView,
        policy: AccessPolicy | None = None,
        *,
        poll_s: float = WATCH_POLL_S,
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
        except (_Invalid, ViewInvalid) as exc:
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
                for e in read_events(self._view.event_log_path).entries
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
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._max_watches} event streams are open already; try again later",
            )
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
            try:
                by = normalise_by(request.by.split(","))
            except ValueError as exc:
                raise _Invalid(str(exc)) from None
            since = _since(request.since) or None
            events = read_events(self._view.event_log_path).entries
            if run and not any(e.run == run for e in events):
                raise ViewNotFound(f"no events for run {run!r} in the event log")
            until = time.time() if _run_is_open(events, run) else None
            report = compute_goodput(events, run=run, since=since, until=until).to_proto()
            return controller_pb2.GetGoodputResponse(report=shape_report(report, by))

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
                    _reason(request.reason, required=False)
                    or ("operator restart" if request.relaunch else "operator stop"),
                    caller.identity,
                    relaunch=request.relaunch,
                )
            ),
        )

    def DrainNode(
        self, request: controller_pb2.DrainNodeRequest, context: grpc.ServicerContext
    ) -> controller_pb2.DrainNodeResponse:
        caller = self._admin(context, "DrainNode")
        return self._call(
            context,
            lambda: controller_pb2.DrainNodeResponse(
                draining=self._view.drain(
                    _name(request.node, "node"),
                    _reason(request.reason, required=not request.undo) or "drain ended",
                    caller.identity,
                    undo=request.undo,
                )
            ),
        )

    def ReleaseClaims(
        self, request: controller_pb2.ReleaseClaimsRequest, context: grpc.ServicerContext
    ) -> controller_pb2.ReleaseClaimsResponse:
        caller = self._admin(context, "ReleaseClaims")

        def body() -> controller_pb2.ReleaseClaimsResponse:
            if bool(request.node) == bool(request.run):
                raise _Invalid("name exactly one of node and run")
            node = _name(request.node, "node") if request.node else ""
            run = _name(request.run, "run") if request.run else ""
            released = self._view.release_claims(node=node, run=run, actor=caller.identity)
            return controller_pb2.ReleaseClaimsResponse(nodes=released)

        return self._call(context, body)

    def GetPolicy(
        self, request: controller_pb2.GetPolicyRequest, context: grpc.ServicerContext
    ) -> controller_pb2.GetPolicyResponse:
        return self._call(
            context, lambda: self._view.policy(_name(request.run, "run") if request.run else "")
        )

    def SetPolicy(
        self, request: controller_pb2.SetPolicyRequest, context: grpc.ServicerContext
    ) -> controller_pb2.SetPolicyResponse:
        caller = self._admin(context, "SetPolicy")

        def body() -> controller_pb2.SetPolicyResponse:
            run = _name(request.run, "run") if request.run else ""
            if not request.values and not request.replace:
                raise _Invalid("values must name at least one policy key to change")
            if len(request.values) > MAX_POLICY_KEYS:
                raise _Invalid(
                    f"{len(request.values)} policy keys; the policy has fewer than {MAX_POLICY_KEYS}"
                )
            return self._view.set_policy(
                run,
                dict(request.values),
                replace=request.replace,
                actor=caller.identity,
                reason=_reason(request.reason, required=False),
            )

        return self._call(context, body)


def _run_is_open(events: Sequence[LogEntry], run: str) -> bool:
    """A run without RUN_END is still allocated now: count it up to the present, not its last event."""
    runs = {e.run for e in events if not run or e.run == run}
    ended = {e.run for e in events if e.kind == events_pb2.EVENT_KIND_RUN_END}
    return bool(runs - ended)


def follow_events(
    path: Path, *, after_seq: int, active: Callable[[], bool], poll_s: float = WATCH_POLL_S
) -> Iterator[LogEntry]:
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
