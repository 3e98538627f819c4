"""A parked rank: `rank_main`, forked by its leader (nodeagent.warm.leader) from the imports it
holds; `python -m nodeagent.warm.rank --status-fd FD --control-fd FD` runs the same on its own.

It imports `torch`, `torch.distributed` and the agent's `warm_preload` modules (by default what
DDP and DCP import on first use) and says `ready` on its status pipe. A hand-off (its control pipe)
makes it join a small rendezvous on a TCPStore that node rank 0's local rank 0 hosts at the
controller's endpoint (every node's local rank 0 writes its local rank count under
`runwarden-warm/<rendezvous id>/`, so global ranks follow the controller's node ranks; the store's
host serves one rendezvous id and refuses a rank of any other attempt before it writes a key,
EXIT_RENDEZVOUS), set the environment the cold path gives a rank (the agent's launch environment
plus what torchrun adds, TORCHELASTIC_USE_AGENT_STORE=True so `init_process_group("env://")`
connects to that store), and run the script with runpy as `__main__` (or `-m module`).

When the attempt ends (the script's exit, its failure, or `abort`, which shuts the TCP sockets the
attempt opened so a blocked collective returns) the rank tears the process group down, puts back
what the script changed in the process (environment, directory, sys.argv/sys.path, signal handlers),
kills the attempt's own children, frees what it does not keep on the GPU (`release_gpu`), says
`ended <code>` and parks again in the same process, keeping what lives in imported modules
(nodeagent.trainer.memory_state's in-memory copies). A rank still inside the attempt
LEAVE_STACKS_AFTER_S after an abort prints every thread's stack to the agent's log, and what each
native thread waits in (its system call) and the state of each socket of the attempt still open.

An abort is level-triggered: it holds until the attempt has unwound. Every LEAVE_RESCAN_S the rank
shuts the sockets the attempt opened since (a process group built after the abort, a pair gloo
connects late, a store reconnect), so no collective or store call can block on a peer after it;
an abort that arrives while a hand-off waits in the queue ends that attempt before its script runs.

CUDA: a rank is forked from its leader, which only imported (nodeagent.warm.leader: no torch op, no
CUDA call), and never touches CUDA while parked (it checks `torch.cuda.is_initialized()` is False
before it first says ready); a rank itself never forks. Environment read at interpreter
start-up or at torch's import cannot be changed after the fact (the agent sends such launches
cold); PYTHONPATH entries are added to sys.path and OMP_NUM_THREADS becomes torch.set_num_threads
at the hand-off.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import importlib
import os
import platform
import queue
import runpy
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from nodeagent.warm.protocol import (
    ABORT,
    EXIT_BAD_HANDOFF,
    EXIT_FENCED,
    EXIT_NOT_READY,
    EXIT_RENDEZVOUS,
    RANK_MODULE,
    HandOff,
    HandOffError,
    Lines,
    Rendezvous,
    add_process_options,
    parse_handoff,
    process_options,
)

# A rank still inside the attempt this long after an abort prints every thread's stack (stderr: the
# agent's log), so a rank the agent then kills for missing its park bound (3 s) says where it was.
LEAVE_STACKS_AFTER_S = 1.5
# How often an aborted attempt's new sockets are looked for and shut until it has unwound.
LEAVE_RESCAN_S = 0.02
PREFIX = "runwarden-warm"


def attempt_sockets(proc: str = "/proc/self") -> dict[int, str]:
    """A process's (`proc`: its /proc directory) socket fds -> their `socket:[inode]` names."""
    out: dict[int, str] = {}
    for name in os.listdir(f"{proc}/fd"):
        try:
            link = os.readlink(f"{proc}/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:"):
            out[int(name)] = link
    return out


# x86_64 system calls a thread stuck in a collective or a store call waits in (other machines and
# other calls: the number, as /proc/<tid>/syscall gives it)
_SYSCALLS = {
    "0": "read",
    "7": "poll",
    "23": "select",
    "35": "nanosleep",
    "45": "recvfrom",
    "47": "recvmsg",
    "202": "futex",
    "230": "clock_nanosleep",
    "232": "epoll_wait",
    "271": "ppoll",
    "281": "epoll_pwait",
}
_SYSCALL_NAMES = _SYSCALLS if platform.machine() == "x86_64" else {}
_TCP_STATES = {
    "01": "ESTABLISHED",
    "02": "SYN_SENT",
    "03": "SYN_RECV",
    "04": "FIN_WAIT1",
    "05": "FIN_WAIT2",
    "06": "TIME_WAIT",
    "07": "CLOSE",
    "08": "CLOSE_WAIT",
    "09": "LAST_ACK",
    "0A": "LISTEN",
    "0B": "CLOSING",
}


