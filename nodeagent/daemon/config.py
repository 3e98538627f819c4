"""The node agent's one frozen config: TOML file < environment < flags, validated once.

Keys (TOML top level, or `RUNWARDEN_AGENT_<KEY>` in the environment, or the CLI flag):

    node                      this node's name in etcd (default: the host name)
    listen                    TCP "host:port" for the controller ("" = no TCP listener)
    unix_socket               path of the unix socket the local ranks use
    advertise                 "host:port" written into the node record (default: `listen`)
    etcd_endpoints            ["127.0.0.1:2379", ...]; empty = no etcd (standalone, tests)
    etcd_root                 key prefix root (default "/runwarden")
    etcd_tls_ca / etcd_tls_cert / etcd_tls_key     TLS to etcd (optional)
    lease_ttl_s               node lease TTL (keepalive every TTL/3)
    progress_interval_s       one progress write per node per this interval
    evidence_recent           how many evidence records GetNodeStatus shows
    kernel_log                "auto" | "kmsg" | "journalctl" | "dmesg" | "none"
    dmesg_interval_s          poll interval of the `dmesg` fallback
    nvml_interval_s           NVML counter/throttle poll interval (0 = off)
    allowed_executables       argv[0] values LaunchWorkers may start (absolute paths or names)
    chaos_enabled             allow InjectFault
    tls_cert / tls_key        server certificate (TCP listener); required for a non-loopback listen
    tls_client_ca             CA that signs client certificates (mutating RPCs need one)
    metrics_listen            "host:port" for Prometheus /metrics ("" = off)
    run_dir                   stop files and flight-recorder sockets live under here
    stop_grace_s              default TERM -> KILL grace for StopWorkers
    drain_handoff_s           after a SIGTERM to the agent (`systemctl stop`, Kubernetes, scancel):
                              how long the agent, now draining, waits for the controller to end
                              the running attempt with a planned stop before it asks its own ranks
                              to stop (finish the step, save, commit, exit 0); default 15, 0..3600
    drain_timeout_s           after a SIGTERM to the agent: how long it waits for its workers to
                              end before it stops them hard (TERM, KILL after stop_grace_s) and
                              exits; default 300, drain_handoff_s..86400. A supervisor's stop
                              timeout must exceed it plus stop_grace_s (the agent asks systemd for
                              that much with EXTEND_TIMEOUT_USEC)
    flight_recorder_timeout_s default per-rank timeout of CollectFlightRecorder
    fr_buffer_size            TORCH_FR_BUFFER_SIZE given to launched workers
    max_message_bytes         gRPC send/receive limit
    local_ranks               ranks per attempt on this node (advertised in the node record)
    log_level                 "debug" | "info" | "warning" | "error"
    preflight_config          the preflight TOML file RunPreflight uses ("" = preflight's defaults)
    torchrun                  argv prefix a structured launch starts torchrun with (default: this
                              agent's own interpreter, `[sys.executable, "-m", "torch.distributed.run"]`);
                              its argv[0] must be in allowed_executables. In the environment and the
                              `--torchrun` flag: one shell-quoted string
    collective_ifname         the network interface the workers' collectives use ("" = torch's
                              default): GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME
    rdzv_port                 the port this node hosts torchrun's c10d store on when it is node rank 0
                              (0 = a port free at start-up; fixed ports outside the ephemeral range are
                              better in production). Reported in the node record with `torch_host`,
                              the advertised host without its port (torchrun --local-addr)
    warm_workers              true: keep one parked group of rank processes (torch imported) ready and
                              hand a structured launch to it instead of starting torchrun; anything the
                              warm path cannot run goes cold, and the launch's answer says which path
                              ran (nodeagent.warm.groups). Default true (false: every launch is cold
                              torchrun, no parked processes). Every agent of a run should have the same
                              setting (a cold node makes the whole attempt go cold)
    warm_wait_s               how long a launch waits for a parked group that is still starting before
                              it goes cold; default 30, 0..600
    warm_preload              modules a parked rank imports before it says ready, so the restart path
                              does not: by default what DDP and DCP import on first use
                              (torch._dynamo, ~3 s on 2 cores, which every DDP rank waits for in its
                              construction's collectives) and runwarden's trainer helper. A module
                              that fails to import is reported in the agent's log and skipped (the
                              job imports it itself). Add the job's own heavy imports; [] for none
    memory_copy_budget_bytes  host memory one warm rank's in-memory checkpoint copies may use, both
                              together (nodeagent.trainer.memory_state); default 16 GiB, 0 = keep none. A copy
                              over it is not kept (the rank's log and its next load say so)
    checkpoint_dir            this node's path to the runs' checkpoint directory: preflight's storage
                              checks use it when the preflight config's checkpoint_path is empty
    expected_driver_version   the NVIDIA driver and CUDA versions the node's image was built for (e.g.
    expected_cuda_version     "550.127.05", "12.4"): preflight's expected versions when its config
                              leaves them empty ("" = not checked). local_ranks, when set, is likewise
                              the GPU count preflight expects when its expected_gpu_count is 0

A structured launch runs `--nproc-per-node` = local_ranks, or the GPU count when local_ranks is 0 and
NVML sees GPUs, else 1; the node record reports that number.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shlex
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runwarden.config import ConfigError, load_section, read_toml, require_positive
from runwarden.net import is_loopback

ENV_PREFIX = "RUNWARDEN_AGENT_"
KERNEL_LOG_SOURCES = ("auto", "kmsg", "journalctl", "dmesg", "none")
LOG_LEVELS = ("debug", "info", "warning", "error")
# Linux interface names: at most 15 bytes (IFNAMSIZ - 1), no '/', no whitespace, not "." or "..".
_IFNAME = re.compile(r"^[A-Za-z0-9_.:@-]{1,15}$")
_VERSION = re.compile(r"^[0-9][0-9A-Za-z.+-]{0,63}$")  # what NVML reports: digits and dots


# What DDP and DCP import on first use, and the trainer helper: see warm_preload above.
DEFAULT_WARM_PRELOAD = ("torch._dynamo", "torch.distributed.checkpoint", "nodeagent.trainer")
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentConfig:
    node: str = ""
    listen: str = "127.0.0.1:50051"
    unix_socket: str = "/run/runwarden/agent.sock"
    advertise: str = ""
    etcd_endpoints: tuple[str, ...] = ()
    etcd_root: str = "/runwarden"
    etcd_tls_ca: str = ""
    etcd_tls_cert: str = ""
    etcd_tls_key: str = ""
    lease_ttl_s: float = 5.0
    progress_interval_s: float = 1.0
    evidence_recent: int = 50
    kernel_log: str = "auto"
    dmesg_interval_s: float = 5.0
    nvml_interval_s: float = 10.0
    allowed_executables: tuple[str, ...] = ()
    chaos_enabled: bool = False
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    metrics_listen: str = "127.0.0.1:9400"
    run_dir: str = "/run/runwarden"
    stop_grace_s: float = 30.0
    drain_handoff_s: float = 15.0
    drain_timeout_s: float = 300.0
    flight_recorder_timeout_s: float = 5.0
    fr_buffer_size: int = 2000
    max_message_bytes: int = 16 * 1024 * 1024
    local_ranks: int = 0
    log_level: str = "info"
    preflight_config: str = ""
    torchrun: tuple[str, ...] = ()
    collective_ifname: str = ""
    rdzv_port: int = 0
    warm_workers: bool = True
    warm_wait_s: float = 30.0
    warm_preload: tuple[str, ...] = DEFAULT_WARM_PRELOAD
    memory_copy_budget_bytes: int = 16 * 1024**3  # nodeagent.trainer.memory_state.DEFAULT_BUDGET_BYTES
    checkpoint_dir: str = ""
    expected_driver_version: str = ""
    expected_cuda_version: str = ""

    def __post_init__(self) -> None:
        where = "nodeagent"
        for f in dataclasses.fields(self):  # TOML and float() take nan and inf: no duration is either
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{where}.{f.name}: must be a finite number of seconds, got {value!r}")
        if not isinstance(self.warm_workers, bool):
            raise ConfigError(f"{where}.warm_workers: expected true or false, got {self.warm_workers!r}")
        if not 0 <= self.warm_wait_s <= 600:
            raise ConfigError(f"{where}.warm_wait_s: must be within 0..600, got {self.warm_wait_s!r}")
        if len(self.warm_preload) > 64 or not all(
            isinstance(m, str) and _MODULE_NAME.fullmatch(m) for m in self.warm_preload
        ):
            raise ConfigError(
                f"{where}.warm_preload: at most 64 dotted module names, got {list(self.warm_preload)!r}"
            )
        if (
            not isinstance(self.memory_copy_budget_bytes, int)
            or isinstance(self.memory_copy_budget_bytes, bool)
            or self.memory_copy_budget_bytes < 0
        ):
            raise ConfigError(
                f"{where}.memory_copy_budget_bytes: a number of bytes >= 0, got {self.memory_copy_budget_bytes!r}"
            )
        if not self.torchrun:
            object.__setattr__(self, "torchrun", (sys.executable, "-m", "torch.distributed.run"))
        if any(not isinstance(a, str) or not a or "\0" in a for a in self.torchrun):
            raise ConfigError(
                f"{where}.torchrun: an argv of non-empty strings without NUL, got {self.torchrun!r}"
            )
        if self.collective_ifname and (
            not _IFNAME.match(self.collective_ifname) or self.collective_ifname in (".", "..")
        ):
            raise ConfigError(
                f"{where}.collective_ifname: not a network interface name: {self.collective_ifname!r}"
            )
        if self.checkpoint_dir and (not os.path.isabs(self.checkpoint_dir) or "\0" in self.checkpoint_dir):
            raise ConfigError(f"{where}.checkpoint_dir: an absolute path, got {self.checkpoint_dir!r}")
        for key in ("expected_driver_version", "expected_cuda_version"):
            version = getattr(self, key)
            if version and not _VERSION.match(version):
                raise ConfigError(f"{where}.{key}: a version like 550.127.05 or 12.4, got {version!r}")
        if not 0 <= self.rdzv_port <= 65535:
            raise ConfigError(
                f"{where}.rdzv_port: must be within 0..65535 (0 = pick one), got {self.rdzv_port}"
            )
        if not self.node:
            object.__setattr__(self, "node", socket.gethostname())
        if not self.advertise:
            object.__setattr__(self, "advertise", self.listen)
        require_positive(
            where,
            lease_ttl_s=self.lease_ttl_s,
            progress_interval_s=self.progress_interval_s,
            dmesg_interval_s=self.dmesg_interval_s,
            flight_recorder_timeout_s=self.flight_recorder_timeout_s,
            max_message_bytes=self.max_message_bytes,
            evidence_recent=self.evidence_recent,
        )
        if (
            self.nvml_interval_s < 0
            or self.stop_grace_s < 0
            or self.fr_buffer_size < 0
            or self.local_ranks < 0
        ):
            raise ConfigError(
                f"{where}: nvml_interval_s, stop_grace_s, fr_buffer_size, local_ranks must be >= 0"
            )
        if not 0 <= self.drain_handoff_s <= 3600:
            raise ConfigError(
                f"{where}.drain_handoff_s: must be within 0..3600, got {self.drain_handoff_s!r}"
            )
        if not self.drain_handoff_s <= self.drain_timeout_s <= 86400 or self.drain_timeout_s <= 0:
            raise ConfigError(
                f"{where}.drain_timeout_s: must be > 0 and within drain_handoff_s "
                f"({self.drain_handoff_s:g})..86400, got {self.drain_timeout_s!r}"
            )
        if self.kernel_log not in KERNEL_LOG_SOURCES:
            raise ConfigError(
                f"{where}.kernel_log: one of {', '.join(KERNEL_LOG_SOURCES)}, got {self.kernel_log!r}"
            )
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"{where}.log_level: one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if not self.listen and not self.unix_socket:
            raise ConfigError(f"{where}: need at least one of listen and unix_socket")
        for name in ("listen", "metrics_listen", "advertise"):
            value = getattr(self, name)
            if value:
                split_host_port(value, f"{where}.{name}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError(f"{where}: tls_cert and tls_key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError(f"{where}: tls_client_ca needs tls_cert and tls_key")
        if self.listen and not self.tls_enabled and not is_loopback(split_host_port(self.listen, where)[0]):
            raise ConfigError(
                f"{where}.listen: {self.listen} is not a loopback address; plain TCP is allowed on "
                "loopback only (set tls_cert, tls_key and tls_client_ca)"
            )

    @property
    def tls_enabled(self) -> bool:
        return bool(self.tls_cert)

    @property
    def advertised_host(self) -> str:
        """The host of `advertise`, without the port (and without IPv6 brackets)."""
        return split_host_port(self.advertise, "nodeagent.advertise")[0]

    def stop_file(self, run: str) -> Path:
        return Path(self.run_dir) / "runs" / run / "stop"

    def fr_socket_dir(self, run: str, attempt: int) -> Path:
        return Path(self.run_dir) / "runs" / run / f"attempt-{attempt}" / "fr"


def split_host_port(value: str, where: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{where}: expected host:port, got {value!r}")
    return host, int(port)


def split_argv(value: str, where: str) -> list[str]:
    """A shell-quoted command line as an argv (the `torchrun` key from the environment or a flag)."""
    try:
        return shlex.split(value)
    except ValueError as exc:
        raise ConfigError(f"{where}: not a shell-quoted command line: {exc}") from None


def env_mapping(environ: Mapping[str, str]) -> dict[str, Any]:
    """The RUNWARDEN_AGENT_* variables as config keys; list keys are comma-separated."""
    list_keys = {f.name for f in dataclasses.fields(AgentConfig) if "tuple" in str(f.type)}
    out: dict[str, Any] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        key = name[len(ENV_PREFIX) :].lower()
        if key == "torchrun":
            out[key] = split_argv(value, name)
        else:
            out[key] = [v for v in value.split(",") if v] if key in list_keys else value
    return out


def from_sources(
    *,
    file: str | Path | None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> AgentConfig:
    """Merge file < environment < flags (flags that are None are absent) and validate once."""
    merged: dict[str, Any] = {}
    if file:
        merged.update(read_toml(file))
    merged.update(env_mapping(os.environ if environ is None else environ))
    merged.update({k: v for k, v in (flags or {}).items() if v is not None})
    return load_section(AgentConfig, merged, str(file) if file else "nodeagent")
