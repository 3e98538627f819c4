"""TLS with client-certificate auth against a real etcd; certificates are made by the test."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from runwarden.store import Store, StoreConfig, StoreError
from testbed.etcd_server import EtcdServer, EtcdTls
from tests.support.pki import Pki, make_pki


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path / "pki")


@pytest.fixture
def tls_etcd(etcd_factory: Callable[..., EtcdServer], pki: Pki) -> EtcdServer:
    tls = EtcdTls(
        cert_file=pki.server_cert, key_file=pki.server_key, ca_file=pki.ca_file, client_cert_auth=True
    )
    return etcd_factory(tls=tls)


def _assert_one_clear_line(err: StoreError, *words: str) -> None:
    text = str(err)
    assert "\n" not in text and "Traceback" not in text
    assert err.__cause__ is None and (err.__context__ is None or err.__suppress_context__)
    for word in words:
        assert word in text, text


def test_client_with_the_right_certificate_connects(tls_etcd: EtcdServer, pki: Pki) -> None:
    config = StoreConfig(
        endpoints=(tls_etcd.endpoint,),
        ca_file=pki.ca_file,
        cert_file=pki.client_cert,
        key_file=pki.client_key,
    )
    with Store.connect(config) as store:
        revision = store.put(store.keys.node("n1"), b"tls")
        kv = store.get(store.keys.node("n1"))
        assert kv is not None and kv.value == b"tls" and kv.mod_revision == revision


def test_client_without_a_certificate_is_refused_clearly(tls_etcd: EtcdServer, pki: Pki) -> None:
    config = StoreConfig(endpoints=(tls_etcd.endpoint,), ca_file=pki.ca_file, timeout_s=3.0)
    with pytest.raises(StoreError) as caught:
        Store.connect(config)
    print(caught.value)
    _assert_one_clear_line(caught.value, "TLS", tls_etcd.endpoint, "no client certificate")


def test_client_trusting_another_ca_is_refused_clearly(tls_etcd: EtcdServer, tmp_path: Path) -> None:
    other = make_pki(tmp_path / "other", name="other")
    config = StoreConfig(
        endpoints=(tls_etcd.endpoint,),
        ca_file=other.ca_file,
        cert_file=other.client_cert,
        key_file=other.client_key,
        timeout_s=3.0,
    )
    with pytest.raises(StoreError) as caught:
        Store.connect(config)
    print(caught.value)
    _assert_one_clear_line(caught.value, "TLS", tls_etcd.endpoint, "not signed by ca_file")


def test_plaintext_client_against_tls_etcd_is_refused_clearly(tls_etcd: EtcdServer) -> None:
    with pytest.raises(StoreError) as caught:
        Store.connect(StoreConfig(endpoints=(tls_etcd.endpoint,), timeout_s=3.0))
    print(caught.value)
    _assert_one_clear_line(caught.value, tls_etcd.endpoint, "TLS")


def test_missing_tls_file_is_named(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(StoreError) as caught:
        Store.connect(StoreConfig(endpoints=("127.0.0.1:2379",), ca_file=missing))
    _assert_one_clear_line(caught.value, "ca_file", missing)
