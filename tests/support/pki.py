"""A throwaway cluster CA with a server and a client certificate, made by the product's runwarden.certs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runwarden.certs import create_ca, issue

LOCAL_HOSTS = ("localhost", "127.0.0.1")


@dataclass(frozen=True, slots=True, kw_only=True)
class Pki:
    ca_file: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def make_pki(directory: Path, name: str = "test") -> Pki:
    """A CA in ``directory``, a server certificate for localhost and a client certificate (no admin organization)."""
    ca = create_ca(directory, name=f"{name} CA", days=1)
    server = issue(
        directory, "server", role="server", common_name=f"{name} server", hosts=LOCAL_HOSTS, days=1
    )
    client = issue(directory, "client", role="reader", common_name=f"{name} client", days=1)
    return Pki(
        ca_file=str(ca.cert),
        server_cert=str(server.cert),
        server_key=str(server.key),
        client_cert=str(client.cert),
        client_key=str(client.key),
    )
