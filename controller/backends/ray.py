"""The Ray backend (`[controller] backend = "ray"`): one node agent per Ray node, held by a placement group.

Ray places the agents, the agents place the ranks (the structured torchrun launch of
controller/backends/local.py, as on every backend). Everything the run holds lives in its Ray
namespace and is detached, so a controller that restarts, or its standby, adopts it instead of
placing a second set; nothing an operator set is read for a decision or touched. `RayScheduler`
is the `Scheduler` (controller/backends/base.py) the live controller calls. ``ray`` is an optional
extra: this module is imported only when the backend is chosen.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from controller.backends.base import Allocation, BackendError, NodeRequest, RunOutcome, validate_node_name
from runwarden.config import ConfigError, load_section
from runwarden.names import check_name

ALLOC = "alloc"
REQUEST_PREFIX = "req-"
QUEUED_SUFFIX = "-queued"
MARK_PREFIX = "quarantine-"
NODE_PREFIX = "ray-"
_NAMESPACE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_RESOURCE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:-]*$")
_MARK_AMOUNT = 0.001


@dataclass(frozen=True, slots=True, kw_only=True)
class RayConfig:
    """The ``[ray]`` section."""

    address: str = "auto"  # ray.init(address=...): "auto", "<gcs host>:<port>" or "ray://<host>:10001"
    node_ip_address: str = ""  # this host's address in the Ray cluster ("" = Ray's own guess)
    namespace: str = "runwarden"  # the run's Ray namespace (from the controller: "runwarden-<run>")
    # One bundle per node: size it to the whole node ({"CPU" = 8, "GPU" = 8}), so none fits twice.
    bundle: dict[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    # The agents (same keys as [slurm]).
    agent_config: str = ""  # --config FILE, a path valid on every node ("" = none)
    etcd_endpoints: tuple[str, ...] = ()  # --etcd, repeated (empty: the agent config's own)
    etcd_root: str = ""  # --etcd-root ("" = the agent's default)
    agent_run_dir: str = "/run/runwarden"  # each agent's unix socket and run dir under <this>/<node name>
    agent_port: int = 50051  # each agent listens on <its Ray node's ip>:<this>
    metrics_port: int = 0  # the agent's /metrics on <ip>:<this> (0 = off)
    nodeagent: tuple[
        str, ...
    ] = ()  # the agent command on the nodes (empty: <ray's python> -m nodeagent.daemon.cli)
    agent_args: tuple[str, ...] = ()  # more agent flags, e.g. ["--lease-ttl", "3"]
    stop_timeout_s: float = 30.0  # SIGTERM to SIGKILL when an agent is stopped
    quarantine_stops_agent: bool = False  # a quarantined node's agent leaves too (no burn-in then)
    # Ray itself.
    allocate_timeout_s: float = 600.0  # allocate waits this long for Ray to grant every bundle
    call_timeout_s: float = 30.0  # any other call to Ray (an actor's answer, a lookup)

    def __post_init__(self) -> None:
        if not self.address or any(c.isspace() for c in self.address):
            raise BackendError(f"address: {self.address!r} is not a Ray address")
        if any(c.isspace() or c == "/" for c in self.node_ip_address):
            raise BackendError(f"node_ip_address: {self.node_ip_address!r} is not an address")
        if not _NAMESPACE.match(self.namespace):
            raise BackendError(f"namespace: {self.namespace!r}: letters, digits and ._-, at most 63")
        if not self.bundle:
            raise BackendError("bundle: at least one resource")
        for name, amount in self.bundle.items():
            if not _RESOURCE.match(name) or name.startswith("node:"):
                raise BackendError(f"bundle: {name!r} is not a resource name (node:* is runwarden's to pin)")
            if isinstance(amount, bool) or not isinstance(amount, int | float) or not amount > 0:
                raise BackendError(f"bundle.{name}: must be a number > 0, got {amount!r}")
        object.__setattr__(self, "bundle", {k: float(v) for k, v in self.bundle.items()})
        for argv, what in ((self.nodeagent, "nodeagent"), (self.agent_args, "agent_args")):
            if any(not a or "\0" in a for a in argv):
                raise BackendError(f"{what}: an argv of non-empty strings without NUL")
        for endpoint in self.etcd_endpoints:
            if not re.match(r"^[^\s,]+:[0-9]+$", endpoint):
                raise BackendError(f"etcd_endpoints: {endpoint!r} is not host:port")
        if not self.agent_run_dir.startswith("/"):
            raise BackendError(f"agent_run_dir: must be an absolute path, got {self.agent_run_dir!r}")
        if not 1 <= self.agent_port <= 65535 or not 0 <= self.metrics_port <= 65535:
            raise BackendError("agent_port must be within 1..65535, metrics_port within 0..65535")
        if not (self.stop_timeout_s > 0 and self.allocate_timeout_s > 0 and self.call_timeout_s > 0):
            raise BackendError("stop_timeout_s, allocate_timeout_s and call_timeout_s must be > 0")


def node_name(ip: str) -> str:
    """The agent's node name on the Ray node with this IP: ``ray-<ip>`` (IPv6 ':' as '-')."""
    name = NODE_PREFIX + ip.replace(":", "-").strip("[]")
    try:
        check_name("ray node", name)
    except ValueError as exc:
        raise BackendError(str(exc)) from None
    return validate_node_name(name)


