"""Roles from the TLS client certificate: read-only callers are refused mutating RPCs (PERMISSION_DENIED)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from controller.api.access import AccessPolicy
from controller.api.server import ServerTLS, build_server
from controller.ctl.main import main
from runwarden.certs import IssuedFiles, create_ca, issue
from runwarden.store import Store
from runwarden.v1 import common_pb2, controller_pb2, controller_pb2_grpc, store_pb2

from .conftest import RUN, LiveController, _start


@pytest.fixture
def ca(tmp_path: Path) -> IssuedFiles:
    return create_ca(tmp_path / "pki", days=1)


@pytest.fixture
def live_tls(store: Store, tmp_path: Path, ca: IssuedFiles) -> Iterator[LiveController]:
    server = issue(
        ca.cert.parent,
        "server",
        role="server",
        common_name="controller",
        hosts=("localhost", "127.0.0.1"),
        days=1,
    )
    tls = ServerTLS.from_files(server.cert, server.key, ca.cert)
    yield from _start(store, tmp_path, tls=tls, policy=AccessPolicy(admin_names=frozenset({"ops-robot"})))


def _tls_args(ca: IssuedFiles, stem: str, cn: str, role: str) -> list[str]:
    pem = issue(ca.cert.parent, stem, role=role, common_name=cn, days=1)
    return ["--ca", str(ca.cert), "--cert", str(pem.cert), "--key", str(pem.key)]


def test_read_only_certificate_can_read_but_not_mutate(
    live_tls: LiveController, ca: IssuedFiles, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--controller", live_tls.address, *_tls_args(ca, "viewer", "viewer", "reader")]
    assert main([*base, "status"]) == 0
    assert "llm" in capsys.readouterr().out
    assert main([*base, "quarantine", "n1", "--reason", "looks slow"]) == 4
    err = capsys.readouterr().err
    assert (
        "permission denied" in err and "QuarantineNode needs an admin certificate" in err and "viewer" in err
    )
    assert main([*base, "stop", RUN]) == 4
    assert main([*base, "release", "n2"]) == 4
    assert main([*base, "config", "set", "restart_budget", "3"]) == 4
    assert "SetPolicy needs an admin certificate" in capsys.readouterr().err
    capsys.readouterr()
    # nothing was written
    entry = store_pb2.PoolEntry.FromString(live_tls.store.get(live_tls.store.keys.pool("n1")).value)
    assert entry.state == common_pb2.POOL_STATE_SPARE and not entry.reason  # as the fixture wrote it
    assert live_tls.store.get(live_tls.store.keys.stop(RUN)) is None


def test_admin_by_organization_and_by_name(
    live_tls: LiveController, ca: IssuedFiles, capsys: pytest.CaptureFixture[str]
) -> None:
    by_org = ["--controller", live_tls.address, *_tls_args(ca, "alice", "alice", "admin")]
    assert main([*by_org, "quarantine", "n1", "--reason", "ECC errors", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pool_state"] == "POOL_STATE_QUARANTINED"
    entry = store_pb2.PoolEntry.FromString(live_tls.store.get(live_tls.store.keys.pool("n1")).value)
    assert entry.reason == "operator alice: ECC errors"
    by_name = ["--controller", live_tls.address, *_tls_args(ca, "robot", "ops-robot", "reader")]
    assert main([*by_name, "stop", RUN, "--reason", "time limit"]) == 0
    stop = store_pb2.StopRequest.FromString(live_tls.store.get(live_tls.store.keys.stop(RUN)).value)
    assert stop.requested_by == "ops-robot"


def test_plaintext_client_and_foreign_certificate_are_refused(
    live_tls: LiveController, ca: IssuedFiles, tmp_path: Path
) -> None:
    channel = grpc.insecure_channel(live_tls.address)
    with pytest.raises(grpc.RpcError) as exc:
        controller_pb2_grpc.ControllerStub(channel).GetStatus(controller_pb2.GetStatusRequest(), timeout=3)
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    channel.close()
    other = create_ca(tmp_path / "other", name="another cluster CA", days=1)
    # an admin certificate (O=runwarden:admin), but not signed by our CA
    mallory = issue(other.cert.parent, "mallory", role="admin", common_name="mallory", days=1)
    creds = grpc.ssl_channel_credentials(
        ca.cert.read_bytes(), mallory.key.read_bytes(), mallory.cert.read_bytes()
    )
    channel = grpc.secure_channel(live_tls.address, creds)
    with pytest.raises(grpc.RpcError) as exc:
        controller_pb2_grpc.ControllerStub(channel).QuarantineNode(
            controller_pb2.QuarantineNodeRequest(node="n1", reason="x"), timeout=3
        )
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    channel.close()


def test_plaintext_is_refused_off_loopback(store: Store, tmp_path: Path) -> None:
    from controller.api.store_view import StoreBackedView

    with pytest.raises(ValueError, match="plaintext"):
        build_server(StoreBackedView(store, tmp_path / "e.jsonl"), "0.0.0.0:0")
