"""`controller`: the supervisor daemon.

    controller run --config controller.toml [--etcd HOST:PORT] [--api ADDRESS] [--identity NAME]

It campaigns for leadership in etcd (a standby waits), rebuilds its view from etcd, and supervises
the run (controller/live/loop.py); the Controller gRPC API (for `controllerctl`) is served by every
replica, and a standby answers reads from etcd. `[controller] backend` says who places the node
agents (agents, slurm, ray, kubernetes); the leader allocates through it and gives the allocation
back when the run is over. `main` says how it stops, its signals, systemd and its exit
codes.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from runwarden.config import ConfigError
from runwarden.sdnotify import Notifier, watchdog_interval_s

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from runwarden.store import Store


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="controller", description="runwarden's run supervisor daemon")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the controller (leader election, supervision, API)")
    run.add_argument("--config", help="TOML config file (see controller/live/config.py)")
    run.add_argument("--etcd", help="etcd endpoints, comma-separated (overrides the file and env)")
    run.add_argument("--api", help="Controller API listen address (host:port)")
    run.add_argument("--identity", help="this replica's name in the election")
    run.add_argument(
        "--metrics",
        help="Prometheus /metrics address (host:port; default 127.0.0.1:9401, loopback; '' or port 0 = off)",
    )
    run.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    run.add_argument(
        "--resume",
        action="store_true",
        help="launch a run that a stop ended before this start again (implied by --exit-when-done)",
    )
    run.add_argument(
        "--exit-when-done",
        action="store_true",
        help="exit when the run is over: 0 completed, 75 stopped (requeue), 3 failed (do not requeue); "
        "implies --resume",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """The `controller` command.

    SIGTERM/SIGINT stop it cleanly. SIGHUP re-reads the config file's [policy] and makes it the run's policy the way `controllerctl config apply` does (validated whole, written to
    etcd with a compare-and-swap, applied by the leader; a bad file is refused with a log line and
    nothing changes); the other sections take effect at the next start.

    Under systemd (deploy/systemd/controller.service, Type=notify) it sends READY=1 once its API serves,
    and WATCHDOG=1 every WatchdogSec/2 while the supervisor thread's loop turns (campaigning or leading):
    a wedged controller is killed and restarted, and its standby takes over meanwhile.

    Exit codes: 0 stopped cleanly (by a signal) or the run completed, 2 bad config or etcd unreachable
    at start. With --exit-when-done the controller exits when the run is over, with the exit code
    contract of controller/backends/base.py (a batch script reads it): 0 completed, 75 stopped cleanly
    and resumable from its commit (requeue), 3 failed: crash loop or restart budget spent (do not requeue).

    A stop that ends the run stays in etcd, so a restarted daemon (systemd's Restart=always, a watchdog
    kill, a reboot) does not launch a run an operator stopped. --resume says a new launch is wanted: a
    run-ending stop requested before this process started is cleared when it takes office (logged: it
    becomes a relaunching stop, which the relaunch retires), and the run resumes from its latest commit;
    a stop requested after the start (a time limit's notice while it starts) is honoured.
    --exit-when-done implies it: its exit 75 asks for exactly that requeue (deploy/slurm/runwarden.sbatch
    with RUNWARDEN_MODE=controller requeues the job on 75).
    """
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    from controller.api.access import AccessPolicy
    from controller.api.server import ServerTLS, build_server
    from controller.live.config import DEFAULT_METRICS_ADDRESS, load_controller_config
    from controller.live.loop import LiveController, ShellConfig
    from controller.live.paging import Pager
    from controller.live.view import LiveView
    from controller.supervisor.machine import Supervisor
    from controller.supervisor.policy import RunPlan
    from runwarden.store import START_WAIT_S, Store, StoreError

    started_at = time.time()  # a run-ending stop older than this is cleared with --resume
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
        store = Store.connect(cfg.store, wait_s=START_WAIT_S)
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
        "priority": run.priority,
        "script_mode": run.script_mode,
    }
    if run.identity:
        shell_kwargs["identity"] = run.identity
    if args.resume or args.exit_when_done:
        shell_kwargs["resume_stopped_before"] = started_at
    from controller.backends.agents import AgentClients

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
            from controller.live.metrics import ControlPlaneCollector

            control_plane = ControlPlaneCollector(
                LiveView(shell),
                run=run.run,
                identity=shell.cfg.identity,
                spares_wanted=run.spares,
                is_leader=shell.is_leader.is_set,
            )
            _serve_metrics(run.metrics_address, shell.cfg.event_log_path, control_plane)
        except (OSError, ValueError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else str(exc)
            if run.metrics_address == DEFAULT_METRICS_ADDRESS:
                # the default port taken (a second replica on this host): supervise without metrics
                logging.getLogger("controller").warning(
                    "no /metrics: cannot serve on the default %s (%s); give --metrics HOST:PORT",
                    run.metrics_address,
                    why,
                )
            else:
                print(f"controller: cannot serve metrics on {run.metrics_address}: {why}", file=sys.stderr)
                server.stop(grace=None)
                return 2
    logging.getLogger("controller").info("Controller API on port %d; identity %s", port, shell.cfg.identity)
    done = threading.Event()
    reload = threading.Event()
    wake = threading.Event()  # the main loop's sleep, cut short by any signal

    def on_signal(signum: int, _frame: Any) -> None:
        shell.stop()
        done.set()
        wake.set()

    def on_hangup(signum: int, _frame: Any) -> None:
        reload.set()  # the main loop re-reads the file: no I/O inside a signal handler
        wake.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_hangup)
    worker = threading.Thread(target=shell.run, name="supervisor", daemon=True)
    worker.start()
    notifier = Notifier()
    watchdog_s = watchdog_interval_s()
    notifier.ready(f"{shell.cfg.identity}: API on port {port}")
    while not done.is_set() and worker.is_alive():
        if args.exit_when_done and shell.done.is_set():
            break
        if reload.is_set():
            reload.clear()
            reload_policy(args.config, overrides, store, run.run, shell.cfg.identity)
        if watchdog_s and time.monotonic() - shell.alive_at < 2 * watchdog_s:
            notifier.watchdog()  # a supervisor loop stuck for WatchdogSec gets no more pings
        wake.wait(min(0.5, watchdog_s or 0.5))
        wake.clear()
    notifier.stopping()
    shell.close()
    # the supervisor thread resigns its election key on the way out: the standby leads now, not
    # after the lease TTL (an upgrade's handover), so etcd is closed only after it
    worker.join(timeout=5.0)
    server.stop(grace=1.0)
    store.close()
    if not pager.flush():  # a page in flight (the crash loop's, the budget's) is delivered first
        logging.getLogger("controller").warning("a page was still being delivered at exit")
    if args.exit_when_done and shell.outcome is not None:
        code = shell.outcome.exit_code
        logging.getLogger("controller").info("the run is over (%s): exit %d", shell.outcome.value, code)
        return code
    return 0


def reload_policy(path: str | None, overrides: dict[str, Any], store: Store, run: str, identity: str) -> bool:
    """SIGHUP: the config file's [policy] becomes the run's policy, whole (controller/api/policy.py);
    whether it was written. A bad file or an unreachable etcd is a log line, never an exit."""
    from controller.api import policy as policy_store
    from controller.live.config import load_controller_config
    from controller.supervisor.reconfigure import describe
    from runwarden.store import StoreError

    log = logging.getLogger("controller")
    if not path:
        log.warning("SIGHUP: no --config file to re-read; the policy is unchanged")
        return False
    try:
        new = load_controller_config(path, overrides).policy
        changed, revision = policy_store.update(
            store,
            run,
            lambda _current: new,
            changed_by=f"controller {identity} (SIGHUP)",
            reason=f"re-read {path}",
            now=time.time(),
        )
    except ConfigError as exc:
        log.error("SIGHUP: %s; the policy is unchanged", exc)
        return False
    except (StoreError, policy_store.PolicyConflict) as exc:
        log.error("SIGHUP: the policy from %s was not stored: %s; it is unchanged", path, exc)
        return False
    if changed:
        log.info("SIGHUP: policy from %s stored (revision %d): %s", path, revision, describe(changed))
    else:
        log.info("SIGHUP: %s has the policy in force already; nothing changed", path)
    return True


def _serve_metrics(address: str, event_log: Any, *extra: Collector) -> Callable[[], None] | None:
    """Prometheus /metrics: every run's windowed rates (1 h, 24 h, 7 d) and whole-run goodput, folded
    in from the event log by a follower thread as lines are appended; a scrape never re-reads the log
    (controller/goodput/windows.py); and ``extra`` collectors (the leader and the pool,
    controller/live/metrics.py). Returns what stops them, or None for port 0 ("0", "HOST:0": off, as
    "" is); ValueError for an address that is not HOST:PORT."""
    from prometheus_client import CollectorRegistry, start_http_server

    from controller.goodput.metrics import WindowedRatesCollector

    host, _, port = address.rpartition(":")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT with a port in 0..65535 (0 = off), got {address!r}")
    if int(port) == 0:
        logging.getLogger("controller").info("Prometheus metrics off (port 0)")
        return None
    registry = CollectorRegistry()
    collector = WindowedRatesCollector(event_log)
    registry.register(collector)
    for c in extra:
        registry.register(c)
    httpd, _ = start_http_server(int(port), addr=host.strip("[]") or "127.0.0.1", registry=registry)
    stop = threading.Event()
    threading.Thread(target=collector.follow, args=(stop,), name="metrics", daemon=True).start()
    logging.getLogger("controller").info("Prometheus metrics on %s", address)

    def close() -> None:
        stop.set()
        httpd.shutdown()
        httpd.server_close()

    return close


if __name__ == "__main__":
    sys.exit(main())
