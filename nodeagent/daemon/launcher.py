"""The local launcher: start a worker command in its own session, stop it leaving nothing behind.

The environment a worker gets, in order (later wins): the agent's own environment minus the
agent's private variables, the controller's `env`, then the variables the supervisor's contract
requires (rendezvous id per attempt, NCCL async error handling and dump on timeout, the flight
recorder's buffer size, the stop file, the agent's socket). Only executables allowed by config
may be started. Stopping sends SIGTERM to the whole tree, then SIGKILL after the grace period,
and rescans /proc until no process of the tree is left.

torchrun and SIGTERM (measured with torch 2.13): a SIGTERM to torchrun is forwarded at once to
every rank, torchrun then waits up to its shutdown timeout (`--shutdown-timeout`, else
$TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30 s) and SIGKILLs the ranks still alive, and it exits 1
(its SignalException is re-raised) even when every rank saved, committed and exited 0. So:

* a planned stop never signals torchrun: the agent raises the run's stop flag (the stop file and
  the answer to the ranks' reports), the ranks finish the step, save, commit and exit 0, and
  torchrun exits 0 with them;
* a hard stop (StopWorkers, self-fencing, the end of a drain) TERMs the whole tree, ranks
  included; a rank whose reporter turns SIGTERM into a stop request still saves if it can, and
  the agent alone decides when the grace is over: workers get
  TORCH_ELASTIC_SHUTDOWN_TIMEOUT = TORCHRUN_SHUTDOWN_TIMEOUT_S (unless the environment or the
  controller's env sets it), so torchrun's own 30 s never cuts a longer grace short.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from nodeagent.daemon import proctree
from runwarden.v1 import common_pb2

log = logging.getLogger(__name__)
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
TRACK_INTERVAL_S = 1.0
PRIVATE_ENV_PREFIXES = ("NOTIFY_SOCKET", "WATCHDOG_", "RUNWARDEN_AGENT_", "LISTEN_")
# The longest grace a StopWorkers may ask for (validate: grace_s <= 3600): torchrun waits at least
# that long for its ranks after a TERM, the agent's KILL ends the wait.
TORCHRUN_SHUTDOWN_TIMEOUT_S = 3600


class LaunchError(Exception):
    """The launch was refused or failed; `permission` says whether config forbids it, `temporary`
    whether asking again soon may work (a warm worker's parked group still starting)."""

    def __init__(self, message: str, *, permission: bool = False, temporary: bool = False) -> None:
        super().__init__(message)
        self.permission = permission
        self.temporary = temporary


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchSpec:
    run: str
    attempt: int
    node: str = ""  # the agent's node: with run and attempt, what names a leftover rank's origin
    rendezvous_id: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str = ""
    node_rank: int = 0
    nnodes: int = 1
    resume_step: int = -1
    stop_file: Path
    fr_socket_dir: Path
    agent_socket: str = ""
    fr_buffer_size: int = 2000


@dataclass(frozen=True, slots=True, kw_only=True)
class ExitInfo:
    exit_code: int | None
    signal: int | None
    ended_at: float
    detail: str

    def to_proto(self) -> common_pb2.ExitStatus:
        status = common_pb2.ExitStatus(ended_at=self.ended_at, detail=self.detail)
        if self.exit_code is not None:
            status.exit_code = self.exit_code
        if self.signal is not None:
            status.signal = self.signal
        return status


@dataclass(slots=True, kw_only=True)
class AttemptEnd:
    """How a worker whose leader outlives its attempt (a warm group, nodeagent.warm.groups) ends: its
    owner calls `finish` once; parked = the processes live on for the next attempt, so the reaper
    records the exit without killing the tree (`keep_pids` are then no leftover of this attempt)."""

    done: threading.Event = field(default_factory=threading.Event)
    exit_code: int = 0
    parked: bool = False
    keep_pids: tuple[int, ...] = ()

    def finish(self, exit_code: int, *, parked: bool, keep_pids: tuple[int, ...] = ()) -> None:
        if self.done.is_set():
            return
        self.exit_code, self.parked, self.keep_pids = exit_code, parked, keep_pids
        self.done.set()


@dataclass(slots=True, kw_only=True)
class Worker:
    run: str
    attempt: int
    pid: int
    started_at: float
    popen: subprocess.Popen[bytes]
    exit: ExitInfo | None = None
    stopping: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    reaped: threading.Event = field(default_factory=threading.Event)  # after the exit callback
    # every process ever found in the tree, pid -> start ticks (a pid alone may be reused): what a
    # leftover of this attempt is known by after it ended (nodeagent.daemon.leftovers)
    seen: dict[int, int] = field(default_factory=dict)
    parked: bool = False  # ended with its processes parked for the next attempt (AttemptEnd)

    def track(self) -> list[proctree.ProcInfo]:
        tree = proctree.tree_of(self.pid, adopted=self.seen.keys())
        self.seen.update((p.pid, p.start_ticks) for p in tree)
        return tree

    @property
    def running(self) -> bool:
        return self.exit is None


def worker_env(spec: LaunchSpec, base: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in base.items() if not k.startswith(PRIVATE_ENV_PREFIXES)}
    for key, value in spec.env.items():
        if not ENV_NAME.match(key) or "\0" in value:
            raise LaunchError(f"env: bad variable {key!r}")
        env[key] = value
    env.update(
        {
            # RUNWARDEN_NODE/RUN/ATTEMPT: inherited by torchrun, the ranks and their children, they
            # tell a leftover of this attempt once it has ended (preflight.checks.processes)
            **({"RUNWARDEN_NODE": spec.node} if spec.node else {}),
            "RUNWARDEN_RUN": spec.run,
            "RUNWARDEN_ATTEMPT": str(spec.attempt),
            "RUNWARDEN_RDZV_ID": spec.rendezvous_id,
            "RUNWARDEN_NODE_RANK": str(spec.node_rank),
            "RUNWARDEN_NNODES": str(spec.nnodes),
            "RUNWARDEN_RESUME_STEP": str(spec.resume_step),
            "RUNWARDEN_STOP_FILE": str(spec.stop_file),
            "RUNWARDEN_FR_SOCKET_DIR": str(spec.fr_socket_dir),
            # not RUNWARDEN_AGENT_*: that prefix is the agent's own config (nodeagent.daemon.config); a
            # process started from a rank's environment must not read it as a config key
            "RUNWARDEN_NODEAGENT_SOCKET": spec.agent_socket,
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_BUFFER_SIZE": str(spec.fr_buffer_size),
        }
    )
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(TORCHRUN_SHUTDOWN_TIMEOUT_S))
    return env