def where_it_waits(keep: set[str], proc: str = "/proc/self") -> str:
    """What a rank still inside an aborted attempt waits in, read from /proc (no ptrace): each
    native thread's name and system call, and each socket not in `keep` with its TCP state
    (`proc`: another process's /proc directory, for a test that waits on a rank in vain)."""
    threads = []
    for tid in sorted(os.listdir(f"{proc}/task"), key=int):
        try:
            with open(f"{proc}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"{proc}/task/{tid}/syscall") as f:
                call = f.read().split()[0]
        except (OSError, IndexError):
            continue
        threads.append(f"{tid} {name}: {_SYSCALL_NAMES.get(call, call)}")
    states: dict[str, str] = {}
    for table in (f"{proc}/net/tcp", f"{proc}/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9:
                states[f"socket:[{cols[9]}]"] = _TCP_STATES.get(cols[3], cols[3])
    sockets = [
        f"fd {fd} {states.get(name, 'not TCP')}"
        for fd, name in sorted(attempt_sockets(proc).items())
        if name not in keep
    ]
    return f"threads: {'; '.join(threads)}\nthe attempt's sockets: {', '.join(sockets) or 'none'}"


def shut_sockets(keep: set[str]) -> int:
    """shutdown(2) every connected TCP socket of this process not in `keep` (the ones it had before
    the attempt): what unblocks a rank inside a gloo collective (measured, torch 2.13: the pending
    op fails in ~2 ms with "Connection closed by peer", while ProcessGroupGloo.abort(), shutdown()
    and destroy_process_group() from another thread leave it blocked until the collective timeout).
    Listening sockets are left to their owner. Returns how many were shut."""
    shut = 0
    for fd, name in attempt_sockets().items():
        if name in keep:
            continue
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with sock:  # closes the duplicate only; shutdown acts on the socket itself
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                continue
            try:
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    continue
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                continue  # not connected
            shut += 1
    return shut


def script_exit_code(code: object) -> int:
    """A SystemExit's code as `python script.py` would exit with it."""
    if code is None:
        return 0
    if isinstance(code, int) and not isinstance(code, bool):
        return code & 0xFF
    print(code, file=sys.stderr, flush=True)
    return 1


class _ProcessState:
    """What an attempt's script may change in the process and the next attempt must not inherit."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)

    def __init__(self) -> None:
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.argv = list(sys.argv)
        self.path = list(sys.path)
        self.handlers = {s: signal.getsignal(s) for s in self.SIGNALS}

    def restore(self) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        with contextlib.suppress(OSError):
            os.chdir(self.cwd)
        sys.argv[:] = self.argv
        sys.path[:] = self.path
        for sig, handler in self.handlers.items():
            with contextlib.suppress(ValueError, TypeError, OSError):
                signal.signal(sig, handler)


class WarmRank:
    """One rank process across attempts: parked, given a hand-off, running its attempt, parked again.

    A control thread reads the leader's lines: a hand-off (queued for the main thread), `abort`
    (leave the running attempt now), EOF (the group is closed: leave the attempt, then exit). The
    main thread runs each attempt's script and says `ended <code>` when it has unwound."""

    def __init__(self, status_fd: int) -> None:
        self.status_fd = status_fd
        self.handoffs: queue.Queue[bytes | None] = queue.Queue()
        self.lock = threading.Lock()
        self.in_attempt = False
        self.before: set[str] = set()
        self.last_attempt = -1  # the fence: a hand-off for this attempt or an older one is refused
        # Hand-offs queued (control thread) and taken (main thread), counted under the lock: an abort
        # covers every hand-off queued before it, also one the main thread has not taken yet.
        self.queued = 0
        self.taken = 0
        self.aborted_through = 0
        self.aborted = False  # the running attempt was aborted: its sockets are shut until it ends

    def say(self, line: str) -> None:
        os.write(self.status_fd, (line + "\n").encode())

    def read_control(self, fd: int) -> None:
        lines = Lines(fd)
        while True:
            try:
                line = lines.read_line()
            except (HandOffError, OSError):
                line = None
            if line is None:
                self.abort()
                self.handoffs.put(None)
                return
            if line == ABORT:
                self.abort()
            elif line:
                with self.lock:
                    self.queued += 1
                self.handoffs.put(line)

    def abort(self) -> None:
        """Leave the running attempt's collectives (control thread): shut the attempt's TCP sockets,
        so every collective and store call of this rank fails at once and the script unwinds; on
        other backends than gloo the process group's own abort too (NCCL: ncclCommAbort)."""
        with self.lock:
            self.aborted_through = self.queued
            if not self.in_attempt or self.aborted:
                return
            self.aborted = True
            shut = shut_sockets(self.before)
            faulthandler.dump_traceback_later(LEAVE_STACKS_AFTER_S, exit=False, file=sys.stderr)
        threading.Thread(target=self.keep_shut, name="runwarden-warm-leave", daemon=True).start()
        print(f"runwarden warm: leaving the attempt: {shut} socket(s) shut", file=sys.stderr, flush=True)
        import torch.distributed as dist

        from nodeagent.trainer.torch_api import abort_default_group

        try:
            if dist.is_initialized() and dist.get_backend() != "gloo":
                abort_default_group()
        except Exception as exc:  # the sockets are what gloo needs; an abort that fails changes nothing
            print(f"runwarden warm: process group abort: {exc}", file=sys.stderr, flush=True)

    def keep_shut(self) -> None:
        """Until the aborted attempt has unwound: shut each socket it opens after the abort's scan;
        past LEAVE_STACKS_AFTER_S, say once where the rank waits."""
        said_at = time.monotonic() + LEAVE_STACKS_AFTER_S
        while True:
            with self.lock:
                if not self.aborted:
                    return
                shut_sockets(self.before)
                report = where_it_waits(self.before) if time.monotonic() >= said_at else ""
            if report:
                said_at = float("inf")
                print(
                    f"runwarden warm: still inside the aborted attempt: {report}", file=sys.stderr, flush=True
                )
            time.sleep(LEAVE_RESCAN_S)

    def run_attempt(self, data: bytes) -> int:
        with self.lock:
            self.taken += 1
        try:
            handoff = parse_handoff(data)
        except HandOffError as exc:
            print(f"runwarden warm: bad hand-off: {exc}", file=sys.stderr, flush=True)
            return EXIT_BAD_HANDOFF
        if handoff.attempt <= self.last_attempt:
            print(
                f"runwarden warm: fenced: attempt {handoff.attempt} is not newer than attempt "
                f"{self.last_attempt}, which this process already ran",
                file=sys.stderr,
                flush=True,
            )
            return EXIT_FENCED
        self.last_attempt = handoff.attempt
        with self.lock:
            aborted_before_start = self.taken <= self.aborted_through
            if not aborted_before_start:
                self.before = set(attempt_sockets().values())
                self.in_attempt = True
        if aborted_before_start:
            print(
                f"runwarden warm: attempt {handoff.attempt} was aborted before it started",
                file=sys.stderr,
                flush=True,
            )
            return 1
        saved = _ProcessState()
        held: list[Any] = []  # the store: closed with the attempt, so the next one can host its own
        try:
            rank, world_size, store = rendezvous(handoff.rendezvous)
            held.append(store)
            del store
            # node rank 0's local rank 0 serves the store to the whole job while the script runs
            run_handoff(handoff, rank_env(handoff, rank=rank, world_size=world_size))
            code = 0
        except RendezvousError as exc:
            print(f"runwarden warm: {exc}", file=sys.stderr, flush=True)
            code = EXIT_RENDEZVOUS
        except SystemExit as exc:
            code = script_exit_code(exc.code)
        except BaseException:  # the script's own failure (a collective that lost a peer, say)
            traceback.print_exc()
            code = 1
        finally:
            with self.lock:
                self.in_attempt = False
                self.aborted = False
                faulthandler.cancel_dump_traceback_later()
                # whatever of the attempt still waits on a peer (an async save's collective on its own
                # group, say) fails now instead of holding the teardown
                shut_sockets(self.before)
            leave_process_group()
            kill_children()
            held.clear()
            saved.restore()
            gc.collect()
            release_gpu()
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
        return code


def leave_process_group() -> None:
    import torch.distributed as dist

    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception as exc:
        print(f"runwarden warm: destroy_process_group: {exc}", file=sys.stderr, flush=True)


def release_gpu() -> str:
    """After an attempt that used CUDA: give the caching allocator's free blocks back to the driver
    (the attempt's tensors are gone: its process groups destroyed, gc run) and say what the parked
    rank keeps. "" when the attempt never touched CUDA."""
    import torch

    from nodeagent.trainer import memory_state

    if not torch.cuda.is_initialized():
        return ""
    try:
        torch.cuda.synchronize()  # the copies' side streams included: their buffers are host memory
    except Exception as exc:  # an aborted NCCL communicator's kernels: freed all the same
        print(f"runwarden warm: cuda synchronize: {exc}", file=sys.stderr, flush=True)
    torch.cuda.empty_cache()
    torch.cuda.ipc_collect()
    line = (
        f"runwarden warm: parked after a GPU attempt: keeps its CUDA context on device "
        f"{torch.cuda.current_device()}, {torch.cuda.memory_reserved() / 2**20:.0f} MiB still reserved by "
        f"torch's allocator, {memory_state.kept_bytes() / 2**20:.0f} MiB of copies in host memory"
    )
    print(line, file=sys.stderr, flush=True)
    return line


def kill_children() -> None:
    """The attempt's own child processes (data loader workers, say) end with it."""
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(stat) > 1 and int(stat[1]) == me:
            with contextlib.suppress(OSError):
                os.kill(int(entry), signal.SIGKILL)
                os.waitpid(int(entry), 0)


def rank_main(
    status_fd: int, control_fd: int, preload: tuple[str, ...] = (), copy_budget_bytes: int | None = None
) -> int:
    import torch
    import torch.distributed  # the import is what a warm worker saves the launch

    from nodeagent.trainer import memory_state

    if copy_budget_bytes is not None:
        memory_state.set_budget(copy_budget_bytes)

    for module in preload:  # what the job would import on its restart path (AgentConfig.warm_preload)
        try:
            importlib.import_module(module)
        except Exception as exc:  # the job imports it itself, or fails there with its own error
            print(
                f"runwarden warm: preload {module}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True
            )

    if torch.cuda.is_initialized():  # never: importing torch does not create a CUDA context
        print("runwarden warm: CUDA is initialised in a parked rank; refusing to park", file=sys.stderr)
        return EXIT_NOT_READY
    rank = WarmRank(status_fd)
    threading.Thread(
        target=rank.read_control, args=(control_fd,), name="runwarden-warm-control", daemon=True
    ).start()
    rank.say("ready")
    while True:
        data = rank.handoffs.get()
        if data is None:
            return 0  # the group was closed
        code = rank.run_attempt(data)
        try:
            rank.say(f"ended {code}")
        except OSError:
            return code  # the leader is gone


class RendezvousError(RuntimeError):
    pass


def rendezvous(r: Rendezvous) -> tuple[int, int, Any]:
    """(global rank, world size, the store): every node's local rank count, by node rank.

    The store host names the one rendezvous its store serves (`<prefix>/serves`): a rank of another
    attempt that reaches this store (a stale rank, or one handed an old attempt) is refused at once
    and never writes a key of this attempt's rendezvous."""
    from torch.distributed import TCPStore

    hosts = r.node_rank == 0 and r.local_rank == 0
    timeout = timedelta(seconds=r.timeout_s)
    try:
        if not hosts:
            _wait_listening(r.master_addr, r.master_port, r.timeout_s)
        store = TCPStore(r.master_addr, r.master_port, None, hosts, timeout, wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        raise RendezvousError(
            f"cannot {'host' if hosts else 'reach'} the warm rendezvous store at "
            f"{r.master_addr}:{r.master_port}: {exc}"
        ) from None
    prefix = f"{PREFIX}/{r.rdzv_id}/local_world_size/"
    keys = [f"{prefix}{n}" for n in range(r.nnodes)]
    try:
        if hosts:
            store.set(f"{PREFIX}/serves", r.rdzv_id)
        store.wait([f"{PREFIX}/serves"], timeout)
        serves = bytes(store.get(f"{PREFIX}/serves")).decode("ascii", "replace")
        if serves != r.rdzv_id:
            raise RendezvousError(
                f"fenced: the store at {r.master_addr}:{r.master_port} serves rendezvous {serves[:80]!r}, "
                f"not {r.rdzv_id!r}"
            )
        if r.local_rank == 0:
            store.set(keys[r.node_rank], str(r.local_world_size))
        store.wait(keys, timeout)
        raw = [store.get(k) for k in keys]
    except (RuntimeError, OSError) as exc:
        raise RendezvousError(
            f"warm rendezvous {r.rdzv_id} at {r.master_addr}:{r.master_port}: not every one of the "
            f"{r.nnodes} nodes joined within {r.timeout_s:g} s (a node launched cold? every agent of a "
            f"run needs warm_workers on): {exc}"
        ) from None
    sizes = []
    for n, value in enumerate(raw):
        text = bytes(value).decode("ascii", "replace")
        if not text.isdigit() or not 1 <= int(text) <= 4096:
            raise RendezvousError(f"warm rendezvous {r.rdzv_id}: node rank {n} wrote {text[:20]!r}")
        sizes.append(int(text))
    if sizes[r.node_rank] != r.local_world_size:
        raise RendezvousError(
            f"warm rendezvous {r.rdzv_id}: node rank {r.node_rank} is claimed by another node "
            f"({sizes[r.node_rank]} ranks there, {r.local_world_size} here)"
        )
    return sum(sizes[: r.node_rank]) + r.local_rank, sum(sizes), store


def _wait_listening(addr: str, port: int, timeout_s: float) -> None:
    """Until the store's host listens (every rank gets its hand-off at the same moment, the host
    needs a moment to bind): a TCPStore client refused once backs off 250-750 ms, then 1.5x that
    (c10d's ExponentialBackoffWithJitter), a restart's largest idle wait here; a plain connect every
    10 ms costs nothing. Gives up quietly at the deadline: TCPStore then reports the error itself."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(1.0, timeout_s))):
                return
        except OSError:
            if time.monotonic() >= deadline:
                return
            time.sleep(0.01)


def rank_env(handoff: HandOff, *, rank: int, world_size: int) -> dict[str, str]:
    """The agent's environment for the ranks plus what torchrun gives each rank (see the module doc)."""
    r = handoff.rendezvous
    env = dict(handoff.env)
    env.update(
        {
            "RANK": str(rank),
            "GROUP_RANK": str(r.node_rank),
            "ROLE_RANK": str(rank),
            "ROLE_NAME": "default",
            "LOCAL_RANK": str(r.local_rank),
            "LOCAL_WORLD_SIZE": str(r.local_world_size),
            "WORLD_SIZE": str(world_size),
            "GROUP_WORLD_SIZE": str(r.nnodes),
            "ROLE_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": r.master_addr,
            "MASTER_PORT": str(r.master_port),
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": r.rdzv_id,
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "RUNWARDEN_LAUNCH_PATH": "warm",
        }
    )
    return env


def run_handoff(handoff: HandOff, env: Mapping[str, str]) -> None:
    """Become the rank: environment, directory, sys.path and argv as `python <script>` would have
    them, then the script as __main__ (its SystemExit and exceptions end the attempt, not the
    process: WarmRank.run_attempt puts the process back as it was)."""
    import torch

    os.environ.clear()
    os.environ.update(env)
    if handoff.cwd:
        os.chdir(handoff.cwd)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and torch.get_num_threads() != int(threads):
        torch.set_num_threads(int(threads))  # OpenMP read the variable at import, with the parked value
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True)  # torchrun starts ranks with `python -u`
    if handoff.module:
        sys.path[0:1] = [os.getcwd(), *extra]
        sys.argv = [handoff.module, *handoff.argv[2:]]
        runpy.run_module(handoff.module, run_name="__main__", alter_sys=True)
    else:
        script = handoff.argv[0]
        sys.path[0:1] = [os.path.dirname(os.path.realpath(script)), *extra]
        sys.argv = list(handoff.argv)
        runpy.run_path(script, run_name="__main__")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {RANK_MODULE}", description=__doc__.splitlines()[0])
    p.add_argument("--status-fd", type=int, required=True)
    p.add_argument("--control-fd", type=int, required=True)
    add_process_options(p)
    args = p.parse_args(argv)
    preload, copy_budget_bytes = process_options(p, args)
    return rank_main(args.status_fd, args.control_fd, preload, copy_budget_bytes)


if __name__ == "__main__":
    sys.exit(main())
