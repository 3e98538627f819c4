"""gRPC clients for the node agents, as the controller's shell uses them.

Every call has a deadline and turns a failure into a value (kopf's habit: an RPC error is an
outcome the core reasons about, never an exception that kills the loop). Channels are cached per
address and replaced when a node re-registers at another address.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from runwarden.v1 import agent_pb2, agent_pb2_grpc, common_pb2

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20  # flight-recorder dumps of 8 ranks fit with room to spare


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentTLS:
    """Client side of mTLS to the agents: the CA that signed them and the controller's cert."""

    ca: Path
    cert: Path
    key: Path


@dataclass(frozen=True, slots=True, kw_only=True)
class RpcOutcome:
    """The result of one agent RPC: ok with a response, or the gRPC code and a one-line reason."""

    node: str
    ok: bool
    code: str = "OK"
    error: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class PreflightOutcome:
    node: str
    ok: bool
    summary: common_pb2.PreflightSummary
    failed: tuple[common_pb2.CheckResult, ...]
    error: str = ""


class AgentClients:
    """One channel per agent address; thread-safe."""

    def __init__(self, tls: AgentTLS | None = None) -> None:
        self._tls = tls
        self._lock = threading.Lock()
        self._channels: dict[str, tuple[str, grpc.Channel, agent_pb2_grpc.NodeAgentStub]] = {}
        self._creds: grpc.ChannelCredentials | None = None
        if tls is not None:
            self._creds = grpc.ssl_channel_credentials(
                root_certificates=tls.ca.read_bytes(),
                private_key=tls.key.read_bytes(),
                certificate_chain=tls.cert.read_bytes(),
            )

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
        with self._lock:
            chans = list(self._channels.values())
            self._channels.clear()
        for _, ch, _ in chans:
            ch.close()

    # -- calls ---------------------------------------------------------------------------------

    def run_preflight(self, node: str, mode: str, timeout_s: float) -> PreflightOutcome:
        stub = self._stub(node)
        empty = common_pb2.PreflightSummary(mode=mode)
        if stub is None:
            return PreflightOutcome(node=node, ok=False, summary=empty, failed=(), error="no address known")
        failed: list[common_pb2.CheckResult] = []
        summary: common_pb2.PreflightSummary | None = None
        try:
            for item in stub.RunPreflight(agent_pb2.RunPreflightRequest(mode=mode), timeout=timeout_s):
                if item.HasField("result") and item.result.status == common_pb2.CHECK_STATUS_FAIL:
                    failed.append(item.result)
                elif item.HasField("summary"):
                    summary = item.summary
        except grpc.RpcError as exc:
            return PreflightOutcome(node=node, ok=False, summary=empty, failed=tuple(failed), error=_why(exc))
        if summary is None:
            return PreflightOutcome(
                node=node, ok=False, summary=empty, failed=tuple(failed), error="agent sent no summary"
            )
        return PreflightOutcome(node=node, ok=True, summary=summary, failed=tuple(failed))

    def launch(self, node: str, request: agent_pb2.LaunchWorkersRequest, timeout_s: float) -> RpcOutcome:
        return self._unary(node, "LaunchWorkers", request, timeout_s)[0]

    def stop(self, node: str, run: str, attempt: int, grace_s: float) -> RpcOutcome:
        req = agent_pb2.StopWorkersRequest(run=run, attempt=attempt, grace_s=grace_s)
        return self._unary(node, "StopWorkers", req, grace_s + 10.0)[0]

    def request_stop(self, node: str, run: str, reason: str, timeout_s: float = 5.0) -> RpcOutcome:
        req = agent_pb2.RequestStopRequest(run=run, reason=reason)
        return self._unary(node, "RequestStop", req, timeout_s)[0]

    def collect_dumps(
        self, node: str, run: str, timeout_s: float
    ) -> tuple[RpcOutcome, agent_pb2.CollectFlightRecorderResponse | None]:
        req = agent_pb2.CollectFlightRecorderRequest(run=run, timeout_s=timeout_s)
        return self._unary(node, "CollectFlightRecorder", req, timeout_s + 5.0)

    def inject_fault(
        self, node: str, request: agent_pb2.InjectFaultRequest, timeout_s: float = 5.0
    ) -> RpcOutcome:
        return self._unary(node, "InjectFault", request, timeout_s)[0]

    def status(
        self, node: str, timeout_s: float = 5.0
    ) -> tuple[RpcOutcome, agent_pb2.GetNodeStatusResponse | None]:
        return self._unary(node, "GetNodeStatus", agent_pb2.GetNodeStatusRequest(), timeout_s)

    def _unary(self, node: str, method: str, request: object, timeout_s: float) -> tuple[RpcOutcome, Any]:
        stub = self._stub(node)
        if stub is None:
            return RpcOutcome(node=node, ok=False, code="UNAVAILABLE", error="no address known"), None
        try:
            resp = getattr(stub, method)(request, timeout=timeout_s)
        except grpc.RpcError as exc:
            code = exc.code().name if hasattr(exc, "code") and exc.code() is not None else "UNKNOWN"
            log.info("agent %s %s failed: %s", node, method, _why(exc))
            return RpcOutcome(node=node, ok=False, code=code, error=_why(exc)), None
        return RpcOutcome(node=node, ok=True), resp


def _why(exc: grpc.RpcError) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return f"{code.name if code else 'UNKNOWN'}: {(details or '')[:200]}"
