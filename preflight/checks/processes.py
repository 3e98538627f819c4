"""Processes that should not be on the node: a stray holding GPU memory, a leftover rank of an ended
attempt. Who may hold GPU memory is a `ProcessView`'s answer: alone (`preflight run`, a Slurm
prolog) `OwnTree`, the preflight's own children; inside the node agent the agent's view
(nodeagent.daemon.leftovers), which also knows which processes are leftovers of its ended attempts.
A process's attempt is read from the environment the agent's launcher gives every rank.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from preflight.checks.base import CheckContext, CheckSpec, own_process_tree
from preflight.config import MODES
from preflight.result import CheckResult, failed, passed

# The variables nodeagent.daemon.launcher.worker_env sets (preflight does not import the agent).
NODE_ENV, RUN_ENV, ATTEMPT_ENV = "RUNWARDEN_NODE", "RUNWARDEN_RUN", "RUNWARDEN_ATTEMPT"
AGENT_ENV = "RUNWARDEN_NODEAGENT_SOCKET"
OLD_AGENT_ENV = "RUNWARDEN_AGENT_SOCKET"  # before it moved out of the agent's config prefix
MAX_ENVIRON_BYTES = 1 << 20  # a bound on what is read of one process's environment
LEFTOVERS_TIMEOUT_S = 5.0  # a /proc scan: milliseconds on a busy host; more means /proc is stuck


@dataclass(frozen=True, slots=True, kw_only=True)
class Origin:
    """The attempt a process belongs to, and how that is known."""

    node: str
    run: str
    attempt: int
    how: str  # "its environment" | "seen in the attempt's process tree"
    # The socket of the agent that launched it ("" unknown): two agents on one host (tests, a demo)
    # may share a node name, never a socket; an agent restarted with its config keeps its socket.
    agent: str = ""

    def describe(self) -> str:
        node = f"node {self.node} " if self.node else ""
        return f"{node}run {self.run} attempt {self.attempt} ({self.how})"


@dataclass(frozen=True, slots=True, kw_only=True)
class Leftover:
    """A live process of an attempt that has ended on this node."""

    pid: int
    name: str
    origin: Origin

    def describe(self) -> str:
        return f"pid={self.pid} name={self.name} from {self.origin.describe()}"


class ProcessView(Protocol):
    """Inside the agent its whole tree is not "ours": the agent is the subreaper of its earlier ranks, and
    a killed attempt's rank that keeps its GPU memory would make the next attempt run out of memory on
    a healthy node. The origin comes from `RUNWARDEN_NODE`, `RUNWARDEN_RUN`, `RUNWARDEN_ATTEMPT` and
    `RUNWARDEN_NODEAGENT_SOCKET` (`RUNWARDEN_AGENT_SOCKET` from older agents; see
    nodeagent.daemon.launcher.worker_env), which torchrun, the ranks and their children inherit;
    /proc/<pid>/environ is the environment at exec, so a rank that changes its own environment later
    still shows it.
    """

    def allowed(self, pid: int) -> bool:
        """Whether `pid` may hold GPU memory now (asked when NVML lists it, so children started
        since the preflight began are judged as they are then)."""
        ...

    def origin(self, pid: int) -> Origin | None:
        """The attempt `pid` came from, when known."""
        ...


def origin_in(env: Mapping[str, str], how: str) -> Origin | None:
    run, attempt = env.get(RUN_ENV, ""), env.get(ATTEMPT_ENV, "")
    if not run or not attempt.isdigit():
        return None
    return Origin(
        node=env.get(NODE_ENV, ""),
        run=run,
        attempt=int(attempt),
        how=how,
        agent=env.get(AGENT_ENV) or env.get(OLD_AGENT_ENV, ""),
    )


def environ_of(pid: int) -> dict[str, str] | None:
    """The process's environment at exec; None when it cannot be read (gone, another user's)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            raw = fh.read(MAX_ENVIRON_BYTES)
    except OSError:
        return None
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key.startswith(b"RUNWARDEN_"):  # the only ones read; the rest may be large
            env[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return env


# The markers this process itself was started with (a preflight run from inside a rank's
# environment, say): its own children inherit them, so they say nothing about a leftover.
_INHERITED = origin_in(os.environ, "its environment")


def origin_from_environ(pid: int) -> Origin | None:
    env = environ_of(pid)
    origin = None if env is None else origin_in(env, "its environment")
    return None if origin == _INHERITED else origin


class OwnTree:
    """Outside the agent: this process and its descendants may hold GPU memory, nothing else."""

    def allowed(self, pid: int) -> bool:
        return pid in own_process_tree()

    def origin(self, pid: int) -> Origin | None:
        return origin_from_environ(pid)


def leftover_result(leftovers: list[Leftover], remedy: str) -> CheckResult:
    name = "processes.leftover_ranks"
    if not leftovers:
        return passed(name, "no process of an ended attempt is alive", value=0, unit="count", threshold=0)
    shown = ", ".join(
        f"pid {o.pid} ({o.name}, run {o.origin.run} attempt {o.origin.attempt})" for o in leftovers
    )
    return failed(
        name,
        f"{len(leftovers)} process(es) of ended attempts still alive: {shown}",
        value=len(leftovers),
        unit="count",
        threshold=0,
        evidence=tuple(o.describe() for o in leftovers),
        remedy=remedy,
    )


def leftovers_spec(find: Callable[[], list[Leftover]], remedy: str) -> CheckSpec:
    """The `processes` unit, for a caller that knows its ended attempts (the node agent)."""

    def run(ctx: CheckContext) -> list[CheckResult]:
        return [leftover_result(find(), remedy)]

    return CheckSpec(
        name="processes", run=run, timeout_s=lambda c, m: LEFTOVERS_TIMEOUT_S, modes=lambda c: MODES
    )
