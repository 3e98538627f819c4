"""No secret in logs, events or error messages: the controller runs against an etcd with auth and
an mTLS API (password and private keys configured), at DEBUG level, with good and with wrong
credentials; controllerctl is given a key that does not match its certificate. The etcd password,
any private key PEM and the key's base64 body must appear in none of their outputs."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from controller.ctl.main import main
from examples.cluster import write_toml
from runwarden.eventlog import read_events
from testbed.etcd_server import EtcdServer, free_port
from testbed.wait import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
PASSWORD = "pw-7f3a9c-never-in-a-log"
ROOT = Path(__file__).resolve().parents[2]


def _etcdctl(etcd: EtcdServer, *args: str) -> None:
    subprocess.run(
        ["etcdctl", f"--endpoints={etcd.client_url}", *args],
        check=True,
        capture_output=True,
        timeout=30,
        env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"},
    )


def _secrets(pki: Path) -> list[str]:
    out = [PASSWORD, "PRIVATE KEY"]
    for key in pki.glob("*.key"):
        body = [ln for ln in key.read_text().splitlines() if ln and not ln.startswith("-----")]
        out += [ln[:24] for ln in body]  # any piece of the base64 body
    return out


def _assert_clean(text: str, secrets: list[str], where: str) -> None:
    for s in secrets:
        assert s not in text, f"a secret ({s[:6]}...) appears in {where}"


def _controller(
    tmp: Path, etcd: EtcdServer, pki: Path, password: str
) -> tuple[subprocess.Popen[bytes], Path, Path]:
    run_dir = tmp / f"ctl-{password[:5]}"
    run_dir.mkdir()
    cfg = run_dir / "controller.toml"
    write_toml(
        cfg,
        {
            "store": {"endpoints": [etcd.endpoint], "user": "root", "password": password, "timeout_s": 3.0},
            "controller": {
                "run": "secretrun",
                "nodes": 1,
                "command": [sys.executable, "-c", "pass"],
                "run_dir": str(run_dir),
                "api_address": f"127.0.0.1:{free_port()}",
                "identity": "c1",
                "metrics_address": "",
            },
            "api_tls": {
                "cert": str(pki / "controller.pem"),
                "key": str(pki / "controller.key"),
                "ca": str(pki / "ca.pem"),
            },
            "agent_tls": {
                "cert": str(pki / "controller.pem"),
                "key": str(pki / "controller.key"),
                "ca": str(pki / "ca.pem"),
            },
        },
    )
    log = run_dir / "controller.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "controller.live.main", "run", "--config", str(cfg), "--log-level", "DEBUG"],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    return proc, log, run_dir


def test_no_secret_in_controller_logs_events_or_errors(
    etcd: EtcdServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pki = tmp_path / "pki"
    assert main(["certs", "init", str(pki)]) == 0
    assert main(["certs", "issue", str(pki), "controller", "--role", "server", "--host", "127.0.0.1"]) == 0
    assert main(["certs", "issue", str(pki), "alice", "--role", "admin"]) == 0
    assert main(["certs", "issue", str(pki), "other", "--role", "reader"]) == 0
    secrets = _secrets(pki)
    _etcdctl(etcd, "user", "add", "root", f"--new-user-password={PASSWORD}")
    _etcdctl(etcd, "auth", "enable")

    # good credentials: it runs (waits for nodes, elected, serves its API), then stops on SIGTERM
    proc, log, run_dir = _controller(tmp_path, etcd, pki, PASSWORD)
    events = run_dir / "events.jsonl"

    def leading() -> bool:  # elected, and its first event logged: it has run the paths that log
        assert proc.poll() is None, log.read_text()[-2000:]
        return "c1 is the leader" in log.read_text() and events.exists() and bool(read_events(events).entries)

    wait_until(
        leading, 60, "the controller to lead and log its first event", detail=lambda: log.read_text()[-2000:]
    )
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    text = log.read_text()
    assert text.strip(), "the controller logged nothing"
    _assert_clean(text, secrets, "the controller's DEBUG log")
    _assert_clean(events.read_text(), secrets, "the event log")
    assert read_events(events).errors == []

    # wrong password: it fails with a clear message that names neither the right nor the wrong one
    wrong = "wrong-" + PASSWORD
    proc, log, _ = _controller(tmp_path, etcd, pki, wrong)
    assert proc.wait(timeout=60) != 0
    text = log.read_text()
    assert "credential" in text.lower() or "auth" in text.lower(), text[-1500:]
    _assert_clean(text, [*secrets, wrong], "the controller's error output")

    # controllerctl with a key that does not match its certificate: refused, key not echoed
    capsys.readouterr()
    rc = main(
        [
            "--controller",
            "127.0.0.1:1",
            "--ca",
            str(pki / "ca.pem"),
            "--cert",
            str(pki / "alice.pem"),
            "--key",
            str(pki / "other.key"),
            "status",
        ]
    )
    out = capsys.readouterr()
    assert rc != 0
    _assert_clean(out.out + out.err, secrets, "controllerctl's error")
