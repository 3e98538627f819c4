"""The flags every lightfleet program takes: where etcd is (as the real agents are told), the agents'
behaviour, and the node names. Shared by `python -m lightfleet` and `python -m lightfleet.process`."""

from __future__ import annotations

import argparse
import os

from lightfleet.settings import AgentSettings, Latency, SettingsError
from runwarden.keys import DEFAULT_ROOT
from runwarden.names import check_name
from runwarden.store import StoreConfig, StoreError


class UsageError(ValueError):
    """A flag that cannot work: one line."""


def add_common(p: argparse.ArgumentParser) -> None:
    etcd = p.add_argument_group("etcd (the real agent's etcd_* keys; env RUNWARDEN_AGENT_ETCD_ENDPOINTS too)")
    etcd.add_argument(
        "--etcd",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="etcd endpoint (repeatable or comma-separated); default $RUNWARDEN_AGENT_ETCD_ENDPOINTS, "
        "then $RUNWARDEN_ETCD_ENDPOINTS (the controller's)",
    )
    etcd.add_argument("--etcd-root", default=os.environ.get("RUNWARDEN_AGENT_ETCD_ROOT", DEFAULT_ROOT))
    etcd.add_argument("--etcd-tls-ca", default=os.environ.get("RUNWARDEN_AGENT_ETCD_TLS_CA", ""))
    etcd.add_argument("--etcd-tls-cert", default=os.environ.get("RUNWARDEN_AGENT_ETCD_TLS_CERT", ""))
    etcd.add_argument("--etcd-tls-key", default=os.environ.get("RUNWARDEN_AGENT_ETCD_TLS_KEY", ""))
    nodes = p.add_argument_group("nodes")
    nodes.add_argument("--prefix", default="light-", help="node names are PREFIX + a zero-padded index")
    nodes.add_argument(
        "--first-port",
        type=int,
        default=0,
        help="agent i listens on 127.0.0.1:FIRST_PORT+i (0: a port of the kernel's choosing each; keep "
        "fixed ranges below the ephemeral range, /proc/sys/net/ipv4/ip_local_port_range)",
    )
    b = p.add_argument_group("behaviour (latencies: SECONDS or LOW:HIGH, uniform)")
    b.add_argument("--ranks", type=int, default=8, help="local ranks per node (default 8)")
    b.add_argument("--lease-ttl", type=float, default=5.0, help="node lease TTL, s (the real agent's 5)")
    b.add_argument("--progress-s", type=float, default=1.0, help="progress write interval, s (the real 1)")
    b.add_argument("--preflight-s", default="2", help="RunPreflight's duration (default 2)")
    b.add_argument("--launch-s", default="0.05", help="LaunchWorkers' answer (default 0.05)")
    b.add_argument(
        "--stop-s", default="0.3", help="StopWorkers: TERM -> exit (default 0.3; capped by the grace)"
    )
    b.add_argument("--dump-s", default="0.05", help="CollectFlightRecorder's answer (default 0.05)")
    b.add_argument("--step-s", type=float, default=1.0, help="one training step, s (default 1)")
    b.add_argument(
        "--startup-s", type=float, default=3.0, help="attempt record -> ranks loaded, s (default 3)"
    )
    b.add_argument("--save-s", type=float, default=0.5, help="a checkpoint's save + commit, s (default 0.5)")
    b.add_argument("--ckpt-every", type=int, default=10, help="steps between commits (0: none; default 10)")
    b.add_argument("--steps", type=int, default=0, help="the run's last step (0: forever)")
    b.add_argument("--seed", type=int, default=0, help="seeds every agent's sampled latencies")
    b.add_argument(
        "--cold",
        action="store_true",
        help="model warm_workers = false (torchrun's ranks: a hung rank waits out the stop's grace); "
        "default: the real agent's default, warm parked ranks",
    )
    p.add_argument("--io-threads", type=int, default=8, help="etcd calls in flight per process (default 8)")
    p.add_argument(
        "--no-revoke", action="store_true", help="at exit leave the leases to expire instead of revoking them"
    )
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))


def endpoints(args: argparse.Namespace) -> tuple[str, ...]:
    given = [e for item in args.etcd for e in item.split(",") if e.strip()]
    for var in ("RUNWARDEN_AGENT_ETCD_ENDPOINTS", "RUNWARDEN_ETCD_ENDPOINTS"):
        if not given:
            given = [e for e in os.environ.get(var, "").split(",") if e.strip()]
    if not given:
        raise UsageError("no etcd endpoint: give --etcd HOST:PORT (or RUNWARDEN_AGENT_ETCD_ENDPOINTS)")
    return tuple(given)


def store_config(args: argparse.Namespace) -> StoreConfig:
    """The StoreConfig the real agent builds from its etcd_* keys (nodeagent.daemon.cli)."""
    try:
        return StoreConfig(
            endpoints=endpoints(args),
            root=args.etcd_root,
            ca_file=args.etcd_tls_ca or None,
            cert_file=args.etcd_tls_cert or None,
            key_file=args.etcd_tls_key or None,
        )
    except StoreError as exc:
        raise UsageError(str(exc)) from None


def settings(args: argparse.Namespace) -> AgentSettings:
    try:
        return AgentSettings(
            local_ranks=args.ranks,
            lease_ttl_s=args.lease_ttl,
            progress_interval_s=args.progress_s,
            preflight=Latency.parse(args.preflight_s, "--preflight-s"),
            launch=Latency.parse(args.launch_s, "--launch-s"),
            stop=Latency.parse(args.stop_s, "--stop-s"),
            dump=Latency.parse(args.dump_s, "--dump-s"),
            step_s=args.step_s,
            startup_s=args.startup_s,
            save_s=args.save_s,
            ckpt_every=args.ckpt_every,
            steps=args.steps,
            seed=args.seed,
            warm=not args.cold,
        )
    except SettingsError as exc:
        raise UsageError(str(exc)) from None


def node_names(prefix: str, first: int, count: int, width: int) -> list[str]:
    names = [f"{prefix}{i:0{width}d}" for i in range(first, first + count)]
    if not names:
        raise UsageError("no nodes: --nodes / --count must be at least 1")
    try:
        for name in (names[0], names[-1]):
            check_name("node name", name)
    except ValueError as exc:
        raise UsageError(f"--prefix {prefix!r}: {exc}") from None
    return names


def width_for(nodes: int) -> int:
    return max(4, len(str(max(nodes - 1, 0))))