def node_ip(node: str) -> str | None:
    """The Ray node IP a ``ray-<ip>`` node name stands for (None: not such a name)."""
    if not node.startswith(NODE_PREFIX):
        return None
    rest = node[len(NODE_PREFIX) :]
    return rest if "." in rest else rest.replace("-", ":")


def agent_argv(cfg: RayConfig, *, ip: str, python: str) -> list[str]:
    """The agent's command line on the Ray node with this IP."""
    node = node_name(ip)
    host = f"[{ip}]" if ":" in ip else ip
    state = os.path.join(cfg.agent_run_dir, node)
    argv = list(cfg.nodeagent) or [python, "-m", "nodeagent.daemon.cli"]
    if cfg.agent_config:
        argv += ["--config", cfg.agent_config]
    argv += [
        "--node",
        node,
        "--listen",
        f"{host}:{cfg.agent_port}",
        "--advertise",
        f"{host}:{cfg.agent_port}",
    ]
    argv += ["--unix-socket", os.path.join(state, "agent.sock"), "--run-dir", os.path.join(state, "run")]
    argv += ["--metrics-listen", f"{host}:{cfg.metrics_port}" if cfg.metrics_port else ""]
    for endpoint in cfg.etcd_endpoints:
        argv += ["--etcd", endpoint]
    if cfg.etcd_root:
        argv += ["--etcd-root", cfg.etcd_root]
    return argv + list(cfg.agent_args)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    PR_SET_PDEATHSIG = 1
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class AgentHost:
    """The actor in one bundle: the node agent is its child process, restarted when it exits (as
    systemd's Restart=always would: after 1 s, doubling to 30 s while it keeps failing), and it
    dies with the actor."""

    def __init__(self, cfg: RayConfig):
        self.cfg = cfg
        self.ip = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        self.node = node_name(self.ip)
        state = os.path.join(cfg.agent_run_dir, self.node)
        os.makedirs(os.path.join(state, "run"), exist_ok=True)
        self.log_path = os.path.join(state, "agent.log")
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._stopping = False
        self._lock = threading.Lock()
        started = threading.Event()
        # The parent-death signal is tied to the thread that forks: every agent is started from
        # this thread, which lives until the agent is stopped for good (or the process ends).
        threading.Thread(target=self._supervise, args=(started,), name="agent", daemon=True).start()
        started.wait(30)

    def _spawn(self) -> subprocess.Popen[bytes]:
        with open(self.log_path, "ab") as log:
            return subprocess.Popen(
                agent_argv(self.cfg, ip=self.ip, python=sys.executable),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
                close_fds=True,
            )

    def _supervise(self, started: threading.Event) -> None:
        delay, since = 1.0, 0.0
        while True:
            with self._lock:
                if self._stopping:
                    return  # stop_agent waits for the agent before it says so: nothing left to kill
                if self.proc is None or self.proc.poll() is not None:
                    if self.proc is not None:
                        delay = 1.0 if time.monotonic() - since > 60 else min(delay * 2, 30.0)
                    self.proc, since = self._spawn(), time.monotonic()
                    self.starts += 1
            started.set()
            time.sleep(0.5 if self.starts <= 1 else delay)

    def info(self) -> dict[str, Any]:
        proc = self.proc
        return {
            "node": self.node,
            "ip": self.ip,
            "node_id": self.node_id,
            "pid": proc.pid if proc is not None else None,
            "exit": proc.poll() if proc is not None else None,
            "starts": self.starts,
            "log": self.log_path,
        }

    def stop_agent(self) -> int | None:
        """SIGTERM the agent (it stops its workers and revokes its lease), SIGKILL past the timeout;
        it is not restarted."""
        with self._lock:
            self._stopping = True
            proc = self.proc
            if proc is None:
                return None
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(self.cfg.stop_timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            return proc.returncode


@dataclass(frozen=True, slots=True)
class _Agent:
    group: str
    index: int
    node: str
    ip: str
    handle: Any


class RayScheduler:
    """`backend = "ray"`. Thread-safe: the shell calls it off its loop. Everything lives in the Ray
    namespace ``namespace`` (default ``runwarden``; one per run), detached.

    * ``allocate(nodes, spares)`` -- one ``STRICT_SPREAD`` placement group named ``alloc`` with
      ``nodes + spares`` bundles (each ``bundle`` -- size it to a whole node, so that no second bundle
      fits where one is), and in each bundle one actor (``alloc-agent-<i>``) whose process runs the node
      agent as its child (``nodeagent --node ray-<node ip>``; the child dies with the actor, SIGTERM by
      PR_SET_PDEATHSIG). A node that dies takes its actor and its agent with it: the agent's lease
      expires (node lost). Ray then moves the lost bundle to another node and restarts the actor there,
      so a new agent (a new node to the pool) registers by itself.
    * ``request_nodes(count, exclude)`` -- another ``STRICT_SPREAD`` group (``req-<n>``) with one
      bundle pinned (``node:<ip>`` resource) to each alive node that holds none of the run's bundles,
      carries no quarantine mark and is not excluded, granted now; what those cannot cover waits in
      Ray's queue as ``req-<n>-queued`` (unpinned: Ray, or its autoscaler, grants it when a node has
      room). While a queued ask waits, another request with no free node returns it instead of asking
      twice. (A queued bundle is placed by Ray: with whole-node bundles it can only land on a node the
      run does not hold.)
    * ``quarantine(node)`` -- the mark is a placement group ``quarantine-<node>`` of the run (one
      bundle of ``node:<ip>: 0.001``): it survives a controller restart, ``request_nodes`` never picks
      the node, and the node's own bundle stays reserved (nothing else lands there). The agent keeps
      running, as under a Slurm drain or a Kubernetes taint: the pool's burn-in (a full preflight
      through it) decides whether the node comes back. With ``quarantine_stops_agent`` the agent is
      stopped too (SIGTERM: its lease revoked) and its actor killed for good; such a node comes back
      only through ``release`` (an operator's ``controllerctl release``).
    * ``release(node)`` -- removes only that mark, and starts the agent again in the node's bundle if
      it was stopped and the run still holds the bundle (a new registration: burn-in).
    * ``finish`` -- every actor (agents stopped first) and every placement group of the run is removed.
    """

    name = "ray"

    def __init__(self, config: RayConfig):
        self.config = config
        self._lock = threading.RLock()
        self._connected = False
        self._remote: Any = None

    @classmethod
    def from_section(cls, raw: dict[str, Any], where: str, *, run: str = "") -> RayScheduler:
        """The `[ray]` table; ``run`` (the controller's run name) makes the default namespace
        ``runwarden-<run>``, so two runs on one Ray cluster never adopt each other's agents."""
        if run and "namespace" not in raw:
            raw = {**raw, "namespace": f"runwarden-{run}"}
        try:
            config = load_section(RayConfig, raw, where)
        except ConfigError as exc:
            raise BackendError(str(exc)) from None
        return cls(config)

    # ---- Ray ------------------------------------------------------------------------------------

    def _connect(self) -> None:
        if self._connected:
            return
        try:
            if not ray.is_initialized():
                ray.init(
                    address=self.config.address,
                    namespace=self.config.namespace,
                    log_to_driver=False,
                    logging_level="warning",
                    configure_logging=False,
                    **(
                        {"_node_ip_address": self.config.node_ip_address}
                        if self.config.node_ip_address
                        else {}
                    ),
                )
        except Exception as exc:
            raise BackendError(f"ray: cannot connect to {self.config.address}: {_one_line(exc)}") from None
        ns = ray.get_runtime_context().namespace
        if ns != self.config.namespace:
            raise BackendError(
                f"ray: this process is connected in namespace {ns!r}, not {self.config.namespace!r}"
            )
        self._remote = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)(AgentHost)
        self._connected = True

    def _groups(self) -> dict[str, dict[str, Any]]:
        """The run's placement groups by name (not removed)."""
        # The table lists every namespace's groups: ours carry "<namespace>/" in their names.
        prefix = self._full("")
        ours = {}
        for entry in ray.util.placement_group_table().values():
            full = entry.get("name") or ""
            if entry.get("state") == "REMOVED" or not full.startswith(prefix):
                continue
            name = full[len(prefix) :]
            if name == ALLOC or name.startswith((REQUEST_PREFIX, MARK_PREFIX)):
                ours[name] = entry
        return ours

    def _full(self, group: str) -> str:
        return f"{self.config.namespace}/{group}"

    def _group(self, name: str) -> Any | None:
        try:
            return ray.util.get_placement_group(self._full(name))
        except ValueError:
            return None

    def _alive_nodes(self) -> dict[str, dict[str, Any]]:
        """Alive Ray nodes by node id."""
        return {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}

    def _marks(self, groups: dict[str, dict[str, Any]]) -> set[str]:
        return {name[len(MARK_PREFIX) :] for name in groups if name.startswith(MARK_PREFIX)}

    def _agent_name(self, group: str, index: int) -> str:
        return f"{group}-agent-{index}"

    def _actor(self, group: str, index: int) -> Any | None:
        try:
            return ray.get_actor(self._agent_name(group, index), namespace=self.config.namespace)
        except ValueError:
            return None

    def _start_agent(self, group: str, index: int) -> Any:
        pg = self._group(group)
        if pg is None:
            raise BackendError(f"ray: placement group {group} is gone")
        return self._remote.options(
            name=self._agent_name(group, index),
            namespace=self.config.namespace,
            lifetime="detached",
            get_if_exists=True,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=index
            ),
        ).remote(self.config)

    def _agents(self) -> list[_Agent]:
        """Every agent actor of the run that answers (``call_timeout_s``), by group and bundle. Only
        bundles placed on an alive node are asked: an actor waiting for its bundle cannot answer."""
        found: list[tuple[str, int, Any]] = []
        alive = set(self._alive_nodes())
        for group, entry in self._groups().items():
            if group.startswith(MARK_PREFIX):
                continue
            for index, node_id in entry.get("bundles_to_node_id", {}).items():
                if node_id not in alive:
                    continue
                handle = self._actor(group, int(index))
                if handle is not None:
                    found.append((group, int(index), handle))
        refs = [h.info.remote() for _, _, h in found]
        ready, _ = (
            ray.wait(refs, num_returns=len(refs), timeout=self.config.call_timeout_s) if refs else ([], [])
        )
        agents = []
        for (group, index, handle), ref in zip(found, refs, strict=True):
            if ref not in ready:
                continue
            try:
                info = ray.get(ref)
            except Exception:
                continue  # a dead or restarting actor: not an agent right now
            agents.append(_Agent(group=group, index=index, node=info["node"], ip=info["ip"], handle=handle))
        return agents

    # ---- Scheduler ------------------------------------------------------------------------------

    def allocate(self, nodes: int, spares: int) -> Allocation:
        if nodes < 1 or spares < 0:
            raise BackendError(f"allocate: need nodes >= 1 and spares >= 0, got {nodes} and {spares}")
        with self._lock, _ray_errors("allocate"):
            self._connect()
            count = nodes + spares
            pg = self._group(ALLOC)
            if pg is None:
                pg = placement_group(
                    [dict(self.config.bundle)] * count,
                    strategy="STRICT_SPREAD",
                    name=self._full(ALLOC),
                    lifetime="detached",
                )
            elif len(pg.bundle_specs) != count:
                raise BackendError(
                    f"ray: namespace {self.config.namespace} already holds an allocation of "
                    f"{len(pg.bundle_specs)} nodes, not {count}: another run's? (finish it, or set namespace)"
                )
            ready, _ = ray.wait([pg.ready()], timeout=self.config.allocate_timeout_s)
            if not ready:
                raise BackendError(
                    f"ray: {count} nodes of {self.config.bundle} on distinct Ray nodes not granted "
                    f"within {self.config.allocate_timeout_s:g} s (placement group {pg.id.hex()} pending)"
                )
            marks = self._marks(self._groups())
            bundle_nodes = ray.util.placement_group_table(pg).get("bundles_to_node_id", {})
            ips = {nid: n["NodeManagerAddress"] for nid, n in self._alive_nodes().items()}
            for index in range(count):
                ip = ips.get(bundle_nodes.get(index, ""))
                # A missing actor is started, except where quarantine stopped it (release restarts it).
                if self._actor(ALLOC, index) is None and not (ip is not None and node_name(ip) in marks):
                    self._start_agent(ALLOC, index)
            names = tuple(a.node for a in self._agents() if a.group == ALLOC)  # those that answer
            return Allocation(id=f"ray:{pg.id.hex()}", nodes=tuple(dict.fromkeys(names)))

    def request_nodes(self, count: int, *, exclude: tuple[str, ...], reason: str) -> NodeRequest:
        if count < 1:
            raise BackendError(f"request_nodes: count must be >= 1, got {count}")
        with self._lock, _ray_errors("request_nodes"):
            self._connect()
            groups = self._groups()
            held = set()
            for group, entry in groups.items():
                if not group.startswith(MARK_PREFIX):
                    held.update(entry.get("bundles_to_node_id", {}).values())
            barred = self._marks(groups) | set(exclude)
            free = [
                n["NodeManagerAddress"]
                for nid, n in sorted(self._alive_nodes().items())
                if nid not in held
                and node_name(n["NodeManagerAddress"]) not in barred
                and all(n.get("Resources", {}).get(k, 0.0) >= v for k, v in self.config.bundle.items())
            ]
            free = list(dict.fromkeys(free))[:count]  # one bundle per IP: the node name is the IP's
            queued = [
                g for g, e in groups.items() if g.endswith(QUEUED_SUFFIX) and e.get("state") != "CREATED"
            ]
            if queued and not free:
                # An earlier ask still waits in Ray's queue: that is the answer, not a second ask.
                entry = groups[queued[0]]
                return NodeRequest(
                    id=f"ray:{queued[0]}:{entry['placement_group_id']}",
                    count=len(entry.get("bundles", {})),
                    submitted_at=time.time(),
                )
            taken = [
                int(g[len(REQUEST_PREFIX) :].split("-")[0]) for g in groups if g.startswith(REQUEST_PREFIX)
            ]
            number = max(taken, default=0) + 1
            asks: list[tuple[str, list[dict[str, float]]]] = []
            if free:  # granted now: pinned to the free nodes
                asks.append(
                    (
                        f"{REQUEST_PREFIX}{number}",
                        [{**self.config.bundle, f"node:{ip}": _MARK_AMOUNT} for ip in free],
                    )
                )
            if count > len(free) and not queued:  # the rest waits for Ray (its autoscaler) to have room
                asks.append(
                    (
                        f"{REQUEST_PREFIX}{number}{QUEUED_SUFFIX}",
                        [dict(self.config.bundle)] * (count - len(free)),
                    )
                )
            ids = []
            for name, bundles in asks:
                pg = placement_group(
                    bundles, strategy="STRICT_SPREAD", name=self._full(name), lifetime="detached"
                )
                for index in range(len(bundles)):
                    self._start_agent(name, index)
                ids.append(f"{name}:{pg.id.hex()}")
            return NodeRequest(id="ray:" + ",".join(ids), count=count, submitted_at=time.time())

    def quarantine(self, node: str, reason: str) -> None:
        ip = node_ip(node)
        if ip is None:
            return  # not a node of Ray's (an agent started some other way): nothing to mark here
        with self._lock, _ray_errors("quarantine"):
            self._connect()
            if MARK_PREFIX + node not in self._groups():
                # Pending while the node is away (dead): the name is the mark, kept until release.
                placement_group(
                    [{f"node:{ip}": _MARK_AMOUNT}],
                    strategy="PACK",
                    name=self._full(MARK_PREFIX + node),
                    lifetime="detached",
                )
            if self.config.quarantine_stops_agent:
                self._stop(*(a.handle for a in self._agents() if a.node == node))

    def release(self, node: str) -> bool:
        with self._lock, _ray_errors("release"):
            self._connect()
            groups = self._groups()
            mark = self._group(MARK_PREFIX + node)
            if mark is None:
                return True  # nothing of runwarden's on it
            remove_placement_group(mark)
            ip = self._ip_of(node)
            if ip is None:
                return True  # the node is gone: nothing to restart
            node_id = next(
                (nid for nid, n in self._alive_nodes().items() if n["NodeManagerAddress"] == ip), None
            )
            for group, entry in groups.items():
                if group.startswith(MARK_PREFIX):
                    continue
                for index, bundle_node in entry.get("bundles_to_node_id", {}).items():
                    if bundle_node == node_id and self._actor(group, int(index)) is None:
                        self._start_agent(group, int(index))
            return True

    def check_stop_fits(self, save_commit_s: float) -> None:
        return None  # Ray gives no kill notice to compare with: nothing to check

    def finish(self, outcome: RunOutcome) -> None:
        with self._lock, _ray_errors("finish"):
            self._connect()
            groups = self._groups()
            self._stop(*(a.handle for a in self._agents()))  # those that answer stop their agents first
            for group, entry in groups.items():
                if group.startswith(MARK_PREFIX):
                    continue
                for index in range(len(entry.get("bundles", {}))):
                    handle = self._actor(group, index)
                    if handle is not None:
                        ray.kill(handle, no_restart=True)  # the rest die with their actors (PDEATHSIG)
            for group in groups:
                pg = self._group(group)
                if pg is not None:
                    remove_placement_group(pg)

    # ---- helpers --------------------------------------------------------------------------------

    def _ip_of(self, node: str) -> str | None:
        for n in self._alive_nodes().values():
            if node_name(n["NodeManagerAddress"]) == node:
                return str(n["NodeManagerAddress"])
        return None

    def _stop(self, *handles: Any) -> None:
        """Stop the agents (SIGTERM, their leases revoked), then kill their actors for good."""
        refs = [h.stop_agent.remote() for h in handles]
        if refs:
            ray.wait(
                refs, num_returns=len(refs), timeout=self.config.stop_timeout_s + self.config.call_timeout_s
            )
        for handle in handles:
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:300]


@contextlib.contextmanager
def _ray_errors(what: str) -> Any:
    """Anything Ray raises becomes one BackendError line."""
    try:
        yield
    except BackendError:
        raise
    except Exception as exc:
        raise BackendError(f"ray {what}: {type(exc).__name__}: {_one_line(exc)}") from None
