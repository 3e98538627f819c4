"""The shell's waiting work off the loop: a launch, a planned stop's wait for the exits, a dump
collection, a claim before a preflight, the scheduler's calls, the bandwidth gate.

Agent RPCs themselves hold no thread: they run as coroutines on the agent clients' one asyncio loop
(controller.backends.agents), so a 2,048-host fan-out is one round trip on one thread, a burn-in of
4,000 s waits on no thread at all, and however many nodes burn in, every other call goes on. A task
here waits for its fan-out once (`AgentClients.gather`), never on a thread of its own pool.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

log = logging.getLogger(__name__)

# Tasks at once: each waits on the agents' loop or the store, so a few cover every kind the executor
# starts (at most one launch, stop and collection of an attempt, plus the scheduler's calls).
TASK_BOUND = 16


class TaskPool:
    """A bounded thread pool for the shell's tasks; thread-safe."""

    def __init__(self, bound: int = TASK_BOUND) -> None:
        self._pool = ThreadPoolExecutor(max_workers=max(1, bound), thread_name_prefix="task")

    def submit(self, fn: Callable[..., None], *args: object) -> Future[None]:
        """Run `fn(*args)` on the pool. An exception escaping it is a bug: logged with its traceback."""

        def guarded() -> None:
            try:
                fn(*args)
            except Exception:
                log.exception("%s failed", getattr(fn, "__name__", fn))

        return self._pool.submit(guarded)

    def shutdown(self, *, wait: bool = False) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=True)
