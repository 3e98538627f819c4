"""Every RPC of a real node agent (its own process) and of a real Controller API server, fed random
field values generated from the proto descriptors (hypothesis): each call ends with a clear status
(never UNKNOWN, the code of an unhandled exception), and the server keeps serving afterwards.
Requests over the configured message limit are refused before any handler runs."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings

from controller.api.server import build_server  # noqa: F401 - the live fixture builds the real server
from runwarden.v1 import agent_pb2, controller_pb2, controller_pb2_grpc
from tests.ctl.conftest import LiveController
from tests.fuzz.protostrat import messages

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
# Inputs per RPC: 50 keeps the suite in its time budget; RUNWARDEN_FUZZ_EXAMPLES=500 for a long run.
EXAMPLES = int(os.environ.get("RUNWARDEN_FUZZ_EXAMPLES", "50"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=False,
    database=None,
    suppress_health_check=list(HealthCheck),
)
FUZZED: dict[str, int] = {}  # inputs actually sent, per service (printed for the README's figures)


def _service_methods(service: Any) -> list[tuple[str, Any, Any, bool]]:
    out = []
    for m in service.methods:
        module = agent_pb2 if m.input_type.file.name.endswith("agent.proto") else controller_pb2
        req_cls = getattr(module, m.input_type.name, None)
        if req_cls is None:
            from google.protobuf import message_factory

            req_cls = message_factory.GetMessageClass(m.input_type)
        out.append((m.name, req_cls, m.output_type, m.server_streaming))
    return out


def _call(channel: grpc.Channel, path: str, req: Any, resp_desc: Any, streaming: bool) -> grpc.StatusCode:
    from google.protobuf import message_factory

    resp_cls = message_factory.GetMessageClass(resp_desc)
    try:
        if streaming:
            stream = channel.unary_stream(
                path,
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=resp_cls.FromString,
            )(req, timeout=1.5)
            for i, _ in enumerate(stream):
                if i >= 3:
                    stream.cancel()
                    break
        else:
            channel.unary_unary(
                path,
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=resp_cls.FromString,
            )(req, timeout=10)
    except grpc.RpcError as err:
        code = err.code()
        if code not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
            details = err.details() or ""
            assert details, f"{path}: {code} without a message"
            assert "Traceback" not in details, details
        return code
    return grpc.StatusCode.OK


def _fuzz_method(
    channel: grpc.Channel, service_name: str, path: str, req_cls: Any, resp_desc: Any, streaming: bool
) -> None:
    @FUZZ
    @given(req=messages(req_cls))
    def one(req: Any) -> None:
        code = _call(channel, path, req, resp_desc, streaming)
        FUZZED[service_name] = FUZZED.get(service_name, 0) + 1
        assert code != grpc.StatusCode.UNKNOWN, f"{path} raised on {req}"
        assert code != grpc.StatusCode.UNAVAILABLE, f"{path}: the server went away on {req}"

    one()


def _fuzz_service(channel: grpc.Channel, service_name: str, service: Any, alive: Callable[[], None]) -> None:
    for name, req_cls, resp_desc, streaming in _service_methods(service):
        _fuzz_method(channel, service_name, f"/{service_name}/{name}", req_cls, resp_desc, streaming)
        alive()


def test_every_agent_rpc_survives_random_requests(agent_factory) -> None:
    agent = agent_factory()

    def alive() -> None:
        assert agent.proc.poll() is None, agent.log()[-2000:]
        assert agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest(), timeout=5).node == "n1"

    _fuzz_service(
        agent.channel, "runwarden.v1.NodeAgent", agent_pb2.DESCRIPTOR.services_by_name["NodeAgent"], alive
    )
    print(f"agent RPC inputs fuzzed: {FUZZED['runwarden.v1.NodeAgent']}")
    assert "Traceback" not in agent.log()


def test_every_controller_rpc_survives_random_requests(live: LiveController) -> None:
    channel = grpc.insecure_channel(live.address)
    stub = controller_pb2_grpc.ControllerStub(channel)

    def alive() -> None:
        assert stub.GetStatus(controller_pb2.GetStatusRequest(), timeout=5).runs

    _fuzz_service(
        channel, "runwarden.v1.Controller", controller_pb2.DESCRIPTOR.services_by_name["Controller"], alive
    )
    print(f"controller RPC inputs fuzzed: {FUZZED['runwarden.v1.Controller']}")
    # An oversized request is refused by grpc's receive limit (default 4 MiB) before any handler runs.
    raw = channel.unary_unary(
        "/runwarden.v1.Controller/QuarantineNode", request_serializer=None, response_deserializer=None
    )
    with pytest.raises(grpc.RpcError) as err:
        raw(b"\x0a\x80\x80\x80\x03" + b"n" * (6 << 20), timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    alive()
    channel.close()
