"""The fleet tests' fixtures: a module-scoped `Fleet` of network-namespace hosts (FLEET.md).

Each test module gets its own fleet under this run's prefix (``rw<pid>``), made after sweeping the
leftovers of crashed earlier runs and torn down after the module, with a check that nothing of
the prefix is left. Without network namespaces (not root, no iproute2) the tests skip and say why.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from testbed.fleet import Fleet, Host, available, default_prefix, namespaces, sweep, sweep_orphans

NETTOOLS = Path(__file__).with_name("nettools.py")


def require_namespaces() -> None:
    ok, reason = available()
    if not ok:
        pytest.skip(f"skipped: no network namespaces ({reason})")


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    require_namespaces()
    prefix = default_prefix()
    sweep_orphans()
    sweep(prefix)
    with Fleet(prefix) as made:
        yield made
    assert namespaces(prefix) == [], "the fleet left namespaces behind"


@pytest.fixture
def nettool() -> Callable[..., subprocess.CompletedProcess[str]]:
    """``nettool(host, "echo", addr, port, text)``: run nettools.py on `host` to completion."""

    def run(host: Host, *args: object, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return host.run([sys.executable, str(NETTOOLS), *map(str, args)], timeout=timeout)

    return run


def start_server(host: Host, kind: str, port: int) -> subprocess.Popen[str]:
    """A nettools server (`serve-echo` / `serve-sink`) on `host`, listening once this returns."""
    proc = host.popen(
        [sys.executable, str(NETTOOLS), f"serve-{kind}", str(port)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "listening"
    return proc
