"""Bad input gives one clear StoreError line: malformed endpoints, unreachable etcd, wrong credentials."""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from typing import Any

import pytest

from runwarden import net
from runwarden.store import Relisted, Store, StoreConfig, StoreError, StoreUnavailable, WatchEvent
from testbed.etcd_server import EtcdServer
from testbed.wait import wait_until

PASSWORD = "s3cret-Passw0rd"


def _assert_one_clear_line(err: StoreError, *words: str) -> None:
    text = str(err)
    assert text and "\n" not in text and "Traceback" not in text, text
    assert err.__cause__ is None and (err.__context__ is None or err.__suppress_context__)
    assert PASSWORD not in text and "wrong-password" not in text
    for word in words:
        assert word in text, text


@pytest.mark.parametrize(
    ("endpoints", "words"),
    [
        (("localhost",), ["'localhost'", "host:port"]),
        (("127.0.0.1:",), ["host:port"]),
        (("127.0.0.1:99999",), ["99999", "1..65535"]),
        (("127.0.0.1:0",), ["outside 1..65535"]),
        (("ftp://127.0.0.1:2379",), ["scheme", "'ftp'"]),
        (("http://a:1", "https://b:2"), ["mix"]),
        (("has space:2379",), ["host:port"]),
        ((), ["non-empty"]),
        ((2379,), ["must be a string"]),
    ],
)
def test_malformed_endpoints(endpoints: tuple[object, ...], words: list[str]) -> None:
    with pytest.raises(StoreError) as caught:
        StoreConfig(endpoints=endpoints)  # deliberately wrong types too
    _assert_one_clear_line(caught.value, *words)


def test_other_bad_config_values() -> None:
    cases: list[tuple[dict[str, object], str]] = [
        ({"user": "root"}, "user and password"),
        ({"cert_file": "c.pem"}, "cert_file and key_file"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"root": "runwarden"}, "root"),
        ({"root": "/a//b"}, "root"),
        ({"endpoints": ("http://127.0.0.1:2379",), "ca_file": "ca.pem"}, "http://"),
    ]
    for kwargs, word in cases:
        kwargs.setdefault("endpoints", ("127.0.0.1:2379",))
        with pytest.raises(StoreError) as caught:
            StoreConfig(**kwargs)
        _assert_one_clear_line(caught.value, word)


def test_accepted_endpoint_forms() -> None:
    endpoints = ["http://127.0.0.1:2379", "[::1]:2380", "etcd-0.etcd.svc:2379/"]
    config = StoreConfig(endpoints=endpoints)  # a TOML list is accepted
    assert [e.address for e in config.parsed_endpoints()] == [
        "127.0.0.1:2379",
        "[::1]:2380",
        "etcd-0.etcd.svc:2379",
    ]
    assert not config.secure
    assert StoreConfig(endpoints=("https://127.0.0.1:2379",)).secure
    assert PASSWORD not in repr(StoreConfig(endpoints=("a:1",), user="u", password=PASSWORD))


def test_unreachable_etcd(free_port: int) -> None:
    endpoint = f"127.0.0.1:{free_port}"
    started = time.monotonic()
    with pytest.raises(StoreUnavailable) as caught:
        Store.connect(StoreConfig(endpoints=(endpoint,), timeout_s=5.0))
    assert time.monotonic() - started < 4.0, "a refused connection should fail fast, not wait for the timeout"
    print(caught.value)
    _assert_one_clear_line(caught.value, "cannot reach etcd", endpoint)


def test_unreachable_etcd_among_several_names_each(free_port: int, etcd: EtcdServer) -> None:
    dead = f"127.0.0.1:{free_port}"
    with Store.connect(StoreConfig(endpoints=(dead, etcd.endpoint))) as store:
        assert store.put(store.keys.node("n"), b"v") > 0  # the live endpoint is used
    etcd.kill()
    with pytest.raises(StoreUnavailable) as caught:
        Store.connect(StoreConfig(endpoints=(dead, etcd.endpoint), timeout_s=2.0))
    _assert_one_clear_line(caught.value, dead, etcd.endpoint)


