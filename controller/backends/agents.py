"""gRPC clients for the node agents, as the controller's shell uses them.

Every call has a deadline and turns a failure into a value (kopf's habit: an RPC error is an
outcome the core reasons about, never an exception that kills the loop). Each outcome says whether
the failure is *temporary* (kopf's `TemporaryError`: the agent may answer if asked again) or
*permanent* (`PermanentError`: asking again cannot help); see `is_temporary`. Temporary failures are
retried here with exponential backoff until the call's own deadline runs out, so a caller sees a
temporary outcome only when the whole deadline passed without an answer.

Channels are cached per address and replaced when a node re-registers at another address.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc

from runwarden.v1 import agent_pb2, agent_pb2_grpc, common_pb2

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20  # flight-recorder dumps of 8 ranks fit with room to spare

# The first retry waits this long, each next one twice as long, at most RETRY_MAX_S.
RETRY_FIRST_S = 0.1
RETRY_MAX_S = 2.0
_CANCEL_POLL_S = 0.1  # a cancelled all-reduce call ends within this

# UNAVAILABLE: no connection (agent restarting, host unreachable) or the server is shutting down.
# DEADLINE_EXCEEDED: no answer in time (a loaded host). RESOURCE_EXHAUSTED: the agent's server is at
# its concurrent-RPC limit -- temporary too, unless it is a message over the size limit (the same
# request gives the same too-large answer every time).
_TEMPORARY_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"})


def is_temporary(code: str, error: str = "") -> bool:
    """Whether a failed call with gRPC status `code` (its name) may succeed if made again."""
    if code == "RESOURCE_EXHAUSTED" and "larger than max" in error:
        return False
    return code in _TEMPORARY_CODES


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentTLS:
    """Client side of mTLS to the agents: the CA that signed them and the controller's cert."""

    ca: Path
    cert: Path
    key: Path


@dataclass(frozen=True, slots=True, kw_only=True)
class RpcOutcome:
    """The result of one agent RPC: ok, or the gRPC code and a one-line reason."""

    node: str
    ok: bool
    code: str = "OK"
    error: str = ""
    tries: int = 1

    @property
    def temporary(self) -> bool:
        """A failure that may pass (only meaningful when not ok)."""
        return not self.ok and is_temporary(self.code, self.error)


@dataclass(frozen=True, slots=True, kw_only=True)
class PreflightOutcome:
    """A preflight call: `rpc` says whether the agent answered; `summary` and `failed` what it found."""

    node: str
    rpc: RpcOutcome
    summary: common_pb2.PreflightSummary
    failed: tuple[common_pb2.CheckResult, ...] = ()

    @property
    def ok(self) -> bool:
        return self.rpc.ok


_Resp = TypeVar("_Resp")


def _code_of(exc: grpc.RpcError) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    return code.name if code is not None else "UNKNOWN"


def _why(exc: grpc.RpcError) -> str:
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return f"{_code_of(exc)}: {(details or '')[:200]}"


def with_retries(
    call: Callable[[float], tuple[RpcOutcome, _Resp | None]],
    *,
    deadline_s: float,
    sleep: Callable[[float], object] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    stopped: Callable[[], bool] = lambda: False,
) -> tuple[RpcOutcome, _Resp | None]:
    """Call `call(timeout_s)` until it succeeds, fails permanently, or `deadline_s` has passed.

    Each try gets what is left of the deadline as its timeout; between tries the wait doubles from
    RETRY_FIRST_S up to RETRY_MAX_S (never past the deadline), and none once `stopped()` (the
    clients are closed: the controller is exiting). The last outcome is returned, with the number of
    tries made."""
    end = clock() + deadline_s
    wait = RETRY_FIRST_S
    tries = 0
    while True:
        tries += 1
        out, resp = call(max(0.05, end - clock()))
        if out.ok or not out.temporary or stopped() or clock() + wait >= end:
            if tries > 1:
                out = RpcOutcome(node=out.node, ok=out.ok, code=out.code, error=out.error, tries=tries)
            return out, resp
        log.info("agent %s: temporary failure (%s); retrying in %.2f s", out.node, out.error, wait)
        sleep(wait)
        wait = min(RETRY_MAX_S, wait * 2)


