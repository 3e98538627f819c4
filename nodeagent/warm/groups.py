"""The agent's parked groups (`ParkedGroups`): keep one ready, decide whether a launch goes warm
(`try_launch`, the one place), hand it a structured launch, take it back after the attempt.

With `warm_workers = true` (the default) the agent keeps one parked group (a leader, nodeagent.warm.leader, and
one rank process per local rank, torch imported) started with its own interpreter and environment.
A launch that goes warm is handed to it instead of starting torchrun; the group's leader then
becomes the attempt's worker exactly as torchrun's process would (`Launcher.adopt`: the same reaper,
exit record, stop and kill of its session, stray-process rescan, stop file and agent socket). A
group outlives its attempts: when an attempt ends with every rank parked again, the worker's exit
is recorded without killing the tree and the same group serves the next attempt, its ranks holding
their last checkpoint in memory (nodeagent.trainer.memory_state); a rank that died in the attempt
is forked again by its leader first (a new pid, no copy in memory; the launch's detail says so). A
group that was killed, could not replace a rank, or ran on a node with fatal evidence is closed,
and a fresh one is started once that attempt's worker has ended. A group's states are
nodeagent.warm.lifecycle's.

The warm path is used only when it starts what torchrun would; anything else goes cold, and the
launch's answer and the agent's log say which path ran and why (`LaunchPath`):

* a structured launch (`torchrun` in the request) of a script or `-m module` (not `no_python`);
* the torchrun prefix is `<python> -m torch.distributed.run`, so the ranks' interpreter is known
  (the parked group runs that same interpreter);
* node rank 0 hosts the store (`is_host` exactly on node rank 0: the warm rendezvous store is node
  rank 0's, at the controller's endpoint);
* the launch environment agrees with the parked group's on every variable read at interpreter
  start-up or at torch's import (STARTUP_ENV_PREFIXES);
* a parked group of this node's local rank count is ready, or becomes ready within `warm_wait_s`.

Every agent of a run must have the same `warm_workers` setting: a warm node and a cold node never
meet (the warm rendezvous times out with a message that says so, and the attempt fails).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nodeagent.daemon import proctree, torchrun
from nodeagent.daemon.launcher import (
    IGNORE_USR1,
    PRIVATE_ENV_PREFIXES,
    AttemptEnd,
    Launcher,
    LaunchError,
    LaunchSpec,
    Worker,
    resolve_allowed,
    worker_env,
)
from nodeagent.warm import protocol
from nodeagent.warm.lifecycle import ParkedEvent, ParkedState, Step, transition

log = logging.getLogger(__name__)
# Variables the interpreter, the dynamic loader, the allocator or OpenMP/MKL read once at start-up or
# at torch's import: a parked process has the agent's values, so a launch that sets others goes cold.
STARTUP_ENV_PREFIXES = ("PYTHON", "LD_", "MALLOC_", "GLIBC_", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_")
# Applied at the hand-off instead (sys.path, torch.set_num_threads, line buffering).
HANDOFF_ENV = frozenset({"PYTHONPATH", "PYTHONUNBUFFERED", "OMP_NUM_THREADS"})
WARM_RENDEZVOUS_TIMEOUT_S = 120.0
TORCHRUN_MODULE = ("-m", "torch.distributed.run")
MAX_RESTART_DELAY_S = 30.0
NOT_PARKED = "the parked group was not ready"  # a temporary refusal, not a reason to go cold
REFORKED = "forked again in place of ranks that died"  # a launch detail's words for such ranks
STANDBY_DELAY_S = 0.5  # after a warm launch: the standby's imports start once the hand-off is done


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchPath:
    """Which path a launch took, for the launch's answer and the log."""

    kind: str  # "warm" | "cold"
    detail: str


@dataclass(frozen=True, slots=True, kw_only=True)
class WarmAsk:
    """The parts of a structured launch the warm path needs (from the validated request)."""

    command: tuple[str, ...]
    rdzv_endpoint: str
    is_host: bool
    no_python: bool
    node_rank: int
    nnodes: int
    cold: bool = False  # the controller asked for cold (TorchrunLaunch.cold)


def warm_interpreter(torchrun_prefix: tuple[str, ...]) -> str:
    """The ranks' interpreter when the torchrun prefix is `<python> -m torch.distributed.run`, else ""."""
    if len(torchrun_prefix) == 3 and tuple(torchrun_prefix[1:]) == TORCHRUN_MODULE:
        return torchrun_prefix[0]
    return ""


