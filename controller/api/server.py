"""The Controller API server: the Controller servicer plus health and reflection, plaintext or mutual TLS.

Plaintext is refused on a non-loopback address; with TLS a client certificate signed by the
configured CA is required, and `controller.api.access` maps it to a role.
"""

from __future__ import annotations

from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from controller.api.access import AccessPolicy
from controller.api.service import WATCH_POLL_S, ControllerServicer
from controller.api.view import ControllerView
from runwarden.net import is_loopback_address
from runwarden.v1 import controller_pb2, controller_pb2_grpc

SERVICE_NAME = "runwarden.v1.Controller"


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