class AgentClients:
    """One channel per agent address; thread-safe."""

    def __init__(self, tls: AgentTLS | None = None) -> None:
        self._tls = tls
        self._lock = threading.Lock()
        self._channels: dict[str, tuple[str, grpc.Channel, agent_pb2_grpc.NodeAgentStub]] = {}
        self._closed = threading.Event()  # set by close(): calls in flight end, none is retried
        self._creds: grpc.ChannelCredentials | None = None
        if tls is not None:
            self._creds = grpc.ssl_channel_credentials(
                root_certificates=tls.ca.read_bytes(),
                private_key=tls.key.read_bytes(),
                certificate_chain=tls.cert.read_bytes(),
            )

    def address(self, node: str) -> str:
        """The node's agent address as last set ("" unknown)."""
        with self._lock:
            cur = self._channels.get(node)
            return cur[0] if cur is not None else ""

    def set_address(self, node: str, address: str) -> None:
        with self._lock:
            cur = self._channels.get(node)
            if cur is not None and cur[0] == address:
                return
            if cur is not None:
                cur[1].close()
            opts = [
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ]
            if self._creds is not None:
                channel = grpc.secure_channel(address, self._creds, options=opts)
            else:
                channel = grpc.insecure_channel(address, options=opts)
            self._channels[node] = (address, channel, agent_pb2_grpc.NodeAgentStub(channel))

    def forget(self, node: str) -> None:
        with self._lock:
            cur = self._channels.pop(node, None)
        if cur is not None:
            cur[1].close()

    def _stub(self, node: str) -> agent_pb2_grpc.NodeAgentStub | None:
        with self._lock:
            cur = self._channels.get(node)
        return None if cur is None else cur[2]

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            chans = list(self._channels.values())
            self._channels.clear()
        for _, ch, _ in chans:
            ch.close()

    # -- calls ---------------------------------------------------------------------------------

    def run_preflight(
        self, node: str, request: agent_pb2.RunPreflightRequest, timeout_s: float
    ) -> PreflightOutcome:
        """Stream the checks; a failed check is in `failed`, an RPC failure in `rpc` (retried if temporary)."""
        found: list[tuple[common_pb2.PreflightSummary | None, tuple[common_pb2.CheckResult, ...]]] = []

        def once(timeout: float) -> tuple[RpcOutcome, common_pb2.PreflightSummary | None]:
            stub = self._stub(node)
            if stub is None:
                return RpcOutcome(node=node, ok=False, code="UNAVAILABLE", error="no address known"), None
            failed: list[common_pb2.CheckResult] = []
            summary: common_pb2.PreflightSummary | None = None
            try:
                for item in stub.RunPreflight(request, timeout=timeout):
                    if item.HasField("result") and item.result.status == common_pb2.CHECK_STATUS_FAIL:
                        failed.append(item.result)
                    elif item.HasField("summary"):
                        summary = item.summary
            except grpc.RpcError as exc:
                log.info("agent %s RunPreflight failed: %s", node, _why(exc))
                return RpcOutcome(node=node, ok=False, code=_code_of(exc), error=_why(exc)), None
            found.append((summary, tuple(failed)))
            if summary is None:
                return RpcOutcome(node=node, ok=False, code="DATA_LOSS", error="agent sent no summary"), None
            return RpcOutcome(node=node, ok=True), summary

        out, summary = self._retried(once, timeout_s)
        failed = found[-1][1] if found else ()
        return PreflightOutcome(
            node=node,
            rpc=out,
            summary=summary or common_pb2.PreflightSummary(mode=request.mode),
            failed=failed,
        )

    def launch(
        self, node: str, request: agent_pb2.LaunchWorkersRequest, timeout_s: float
    ) -> tuple[RpcOutcome, agent_pb2.LaunchWorkersResponse | None]:
        """Start the node's workers; retried while temporary. A retry refused with ALREADY_EXISTS
        succeeded if the node now runs this very attempt (an earlier try landed but its answer was
        lost: then there is no response to say which path started it)."""
        tries = 0

        def once(timeout: float) -> tuple[RpcOutcome, agent_pb2.LaunchWorkersResponse | None]:
            nonlocal tries
            tries += 1
            out, resp = self._call(node, "LaunchWorkers", lambda s: s.LaunchWorkers(request, timeout=timeout))
            if out.code == "ALREADY_EXISTS" and tries > 1 and self._runs_attempt(node, request, timeout):
                return RpcOutcome(node=node, ok=True), None
            return out, resp

        return self._retried(once, timeout_s)

    def _runs_attempt(self, node: str, request: agent_pb2.LaunchWorkersRequest, timeout_s: float) -> bool:
        _, status = self._call(
            node,
            "GetNodeStatus",
            lambda s: s.GetNodeStatus(agent_pb2.GetNodeStatusRequest(), timeout=min(timeout_s, 5.0)),
        )
        return status is not None and any(
            w.run == request.run and w.attempt == request.attempt and w.running for w in status.workers
        )

    def stop(self, node: str, request: agent_pb2.StopWorkersRequest, timeout_s: float) -> RpcOutcome:
        """Stop the node's workers; NOT_FOUND (nothing of the run runs there) counts as stopped."""

        def once(timeout: float) -> tuple[RpcOutcome, agent_pb2.StopWorkersResponse | None]:
            out, resp = self._call(node, "StopWorkers", lambda s: s.StopWorkers(request, timeout=timeout))
            return (RpcOutcome(node=node, ok=True), resp) if out.code == "NOT_FOUND" else (out, resp)

        return self._retried(once, timeout_s)[0]

    def request_stop(
        self, node: str, request: agent_pb2.RequestStopRequest, timeout_s: float = 5.0
    ) -> RpcOutcome:
        def once(timeout: float) -> tuple[RpcOutcome, agent_pb2.RequestStopResponse | None]:
            return self._call(node, "RequestStop", lambda s: s.RequestStop(request, timeout=timeout))

        return self._retried(once, timeout_s)[0]

    def drain(
        self, node: str, request: agent_pb2.DrainRequest, timeout_s: float = 5.0
    ) -> tuple[RpcOutcome, agent_pb2.DrainResponse | None]:
        """Drain the node (or end its drain) through its agent; the record it re-puts says the rest."""

        def once(timeout: float) -> tuple[RpcOutcome, agent_pb2.DrainResponse | None]:
            return self._call(node, "Drain", lambda s: s.Drain(request, timeout=timeout))

        return self._retried(once, timeout_s)

    def collect_dumps(
        self, node: str, request: agent_pb2.CollectFlightRecorderRequest, timeout_s: float
    ) -> tuple[RpcOutcome, agent_pb2.CollectFlightRecorderResponse | None]:
        """One try: a rank that cannot answer in time is itself evidence; a retry would spend the deadline."""
        return self._call(
            node, "CollectFlightRecorder", lambda s: s.CollectFlightRecorder(request, timeout=timeout_s)
        )

    def measure_all_reduce(
        self,
        node: str,
        request: agent_pb2.MeasureAllReduceRequest,
        timeout_s: float,
        on_master: Callable[[agent_pb2.CollectiveMaster], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> tuple[RpcOutcome, agent_pb2.AllReduceMeasurement | None]:
        """One rank of an all-reduce group; one try (the group's other ranks do not wait for a retry).

        `on_master` is called with rank 0's master (address and port) as soon as its stream carries it,
        while the rank waits for the others; the answer is the rank's result (rank 0: the figures).
        Setting `cancel` ends the call (CANCELLED) and the agent stops its rank at once: a group whose
        other rank failed need not wait out its timeout."""
        stub = self._stub(node)
        if stub is None:
            return RpcOutcome(node=node, ok=False, code="UNAVAILABLE", error="no address known"), None
        result: agent_pb2.AllReduceMeasurement | None = None
        call = stub.MeasureAllReduce(request, timeout=timeout_s)
        finished = threading.Event()

        def cancel_when_asked() -> None:
            while cancel is not None and not finished.is_set():
                if cancel.wait(_CANCEL_POLL_S):
                    call.cancel()
                    return

        if cancel is not None:
            threading.Thread(target=cancel_when_asked, name="allreduce-cancel", daemon=True).start()
        try:
            for item in call:
                if item.HasField("master") and on_master is not None:
                    on_master(item.master)
                elif item.HasField("result"):
                    result = item.result
        except grpc.RpcError as exc:
            log.info("agent %s MeasureAllReduce failed: %s", node, _why(exc))
            return RpcOutcome(node=node, ok=False, code=_code_of(exc), error=_why(exc)), None
        finally:
            finished.set()
        if result is None:
            return RpcOutcome(node=node, ok=False, code="DATA_LOSS", error="agent sent no result"), None
        return RpcOutcome(node=node, ok=True), result

    def inject_fault(
        self, node: str, request: agent_pb2.InjectFaultRequest, timeout_s: float = 5.0
    ) -> RpcOutcome:
        return self._call(node, "InjectFault", lambda s: s.InjectFault(request, timeout=timeout_s))[0]

    def status(
        self, node: str, request: agent_pb2.GetNodeStatusRequest | None = None, timeout_s: float = 5.0
    ) -> tuple[RpcOutcome, agent_pb2.GetNodeStatusResponse | None]:
        req = request or agent_pb2.GetNodeStatusRequest()

        def once(timeout: float) -> tuple[RpcOutcome, agent_pb2.GetNodeStatusResponse | None]:
            return self._call(node, "GetNodeStatus", lambda s: s.GetNodeStatus(req, timeout=timeout))

        return self._retried(once, timeout_s)

    # -- plumbing ------------------------------------------------------------------------------

    def _retried(
        self, once: Callable[[float], tuple[RpcOutcome, _Resp | None]], timeout_s: float
    ) -> tuple[RpcOutcome, _Resp | None]:
        return with_retries(once, deadline_s=timeout_s, sleep=self._closed.wait, stopped=self._closed.is_set)

    def _call(
        self, node: str, name: str, call: Callable[[agent_pb2_grpc.NodeAgentStub], _Resp]
    ) -> tuple[RpcOutcome, _Resp | None]:
        """One unary call on the node's stub; an RPC error becomes an outcome."""
        stub = self._stub(node)
        if stub is None:
            return RpcOutcome(node=node, ok=False, code="UNAVAILABLE", error="no address known"), None
        try:
            resp = call(stub)
        except grpc.RpcError as exc:
            log.info("agent %s %s failed: %s", node, name, _why(exc))
            return RpcOutcome(node=node, ok=False, code=_code_of(exc), error=_why(exc)), None
        return RpcOutcome(node=node, ok=True), resp