def _etcdctl(etcd: EtcdServer, *args: str) -> None:
    subprocess.run(
        ["etcdctl", f"--endpoints={etcd.client_url}", *args],
        check=True,
        capture_output=True,
        timeout=30,
        env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"},
    )


@pytest.fixture
def auth_etcd(etcd: EtcdServer) -> EtcdServer:
    _etcdctl(etcd, "user", "add", "root", f"--new-user-password={PASSWORD}")
    _etcdctl(etcd, "auth", "enable")
    return etcd


def test_wrong_credentials(auth_etcd: EtcdServer) -> None:
    with pytest.raises(StoreError) as caught:
        Store.connect(StoreConfig(endpoints=(auth_etcd.endpoint,), user="root", password="wrong-password"))
    print(caught.value)
    _assert_one_clear_line(caught.value, "rejected the credentials", "'root'", auth_etcd.endpoint)

    with pytest.raises(StoreError) as caught:
        Store.connect(StoreConfig(endpoints=(auth_etcd.endpoint,)))
    print(caught.value)
    _assert_one_clear_line(caught.value, "requires authentication")


def test_right_credentials_survive_an_etcd_restart(auth_etcd: EtcdServer) -> None:
    config = StoreConfig(endpoints=(auth_etcd.endpoint,), user="root", password=PASSWORD)
    with Store.connect(config) as store:
        seen: list[WatchEvent | Relisted] = []
        watch = store.watch_prefix(store.keys.nodes_prefix(), None, seen.append)
        store.put(store.keys.node("n1"), b"v")
        auth_etcd.kill()
        auth_etcd.start()  # etcd forgets its simple auth tokens: the store and the watch log in again
        kv = store.get(store.keys.node("n1"))
        assert kv is not None and kv.value == b"v"
        revision = store.put(store.keys.node("n2"), b"w")
        wait_until(lambda: watch.next_revision > revision, 10, "the watch to resume after logging in again")
        assert [(e.key, e.value) for e in seen if isinstance(e, WatchEvent)] == [
            (store.keys.node("n1"), b"v"),
            (store.keys.node("n2"), b"w"),
        ]


def test_credentials_for_etcd_without_auth(etcd: EtcdServer) -> None:
    with pytest.raises(StoreError) as caught:
        Store.connect(StoreConfig(endpoints=(etcd.endpoint,), user="root", password=PASSWORD))
    _assert_one_clear_line(caught.value, "does not have authentication enabled")


def test_connect_waits_for_an_etcd_that_is_not_up_yet(free_port: int, etcd_factory: Any) -> None:
    """`wait_s`: an endpoint that does not answer yet is tried again until it does (a daemon starting
    with its host); without it the first failure is the answer."""
    endpoint = f"127.0.0.1:{free_port}"
    config = StoreConfig(endpoints=(endpoint,), timeout_s=1.0)
    with pytest.raises(StoreUnavailable):
        Store.connect(config)
    tries = threading.Event()
    result: list[Store | BaseException] = []

    class _Tries(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "trying again" in record.getMessage():
                tries.set()

    handler = _Tries()
    logging.getLogger("runwarden.store.client").addHandler(handler)

    def connect() -> None:
        try:
            result.append(Store.connect(config, wait_s=60.0))
        except BaseException as exc:
            result.append(exc)

    thread = threading.Thread(target=connect, daemon=True)
    try:
        thread.start()
        assert tries.wait(30), "no failed try was logged"
        etcd_factory(client_port=free_port, peer_port=net.free_port(), metrics_port=net.free_port())
        thread.join(timeout=60)
    finally:
        logging.getLogger("runwarden.store.client").removeHandler(handler)
    assert len(result) == 1 and isinstance(result[0], Store), result
    with result[0] as store:
        assert store.put(store.keys.node("n"), b"v") > 0
