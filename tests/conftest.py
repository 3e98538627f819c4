"""Project-wide fixtures: a real private etcd per test, a store connected to it, free ports.

* ``etcd``: a started ``EtcdServer`` (fast raft timings: minimum lease TTL 1 s), function scope,
  stopped at teardown. Its data dir is under the test's tmp_path.
* ``etcd_factory``: call it (``etcd_factory(tls=..., extra_args=...)``) for more servers or special
  ones; every server it made is killed at teardown.
* ``store``: a ``Store`` connected to ``etcd`` (default key root); closed at teardown.
* ``free_port``: a TCP port free on 127.0.0.1 right now.
"""

from __future__ import annotations

import itertools
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from runwarden.store import Store, StoreConfig
from runwarden.testing.etcd_server import EtcdServer
from runwarden.testing.etcd_server import free_port as _free_port

_counter = itertools.count()


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
        server.kill()  # a test's etcd holds nothing worth a clean shutdown


@pytest.fixture
def etcd(etcd_factory: Callable[..., EtcdServer]) -> EtcdServer:
    return etcd_factory()


@pytest.fixture
def store(etcd: EtcdServer) -> Iterator[Store]:
    connected = Store.connect(StoreConfig(endpoints=(etcd.endpoint,), timeout_s=5.0))
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
