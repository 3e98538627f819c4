"""`controllerctl certs init|issue` makes a CA and certificates that the real components accept:
etcd with TLS + client certificates + user/password auth together, and the Controller API's roles."""

from __future__ import annotations

import stat
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from controller.api.server import ServerTLS
from controller.ctl.main import main
from runwarden.store import Store, StoreConfig, StoreError
from testbed.etcd_server import EtcdServer, EtcdTls
from tests.ctl.conftest import RUN, LiveController, _start

PASSWORD = "s3cret-etcd-pw-do-not-log"


def _certs(*args: str) -> int:
    return main(["certs", *args])


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    d = tmp_path / "pki"
    assert _certs("init", str(d)) == 0
    assert (
        _certs("issue", str(d), "etcd", "--role", "server", "--host", "127.0.0.1", "--host", "localhost") == 0
    )
    assert _certs("issue", str(d), "controller", "--role", "server", "--host", "127.0.0.1") == 0
    assert _certs("issue", str(d), "alice", "--role", "admin") == 0
    assert _certs("issue", str(d), "viewer", "--role", "reader") == 0
    return d


def test_keys_are_private_and_never_printed(pki: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for key in pki.glob("*.key"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    out = capsys.readouterr()
    assert "PRIVATE KEY" not in out.out + out.err
    # the CA is not silently replaced; bad input is refused with a clear line
    assert _certs("init", str(pki)) == 1
    assert "already exists" in capsys.readouterr().err
    assert _certs("issue", str(pki), "x", "--role", "server") == 1
    assert "--host" in capsys.readouterr().err
    assert _certs("issue", str(pki), "../evil", "--role", "admin") == 1
    assert _certs("issue", str(pki / "nope"), "y", "--role", "admin") == 1
    assert "certs init" in capsys.readouterr().err


def _etcdctl(etcd: EtcdServer, pki: Path, *args: str) -> None:
    subprocess.run(
        [
            "etcdctl",
            f"--endpoints={etcd.client_url}",
            f"--cacert={pki / 'ca.pem'}",
            f"--cert={pki / 'controller.pem'}",
            f"--key={pki / 'controller.key'}",
            *args,
        ],
        check=True,
        capture_output=True,
        timeout=30,
        env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"},
    )


def test_etcd_with_tls_client_certs_and_auth_together(
    etcd_factory: Callable[..., EtcdServer], pki: Path
) -> None:
    tls = EtcdTls(
        cert_file=str(pki / "etcd.pem"),
        key_file=str(pki / "etcd.key"),
        ca_file=str(pki / "ca.pem"),
        client_cert_auth=True,
    )
    etcd = etcd_factory(tls=tls)
    _etcdctl(etcd, pki, "user", "add", "root", f"--new-user-password={PASSWORD}")
    _etcdctl(etcd, pki, "auth", "enable")
    good = StoreConfig(
        endpoints=(etcd.client_url,),
        ca_file=str(pki / "ca.pem"),
        cert_file=str(pki / "controller.pem"),
        key_file=str(pki / "controller.key"),
        user="root",
        password=PASSWORD,
        timeout_s=5.0,
    )
    with Store.connect(good) as store:
        store.put(store.keys.stop(RUN), b"x")
        assert store.get(store.keys.stop(RUN)) is not None
    for bad in (
        StoreConfig(
            endpoints=good.endpoints,
            ca_file=good.ca_file,
            cert_file=good.cert_file,
            key_file=good.key_file,
            user="root",
            password="wrong-" + PASSWORD,
            timeout_s=5.0,
        ),
        StoreConfig(
            endpoints=good.endpoints, ca_file=good.ca_file, user="root", password=PASSWORD, timeout_s=5.0
        ),
    ):
        with pytest.raises(StoreError) as err:
            Store.connect(bad).close()
        assert PASSWORD not in str(err.value) and "PRIVATE KEY" not in str(err.value)


@pytest.fixture
def live_tls(store: Store, tmp_path: Path, pki: Path) -> Iterator[LiveController]:
    tls = ServerTLS.from_files(pki / "controller.pem", pki / "controller.key", pki / "ca.pem")
    yield from _start(store, tmp_path, tls=tls)


def test_controller_roles_from_cli_certificates(
    live_tls: LiveController, pki: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def args(stem: str) -> list[str]:
        return [
            "--controller",
            live_tls.address,
            "--ca",
            str(pki / "ca.pem"),
            "--cert",
            str(pki / f"{stem}.pem"),
            "--key",
            str(pki / f"{stem}.key"),
        ]

    assert main([*args("viewer"), "status"]) == 0
    for verb in (["quarantine", "n1", "--reason", "r"], ["release", "n2"], ["stop", RUN]):
        assert main([*args("viewer"), *verb]) == 4, verb
    assert main([*args("alice"), "quarantine", "n1", "--reason", "ECC"]) == 0
    assert live_tls.store.get(live_tls.store.keys.stop(RUN)) is None
    out = capsys.readouterr()
    assert "PRIVATE KEY" not in out.out + out.err


def test_agent_with_cli_certificates_refuses_foreign_and_missing_client_certs(
    agent_factory, pki: Path, tmp_path: Path, free_port: int
) -> None:
    import grpc

    from runwarden.v1 import agent_pb2, agent_pb2_grpc

    assert _certs("issue", str(pki), "agent", "--role", "server", "--host", "127.0.0.1") == 0
    other = tmp_path / "other-pki"
    assert _certs("init", str(other)) == 0
    assert _certs("issue", str(other), "mallory", "--role", "admin") == 0
    agent_factory(
        flags=[
            "--listen",
            f"127.0.0.1:{free_port}",
            "--tls-cert",
            str(pki / "agent.pem"),
            "--tls-key",
            str(pki / "agent.key"),
            "--tls-client-ca",
            str(pki / "ca.pem"),
        ]
    )

    def stub(ca: Path, who: Path | None) -> agent_pb2_grpc.NodeAgentStub:
        creds = grpc.ssl_channel_credentials(
            (ca / "ca.pem").read_bytes(),
            (who.with_suffix(".key")).read_bytes() if who else None,
            who.read_bytes() if who else None,
        )
        return agent_pb2_grpc.NodeAgentStub(grpc.secure_channel(f"127.0.0.1:{free_port}", creds))

    good = stub(pki, pki / "controller.pem")
    assert good.GetNodeStatus(agent_pb2.GetNodeStatusRequest(), timeout=10).node == "n1"
    for caller in (stub(pki, other / "mallory.pem"), stub(pki, None)):
        for call, req in (
            (caller.LaunchWorkers, agent_pb2.LaunchWorkersRequest(run="r", argv=["/bin/true"])),
            (caller.StopWorkers, agent_pb2.StopWorkersRequest(run="r")),
            (caller.RunPreflight, agent_pb2.RunPreflightRequest(mode="quick")),
        ):
            with pytest.raises(grpc.RpcError) as err:
                reply = call(req, timeout=10)
                list(reply) if not hasattr(reply, "ListFields") else None
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # the TLS handshake itself fails
    assert good.GetNodeStatus(agent_pb2.GetNodeStatusRequest(), timeout=10).node == "n1"
