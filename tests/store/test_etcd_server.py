"""The private etcd: start/stop by PID, restart on the same data dir and port, port clashes, no strays."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from runwarden.store import Store, StoreConfig
from testbed import etcd_server
from testbed.etcd_server import EtcdServer, EtcdServerError
from testbed.wait import wait_until
from tests.store.helpers import REPO


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead too
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_stop_and_kill_leave_no_process_and_restart_keeps_data_and_port(tmp_path: Path) -> None:
    server = EtcdServer(tmp_path / "data", fast=True).start()
    endpoint, pid = server.endpoint, server.pid
    assert pid is not None and _alive(pid)
    with Store.connect(StoreConfig(endpoints=(endpoint,))) as store:
        store.put(store.keys.spec("r"), b"kept")
        server.kill()
        assert not _alive(pid) and not server.running
        server.start()
        assert server.endpoint == endpoint and server.pid != pid
        kv = store.get(store.keys.spec("r"))
        assert kv is not None and kv.value == b"kept"
    pid = server.pid
    assert pid is not None
    server.restart()
    assert not _alive(pid)
    pid = server.pid
    assert pid is not None
    server.stop()
    assert not _alive(pid)
    server.stop()  # idempotent


def test_discard_kills_it_and_deletes_its_data_but_keeps_its_log(tmp_path: Path) -> None:
    server = EtcdServer(tmp_path / "data", fast=True).start()
    pid = server.pid
    assert pid is not None and (tmp_path / "data" / "member" / "wal").is_dir()
    server.discard()
    assert not _alive(pid) and not server.running
    assert not (tmp_path / "data").exists()
    assert server.log_path.is_file() and server.log_path.stat().st_size > 0


def test_a_new_server_object_reopens_an_existing_data_dir(tmp_path: Path) -> None:
    with (
        EtcdServer(tmp_path / "data", fast=True) as first,
        Store.connect(StoreConfig(endpoints=(first.endpoint,))) as s,
    ):
        s.put(s.keys.spec("r"), b"v")
    with (
        EtcdServer(tmp_path / "data", fast=True) as second,
        Store.connect(StoreConfig(endpoints=(second.endpoint,))) as s,
    ):
        kv = s.get(s.keys.spec("r"))
        assert kv is not None and kv.value == b"v"


def test_port_clash_on_first_start_is_retried_with_new_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        picks = iter([(taken, etcd_server.free_port(), etcd_server.free_port())])
        real = etcd_server._three_free_ports
        monkeypatch.setattr(etcd_server, "_three_free_ports", lambda: next(picks, None) or real())
        with EtcdServer(tmp_path / "data", fast=True) as server:
            assert server.client_port != taken
            assert server.running


def test_fixed_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        server = EtcdServer(
            tmp_path / "data",
            fast=True,
            client_port=taken,
            peer_port=etcd_server.free_port(),
            metrics_port=etcd_server.free_port(),
        )
        with pytest.raises(EtcdServerError, match="in use"):
            server.start()
        assert not server.running


def test_etcd_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    script = (
        "import sys, time\n"
        "from testbed.etcd_server import EtcdServer\n"
        f"server = EtcdServer({str(tmp_path / 'data')!r}, fast=True).start()\n"
        "print(server.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    try:
        assert owner.stdout is not None
        etcd_pid = int(owner.stdout.readline())
        assert _alive(etcd_pid)
        owner.kill()  # no atexit, no __exit__: only the parent-death signal can clean up
        owner.wait()
        wait_until(lambda: not _alive(etcd_pid), 5, "etcd to die with its owner")
    finally:
        if owner.poll() is None:
            owner.kill()
        owner.wait()
        if owner.stdout is not None:
            owner.stdout.close()


def test_missing_binary_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(EtcdServerError, match="not found"):
        EtcdServer(tmp_path / "data", binary="no-such-etcd-binary").start()


def test_endpoint_before_start_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(EtcdServerError, match="not been started"):
        _ = EtcdServer(tmp_path / "data").endpoint
