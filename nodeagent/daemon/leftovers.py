"""Leftovers of this agent's ended attempts: found by the preflight, killed by the agent after it.

The agent is the subreaper of its ranks, so preflight's usual rule (the caller's own process tree
may hold GPU memory) would hide exactly the process that matters: a rank of an earlier attempt that
outlived it. A process is a *leftover* when it is alive and

* it was seen in an ended attempt's process tree (the launcher records every pid with its start
  time, so a reused pid is never mistaken for it), or
* its environment says this agent started it (this node's name and this agent's socket) for an
  attempt that is not running here now (`RUNWARDEN_NODE/RUN/ATTEMPT`, `RUNWARDEN_NODEAGENT_SOCKET`,
  which torchrun, the ranks and their children inherit): this finds
  a process that escaped before the launcher first saw it (setsid and a double fork) and the ranks
  of an earlier incarnation of this agent (a crashed agent's ranks are re-parented to init),

and every process below a leftover is one too. Everything else in the agent's own tree (the running
attempt's processes, the parked warm groups, the children preflight and the RPCs start) may hold GPU
memory; nothing outside it may.

After a preflight that looked, the agent kills what it reported: TERM to every process of each
leftover's tree, KILL to what is left after `grace_s`, zombies reaped, and says what happened to each
pid (the log, and the preflight's failure evidence). A process that survives KILL is in the kernel
(state D, usually the GPU driver) and keeps failing the check until it ends.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from nodeagent.daemon import proctree
from nodeagent.daemon.launcher import Worker
from preflight.checks import processes
from preflight.checks.base import CheckContext, CheckSpec, process_name
from preflight.checks.processes import Leftover, Origin
from preflight.config import MODES
from preflight.result import CheckResult, warned

log = logging.getLogger(__name__)
KILL_WAIT_S = 1.0  # after a KILL: how long to wait for the tree to go
KILL_PASSES = 3  # a process in the kernel (state D) ignores KILL: the bound is 3 x KILL_WAIT_S
SEEN_IN_TREE = "seen in the attempt's process tree"


@dataclass(frozen=True, slots=True, kw_only=True)
class _Found:
    leftover: Leftover
    start_ticks: int


def find(
    node: str, socket: str, workers: Sequence[Worker], procs: list[proctree.ProcInfo]
) -> dict[int, _Found]:
    """The leftovers in `procs` (a /proc snapshot), by pid, of the agent of `node` serving `socket`."""
    me = os.getpid()
    live = {p.pid: p for p in proctree.alive(procs)}
    running = [w for w in workers if w.running]
    current = {p.pid for w in running for p in w.track()}
    current_attempts = {(w.run, w.attempt) for w in running}
    origins: dict[int, Origin] = {}
    for w in workers:
        if w.running:
            continue
        for pid, start in dict(w.seen).items():
            p = live.get(pid)
            if p is not None and p.start_ticks == start and pid not in current:
                origins[pid] = Origin(node=node, run=w.run, attempt=w.attempt, how=SEEN_IN_TREE, agent=socket)
    for pid in live:
        if pid in origins or pid in current or pid == me:
            continue
        origin = processes.origin_from_environ(pid)
        if (
            origin is not None
            and (origin.node, origin.agent) == (node, socket)  # this agent's, not a neighbour's
            and (origin.run, origin.attempt) not in current_attempts
        ):
            origins[pid] = origin
    for root, origin in list(origins.items()):  # a leftover's own children (data loaders, ...)
        for pid in proctree.descendants({root}, list(live.values())) - current - {me}:
            origins.setdefault(pid, origin)
    return {
        pid: _Found(
            leftover=Leftover(pid=pid, name=process_name(pid), origin=origin),
            start_ticks=live[pid].start_ticks,
        )
        for pid, origin in sorted(origins.items())
    }


class AgentProcesses:
    """One preflight's view of the node's processes (a preflight ProcessView). The leftovers come from
    one /proc snapshot, taken when a check first asks; the GPU-memory holders are judged when asked."""

    def __init__(self, *, node: str, socket: str, workers: Callable[[], list[Worker]]) -> None:
        self._node = node
        self._socket = socket
        self._workers = workers
        self._lock = threading.Lock()
        self._found: dict[int, _Found] | None = None
        self.killed: list[str] = []  # what clean_first killed, one line per pid

    def _snapshot(self) -> dict[int, _Found]:
        with self._lock:
            if self._found is None:
                self._found = find(self._node, self._socket, self._workers(), proctree.all_procs())
            return self._found

    def leftovers(self) -> list[Leftover]:
        return [f.leftover for f in self._snapshot().values()]

    def allowed(self, pid: int) -> bool:
        """In the agent's tree now, and neither a leftover nor below one."""
        found, me = self._snapshot(), os.getpid()
        for _ in range(4096):  # a bound on the parent chain, in case /proc changes under the walk
            if pid in found:
                return False
            if pid == me:
                return True
            info = proctree.read_proc(pid)
            if info is None or info.ppid <= 1:
                return False
            pid = info.ppid
        return False

    def origin(self, pid: int) -> Origin | None:
        found = self._snapshot().get(pid)
        return found.leftover.origin if found is not None else processes.origin_from_environ(pid)

    def clean_first(self, grace_s: float) -> list[str]:
        """Before any check runs: kill the leftovers of ended attempts (runwarden's own, not the
        node's fault), then forget the snapshot, so the checks see only what survived SIGKILL."""
        if not self._snapshot():
            return []
        self.killed = self.clean(grace_s)
        with self._lock:
            self._found = None
        return self.killed

    def clean(self, grace_s: float) -> list[str]:
        """Kill the leftovers this preflight reported (none if no check looked); one line per pid."""
        with self._lock:
            found = dict(self._found or {})
        if not found:
            return []
        try:
            lines = kill(found, grace_s)
        except Exception as exc:  # a bug here must not end the RunPreflight stream: said, not raised
            log.exception("node %s: killing the leftovers failed", self._node)
            return [f"killing the leftovers failed: {type(exc).__name__}: {exc}"]
        for line in lines:
            log.warning("node %s: leftover of an ended attempt: %s", self._node, line)
        return lines


