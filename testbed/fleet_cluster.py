"""A whole runwarden deployment across a `Fleet` of network-namespace hosts (`FleetCluster`), for
tests, bench and drills: etcd on host ``etcd``, the controller on ``ctl`` (a standby on ``ctlb``),
each node agent on its own host, every one the real program with its real CLI and config, started
under ``ip netns exec`` as systemd would start it. Every listener off loopback speaks mTLS
(`runwarden.certs`). The config builders `examples/cluster.py`'s `LocalCluster` shares
(`ClusterSpec`, `write_toml`, `program`, `agent_settings`, ...) live here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runwarden import certs
from runwarden.eventlog import LogEntry, read_events
from runwarden.keys import KeySchema, run_election
from testbed.etcd_server import EtcdServer, EtcdTls
from testbed.fleet import Fleet, FleetError, Host, crash

REPO = Path(__file__).resolve().parents[1]
ETCD_CLIENT_PORT, ETCD_PEER_PORT, ETCD_METRICS_PORT = 2379, 2380, 2381
AGENT_PORT = 50051
RDZV_PORT = 29400
API_PORT = 7070
METRICS_PORT = 9090
_MODULES = {
    "nodeagent": "nodeagent.daemon.cli",
    "controller": "controller.live.main",
    "controllerctl": "controller.ctl.main",
}

# -- shared with examples/cluster.py's LocalCluster ---------------------------------------------


# A controller host's install to take `controller` and `controllerctl` from, not this interpreter's:
# scripts/test_compat.sh points it at a virtualenv with the wheel and no torch.
ENV_CONTROLLER_BIN = "RUNWARDEN_TESTBED_CONTROLLER_BIN"


def program(name: str) -> list[str]:
    """The argv prefix of one of runwarden's programs: the console script beside this interpreter
    (for the controller's, in $RUNWARDEN_TESTBED_CONTROLLER_BIN when set), or
    ``python -m <module>`` when it is not installed."""
    controller_bin = os.environ.get(ENV_CONTROLLER_BIN, "")
    if controller_bin and name in ("controller", "controllerctl"):
        return [str(Path(controller_bin) / name)]
    exe = Path(sys.executable).parent / name
    return [str(exe)] if exe.exists() else [sys.executable, "-m", _MODULES[name]]


def start_controller(config: Path, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    """`controller run --config CONFIG [extra...]` in its own session, stdout and stderr to `log`."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [*program("controller"), "run", "--config", str(config), *extra],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            start_new_session=True,
        )


