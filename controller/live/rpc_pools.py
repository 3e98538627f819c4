"""The shell's slow work off the loop, in pools by kind, each with its own bound.

One pool for every kind of work let sixteen burn-ins (each up to `burn_in_timeout_s`) starve an
attempt's preflights, stops and dump collection, and fanned a 2,048-host attempt's calls out sixteen
at a time. Here:

* `TASK`: work that waits on others (a launch, a planned stop's wait for the exits, a dump
  collection, the scheduler's calls, the bandwidth gate); few at a time, and it fans its calls out
  on CALL, never on TASK, so a task never waits for a thread of its own pool.
* `CALL`: one agent RPC to one node (launch, stop, planned-stop request, dumps); never waits on a
  pool. Bounded at a fleet's size, so an attempt's fan-out is one round trip, not hosts/32 of them.
* `PREFLIGHT`: one attempt preflight of one node (seconds to tens of seconds on real GPUs); the whole
  fleet at once, so no host's answer waits behind another's and comes late for the core's timer.
* `BURN_IN`: one burn-in (up to `burn_in_timeout_s`); its own few threads, so however many nodes burn
  in, every other call of this run goes on.

Threads start when work arrives and stay for the next; a pool past its bound queues its work, and an
RPC's deadline counts from when it is sent (controller.backends.agents.with_retries), so a call that
queued is never cut short for the time it waited.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class RpcKind(enum.Enum):
    TASK = "task"
    CALL = "call"
    PREFLIGHT = "preflight"
    BURN_IN = "burn-in"


# A fleet's size: 2,048 hosts (16,384 GPUs at 8 a host) are measured (BENCHMARKS.md, "the live
# controller at fleet scale"); a larger fleet queues the excess, which costs a round trip per 4,096.
FLEET_BOUND = 4096
BOUNDS: dict[RpcKind, int] = {
    RpcKind.TASK: 16,
    RpcKind.CALL: FLEET_BOUND,
    RpcKind.PREFLIGHT: FLEET_BOUND,
    RpcKind.BURN_IN: 32,
}


class RpcPools:
    """A bounded thread pool per `RpcKind`; thread-safe."""

    def __init__(self, bounds: dict[RpcKind, int] | None = None) -> None:
        given = {**BOUNDS, **(bounds or {})}
        self._pools = {
            kind: ThreadPoolExecutor(max_workers=max(1, given[kind]), thread_name_prefix=f"rpc-{kind.value}")
            for kind in RpcKind
        }

    def submit(self, kind: RpcKind, fn: Callable[..., None], *args: object) -> Future[None]:
        """Run `fn(*args)` on `kind`'s pool. An exception escaping it is a bug: logged with its traceback."""

        def guarded() -> None:
            try:
                fn(*args)
            except Exception:
                log.exception("%s failed", getattr(fn, "__name__", fn))

        return self._pools[kind].submit(guarded)

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
        """`fn` over `items` at once on the CALL pool, results in order (a fan-out of agent RPCs).
        From a TASK or any other thread but a CALL one (a call never waits on its own pool)."""
        return list(self._pools[RpcKind.CALL].map(fn, items))

    def shutdown(self, *, wait: bool = False) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=wait, cancel_futures=True)
