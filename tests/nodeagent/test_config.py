"""Config: file < environment < flags, unknown keys refused, plain TCP only on loopback; the CLI's --help."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nodeagent import cli
from nodeagent.config import from_sources
from runwarden.config import ConfigError
from tests.nodeagent.helpers import ROOT


def test_precedence_file_env_flags(tmp_path):
    f = tmp_path / "a.toml"
    f.write_text(
        'node = "from-file"\nlease_ttl_s = 7\nprogress_interval_s = 3\nallowed_executables = ["/bin/a"]\n'
    )
    env = {
        "RUNWARDEN_AGENT_LEASE_TTL_S": "9",
        "RUNWARDEN_AGENT_ALLOWED_EXECUTABLES": "/bin/b,/bin/c",
        "RUNWARDEN_AGENT_PROGRESS_INTERVAL_S": "2",
    }
    cfg = from_sources(file=f, environ=env, flags={"progress_interval_s": 0.5, "node": None})
    assert cfg.node == "from-file" and cfg.lease_ttl_s == 9.0 and cfg.progress_interval_s == 0.5
    assert cfg.allowed_executables == ("/bin/b", "/bin/c")
    parsed = cli.load(["--config", str(f), "--etcd", "127.0.0.1:1", "--etcd", "127.0.0.1:2", "--chaos"])
    assert parsed.etcd_endpoints == ("127.0.0.1:1", "127.0.0.1:2") and parsed.chaos_enabled


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("nodee = 'x'", "unknown key(s) nodee"),
        ("lease_ttl_s = 0", "lease_ttl_s"),
        ("lease_ttl_s = 'soon'", "expected a number"),
        ("kernel_log = 'syslog'", "kernel_log"),
        ("listen = '0.0.0.0:50051'", "loopback"),
        ("listen = 'nonsense'", "host:port"),
        ("tls_cert = '/c.pem'", "go together"),
    ],
)
def test_bad_config_is_refused_with_the_key_named(tmp_path, text, words):
    f = tmp_path / "bad.toml"
    f.write_text(text + "\n")
    with pytest.raises(ConfigError) as err:
        from_sources(file=f, environ={})
    assert words in str(err.value)


def test_non_loopback_allowed_with_tls(tmp_path):
    cfg = from_sources(
        file=None,
        environ={},
        flags={"listen": "0.0.0.0:1", "tls_cert": "c", "tls_key": "k", "tls_client_ca": "ca"},
    )
    assert cfg.tls_enabled and cfg.advertise == "0.0.0.0:1"


def test_cli_help_and_config_error_exit_code(tmp_path):
    env = {"PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "nodeagent.cli", "--help"], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0 and "--allow-exec" in out.stdout and "--etcd" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "nodeagent.cli", "--listen", "10.1.2.3:5"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert bad.returncode == 2 and "loopback" in bad.stderr
