"""Project-wide fixtures: a real private etcd per test, a store connected to it, free ports.

* ``etcd``: a started ``EtcdServer`` (fast raft timings: minimum lease TTL 1 s), function scope,
  stopped at teardown. Its data dir is under the test's tmp_path.
* ``etcd_factory``: call it (``etcd_factory(tls=..., extra_args=...)``) for more servers or special
  ones; every server it made is killed at teardown.
* ``store``: a ``Store`` connected to ``etcd`` (default key root); closed at teardown.
* ``free_port``: a TCP port free on 127.0.0.1 right now.

With pytest-xdist (`scripts/test.sh` runs two workers on the 2-core machine, `--dist loadscope`) the
unit of scheduling is set here: the modules that start a whole deployment, a Slurm or Ray cluster or a
fleet of network namespaces form one scope, "heavy", run in order on one worker (they share
machine-wide things: Slurm's daemons, namespaces, the CPU their timing assumes), and every other module
is its own scope, so that its module-scoped fixtures start once. The heavy modules are collected first,
so one worker starts on them at once while the other takes the light modules, at a lower CPU priority
(`LIGHT_NICE`). `RUNWARDEN_TEST_WORKERS=0 scripts/test.sh` runs the suite in one process, as before.
"""

from __future__ import annotations

import itertools
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from runwarden.store import Store, StoreConfig
from testbed.etcd_server import EtcdServer
from testbed.etcd_server import free_port as _free_port

_counter = itertools.count()

# Modules (by path prefix, relative to the repository) that run on the one "heavy" xdist worker: the
# deployments, and the modules whose assertions are about timing (a rank's compute vs wait, a lease
# running out, a bandwidth figure, a warm hand-off), which must not share the CPU with a second worker.
HEAVY_MODULES = (
    "tests/e2e/",
    "tests/fleet/",
    "tests/backends/test_slurm",
    "tests/backends/test_ray",  # after the e2e: Ray's raylets have failed to start in a suite's busy first minutes
    "tests/bench/",
    "tests/reliability/test_control_plane_faults.py",
    "tests/reliability/test_checkpoint_failure.py",
    "tests/live/test_bandwidth.py",
    "tests/live/test_unmodified_script.py",
    "tests/live/test_many_runs.py",
    "tests/nodeagent/test_timing.py",
    "tests/nodeagent/test_self_fencing.py",
    "tests/nodeagent/test_warm_",
    "tests/supervisor/test_scale.py",
    "tests/lightfleet/test_controller.py",
    "tests/lightfleet/test_leases.py",
)
# The light worker's tests (and what they start) run at this niceness, so that when both workers want
# the CPU the heavy worker's timing is the one kept; it is set per test, which needs root to lower
# again (CI runs as root; elsewhere every test keeps the worker's own niceness).
LIGHT_NICE = 10


def _heavy(nodeid: str) -> bool:
    return nodeid.startswith(HEAVY_MODULES)


def _order(nodeid: str) -> int:
    """The heavy modules first, in HEAVY_MODULES' order; then the rest."""
    return next(
        (i for i, prefix in enumerate(HEAVY_MODULES) if nodeid.startswith(prefix)), len(HEAVY_MODULES)
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.pluginmanager.hasplugin("xdist"):
        items.sort(key=lambda item: _order(item.nodeid))  # stable: collection order within each


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") and os.geteuid() == 0:
        os.setpriority(os.PRIO_PROCESS, 0, 0 if _heavy(item.nodeid) else LIGHT_NICE)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's loadscope, with this suite's scopes: "heavy" for the deployments, else the module."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleAndHeavyScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "heavy" if _heavy(nodeid) else nodeid.split("::", 1)[0]

    return ModuleAndHeavyScheduling(config, log)


# Seconds each worker spent in each module (setup + call + teardown), summed in the controlling
# process from the workers' reports: the summary shows which worker bounds the suite's wall time.
_busy: dict[str, dict[str, float]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    worker = getattr(getattr(report, "node", None), "gateway", None)
    if worker is None:
        return  # a worker's own report (or no xdist): the controlling process sums them
    module = report.nodeid.split("::", 1)[0]
    per = _busy.setdefault(worker.id, {})
    per[module] = per.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _busy:
        return
    terminalreporter.section("time per worker")
    for worker, per in sorted(_busy.items()):
        top = sorted(per.items(), key=lambda kv: -kv[1])[:12]
        terminalreporter.write_line(
            f"{worker}: {sum(per.values()):.0f} s in {len(per)} modules; the longest: "
            + ", ".join(f"{m.removeprefix('tests/')} {t:.0f}" for m, t in top)
        )


@pytest.fixture
def etcd_factory(tmp_path: Path) -> Iterator[Callable[..., EtcdServer]]:
    servers: list[EtcdServer] = []

    def make(**kwargs: Any) -> EtcdServer:
        kwargs.setdefault("fast", True)
        data_dir = tmp_path / f"etcd-{next(_counter)}" / "data"
        server = EtcdServer(data_dir, **kwargs)
        servers.append(server)
        return server.start()

    yield make
    for server in servers:
        server.discard()  # a test's etcd holds nothing worth a clean shutdown, or worth keeping


@pytest.fixture
def etcd(etcd_factory: Callable[..., EtcdServer]) -> EtcdServer:
    return etcd_factory()


@pytest.fixture
def store(etcd: EtcdServer) -> Iterator[Store]:
    # wait_s: on a machine under load the first handshake can take longer than the timeout
    connected = Store.connect(StoreConfig(endpoints=(etcd.endpoint,), timeout_s=5.0), wait_s=30.0)
    yield connected
    connected.close()


@pytest.fixture
def free_port() -> int:
    return _free_port()


@pytest.fixture(scope="module", autouse=True)
def _signal_handlers_per_module() -> Iterator[None]:
    """A module that drives a library which installs process-wide signal handlers (ray.init sets a
    SIGTERM handler that exits) must not leave them to the modules after it."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    yield
    for sig, handler in saved.items():
        if signal.getsignal(sig) is not handler and handler is not None:
            signal.signal(sig, handler)