def parked_env(base: Mapping[str, str], local_ranks: int) -> dict[str, str]:
    """The environment a parked group starts with: the agent's, as the cold path's ranks get it before
    the launch adds its own (the private variables out), with torchrun's OMP_NUM_THREADS default."""
    env = {k: v for k, v in base.items() if not k.startswith(PRIVATE_ENV_PREFIXES)}
    if local_ranks > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets for more than one rank per node
    return env


def startup_mismatch(launch_env: Mapping[str, str], parked: Mapping[str, str]) -> str:
    """The first start-up variable the launch sets differently from the parked group ("" = none)."""
    keys = {k for k in (*launch_env, *parked) if k.startswith(STARTUP_ENV_PREFIXES) and k not in HANDOFF_ENV}
    for key in sorted(keys):
        if launch_env.get(key) != parked.get(key):
            return key
    return ""


def launch_env(spec: LaunchSpec, base: Mapping[str, str], local_ranks: int) -> dict[str, str]:
    """The ranks' environment on the warm path: the cold path's (`worker_env`), plus torchrun's default."""
    env = worker_env(spec, base)
    if local_ranks > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def plan(ask: WarmAsk | None, *, enabled: bool, interpreter: str) -> str:
    """Why this launch cannot go warm, from the request and config alone ("" = it can)."""
    if not enabled:
        return "warm_workers is off"
    if ask is None:
        return "not a structured (torchrun) launch"
    if ask.cold:
        return "the controller asked for cold: this run's nodes did not all go warm before"
    if ask.no_python:
        return "no_python: the command is not a Python script"
    if ask.command[0].startswith("-") and not (ask.command[0] == "-m" and len(ask.command) >= 2):
        return f"the command starts with the interpreter option {ask.command[0]!r}"
    if ask.is_host != (ask.node_rank == 0):
        return "the store host is not node rank 0"
    if not interpreter:
        return "the torchrun prefix is not `<python> -m torch.distributed.run`"
    return ""


class ParkedGroup:
    """One leader and its parked ranks, started by ParkedGroups; it runs one attempt at a time and,
    when its ranks park again after one, goes back to its owner for the next. Its lifecycle is
    nodeagent.warm.lifecycle's: every change of `state` goes through `_advance`."""

    def __init__(self, popen: subprocess.Popen[bytes], local_ranks: int, env: Mapping[str, str]) -> None:
        self.popen = popen
        self.local_ranks = local_ranks
        self.env = dict(env)
        self.started_at = time.time()
        self.state = ParkedState.STARTING
        self.rank_pids: tuple[int, ...] = ()
        self.renewed: tuple[int, ...] = ()  # ranks forked again in place of ones that died (last attempt)
        self.failure = ""  # why it never became ready
        self.settled = threading.Event()  # ready or failed
        self.attempts: list[int] = []  # the attempts it ran, oldest first
        self.current: AttemptEnd | None = None  # the running attempt's end, set by the watcher

    def _advance(self, event: ParkedEvent) -> Step:
        step = transition(self.state, event)
        self.state = step.state
        return step

    @property
    def ready(self) -> bool:
        return self.settled.is_set() and not self.failure

    def on_ready(self, pids: tuple[int, ...]) -> None:
        self.rank_pids = pids
        self._advance(ParkedEvent.READY)
        self.settled.set()

    def on_failed(self, why: str) -> None:
        self.failure = why
        self._advance(ParkedEvent.FAILED)
        self.settled.set()

    def alive(self) -> bool:
        if self.popen.poll() is not None:
            return False
        states = [proctree.read_proc(pid) for pid in self.rank_pids]
        return all(s is not None and s.state not in ("Z", "X") for s in states)

    def stopped_ranks(self) -> list[int]:
        """Ranks in state T (SIGSTOPped, a hang): they cannot leave an attempt until continued."""
        states = {pid: proctree.read_proc(pid) for pid in self.rank_pids}
        return [pid for pid, st in states.items() if st is not None and st.state in ("T", "t")]

    def hand_off(self, message: bytes, attempt: int) -> AttemptEnd | None:
        """Write the launch (one line): None if the group died meanwhile (nothing was started)."""
        assert self.popen.stdin is not None
        if self._advance(ParkedEvent.HAND_OFF).ignored:
            return None  # its leader is gone already
        end = AttemptEnd()
        self.current = end
        try:
            self.popen.stdin.write(message + b"\n")
            self.popen.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            self.current = None
            self._advance(ParkedEvent.GONE)
            return None
        self.attempts.append(attempt)
        return end

    def end_attempt(self) -> None:
        """Ask the ranks to leave the running attempt and park again (the protocol's `end`)."""
        assert self.popen.stdin is not None
        self._advance(ParkedEvent.END)
        with contextlib.suppress(BrokenPipeError, OSError, ValueError):
            self.popen.stdin.write(protocol.END + b"\n")
            self.popen.stdin.flush()

    def on_line(self, line: bytes) -> None:
        """The leader's word after `ready` (watcher thread): `ended <code>`, its ranks parked again;
        `replacing` before it and `ready <pids>` after it when a rank that died in the attempt is
        forked again (no launch takes the group in between: `settled` is clear)."""
        if line.strip() == protocol.REPLACING.encode():
            self.settled.clear()
            return
        pids = protocol.parse_ready(line, self.local_ranks)
        if pids:
            self.renewed = tuple(p for p in pids if p not in self.rank_pids)
            self.rank_pids = pids
            self.settled.set()
            return
        code = protocol.parse_ended(line)
        if code is None:
            return
        end = self.current
        if self._advance(ParkedEvent.ENDED).attempt_ended and end is not None:
            self.current = None
            end.finish(code, parked=True, keep_pids=self.rank_pids)

    def on_gone(self) -> None:
        """The leader's pipe closed: it exited (or is exiting); a running attempt ended with it."""
        self.settled.set()  # a launch waiting for a replaced rank finds the group gone
        self._advance(ParkedEvent.GONE)
        end, self.current = self.current, None
        if end is not None:
            end.finish(0, parked=False)

    def on_closed(self) -> None:
        self._advance(ParkedEvent.CLOSED)


