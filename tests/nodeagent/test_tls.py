"""mTLS on the TCP listener: mutating RPCs need a verified client certificate."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from runwarden.v1 import agent_pb2, agent_pb2_grpc
from tests.support.pki import make_pki


def _channel(port: int, pki, *, client_cert: bool) -> agent_pb2_grpc.NodeAgentStub:
    creds = grpc.ssl_channel_credentials(
        root_certificates=Path(pki.ca_file).read_bytes(),
        private_key=Path(pki.client_key).read_bytes() if client_cert else None,
        certificate_chain=Path(pki.client_cert).read_bytes() if client_cert else None,
    )
    return agent_pb2_grpc.NodeAgentStub(grpc.secure_channel(f"127.0.0.1:{port}", creds))


def _code(fn, request):
    with pytest.raises(grpc.RpcError) as err:
        fn(request, timeout=10)
    return err.value.code()


BAD_LAUNCH = agent_pb2.LaunchWorkersRequest(run="r1")  # passes auth, then fails validation


def test_client_certificate_required_on_tcp_and_mutations_refused_on_unix_socket(
    agent_factory, tmp_path, free_port
):
    pki = make_pki(tmp_path / "pki")
    agent = agent_factory(
        flags=[
            "--listen",
            f"127.0.0.1:{free_port}",
            "--tls-cert",
            pki.server_cert,
            "--tls-key",
            pki.server_key,
            "--tls-client-ca",
            pki.ca_file,
        ]
    )
    admin = _channel(free_port, pki, client_cert=True)
    assert admin.GetNodeStatus(agent_pb2.GetNodeStatusRequest(), timeout=10).node == "n1"
    assert _code(admin.LaunchWorkers, BAD_LAUNCH) == grpc.StatusCode.INVALID_ARGUMENT  # authorised
    anonymous = _channel(free_port, pki, client_cert=False)
    assert _code(anonymous.GetNodeStatus, agent_pb2.GetNodeStatusRequest()) == grpc.StatusCode.UNAVAILABLE
    # the local ranks' socket: progress yes, mutations no
    assert _code(agent.stub.LaunchWorkers, BAD_LAUNCH) == grpc.StatusCode.PERMISSION_DENIED
    assert _code(agent.stub.InjectFault, agent_pb2.InjectFaultRequest()) == grpc.StatusCode.PERMISSION_DENIED
    assert agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest()).node == "n1"


def test_tls_without_client_ca_refuses_mutations(agent_factory, tmp_path, free_port):
    pki = make_pki(tmp_path / "pki")
    agent_factory(
        flags=[
            "--listen",
            f"127.0.0.1:{free_port}",
            "--tls-cert",
            pki.server_cert,
            "--tls-key",
            pki.server_key,
        ]
    )
    anonymous = _channel(free_port, pki, client_cert=False)
    assert anonymous.GetNodeStatus(agent_pb2.GetNodeStatusRequest(), timeout=10).node == "n1"
    assert _code(anonymous.LaunchWorkers, BAD_LAUNCH) == grpc.StatusCode.UNAUTHENTICATED
    assert (
        _code(anonymous.StopWorkers, agent_pb2.StopWorkersRequest(run="r")) == grpc.StatusCode.UNAUTHENTICATED
    )
