"""`nodeagent`: run the per-host agent (the systemd unit's ExecStart).

    nodeagent --config /etc/runwarden/nodeagent.toml [--node NAME] [--listen HOST:PORT] ...

Precedence: TOML file < RUNWARDEN_AGENT_* environment < flags. Exit codes: 0 after SIGTERM/SIGINT,
2 for a config error, 1 when the agent cannot start (e.g. etcd unreachable for 30 s, port taken).

Signals:
  SIGTERM  `systemctl stop`, Kubernetes, scancel: drain ("agent stopping (SIGTERM)"), leave the
           running attempt time for a planned stop (Agent.leave: the controller's, or after
           drain_handoff_s the agent's own), exit once the workers are gone, revoking the lease.
           A second SIGTERM stops the workers hard at once.
  SIGUSR1  a scheduler's notice (Slurm's --signal=USR1@300 to the job's steps): drain and keep
           running; the controller moves the run off this node, the scheduler ends the agent.
  SIGINT   stop the workers (TERM, KILL after stop_grace_s) and exit now.
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import socket
import sys
from typing import Any

from nodeagent.daemon import config as config_mod
from runwarden.config import ConfigError

log = logging.getLogger("nodeagent")
SIGTERM_REASON = "agent stopping (SIGTERM)"
SIGUSR1_REASON = "scheduler notice (SIGUSR1): this node leaves soon"


class SignalInbox:
    """The main thread's signals, taken out of signal context: the handlers only note the number
    and `signal.set_wakeup_fd` wakes `wait` (no lock is ever taken inside a handler)."""

    def __init__(self, signals: tuple[signal.Signals, ...]) -> None:
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)
        self._got: list[int] = []
        signal.set_wakeup_fd(self._w.fileno(), warn_on_full_buffer=False)
        for sig in signals:
            signal.signal(sig, self._note)

    def _note(self, signum: int, _frame: Any) -> None:
        self._got.append(signum)

    def wait(self, timeout_s: float | None) -> list[int]:
        """The signals that arrived, waiting up to `timeout_s` (None: until one does)."""
        if not self._got:
            select.select([self._r], [], [], timeout_s)
        try:
            while self._r.recv(512):
                pass
        except OSError:
            pass
        got = self._got[:]
        del self._got[: len(got)]
        return got

    def close(self) -> None:
        signal.set_wakeup_fd(-1)
        self._r.close()
        self._w.close()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nodeagent",
        description="runwarden node agent: gRPC NodeAgent service, etcd lease heartbeat, progress "
        "aggregation, Xid/NVML monitors, local worker launcher, flight-recorder collection.",
        epilog="Every flag overrides the config file and the RUNWARDEN_AGENT_<KEY> environment variable.",
    )
    p.add_argument("--config", metavar="FILE", help="TOML config file (keys: see nodeagent/daemon/config.py)")
    p.add_argument("--node", help="node name (default: host name)")
    p.add_argument("--listen", metavar="HOST:PORT", help="TCP listener for the controller ('' = none)")
    p.add_argument("--unix-socket", dest="unix_socket", metavar="PATH", help="unix socket for local ranks")
    p.add_argument("--advertise", metavar="HOST:PORT", help="address written into the node record")
    p.add_argument(
        "--etcd",
        dest="etcd_endpoints",
        action="append",
        metavar="HOST:PORT",
        help="etcd endpoint (repeatable); none = standalone, no etcd",
    )
    p.add_argument(
        "--etcd-root", dest="etcd_root", metavar="PREFIX", help="etcd key root (default /runwarden)"
    )
    p.add_argument(
        "--lease-ttl", dest="lease_ttl_s", type=float, metavar="S", help="node lease TTL (default 5)"
    )
    p.add_argument(
        "--progress-interval",
        dest="progress_interval_s",
        type=float,
        metavar="S",
        help="progress write interval (default 1)",
    )
    p.add_argument("--kernel-log", dest="kernel_log", choices=config_mod.KERNEL_LOG_SOURCES)
    p.add_argument("--nvml-interval", dest="nvml_interval_s", type=float, metavar="S", help="0 = off")
    p.add_argument(
        "--allow-exec",
        dest="allowed_executables",
        action="append",
        metavar="PATH",
        help="an executable LaunchWorkers may start (repeatable)",
    )
    p.add_argument(
        "--chaos",
        dest="chaos_enabled",
        action="store_const",
        const=True,
        help="allow InjectFault (drills and demos only)",
    )
    p.add_argument("--tls-cert", dest="tls_cert", metavar="FILE")
    p.add_argument("--tls-key", dest="tls_key", metavar="FILE")
    p.add_argument("--tls-client-ca", dest="tls_client_ca", metavar="FILE")
    p.add_argument("--metrics-listen", dest="metrics_listen", metavar="HOST:PORT", help="'' = off")
    p.add_argument("--run-dir", dest="run_dir", metavar="DIR", help="stop files and flight-recorder sockets")
    p.add_argument("--local-ranks", dest="local_ranks", type=int, metavar="N")
    p.add_argument("--preflight-config", dest="preflight_config", metavar="FILE")
    p.add_argument("--log-level", dest="log_level", choices=config_mod.LOG_LEVELS)
    p.add_argument(
        "--torchrun",
        metavar="CMDLINE",
        help="how a structured launch starts torchrun, one shell-quoted string "
        "(default: this interpreter -m torch.distributed.run)",
    )
    p.add_argument(
        "--collective-ifname",
        dest="collective_ifname",
        metavar="IFNAME",
        help="network interface of the workers' collectives (GLOO_/NCCL_SOCKET_IFNAME)",
    )
    p.add_argument(
        "--rdzv-port",
        dest="rdzv_port",
        type=int,
        metavar="PORT",
        help="port of the c10d store this node hosts as node rank 0 (0 = pick one at start-up)",
    )
    p.add_argument(
        "--warm-workers",
        dest="warm_workers",
        choices=("true", "false"),
        help="keep parked rank processes ready for a structured launch (default true)",
    )
    p.add_argument(
        "--warm-preload",
        dest="warm_preload",
        metavar="MODULES",
        help="comma-separated modules a parked rank imports before it is ready ('' for none)",
    )
    return p


def load(argv: list[str] | None = None) -> config_mod.AgentConfig:
    args = vars(build_parser().parse_args(argv))
    file = args.pop("config")
    if args["warm_preload"] is not None:
        args["warm_preload"] = [m for m in args["warm_preload"].split(",") if m]
    if args["torchrun"] is not None:
        args["torchrun"] = config_mod.split_argv(args["torchrun"], "--torchrun")
    return config_mod.from_sources(file=file, flags=args)


def make_store(cfg: config_mod.AgentConfig) -> Any:
    if not cfg.etcd_endpoints:
        return None
    from runwarden.store import START_WAIT_S, Store, StoreConfig

    return Store.connect(
        StoreConfig(
            endpoints=cfg.etcd_endpoints,
            root=cfg.etcd_root,
            ca_file=cfg.etcd_tls_ca or None,
            cert_file=cfg.etcd_tls_cert or None,
            key_file=cfg.etcd_tls_key or None,
        ),
        wait_s=START_WAIT_S,
    )


def make_nvml() -> Any:
    from preflight.nvml import PynvmlAdapter

    return PynvmlAdapter()


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = load(argv)
    except ConfigError as exc:
        print(f"nodeagent: config error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from nodeagent.daemon.agent import Agent
    from nodeagent.daemon.server import AgentServer

    inbox = SignalInbox((signal.SIGTERM, signal.SIGINT, signal.SIGUSR1))
    try:
        store = make_store(cfg)
        agent = Agent(cfg, store=store, nvml=make_nvml() if cfg.nvml_interval_s > 0 else None)
        server = AgentServer(agent)
        if cfg.metrics_listen:
            agent.metrics.serve(cfg.metrics_listen)
        agent.start()
        server.start()
    except Exception as exc:
        log.error("cannot start: %s", exc)
        return 1
    log.info(
        "node agent %s serving: tcp %s (port %d), unix %s, pid %d",
        cfg.node,
        cfg.listen or "-",
        server.tcp_port,
        cfg.unix_socket or "-",
        os.getpid(),
    )
    agent.ready()
    while True:
        got = inbox.wait(None)
        if signal.SIGINT in got:
            log.info("SIGINT: stopping the workers now")
            break
        if signal.SIGTERM in got:
            log.info("SIGTERM: draining; waiting for a planned stop of the running attempt")
            agent.leave(
                SIGTERM_REASON,
                wait=lambda t: bool({signal.SIGTERM, signal.SIGINT} & set(inbox.wait(t))),
            )
            break
        if signal.SIGUSR1 in got:
            agent.drain(SIGUSR1_REASON)
    log.info("shutting down: stopping workers, revoking the lease")
    server.stop()
    agent.stop()
    if store is not None:
        store.close()
    inbox.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