def kill(found: dict[int, _Found], grace_s: float) -> list[str]:
    """TERM every process of the leftovers' trees, KILL what is left after `grace_s`; what became of each."""
    identity = {pid: f.start_ticks for pid, f in found.items()}

    def living() -> list[int]:
        procs = proctree.all_procs()
        ours = [p for p in procs if identity.get(p.pid) == p.start_ticks]
        proctree.reap([p.pid for p in ours if p.state == "Z"])  # orphans re-parented to the agent
        alive = proctree.alive(procs)
        tree = proctree.descendants({p.pid for p in proctree.alive(ours)}, alive)
        for p in alive:  # forked since the snapshot: below a leftover, so one too
            if p.pid in tree:
                identity.setdefault(p.pid, p.start_ticks)
        return sorted(tree)

    ended_by: dict[int, str] = {}

    def send(sig: signal.Signals, pids: list[int]) -> None:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
            except PermissionError as exc:
                log.warning("cannot signal leftover pid %d: %s", pid, exc)

    def wait(seconds: float, label: str) -> list[int]:
        deadline = time.monotonic() + seconds
        while True:
            pids = living()
            for pid in found:
                if pid not in pids:
                    ended_by.setdefault(pid, label)
            if not pids or time.monotonic() >= deadline:
                return pids
            time.sleep(0.05)

    send(signal.SIGTERM, living())
    left = wait(grace_s, "ended after SIGTERM")
    for _ in range(KILL_PASSES):  # another pass for what forked during the last one
        if not left:
            break
        send(signal.SIGKILL, left)
        left = wait(KILL_WAIT_S, f"killed with SIGKILL ({grace_s:g} s after SIGTERM)")
    lines = []
    for pid, f in found.items():
        how = (
            ended_by.get(pid)
            or f"survives SIGKILL (state {_state(pid)}: in the kernel, likely the GPU driver)"
        )
        lines.append(f"{f.leftover.describe()}: {how}")
    return lines


def _state(pid: int) -> str:
    info = proctree.read_proc(pid)
    return "?" if info is None else info.state


def spec(view: AgentProcesses, grace_s: float) -> CheckSpec:
    """The `processes` unit over `view`. A leftover of an ended attempt is runwarden's own debris,
    not evidence about the node: the agent kills it before the checks (`clean_first`) and the check
    says so (WARN); only one that survives SIGKILL (stuck in the kernel) FAILs."""
    remedy = (
        f"the agent kills them before and after a preflight (SIGTERM, SIGKILL after {grace_s:g} s) and "
        "says so in its log; one that survives SIGKILL is stuck in the kernel: drain the node and reset the GPU"
    )
    name = "processes.leftover_ranks"

    def run(ctx: CheckContext) -> list[CheckResult]:
        found = view.leftovers()
        if found or not view.killed:
            return [processes.leftover_result(found, remedy)]
        return [
            warned(
                name,
                f"{len(view.killed)} process(es) of ended attempts were still alive and were killed before "
                "this preflight (runwarden's own, not the node's)",
                value=len(view.killed),
                unit="count",
                threshold=0,
                evidence=tuple(view.killed),
            )
        ]

    return CheckSpec(
        name="processes",
        run=run,
        timeout_s=lambda c, m: processes.LEFTOVERS_TIMEOUT_S,
        modes=lambda c: MODES,
    )