@dataclass(frozen=True, slots=True, kw_only=True)
class Launched:
    """A warm launch: the worker (the group's leader, adopted by the launcher) and its detail."""

    worker: Worker
    detail: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Refusal:
    """Why a launch does not go warm. temporary: refuse the launch (the parked group is still
    starting: a cold node never meets warm ones); else it goes cold, with `reason` as its detail."""

    reason: str
    temporary: bool = False


class ParkedGroups:
    """The agent's owner of its parked groups (one parked, one standby at most): it starts them,
    decides whether a launch goes warm (`try_launch`, the one place), hands a launch to a group,
    takes a group back when its attempt ended (`attempt_ended`), and starts a fresh one when a group
    is lost, once the attempt that used it ended."""

    def __init__(
        self,
        *,
        interpreter: str,
        launcher: Launcher,
        allowed_executables: tuple[str, ...],
        local_ranks: Callable[[], int],
        env: Callable[[], Mapping[str, str]],
        preload: tuple[str, ...] = (),
        copy_budget_bytes: int | None = None,
    ) -> None:
        self.interpreter = interpreter
        self.launcher = launcher
        self.allowed_executables = allowed_executables
        self._running: dict[int, ParkedGroup] = {}  # leader pid -> the group a warm worker runs on
        # run -> why its last warm group was lost (the next launch's detail says why it is fresh)
        self._lost: dict[str, str] = {}
        self.preload = preload  # modules each parked rank imports before it says ready
        # host bytes each parked rank's in-memory copies may use (None: memory_state's default)
        self.copy_budget_bytes = copy_budget_bytes
        self._local_ranks = local_ranks
        self._env = env
        self._lock = threading.Lock()
        self._group: ParkedGroup | None = None
        # A second group, parked while an attempt runs (park_standby): what the next attempt gets when
        # this node's running group is lost (its rank crashed), so a restarted node starts warm too.
        self._standby: ParkedGroup | None = None
        self._failures = 0  # in a row: the next start waits 2**n s
        self._closed = False
        self._timer: threading.Timer | None = None

    def try_launch(
        self, spec: LaunchSpec, ask: WarmAsk | None, wait_s: float, still_latest: Callable[[LaunchSpec], None]
    ) -> Launched | Refusal:
        """Hand the launch to the parked group when the warm path can run it (see the module doc), else
        why not. LaunchError (from still_latest, or the interpreter not allowed) refuses the launch."""
        why = plan(ask, enabled=True, interpreter=self.interpreter)
        if why or ask is None:
            return Refusal(reason=why)
        local_ranks = self._local_ranks()
        env = launch_env(spec, self._env(), local_ranks)
        # the same permission rule as torchrun's argv[0]: the interpreter must be allowed
        resolve_allowed(self.interpreter, self.allowed_executables, env.get("PATH", os.defpath))
        self.launcher.prepare(spec)
        message = handoff_message(spec, ask, env, local_ranks)
        if len(message) > protocol.MAX_HANDOFF_BYTES:
            return Refusal(
                reason=f"the launch's argv and environment exceed {protocol.MAX_HANDOFF_BYTES} bytes"
            )
        mismatch = startup_mismatch(env, parked_env(self._env(), local_ranks))
        if mismatch:  # the parked group stays parked: a launch with the agent's environment can use it
            return Refusal(
                reason=f"{mismatch} differs from the parked group's (read at interpreter start-up)"
            )
        group, why = self.take(local_ranks, wait_s)
        if group is None:
            return Refusal(reason=why, temporary=why.startswith(NOT_PARKED))
        try:
            still_latest(spec)
        except LaunchError:
            self.put_back(group)
            raise
        kept, renewed = list(group.attempts), group.renewed
        group.renewed = ()
        end = group.hand_off(message, spec.attempt)
        if end is None:
            self.refill()
            discard(group)
            return Refusal(reason="the parked group died before the hand-off")
        self._running[group.popen.pid] = group
        worker = self.launcher.adopt(spec, group.popen, end)
        standby = threading.Timer(STANDBY_DELAY_S, self.park_standby)
        standby.daemon = True
        standby.start()
        lost = self._lost.pop(spec.run, "")
        origin = f"kept from attempt {kept[-1]}" if kept else (f"fresh: {lost}" if lost else "fresh")
        if kept and renewed:
            origin += f"; ranks {list(renewed)} {REFORKED}"
        detail = f"parked ranks {list(group.rank_pids)} ({origin}; leader {group.popen.pid}), {why}"
        log.info("run %s attempt %d: warm launch: %s", spec.run, spec.attempt, detail)
        return Launched(worker=worker, detail=detail)

    def attempt_ended(self, worker: Worker, *, keep: bool) -> None:
        """A worker ended (reaper thread): if it ran on a parked group whose ranks parked again and
        `keep` (the node is healthy), the same group serves the next attempt; else a fresh one."""
        group = self._running.pop(worker.pid, None)
        if group is None:
            return
        if worker.parked and keep:
            self.put_back(group)  # the same processes, their state in memory, for the next attempt
        else:
            discard(group)  # killed, or a rank not replaced (or this node has fatal evidence): a fresh group
            self.refill()

    def park(self, run: str, attempt: int, park_within_s: float) -> list[Worker]:
        """StopWorkers with park_within_s: the run's warm workers (of `attempt`, 0 = any) leave their
        attempt and park again in the same processes (`end`); waits up to park_within_s for them to
        be reaped and returns them all, parked or not (the caller stops what is left as always). A
        group with a SIGSTOPped rank is left out: it cannot leave, the bound would only wait."""
        parking: list[Worker] = []
        for w in self.launcher.workers(run):
            group = self._running.get(w.pid)
            if w.running and (attempt == 0 or w.attempt == attempt) and group is not None:
                if group.stopped_ranks():
                    log.info("run %s: ranks %s are stopped: not parked", run, group.stopped_ranks())
                    continue
                group.end_attempt()
                parking.append(w)
        deadline = time.monotonic() + park_within_s
        for w in parking:
            w.reaped.wait(max(0.0, deadline - time.monotonic()))
        late = [w for w in parking if not w.reaped.is_set()]
        for w in late:
            # the next warm launch's detail says why it starts from a fresh group on a healthy host
            self._lost[run] = (
                f"the ranks of attempt {w.attempt} did not leave their collectives within "
                f"{park_within_s:.1f} s and were killed"
            )
        if late:
            log.warning(
                "run %s: ranks of %s did not leave their collectives within %.1f s: killed",
                run,
                ", ".join(f"attempt {w.attempt} (leader {w.pid})" for w in late),
                park_within_s,
            )
        return parking

    def refill(self) -> None:
        """Start a parked group unless one is parked or starting (idempotent)."""
        with self._lock:
            if self._closed or self._timer is not None:
                return
            group = self._group
            if group is not None and not (group.settled.is_set() and (group.failure or not group.alive())):
                return
            if group is not None:
                self._discard(group)
            standby, self._standby = self._standby, None
            if standby is not None and not (
                standby.settled.is_set() and (standby.failure or not standby.alive())
            ):
                self._group = standby  # parked (or parking) already: no import on the restart path
                # and a new standby at once, not after the next warm launch: a second fault seconds
                # after this recovery finds it further into its imports (they take 5-17 s on 2 cores)
                self._standby = self._start()
                log.info("warm workers: the standby group (leader pid %d) is next", standby.popen.pid)
                return
            if standby is not None:
                self._discard(standby)
            self._group = self._start()

    def wait_parked(self, timeout_s: float) -> bool:
        """Wait until the first group is parked (or failed): the agent registers after it, so no
        launch comes before a group can take it."""
        with self._lock:
            group = self._group
        return group is not None and group.settled.wait(timeout_s) and not group.failure

    def park_standby(self) -> None:
        """Park a second group beside the one a running attempt holds (called some seconds after a
        warm launch, so its imports do not compete with the rendezvous and the first steps)."""
        with self._lock:
            if self._closed or self._standby is not None or self._group is not None:
                return  # a primary parked here already stands by for the next attempt
            self._standby = self._start()

    def _start(self) -> ParkedGroup:
        local_ranks = self._local_ranks()
        env = parked_env(self._env(), local_ranks)
        r, w = os.pipe()
        try:
            popen = subprocess.Popen(
                [
                    *IGNORE_USR1,
                    *protocol.process_command(
                        self.interpreter,
                        protocol.LEADER_MODULE,
                        self.preload,
                        self.copy_budget_bytes,
                        "--local-ranks",
                        str(local_ranks),
                        "--ready-fd",
                        str(w),
                    ),
                ],
                env=env,
                start_new_session=True,
                stdin=subprocess.PIPE,
                pass_fds=(w,),
            )
        finally:
            os.close(w)
        group = ParkedGroup(popen, local_ranks, env)
        threading.Thread(
            target=self._watch, args=(group, r), name=f"warm-park-{popen.pid}", daemon=True
        ).start()
        log.info("warm workers: parking %d rank(s) (leader pid %d)", local_ranks, popen.pid)
        return group

    def _watch(self, group: ParkedGroup, fd: int) -> None:
        lines = protocol.Lines(fd, protocol.MAX_STATUS_BYTES)
        try:
            line = _read_ready(lines)
            pids = protocol.parse_ready(line, group.local_ranks)
            if pids:
                group.on_ready(pids)
                with self._lock:
                    self._failures = 0
                log.info(
                    "warm workers: %d rank(s) parked in %.1f s: pids %s",
                    group.local_ranks,
                    time.time() - group.started_at,
                    list(pids),
                )
                while (said := _next_line(lines)) is not None:  # the group's life: `ended <code>`
                    group.on_line(said)
                group.on_gone()
                return
        finally:
            os.close(fd)
        rc = group.popen.wait()
        group.on_failed(f"the parked group exited with {rc} before it was ready")
        with self._lock:
            self._failures += 1
            delay = min(MAX_RESTART_DELAY_S, 2.0 ** (self._failures - 1))
            if self._closed or self._group is not group:
                return
            log.warning("warm workers: %s; parking again in %.0f s", group.failure, delay)
            self._timer = threading.Timer(delay, self._retry)
            self._timer.daemon = True
            self._timer.start()

    def _retry(self) -> None:
        with self._lock:
            self._timer = None
        self.refill()

    def take(self, local_ranks: int, wait_s: float) -> tuple[ParkedGroup | None, str]:
        """The parked group for one attempt (the owner forgets it), or None and why not."""
        with self._lock:
            group = self._group
        if group is None:
            self.refill()  # the standby, or a fresh group: waited for below like any parked group
            with self._lock:
                group = self._group
            if group is None:
                return None, "no parked group (one is being started)"
        waited = time.monotonic()
        if not group.settled.wait(wait_s):
            return None, f"{NOT_PARKED} within {wait_s:g} s (still importing)"
        waited = time.monotonic() - waited
        with self._lock:
            if self._group is not group:
                return None, "the parked group was taken by another launch"
            if group.failure:
                return None, group.failure
            if group.local_ranks != local_ranks or not group.alive():
                why = (
                    f"the parked group has {group.local_ranks} rank(s), this node runs {local_ranks}"
                    if group.local_ranks != local_ranks
                    else "the parked group died while parked"
                )
                self._discard(group)
                self._group = None
            else:
                self._group = None
                return group, f"waited {waited:.1f} s for it"
        self.refill()
        return None, why

    def _discard(self, group: ParkedGroup) -> None:
        discard(group)

    def put_back(self, group: ParkedGroup) -> None:
        """A group whose ranks parked again after an attempt is the next attempt's first choice (its
        ranks hold their state in memory); a fresh group parked meanwhile is closed."""
        old: ParkedGroup | None = None
        with self._lock:
            closed = self._closed
            if not closed:
                old, self._group = self._group, group
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
                if old is not None and old is not group and self._standby is None:
                    old, self._standby = None, old  # a fresh group parked meanwhile stands by
        if closed:
            discard(group)
            return
        if old is not None and old is not group:
            discard(old)
        log.info(
            "warm workers: ranks %s parked again after attempt(s) %s", list(group.rank_pids), group.attempts
        )

    def close(self) -> None:
        with self._lock:
            self._closed = True
            group, self._group = self._group, None
            standby, self._standby = self._standby, None
            if self._timer is not None:
                self._timer.cancel()
        for g in (group, standby):
            if g is not None:
                _close_group(g)

    def parked_pids(self) -> tuple[int, ...]:
        with self._lock:
            groups = (self._group, self._standby)
        return tuple(pid for g in groups if g is not None and g.ready for pid in g.rank_pids)


