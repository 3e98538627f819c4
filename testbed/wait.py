"""Waiting in tests for an event, never for a fixed time.

``wait_until(condition, timeout_s, what)`` polls `condition` until it returns something truthy and
returns that; after `timeout_s` it raises AssertionError naming `what` (and `detail()`, what a
failure needs to be understood: a log tail, the last state seen). The poll interval is how often
the condition is read, not a wait for anything. ``wait_contender``: a controller replica stands in
its run's election (a standby is up and campaigning).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from runwarden.keys import run_election
from runwarden.store import Store, StoreConfig

T = TypeVar("T")


def wait_until(
    condition: Callable[[], T | None],
    timeout_s: float,
    what: str,
    interval_s: float = 0.02,
    *,
    detail: Callable[[], object] | None = None,
) -> T:
    """The first truthy value of `condition()`; AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            extra = f"\n{detail()}" if detail is not None else ""
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}{extra}")
        time.sleep(interval_s)


def wait_contender(store: Store | str, run: str, identity: str, timeout_s: float = 60.0) -> None:
    """Until controller `identity` has its contender key in run `run`'s election (on `store`, or on
    the etcd at endpoint `store`). It campaigns in turns of a second: the key is there most of the time."""
    if isinstance(store, str):
        with Store.connect(StoreConfig(endpoints=(store,), timeout_s=5.0)) as connected:
            wait_contender(connected, run, identity, timeout_s)
        return
    prefix = store.keys.election(run_election(run))

    def contenders() -> list[str]:
        return [kv.value.decode("utf-8", "replace") for kv in store.get_prefix(prefix)[0]]

    wait_until(
        lambda: identity in contenders(),
        timeout_s,
        f"{identity} to campaign in run {run}'s election",
        detail=lambda: f"contenders: {contenders()}",
    )