def controllerctl(address: str, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """`controllerctl --controller ADDRESS args...` (plaintext, loopback test controllers)."""
    return subprocess.run(
        [*program("controllerctl"), "--controller", address, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def _toml(value: object) -> str:
    return json.dumps(value) if not isinstance(value, bool) else ("true" if value else "false")


def write_toml(path: Path, sections: dict[str, dict[str, object]]) -> None:
    """Flat TOML: section name -> key -> value (JSON-compatible scalars and lists; "" = top level)."""
    lines: list[str] = []
    for name, table in sections.items():
        if name:
            lines.append(f"[{name}]")
        for key, value in table.items():
            lines.append(f"{key} = {_toml(value)}")
        lines.append("")
    path.write_text("\n".join(lines))


@dataclass(kw_only=True)
class ClusterSpec:
    run: str = "demo"
    active: int = 4
    spares: int = 2
    steps: int = 100_000
    ckpt_every: int = 10
    step_sleep: float = 0.05
    lease_ttl_s: float = 2.0
    seed: int = 1234
    train_args: tuple[str, ...] = ()
    policy: dict[str, object] = field(default_factory=dict)
    # every agent keeps a parked group (nodeagent/warm/rank.py); None: the agent's shipped default (on)
    warm_workers: bool | None = None
    # the agents' and the controller's clocks at their shipped defaults (lease TTL, progress interval,
    # stop grace, drain hand-off, restart backoff, dump and startup timeouts, queue wait), as a user's
    # deployment runs them; False: the test clusters' short ones (lease_ttl_s above among them)
    shipped_timings: bool = False
    # the job, relative to the repository (it takes examples/train.py's flags: examples/decoder.py does)
    script: str = "examples/train.py"


def preflight_settings(ckpt_dir: Path, *, nics: Sequence[str] = ()) -> dict[str, dict[str, object]]:
    """The test clusters' preflight config. Before every attempt the quick preflight checks the
    kernel log, the counters, storage and network; compute and the all-reduce run in the full
    preflight. On a GPU node the quick mode includes the matmul too: here 2 CPU cores would spend
    seconds on it per node. A burn-in runs every stage of the burn-in pipeline on its CPU path, cut
    to about the cost of the full preflight it replaced (0.3 s of matmul loop and of all-reduce
    soak, a 4 MiB memory test). `nics`: interfaces that must be up (() = physical ones)."""
    settings: dict[str, dict[str, object]] = {
        "compute": {"modes": ["full"], "size_cpu": 128, "iterations_cpu": 2},
        "collective": {
            "modes": ["full"],
            "size_bytes_cpu": 1 << 20,
            "iterations": 3,
            "cpu_processes": 2,
        },
        "storage": {"checkpoint_path": str(ckpt_dir), "free_space_floor_gb": 0.1},
        "burn_in": {
            "matmul_duration_s_cpu": 0.3,
            "matmul_size_cpu": 128,
            "memory_mb_cpu": 4,
            "allreduce_duration_s_cpu": 0.3,
            # Several clusters' gloo ranks share two cores here: bandwidth swings are load, not a link.
            "allreduce_min_ratio": 0.1,
            "stage_slack_s": 60.0,
        },
    }
    if nics:
        settings["network"] = {"nics": list(nics)}
    return settings


def agent_settings(
    node: str,
    spec: ClusterSpec,
    *,
    listen: str,
    state_dir: Path,
    etcd_endpoints: Sequence[str],
    preflight_config: Path,
) -> dict[str, object]:
    """A test agent's config keys (top level of nodeagent.toml); callers add TLS keys."""
    settings: dict[str, object] = {
        "node": node,
        "listen": listen,
        "unix_socket": str(state_dir / "agent.sock"),
        "etcd_endpoints": list(etcd_endpoints),
        "kernel_log": "none",
        "nvml_interval_s": 0.0,
        "allowed_executables": [sys.executable],
        "chaos_enabled": True,
        "metrics_listen": "",
        "run_dir": str(state_dir / "run"),
        "local_ranks": 1,
        "preflight_config": str(preflight_config),
    }
    if not spec.shipped_timings:
        settings.update(
            lease_ttl_s=spec.lease_ttl_s,
            progress_interval_s=0.5,
            stop_grace_s=5.0,
            drain_handoff_s=3.0,  # a SIGTERM'd test agent stops its ranks itself if no controller does
        )
    if spec.warm_workers is not None:
        settings["warm_workers"] = spec.warm_workers
    return settings


def controller_settings(
    spec: ClusterSpec,
    *,
    store: dict[str, object],
    run_dir: Path,
    ckpt_dir: Path,
    loss_dir: Path,
    api_address: str,
    metrics_address: str,
) -> dict[str, dict[str, object]]:
    """A test controller's config (controller.toml sections) running the spec's script."""
    # torchrun runs the script with its own interpreter: the command starts at the script.
    command = [
        str(REPO / spec.script),
        "--steps",
        str(spec.steps),
        "--ckpt-dir",
        str(ckpt_dir),
        "--ckpt-every",
        str(spec.ckpt_every),
        "--out",
        str(loss_dir),
        "--seed",
        str(spec.seed),
        "--step-sleep",
        str(spec.step_sleep),
        *spec.train_args,
    ]
    policy: dict[str, object] = {
        "burn_in_passes": 1,
        # No all-reduce soak with neighbours: six agents' gloo ranks share two cores here, so a pair's
        # figure is the machine's load, not a link (tests/live/test_bandwidth.py runs the soak for real).
        "burn_in_soak_neighbours": 0,
    }
    if not spec.shipped_timings:
        policy.update(
            backoff_base_s=0.5,
            backoff_max_s=5.0,
            stop_grace_s=5.0,
            dump_timeout_s=3.0,
            queue_wait_s=5.0,
            startup_timeout_s=120.0,
        )
    policy.update(spec.policy)
    return {
        "store": store,
        "controller": {
            "run": spec.run,
            "nodes": spec.active,
            "command": command,
            "run_dir": str(run_dir),
            "api_address": api_address,
            "identity": "controller-a",
            "election_ttl_s": 3.0,
            "metrics_address": metrics_address,
        },
        "controller.env": {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        "policy": policy,
    }


def parse_status(stdout: str) -> dict[str, object]:
    """The first run of ``controllerctl status --json`` ({} when there is none)."""
    data = json.loads(stdout)
    runs = data.get("runs", []) if isinstance(data, dict) else data
    return runs[0] if runs else {}


def wait_for_event(
    event_log: Path,
    kind: int,
    after_seq: int,
    timeout_s: float,
    pred: Callable[[LogEntry], bool] | None = None,
) -> LogEntry | None:
    """The first event of `kind` after `after_seq` in the log (matching `pred`), or None in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for ev in read_events(event_log).entries:
            if ev.seq > after_seq and ev.kind == kind and (pred is None or pred(ev)):
                return ev
        time.sleep(0.2)
    return None


# -- the cluster across a fleet -----------------------------------------------------------------


class ClusterBase:
    """What LocalCluster and FleetCluster share: the run's layout under `root`, reading its event log,
    `controllerctl status`, and the agent processes' restart/kill (each subclass starts them)."""

    root: Path
    spec: ClusterSpec
    agents: dict[str, subprocess.Popen[bytes]]

    @property
    def run_dir(self) -> Path:
        return self.root / "controller"

    @property
    def event_log(self) -> Path:
        return self.run_dir / "events.jsonl"

    @property
    def ckpt_dir(self) -> Path:
        return self.root / "checkpoints"

    @property
    def loss_dir(self) -> Path:
        return self.root / "losses"

    def ctl(self, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        raise NotImplementedError

    def start_agent(self, node: str) -> None:
        raise NotImplementedError

    def status(self) -> dict[str, object]:
        out = self.ctl("status", "--json")
        return parse_status(out.stdout) if out.returncode == 0 else {}

    def events(self) -> list[LogEntry]:
        return read_events(self.event_log).entries

    def wait_for_event(
        self,
        kind: int,
        after_seq: int,
        timeout_s: float,
        pred: Callable[[LogEntry], bool] | None = None,
    ) -> LogEntry | None:
        return wait_for_event(self.event_log, kind, after_seq, timeout_s, pred)

    def restart_agent(self, node: str) -> None:
        """What systemd's Restart=always does for a dead agent."""
        p = self.agents.get(node)
        if p is None or p.poll() is not None:
            self.start_agent(node)

    def reboot_agent(self, node: str) -> None:
        """The end of a repair: the host's agent stops (SIGINT: its workers now) and starts afresh,
        without the fatal evidence the old one held."""
        p = self.agents.get(node)
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGINT)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.start_agent(node)

    def kill_agent_process(self, node: str) -> None:
        p = self.agents.get(node)
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()


class FleetCluster(ClusterBase):
    """etcd, a controller (and optionally a standby) and one agent per node, each on its own host of
    `fleet`. `start()` / `stop()` or a context manager; `stop()` leaves no process on its hosts
    (the fleet itself, and its namespaces, belong to the caller).

    etcd serves clients on ``<etcd address>:2379`` and demands client certificates; each agent listens
    on ``<its address>:50051`` and advertises that. The Controller API (mTLS too) and /metrics stay on
    the controller host's loopback (127.0.0.1:7070 and :9090), so `ctl` runs ``controllerctl`` on that
    host with an admin certificate. The run directory under `root` is an ordinary directory: the
    namespaces share the filesystem, which makes it the cluster's shared filesystem.
    """

    def __init__(
        self, fleet: Fleet, root: Path, spec: ClusterSpec | None = None, *, standby: bool = False
    ) -> None:
        self.fleet = fleet
        self.root = root.resolve()
        self.spec = spec or ClusterSpec()
        self.with_standby = standby
        self.nodes = [f"node{i + 1}" for i in range(self.spec.active + self.spec.spares)]
        self.hosts: dict[str, Host] = {}
        self.etcd: subprocess.Popen[bytes] | None = None
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.controller: subprocess.Popen[bytes] | None = None
        self.standby: subprocess.Popen[bytes] | None = None

    # -- hosts and paths ----------------------------------------------------------------------

    @property
    def etcd_host(self) -> Host:
        return self.hosts["etcd"]

    @property
    def controller_host(self) -> Host:
        return self.hosts["ctl"]

    @property
    def standby_host(self) -> Host:
        return self.hosts["ctlb"]

    def host(self, node: str) -> Host:
        """The host agent `node` runs on."""
        return self.hosts[node]

    @property
    def etcd_endpoint(self) -> str:
        return f"https://{self.etcd_host.address}:{ETCD_CLIENT_PORT}"

    @property
    def certs_dir(self) -> Path:
        return self.root / "certs"

    def state_dir(self, node: str) -> Path:
        return self.root / "nodes" / node

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> FleetCluster:
        """Hosts, certificates, etcd (healthy before anything else starts), the agents, the
        controller(s). Does not wait for the agents: see `wait_registered`."""
        if self.root.exists():
            shutil.rmtree(self.root)
        for d in (self.root, self.run_dir, self.ckpt_dir, self.loss_dir):
            d.mkdir(parents=True, exist_ok=True)
        names = ["etcd", "ctl", *(["ctlb"] if self.with_standby else []), *self.nodes]
        for name in names:
            self.hosts[name] = self.fleet.hosts.get(name) or self.fleet.add_host(name)
        self._issue_certs()
        self.start_etcd()
        write_toml(self.root / "preflight.toml", preflight_settings(self.ckpt_dir, nics=["eth0"]))
        for node in self.nodes:
            self.start_agent(node)
        self._write_controller_config()
        self.controller = self._start_controller(self.controller_host, "controller-a")
        if self.with_standby:
            self.standby = self._start_controller(self.standby_host, "controller-b")
        return self

    def __enter__(self) -> FleetCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _issue_certs(self) -> None:
        d = self.certs_dir
        certs.create_ca(d, name=f"{self.fleet.prefix} fleet CA", overwrite=True)
        certs.issue(d, "etcd", role="server", hosts=[self.etcd_host.address, "127.0.0.1"])
        controllers = [self.controller_host] + ([self.standby_host] if self.with_standby else [])
        certs.issue(d, "controller", role="server", hosts=[h.address for h in controllers] + ["127.0.0.1"])
        for node in self.nodes:
            certs.issue(d, node, role="server", hosts=[self.host(node).address])
        certs.issue(d, "admin", role="admin")  # controllerctl: the API and the agents' InjectFault

    def _tls(self, stem: str) -> tuple[str, str, str]:
        """(ca, cert, key) paths of a certificate issued by `_issue_certs`."""
        d = self.certs_dir
        return str(d / "ca.pem"), str(d / f"{stem}.pem"), str(d / f"{stem}.key")

    def start_etcd(self, timeout_s: float = 20.0) -> None:
        """etcd on its host (TLS, client certificates required), waiting until /health says true."""
        ca, cert, key = self._tls("etcd")
        server = EtcdServer(
            self.root / "etcd" / "data",
            fast=True,
            tls=EtcdTls(cert_file=cert, key_file=key, ca_file=ca),
            client_port=ETCD_CLIENT_PORT,
            peer_port=ETCD_PEER_PORT,
            metrics_port=ETCD_METRICS_PORT,
        )
        # The harness's own flags, moved off loopback: clients and peers on the host's address,
        # the plain-HTTP metrics/health listener stays on the host's own loopback.
        address = self.etcd_host.address
        argv = [
            a.replace(f"127.0.0.1:{ETCD_CLIENT_PORT}", f"{address}:{ETCD_CLIENT_PORT}").replace(
                f"127.0.0.1:{ETCD_PEER_PORT}", f"{address}:{ETCD_PEER_PORT}"
            )
            for a in server.command()
        ]
        log = (self.root / "etcd.log").open("ab")
        self.etcd = self.etcd_host.popen(argv, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout_s
        while not self.etcd_host.call(_etcd_healthy, ETCD_METRICS_PORT):
            if self.etcd.poll() is not None or time.monotonic() > deadline:
                tail = (self.root / "etcd.log").read_text(errors="replace")[-1500:]
                raise FleetError(f"etcd on {address} did not become healthy: {tail}")
            time.sleep(0.05)

    def kill_etcd(self) -> None:
        """SIGKILL etcd (a crash); `start_etcd()` brings it back on the same data."""
        if self.etcd is not None and self.etcd.poll() is None:
            self.etcd.kill()
            self.etcd.wait()

    def agent_config(self, node: str) -> Path:
        state = self.state_dir(node)
        state.mkdir(parents=True, exist_ok=True)
        ca, cert, key = self._tls(node)
        settings = agent_settings(
            node,
            self.spec,
            listen=f"{self.host(node).address}:{AGENT_PORT}",
            state_dir=state,
            etcd_endpoints=[self.etcd_endpoint],
            preflight_config=self.root / "preflight.toml",
        )
        settings |= {
            "tls_cert": cert,
            "tls_key": key,
            "tls_client_ca": ca,
            "etcd_tls_ca": ca,
            "etcd_tls_cert": cert,
            "etcd_tls_key": key,
        }
        settings |= _cross_host_settings()
        path = state / "nodeagent.toml"
        write_toml(path, {"": settings})
        return path

    def start_agent(self, node: str) -> None:
        cfg = self.agent_config(node)
        with (self.state_dir(node) / "agent.log").open("ab") as log:
            self.agents[node] = self.host(node).popen(
                [*program("nodeagent"), "--config", str(cfg)],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                start_new_session=True,
            )

    def _write_controller_config(self) -> None:
        ca, cert, key = self._tls("controller")
        settings = controller_settings(
            self.spec,
            store={"endpoints": [self.etcd_endpoint], "ca_file": ca, "cert_file": cert, "key_file": key},
            run_dir=self.run_dir,
            ckpt_dir=self.ckpt_dir,
            loss_dir=self.loss_dir,
            api_address=f"127.0.0.1:{API_PORT}",
            metrics_address=f"127.0.0.1:{METRICS_PORT}",
        )
        settings["agent_tls"] = {"ca": ca, "cert": cert, "key": key}
        settings["api_tls"] = {"ca": ca, "cert": cert, "key": key}
        write_toml(self.run_dir / "controller.toml", settings)

    def _start_controller(self, host: Host, identity: str) -> subprocess.Popen[bytes]:
        extra = [] if identity == "controller-a" else ["--identity", identity, "--metrics", ""]
        with (self.run_dir / f"{identity}.log").open("ab") as log:
            return host.popen(
                [*program("controller"), "run", "--config", str(self.run_dir / "controller.toml"), *extra],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                start_new_session=True,
            )

    def stop(self) -> None:
        """SIGTERM the controllers, SIGINT the agents (stop the workers now: a SIGTERM would be a
        drain that hands the attempt over first), SIGKILL what is left on this cluster's hosts
        after 15 s, etcd last. Idempotent."""
        procs = [p for p in (self.controller, self.standby, *self.agents.values()) if p is not None]
        agents = {id(p) for p in self.agents.values()}
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGINT if id(p) in agents else signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        for name, host in self.hosts.items():
            if name != "etcd":
                crash(host)
        if "etcd" in self.hosts:
            crash(self.etcd_host)
        if self.etcd is not None:
            self.etcd.wait(timeout=5)
            # the logs stay; etcd's data (two preallocated 64 MB WAL files) goes
            shutil.rmtree(self.root / "etcd" / "data", ignore_errors=True)

    # -- operating it -------------------------------------------------------------------------

    def ctl(
        self, *args: str, timeout: float = 30.0, host: Host | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``controllerctl`` on the controller's host (or `host`: the standby's) against its API."""
        ca, cert, key = self._tls("admin")
        return (host or self.controller_host).run(
            [
                *program("controllerctl"),
                "--controller",
                f"127.0.0.1:{API_PORT}",
                "--ca",
                ca,
                "--cert",
                cert,
                "--key",
                key,
                *args,
            ],
            timeout=timeout,
            cwd=REPO,
        )

    def nodes_view(self) -> dict[str, dict[str, Any]]:
        """``controllerctl nodes --json`` by node name ({} while the controller does not answer)."""
        out = self.ctl("nodes", "--json")
        if out.returncode != 0:
            return {}
        return {n["node"]: n for n in json.loads(out.stdout).get("nodes", [])}

    def etcdctl(self, *args: str, timeout: float = 15.0) -> subprocess.CompletedProcess[str]:
        """``etcdctl`` on the etcd host with the controller's client certificate."""
        ca, cert, key = self._tls("controller")
        return self.etcd_host.run(
            [
                "etcdctl",
                f"--endpoints={self.etcd_endpoint}",
                f"--cacert={ca}",
                f"--cert={cert}",
                f"--key={key}",
                *args,
            ],
            timeout=timeout,
        )

    def registered_nodes(self) -> set[str]:
        """The nodes whose registration (under their lease) is in etcd now."""
        prefix = "/runwarden/v1/nodes/"
        out = self.etcdctl("get", "--prefix", "--keys-only", prefix)
        return {line[len(prefix) :] for line in out.stdout.split() if line.startswith(prefix)}

    def contenders(self) -> set[str]:
        """The identities of the controllers standing in the run's election now (the leader's included)."""
        prefix = KeySchema().election(run_election(self.spec.run))
        out = self.etcdctl("get", "--prefix", "--print-value-only", prefix)
        return set(out.stdout.split()) if out.returncode == 0 else set()

    def wait_registered(self, timeout_s: float = 60.0) -> float:
        """Until every agent is registered in etcd; returns the seconds it took. FleetError on timeout."""
        t0 = time.monotonic()
        while (missing := set(self.nodes) - self.registered_nodes()) and time.monotonic() - t0 < timeout_s:
            for node in missing:
                p = self.agents.get(node)
                if p is not None and p.poll() is not None:
                    raise FleetError(f"agent {node} exited ({p.returncode}): {self.agent_log(node)[-1500:]}")
            time.sleep(0.2)
        if missing:
            raise FleetError(f"not registered within {timeout_s:g} s: {sorted(missing)}")
        return time.monotonic() - t0

    def agent_log(self, node: str) -> str:
        return (self.state_dir(node) / "agent.log").read_text(errors="replace")

    def controller_log(self, identity: str = "controller-a") -> str:
        return (self.run_dir / f"{identity}.log").read_text(errors="replace")

    def leader(self) -> str:
        """The identity of the controller that leads now ("controller-a" or "controller-b"), from the
        controllers' own logs (the newest "is the leader" line not followed by a lost leadership)."""
        best, at = "", ""
        for identity in ("controller-a", *(["controller-b"] if self.with_standby else [])):
            state = ""
            for line in self.controller_log(identity).splitlines():
                if f"{identity} is the leader" in line:
                    state = line[:23]
                elif "stepping down" in line or "lost:" in line:
                    state = ""
            if state and state > at:
                best, at = identity, state
        return best

    def controller_host_of(self, identity: str) -> Host:
        return self.controller_host if identity == "controller-a" else self.standby_host


def _cross_host_settings() -> dict[str, object]:
    """The agent keys of the cross-host launch, for the agent versions that know them: the workers'
    collectives on the host's eth0, torchrun's store on a fixed port (every host has its own ports).
    `torchrun` keeps its default, the agent's own interpreter."""
    from nodeagent.daemon.config import AgentConfig  # the agent's config is the authority on its keys

    known = {f.name for f in dataclasses.fields(AgentConfig)}
    wanted: dict[str, object] = {"collective_ifname": "eth0", "rdzv_port": RDZV_PORT}
    return {key: value for key, value in wanted.items() if key in known}


def _etcd_healthy(port: int) -> bool:
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
            f"http://127.0.0.1:{port}/health", timeout=1.0
        ) as reply:
            return bool(json.loads(reply.read()).get("health") == "true")
    except (OSError, ValueError):
        return False
