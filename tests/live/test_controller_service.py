"""`controller run` as a systemd service, on a real process against a real etcd: READY=1 and
WATCHDOG=1 on $NOTIFY_SOCKET (as deploy/systemd/controller.service expects), and SIGHUP re-reading
the config file's [policy] into etcd, a bad file refused with a log line and nothing changed."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from controller.api import policy as policy_store
from runwarden.keys import run_election
from runwarden.store import Store
from testbed.etcd_server import EtcdServer

ROOT = Path(__file__).resolve().parents[2]
RUN = "svc"


def _config(etcd: EtcdServer, run_dir: Path, policy: str) -> str:
    return f"""
[store]
endpoints = ["{etcd.endpoint}"]
[controller]
run = "{RUN}"
nodes = 1
command = ["true"]
run_dir = "{run_dir}"
api_address = "127.0.0.1:0"
tick_s = 0.1
[policy]
{policy}
"""


def _until(what: str, cond: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_controller_run_notifies_systemd_and_rereads_its_policy_on_sighup(
    etcd: EtcdServer, store: Store, tmp_path: Path
) -> None:
    cfg = tmp_path / "controller.toml"
    cfg.write_text(_config(etcd, tmp_path / "run", "hang_timeout_floor_s = 30"))
    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(20)
    log = tmp_path / "controller.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "controller.live.main", "run", "--config", str(cfg)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={"PATH": "/usr/bin:/bin", "NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "1000000"},
        )
    try:
        first = sock.recv(4096).decode().splitlines()
        assert first[0] == "READY=1" and first[1].startswith("STATUS=")
        pings = [sock.recv(4096) for _ in range(2)]
        assert pings == [b"WATCHDOG=1", b"WATCHDOG=1"]  # every WatchdogSec/2 while the loop turns

        def floor() -> float | None:
            got = policy_store.read(store, RUN)
            return got.config.hang_timeout_floor_s if got is not None else None

        _until("the leader to seed the policy", lambda: floor() == 30.0)
        cfg.write_text(_config(etcd, tmp_path / "run", "hang_timeout_floor_s = 5"))
        proc.send_signal(signal.SIGHUP)
        _until("SIGHUP to store the file's policy", lambda: floor() == 5.0)
        stored = policy_store.read(store, RUN)
        assert stored is not None and "SIGHUP" in stored.record.changed_by

        cfg.write_text(_config(etcd, tmp_path / "run", "hang_timeout_floor_s = -1"))
        proc.send_signal(signal.SIGHUP)
        _until(
            "the refusal in the log",
            lambda: b"SIGHUP: " in log.read_bytes() and b"unchanged" in log.read_bytes(),
        )
        text = log.read_text()
        assert (
            "hang_timeout_floor_s: must be a finite number >= 0" in text and "the policy is unchanged" in text
        )
        after = policy_store.read(store, RUN)
        assert after is not None and after.revision == stored.revision  # nothing written
        assert proc.poll() is None  # a bad file is a log line, never an exit

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        while (msg := sock.recv(4096)) == b"WATCHDOG=1":
            pass
        assert msg == b"STOPPING=1"
        # it resigned on the way out: a standby would lead at once, not after the election TTL
        assert store.get_prefix(store.keys.election(run_election(RUN)))[0] == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        sock.close()