def resolve_allowed(argv0: str, allowed: tuple[str, ...], path: str) -> str:
    """The executable to run if config allows argv0, else raise LaunchError(permission=True)."""
    if not argv0 or "\0" in argv0:
        raise LaunchError("argv[0]: empty or contains NUL")
    resolved = argv0 if "/" in argv0 else shutil.which(argv0, path=path)
    if resolved is None:
        raise LaunchError(f"argv[0]: {argv0!r} not found on PATH")
    allowed_real = {os.path.realpath(a) for a in allowed if "/" in a}
    if argv0 in allowed or os.path.realpath(resolved) in allowed_real or resolved in allowed:
        return resolved
    raise LaunchError(f"argv[0]: {argv0!r} is not in the agent's allowed_executables", permission=True)


# Slurm's notice (--signal=USR1@N, `scancel --signal=USR1`) goes to every process of the job step,
# not only to the agent: a worker with USR1's default action (terminate) would die of the very
# notice the agent turns into a planned stop (torchrun killed, no commit). Workers start with USR1
# ignored (SIG_IGN survives exec, the ranks inherit it; a trainer that installs a handler still gets
# it); the shell execs the worker, so the worker keeps the pid Popen returns.
IGNORE_USR1 = ("/bin/sh", "-c", 'trap "" USR1; exec "$0" "$@"')