def try_launch(
    groups: ParkedGroups | None,
    spec: LaunchSpec,
    ask: WarmAsk | None,
    *,
    enabled: bool,
    wait_s: float,
    still_latest: Callable[[LaunchSpec], None],
) -> Launched | Refusal:
    """Whether this launch goes warm, for an agent with or without parked groups (warm_workers off,
    or a torchrun prefix whose interpreter is unknown): the one place that decides."""
    if groups is None:
        return Refusal(reason=plan(ask, enabled=enabled, interpreter=""))
    return groups.try_launch(spec, ask, wait_s, still_latest)


def discard(group: ParkedGroup) -> None:
    """Close a group nobody will use: EOF on its stdin, then KILL whatever is left (in a thread)."""
    threading.Thread(target=_close_group, args=(group,), name="warm-discard", daemon=True).start()


def _close_group(group: ParkedGroup) -> None:
    group.on_closed()
    if group.popen.stdin is not None:
        with contextlib.suppress(OSError):  # EOF with nothing written: the leader ends its ranks, exits 0
            group.popen.stdin.close()
    with contextlib.suppress(subprocess.TimeoutExpired):
        group.popen.wait(timeout=5.0)
    leader = group.popen.pid
    for _ in range(50):  # the leader's session: KILL and rescan until nothing of it is left
        tree = proctree.alive(proctree.tree_of(leader))
        if not tree:
            break
        for p in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
        time.sleep(0.05)
    if group.popen.poll() is None:
        group.popen.wait()


def _next_line(lines: protocol.Lines) -> bytes | None:
    try:
        return lines.read_line()
    except (protocol.HandOffError, OSError):
        return None


def _read_ready(lines: protocol.Lines) -> bytes:
    return _next_line(lines) or b""


def handoff_message(spec: LaunchSpec, ask: WarmAsk, env: Mapping[str, str], local_ranks: int) -> bytes:
    host, port = torchrun.split_endpoint(ask.rdzv_endpoint)
    rendezvous: dict[str, Any] = {
        "rdzv_id": spec.rendezvous_id,
        "node_rank": ask.node_rank,
        "nnodes": ask.nnodes,
        "local_world_size": local_ranks,
        "master_addr": host,
        "master_port": port,
        "timeout_s": WARM_RENDEZVOUS_TIMEOUT_S,
    }
    return protocol.encode_handoff(
        argv=ask.command, cwd=spec.cwd, env=env, rendezvous=rendezvous, attempt=spec.attempt
    )
