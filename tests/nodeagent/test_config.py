"""Config: file < environment < flags, unknown keys refused, plain TCP only on loopback; the CLI's --help."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nodeagent.daemon import cli
from nodeagent.daemon.config import from_sources
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
        [sys.executable, "-m", "nodeagent.daemon.cli", "--help"], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0 and "--allow-exec" in out.stdout and "--etcd" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "nodeagent.daemon.cli", "--listen", "10.1.2.3:5"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert bad.returncode == 2 and "loopback" in bad.stderr


def test_launch_keys_default_to_the_agents_own_interpreter_and_are_validated(tmp_path):
    cfg = from_sources(file=None, environ={})
    assert cfg.torchrun == (sys.executable, "-m", "torch.distributed.run")
    assert cfg.collective_ifname == "" and cfg.rdzv_port == 0
    env = {
        "RUNWARDEN_AGENT_TORCHRUN": "/opt/py/bin/python3 -m 'torch.distributed.run'",
        "RUNWARDEN_AGENT_COLLECTIVE_IFNAME": "eth1",
        "RUNWARDEN_AGENT_RDZV_PORT": "29400",
    }
    cfg = from_sources(file=None, environ=env)
    assert cfg.torchrun == ("/opt/py/bin/python3", "-m", "torch.distributed.run")
    assert (cfg.collective_ifname, cfg.rdzv_port) == ("eth1", 29400)
    parsed = cli.load(["--torchrun", "/usr/bin/torchrun", "--collective-ifname", "lo", "--rdzv-port", "0"])
    assert parsed.torchrun == ("/usr/bin/torchrun",) and parsed.collective_ifname == "lo"
    f = tmp_path / "a.toml"
    f.write_text('torchrun = ["/x/python", "-m", "torch.distributed.run"]\nadvertise = "[::1]:7"\n')
    cfg = from_sources(file=f, environ={})
    assert cfg.torchrun[0] == "/x/python" and cfg.advertised_host == "::1"


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("rdzv_port = 70000", "rdzv_port"),
        ("rdzv_port = -1", "rdzv_port"),
        ("collective_ifname = 'eth0/../x'", "collective_ifname"),
        ("collective_ifname = 'a-name-much-too-long'", "collective_ifname"),
        ("torchrun = ['']", "torchrun"),
        ("torchrun = 'python'", "torchrun"),
    ],
)
def test_bad_launch_keys_are_refused(tmp_path, text, words):
    f = tmp_path / "bad.toml"
    f.write_text(text + "\n")
    with pytest.raises(ConfigError) as err:
        from_sources(file=f, environ={})
    assert words in str(err.value)


def test_warm_preload_defaults_to_what_ddp_and_dcp_import_and_is_validated(tmp_path):
    cfg = from_sources(file=None, environ={})
    assert "torch._dynamo" in cfg.warm_preload and "torch.distributed.checkpoint" in cfg.warm_preload
    assert from_sources(file=None, environ={"RUNWARDEN_AGENT_WARM_PRELOAD": ""}).warm_preload == ()
    assert cli.load(["--warm-preload", "a.b,c"]).warm_preload == ("a.b", "c")
    f = tmp_path / "bad.toml"
    for bad in ('warm_preload = ["os; rm -rf /"]', 'warm_preload = ["a..b"]', "warm_preload = [1]"):
        f.write_text(bad + "\n")
        with pytest.raises(ConfigError, match="warm_preload"):
            from_sources(file=f, environ={})


def test_a_torchrun_flag_that_is_not_a_command_line_is_a_config_error():
    with pytest.raises(ConfigError, match="--torchrun"):
        cli.load(["--torchrun", "python 'unclosed"])


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("drain_handoff_s = -1", "drain_handoff_s"),
        ("drain_handoff_s = 4000", "drain_handoff_s"),
        ("drain_handoff_s = nan", "drain_handoff_s"),
        ("drain_timeout_s = 0", "drain_timeout_s"),
        ("drain_timeout_s = 100000", "drain_timeout_s"),
        ("drain_handoff_s = 60\ndrain_timeout_s = 30", "drain_timeout_s"),
        ("drain_timeout = 30", "unknown key"),
    ],
)
def test_bad_drain_keys_are_refused(tmp_path, text, words):
    f = tmp_path / "bad.toml"
    f.write_text(text + "\n")
    with pytest.raises(ConfigError) as err:
        from_sources(file=f, environ={})
    assert words in str(err.value)


def test_drain_keys_default_and_come_from_the_environment():
    cfg = from_sources(file=None, environ={})
    assert (cfg.drain_handoff_s, cfg.drain_timeout_s) == (15.0, 300.0)
    cfg = from_sources(
        file=None, environ={"RUNWARDEN_AGENT_DRAIN_HANDOFF_S": "0", "RUNWARDEN_AGENT_DRAIN_TIMEOUT_S": "2.5"}
    )
    assert (cfg.drain_handoff_s, cfg.drain_timeout_s) == (0.0, 2.5)


FLOAT_KEYS = (
    "stop_grace_s",
    "lease_ttl_s",
    "nvml_interval_s",
    "progress_interval_s",
    "dmesg_interval_s",
    "drain_handoff_s",
    "drain_timeout_s",
    "flight_recorder_timeout_s",
    "warm_wait_s",
)


@pytest.mark.parametrize("key", FLOAT_KEYS)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_durations_are_refused_with_the_key_named(tmp_path, key, value):
    """TOML has nan and inf literals, float() takes them from the environment: a fence that never
    kills (stop_grace_s = inf) or a lease that never expires must not load."""
    f = tmp_path / "a.toml"
    f.write_text(f"{key} = {value}\n")
    with pytest.raises(ConfigError, match=rf"nodeagent\.{key}: must be a finite number"):
        from_sources(file=f, environ={})
    with pytest.raises(ConfigError, match=rf"nodeagent\.{key}: must be a finite number"):
        from_sources(file=None, environ={f"RUNWARDEN_AGENT_{key.upper()}": value})


def test_every_float_key_is_covered_by_the_finite_test():
    import dataclasses

    from nodeagent.daemon.config import AgentConfig

    floats = {f.name for f in dataclasses.fields(AgentConfig) if f.type in ("float", float)}
    assert floats == set(FLOAT_KEYS)


def test_a_ranks_environment_is_no_agent_config(tmp_path):
    """Every variable the launcher gives a rank stays out of the agent's RUNWARDEN_AGENT_* prefix: an
    agent started from a rank's environment (a nested or restarted one) reads no key from it. The
    rank's agent socket was RUNWARDEN_AGENT_SOCKET, which made such an agent refuse to start."""
    from nodeagent.daemon.config import ENV_PREFIX, env_mapping
    from nodeagent.daemon.launcher import LaunchSpec, worker_env
    from nodeagent.trainer import agent_socket

    spec = LaunchSpec(
        run="r",
        attempt=1,
        node="n1",
        rendezvous_id="r-1",
        argv=("x",),
        env={},
        stop_file=tmp_path / "stop",
        fr_socket_dir=tmp_path / "fr",
        agent_socket="/run/runwarden/agent.sock",
    )
    env = worker_env(spec, {"RUNWARDEN_AGENT_NODE": "the agent's own"})
    assert not [k for k in env if k.startswith(ENV_PREFIX)] and env_mapping(env) == {}
    assert from_sources(file=None, environ=env).node != "the agent's own"
    assert agent_socket(env) == "/run/runwarden/agent.sock"
    assert agent_socket({"RUNWARDEN_AGENT_SOCKET": "/old.sock"}) == "/old.sock"  # an older agent's rank
    assert agent_socket({}) == ""