class Launcher:
    def __init__(
        self, *, allowed_executables: tuple[str, ...], on_exit: Callable[[Worker], None] | None = None
    ) -> None:
        self._allowed = allowed_executables
        self._on_exit = on_exit  # called on the reaper thread once a worker has ended
        self._lock = threading.Lock()
        self._workers: list[Worker] = []
        proctree.become_subreaper()

    def prepare(self, spec: LaunchSpec) -> None:
        """The checks and directories every launch needs, cold or warm (LaunchError if refused)."""
        cwd = spec.cwd or None
        if cwd is not None and not os.path.isdir(cwd):
            raise LaunchError(f"cwd: {cwd!r} is not a directory")
        with self._lock:
            if any(w.running and w.run == spec.run for w in self._workers):
                raise LaunchError(f"run {spec.run!r} already has running workers on this node")
        spec.fr_socket_dir.mkdir(parents=True, exist_ok=True)
        spec.stop_file.parent.mkdir(parents=True, exist_ok=True)

    def launch(self, spec: LaunchSpec) -> Worker:
        env = worker_env(spec, os.environ)
        exe = resolve_allowed(spec.argv[0] if spec.argv else "", self._allowed, env.get("PATH", os.defpath))
        cwd = spec.cwd or None
        self.prepare(spec)
        if not os.access(exe, os.X_OK):
            raise LaunchError(f"cannot start {spec.argv[0]!r}: not an executable file")
        try:
            popen = subprocess.Popen(
                [*IGNORE_USR1, exe, *spec.argv[1:]],
                env=env,
                cwd=cwd,
                start_new_session=True,
                stdin=subprocess.DEVNULL,
            )
        except OSError as exc:
            raise LaunchError(f"cannot start {spec.argv[0]!r}: {exc.strerror}") from None
        worker = self.adopt(spec, popen)
        log.info("launched %s attempt %d: pid %d %s", spec.run, spec.attempt, popen.pid, list(spec.argv))
        return worker

    def adopt(
        self, spec: LaunchSpec, popen: subprocess.Popen[bytes], attempt_end: AttemptEnd | None = None
    ) -> Worker:
        """`popen` (a session leader this launcher's rules apply to: its own session, USR1 ignored)
        becomes the attempt's worker: reaped, tracked, stopped and killed like a launched one. The
        warm path's parked group arrives here (nodeagent.warm.groups), with `attempt_end`: its
        attempt may end before its leader does."""
        worker = Worker(
            run=spec.run, attempt=spec.attempt, pid=popen.pid, started_at=time.time(), popen=popen
        )
        with self._lock:
            self._workers = [w for w in self._workers if w.running or w.run != spec.run] + [worker]
        threading.Thread(
            target=self._reap, args=(worker, attempt_end), name=f"reap-{popen.pid}", daemon=True
        ).start()
        return worker

    def _reap(self, worker: Worker, attempt_end: AttemptEnd | None) -> None:
        while True:
            if attempt_end is not None:  # its owner finishes it on the group's word or the leader's exit
                if attempt_end.done.wait(TRACK_INTERVAL_S):
                    rc = attempt_end.exit_code if attempt_end.parked else worker.popen.wait()
                    break
                worker.track()
                continue
            try:
                rc = worker.popen.wait(timeout=TRACK_INTERVAL_S)
                break
            except subprocess.TimeoutExpired:
                worker.track()  # remember members before a double-fork cuts their links
        if attempt_end is not None and attempt_end.parked:
            worker.parked = True
            for pid in (worker.pid, *attempt_end.keep_pids):  # they live on, parked: no leftover
                worker.seen.pop(pid, None)
        else:
            # The leader is gone: whatever it left behind in its tree goes too.
            _kill_tree(worker, grace_s=0.0 if worker.stopping else 2.0)
        detail = f"exit code {rc}" if rc >= 0 else f"killed by {signal.Signals(-rc).name}"
        worker.exit = ExitInfo(
            exit_code=rc if rc >= 0 else None,
            signal=-rc if rc < 0 else None,
            ended_at=time.time(),
            detail=detail + ("; its ranks parked again for the next attempt" if worker.parked else ""),
        )
        worker.done.set()
        log.info(
            "worker %s attempt %d pid %d ended: %s",
            worker.run,
            worker.attempt,
            worker.pid,
            worker.exit.detail,
        )
        if self._on_exit is not None:
            try:
                self._on_exit(worker)
            except Exception:
                log.exception("exit callback failed for %s attempt %d", worker.run, worker.attempt)
        worker.reaped.set()

    def workers(self, run: str | None = None) -> list[Worker]:
        with self._lock:
            return [w for w in self._workers if run is None or w.run == run]

    def stop(self, run: str, attempt: int, grace_s: float) -> list[Worker]:
        """TERM the tree, KILL after grace_s; returns once nothing of it is left."""
        targets = [w for w in self.workers(run) if w.running and (attempt == 0 or w.attempt == attempt)]
        for w in targets:
            w.stopping = True
        threads = [threading.Thread(target=_kill_tree, args=(w, grace_s)) for w in targets]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for w in targets:
            w.done.wait(timeout=10.0)
        return targets

    def owns(self, pid: int) -> bool:
        """True if pid is in the tree of one of this launcher's running workers."""
        return any(pid in {p.pid for p in w.track()} for w in self.workers() if w.running)

    def stop_all(self, grace_s: float) -> None:
        for run in {w.run for w in self.workers() if w.running}:
            self.stop(run, 0, grace_s)


def _signal_tree(worker: Worker, sig: int) -> list[int]:
    procs = proctree.alive(worker.track())
    for p in procs:
        try:
            os.kill(p.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError as exc:
            log.warning("cannot signal pid %d: %s", p.pid, exc)
    return [p.pid for p in procs]


def _kill_tree(worker: Worker, grace_s: float) -> None:
    leader = worker.pid
    if grace_s > 0 and _signal_tree(worker, signal.SIGTERM):
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            tree = worker.track()
            proctree.reap([p.pid for p in tree if p.pid != leader])
            if not proctree.alive(tree):
                break
            time.sleep(0.05)
    for _ in range(200):  # KILL and rescan: a fork during the kill shows up on the next pass
        pids = _signal_tree(worker, signal.SIGKILL)
        tree = worker.track()
        proctree.reap([p.pid for p in tree if p.pid != leader])
        if not pids and not [p for p in tree if p.pid != leader]:
            return
        time.sleep(0.02)
    log.error("processes of worker %d survive SIGKILL: %s", leader, [p.pid for p in worker.track()])
