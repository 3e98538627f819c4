"""`controller`: the supervisor daemon.

    controller run --config controller.toml [--etcd HOST:PORT] [--api ADDRESS] [--identity NAME]

It campaigns for leadership in etcd (a standby waits), rebuilds its view from etcd, and supervises
the run; the Controller gRPC API (for `controllerctl`) is served by every replica, and a standby
answers reads from etcd. SIGTERM/SIGINT stop it cleanly.

`[controller] backend` says who places the node agents (agents, slurm, ray, kubernetes); the leader
allocates through it and gives the allocation back when the run is over.

Exit codes: 0 stopped cleanly (by a signal) or the run completed, 2 bad config or etcd unreachable
at start. With --exit-when-done the controller exits when the run is over, with the exit code
contract of controller/backends/base.py (a batch script reads it): 0 completed, 75 stopped cleanly
and resumable from its commit (requeue), 3 failed: crash loop or restart budget spent (do not requeue).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Any

from runwarden.config import ConfigError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="controller", description="runwarden's run supervisor daemon")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the controller (leader election, supervision, API)")
    run.add_argument("--config", help="TOML config file (see controller/live/config.py)")
    run.add_argument("--etcd", help="etcd endpoints, comma-separated (overrides the file and env)")
    run.add_argument("--api", help="Controller API listen address (host:port)")
    run.add_argument("--identity", help="this replica's name in the election")
    run.add_argument("--metrics", help="Prometheus /metrics address (host:port; '' = off)")
    run.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    run.add_argument(
        "--exit-when-done",
        action="store_true",
        help="exit when the run is over: 0 completed, 75 stopped (requeue), 3 failed (do not requeue)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    from controller.api.access import AccessPolicy
    from controller.api.server import ServerTLS, build_server
    from controller.live.config import load_controller_config
    from controller.live.loop import LiveController, ShellConfig
    from controller.live.paging import Pager
    from controller.live.view import LiveView
    from controller.supervisor.machine import Supervisor
    from controller.supervisor.policy import RunPlan
    from runwarden.store import Store, StoreError

    overrides: dict[str, Any] = {}
    if args.etcd:
        overrides["store.endpoints"] = [e for e in args.etcd.split(",") if e]
    if args.api:
        overrides["controller.api_address"] = args.api
    if args.identity:
        overrides["controller.identity"] = args.identity
    if args.metrics is not None:
        overrides["controller.metrics_address"] = args.metrics
    try:
        cfg = load_controller_config(args.config, overrides)
        scheduler = cfg.scheduler()
    except ConfigError as exc:
        print(f"controller: {exc}", file=sys.stderr)
        return 2
    try:
        store = Store.connect(cfg.store)
    except StoreError as exc:
        print(f"controller: {exc}", file=sys.stderr)
        return 2
    run = cfg.run
    shell_kwargs: dict[str, Any] = {
        "run": run.run,
        "command": tuple(run.command),
        "run_dir": run.run_dir,
        "election_ttl_s": run.election_ttl_s,
        "tick_s": run.tick_s,
        "env": tuple(sorted(run.env.items())),
        "procs_per_node": run.procs_per_node,
        "spares": run.spares,
    }
    if run.identity:
        shell_kwargs["identity"] = run.identity
    from controller.live.agents import AgentClients

    pager = Pager(cfg.paging)
    shell = LiveController(
        ShellConfig(**shell_kwargs),
        store,
        lambda: Supervisor(cfg.policy, RunPlan(run=run.run, nodes=run.nodes)),
        agents=AgentClients(cfg.agent_tls),
        pager=pager,
        scheduler=scheduler,
    )
    tls = None
    if cfg.api_tls is not None:
        tls = ServerTLS(
            cert_pem=cfg.api_tls.cert.read_bytes(),
            key_pem=cfg.api_tls.key.read_bytes(),
            client_ca_pem=cfg.api_tls.ca.read_bytes(),
        )
    try:
        server, port = build_server(LiveView(shell), run.api_address, tls=tls, policy=AccessPolicy())
    except (ValueError, OSError) as exc:
        print(f"controller: {exc}", file=sys.stderr)
        return 2
    server.start()
    if run.metrics_address:
        try:
            _serve_metrics(run.metrics_address, shell.cfg.event_log_path, run.run)
        except OSError as exc:
            print(
                f"controller: cannot serve metrics on {run.metrics_address}: {exc.strerror}", file=sys.stderr
            )
            server.stop(grace=None)
            return 2
    logging.getLogger("controller").info("Controller API on port %d; identity %s", port, shell.cfg.identity)
    done = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        shell.stop()
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    worker = threading.Thread(target=shell.run, name="supervisor", daemon=True)
    worker.start()
    while not done.is_set() and worker.is_alive():
        if args.exit_when_done and shell.done.is_set():
            break
        done.wait(0.5)
    shell.close()
    server.stop(grace=1.0)
    store.close()
    if not pager.flush():  # a page in flight (the crash loop's, the budget's) is delivered first
        logging.getLogger("controller").warning("a page was still being delivered at exit")
    if args.exit_when_done and shell.outcome is not None:
        code = shell.outcome.exit_code
        logging.getLogger("controller").info("the run is over (%s): exit %d", shell.outcome.value, code)
        return code
    return 0


def _serve_metrics(address: str, event_log: Any, run: str) -> None:
    """Prometheus /metrics: the goodput report, computed from the event log at scrape time."""
    from prometheus_client import CollectorRegistry, start_http_server

    from controller.goodput.metrics import register_goodput_metrics
    from controller.goodput.report import compute_goodput
    from runwarden.eventlog import read_events

    registry = CollectorRegistry()
    register_goodput_metrics(registry, lambda: [compute_goodput(read_events(event_log).events, run=run)])
    host, _, port = address.rpartition(":")
    start_http_server(int(port), addr=host or "127.0.0.1", registry=registry)
    logging.getLogger("controller").info("Prometheus metrics on %s", address)


if __name__ == "__main__":
    sys.exit(main())
