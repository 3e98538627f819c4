"""The controller daemon's config: one TOML file, validated once, unknown keys refused.

    [store]            runwarden.store.StoreConfig (endpoints, TLS files, user/password, root)
    [controller]       the run and the shell: run, nodes, command, script_mode, run_dir, api_address, ...
    [controller.env]   extra environment for every rank
    [policy]           controller.supervisor.policy.SupervisorConfig (restart budget, hang timeout, ...)
    [paging]           controller.live.paging.PagerConfig (webhook_url, command, rate limit)
    [api_tls]          optional: cert/key/client CA for the Controller API (mTLS)
    [agent_tls]        optional: CA + client cert/key the controller presents to the agents
    [slurm] [ray] [kubernetes]   the chosen backend's own settings (controller/live/schedulers.py)

Precedence: file < environment (RUNWARDEN_ETCD_ENDPOINTS) < flags (the CLI applies them).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller.backends.agents import AgentTLS
from controller.backends.base import Scheduler
from controller.backends.local import SCRIPT_MODES
from controller.live.paging import PagerConfig
from controller.live.schedulers import SECTIONS as BACKEND_SECTIONS
from controller.live.schedulers import build_scheduler, check_backend
from controller.supervisor.policy import SupervisorConfig
from runwarden.config import ConfigError, load_section, read_toml
from runwarden.store import StoreConfig, StoreError

DEFAULT_METRICS_ADDRESS = "127.0.0.1:9401"  # the agent's default is 9400: both fit on one host


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSection:
    run: str
    nodes: int
    command: tuple[str, ...]
    run_dir: Path
    api_address: str = "127.0.0.1:7070"
    # "host:port" for Prometheus /metrics (windowed rates, goodput); "" or port 0 = off. On by default, on
    # loopback: a scraper on the host (or a port forward) reads it, nothing else can.
    metrics_address: str = DEFAULT_METRICS_ADDRESS
    identity: str = ""
    procs_per_node: int = 1
    backend: str = "agents"  # who places the node agents: agents (systemd) | slurm | ray | kubernetes
    spares: int = 0  # nodes allocated beyond `nodes` (inside the allocation: a swap takes seconds)
    # several runs on one fleet (one etcd root): who gets a free node first when two ask at once
    # (the higher; the same: first come). controller/fleet/claims.py
    priority: int = 0
    election_ttl_s: float = 3.0
    tick_s: float = 0.25
    env: dict[str, str] = field(default_factory=dict)
    # "instrumented": the command calls nodeagent.trainer; "unmodified": it has no runwarden calls and
    # every rank runs it through nodeagent.trainer.bootstrap (progress from the flight recorder's counters)
    script_mode: str = "instrumented"

    def __post_init__(self) -> None:
        if not self.command:
            raise ConfigError("controller.command: must be a non-empty argv list")
        if self.script_mode not in SCRIPT_MODES:
            raise ConfigError(
                f"controller.script_mode: one of {', '.join(SCRIPT_MODES)}, got {self.script_mode!r}"
            )
        first = self.command[0]
        module = first == "-m" and len(self.command) >= 2
        if self.script_mode == "unmodified" and first.startswith("-") and not module:
            raise ConfigError(
                f"controller.command: an unmodified script is a script or -m MODULE, got {first!r}"
            )
        if self.nodes < 1 or self.procs_per_node < 1:
            raise ConfigError("controller.nodes and controller.procs_per_node must be >= 1")
        if self.spares < 0:
            raise ConfigError(f"controller.spares: must be >= 0, got {self.spares}")
        if not -1000 <= self.priority <= 1000:
            raise ConfigError(f"controller.priority: must be within -1000..1000, got {self.priority}")
        check_backend(self.backend)
        if not 1.0 <= self.election_ttl_s <= 60.0:
            raise ConfigError(f"controller.election_ttl_s: must be within 1..60 s, got {self.election_ttl_s}")
        if not 0.01 <= self.tick_s <= 10.0:
            raise ConfigError(f"controller.tick_s: must be within 0.01..10 s, got {self.tick_s}")


@dataclass(frozen=True, slots=True, kw_only=True)
class TLSSection:
    cert: Path
    key: Path
    ca: Path


@dataclass(frozen=True, slots=True, kw_only=True)
class ControllerConfig:
    run: RunSection
    store: StoreConfig
    policy: SupervisorConfig
    paging: PagerConfig
    api_tls: TLSSection | None = None
    agent_tls: AgentTLS | None = None
    backend_section: dict[str, Any] = field(default_factory=dict)  # [slurm], [ray] or [kubernetes]

    def scheduler(self) -> Scheduler:
        """The chosen backend's scheduler (ConfigError for bad settings)."""
        return build_scheduler(
            self.run.backend, self.backend_section, f"[{self.run.backend}]", run=self.run.run
        )


_SECTIONS = {"store", "controller", "policy", "paging", "api_tls", "agent_tls", *BACKEND_SECTIONS}
DEFAULT_STORE_ENDPOINTS = (
    "127.0.0.1:2379",
)  # [store] endpoints when neither file, environment nor flag says


def load_controller_config(
    path: str | Path | None, overrides: dict[str, Any] | None = None
) -> ControllerConfig:
    """Read the file, apply the environment and then `overrides` ({"controller.run": ...})."""
    raw: dict[str, Any] = read_toml(path) if path else {}
    where = str(path) if path else "<flags>"
    unknown = sorted(set(raw) - _SECTIONS)
    if unknown:
        raise ConfigError(
            f"{where}: unknown section(s) {', '.join(unknown)}; known: {', '.join(sorted(_SECTIONS))}"
        )
    sections: dict[str, dict[str, Any]] = {name: dict(raw.get(name, {})) for name in _SECTIONS}
    env_endpoints = os.environ.get("RUNWARDEN_ETCD_ENDPOINTS", "")
    if env_endpoints:
        sections["store"]["endpoints"] = [e for e in env_endpoints.split(",") if e]
    for dotted, value in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        if section not in _SECTIONS or not key:
            raise ConfigError(f"override {dotted!r}: expected <section>.<key>")
        sections[section][key] = value
    run = load_section(RunSection, sections["controller"], f"{where} [controller]")
    sections["store"].setdefault("endpoints", list(DEFAULT_STORE_ENDPOINTS))
    try:
        store = load_section(StoreConfig, sections["store"], f"{where} [store]")
    except StoreError as exc:
        raise ConfigError(f"{where} [store]: {exc}") from None
    policy = load_section(SupervisorConfig, sections["policy"], f"{where} [policy]")
    paging = load_section(PagerConfig, sections["paging"], f"{where} [paging]")
    api_tls = (
        load_section(TLSSection, sections["api_tls"], f"{where} [api_tls]") if sections["api_tls"] else None
    )
    agent_tls = None
    if sections["agent_tls"]:
        tls = load_section(TLSSection, sections["agent_tls"], f"{where} [agent_tls]")
        agent_tls = AgentTLS(ca=tls.ca, cert=tls.cert, key=tls.key)
    for name in BACKEND_SECTIONS:
        if sections[name] and name != run.backend:
            raise ConfigError(f"{where}: a [{name}] section, but controller.backend is {run.backend!r}")
    return ControllerConfig(
        run=run,
        store=store,
        policy=policy,
        paging=paging,
        api_tls=api_tls,
        agent_tls=agent_tls,
        backend_section=sections.get(run.backend, {}),
    )
