"""Warm workers, the parked side: rank processes started before the launch, torch already imported.

    python -m nodeagent.warm.parked leader --local-ranks N --ready-fd FD    # started by the agent
    python -m nodeagent.warm.parked rank --ready-fd FD                      # started by the leader

A parked group is one leader (the agent starts it in its own session, like torchrun on the cold
path, so the agent's stop, kill and stray-process rescan treat it exactly like torchrun's tree)
and one rank process per local rank, its children. Each rank imports `torch`,
`torch.distributed` and the agent's `warm_preload` modules (by default what DDP and DCP import on
first use: torch._dynamo alone is ~3 s here, and a fresh rank's DDP construction holds every other
rank in its collectives until it is done) and says "ready" on its status pipe; the leader says "ready <pids>" to the agent
once every rank has. Messages are lines (JSON never holds a raw newline):

* agent -> leader (its stdin): a hand-off (one JSON object: never a pickle, only plain data
  crosses), `end` (leave the running attempt and park again), EOF (close the group: exit 0);
* leader -> rank (a control pipe): the hand-off with its local rank, `abort`, EOF;
* rank -> leader (a status pipe): `ready`, then `ended <code>` after each attempt;
* leader -> agent (the ready fd): `ready <pids>`, then `ended <code>` after each attempt whose
  ranks all parked again alive; the leader exits instead when a rank died, after a TERM, or when
  the agent is gone (a running attempt first runs to its end, as torchrun's would).

A group outlives its attempts (issue 18: healthy hosts keep their processes): when an attempt
ends, by the script's exit, its failure (a collective whose peer died raises in ~20 ms) or an
`abort`, the rank tears the process group down, puts back what the script changed in the process
(environment, directory, sys.argv/sys.path, signal handlers), kills the attempt's own children and
parks again in the same process, keeping what lives in imported modules: nodeagent.trainer.memory_state's
in-memory copy of the last checkpoint it saved. `abort` gets a rank out of a collective that would
otherwise block until the collective timeout (a hung peer, a lost host): the rank shuts down the TCP
sockets the attempt opened (the measurement is in `shut_sockets`). A rank that cannot leave in time
is killed with its group by the agent (StopWorkersRequest.park_within_s), which parks a fresh one;
it first prints every thread's stack to the agent's log (LEAVE_STACKS_AFTER_S after the abort), so
the log says where it was stuck, and the next launch's detail says why that host's group is fresh.

Fencing by attempt: a hand-off names its attempt and a rank runs only attempts newer than the last
it ran; the warm rendezvous store's host writes the one rendezvous id it serves, and a rank of any
other attempt that reaches it is refused before it writes a key (EXIT_RENDEZVOUS, parked again).

A rank that gets its hand-off joins a small rendezvous on a TCPStore that node rank 0's local rank 0
hosts at the controller's endpoint (node rank 0's torch host and rdzv_port, what torchrun's c10d
store would use): every node's local rank 0 writes its local rank count under
`runwarden-warm/<rendezvous id>/`, so global ranks follow the controller's node ranks and nodes
with different rank counts still get consecutive ranks. The rank then sets the environment the cold
path gives a rank (the agent's launch environment plus what torchrun adds: RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_*; TORCHELASTIC_USE_AGENT_STORE=True, so the job's
`init_process_group("env://")` connects to that same store as a client), sys.argv, the working
directory, and runs the script with runpy as `__main__` (or `-m module`, as `python -m` would).
Modules the script imports stay imported across attempts (a changed module needs a cold start; the
script file itself is read again every attempt).

The leader supervises like torchrun --max-restarts=0, without ending processes: the first rank to
fail gets the others out of the attempt (`abort`, KILLed after RANK_FAIL_GRACE_S) and its code
becomes the attempt's exit code (128+n for a rank killed by signal n); all ranks ending 0 is 0. A
SIGTERM to the leader is forwarded to the ranks and the leader keeps waiting for them (so a rank's
save is not cut short; the agent's KILL ends a grace that is over), then exits.

CUDA: a fresh parked rank never touches CUDA (importing torch does not initialise it; the rank
checks `torch.cuda.is_initialized()` is False before it first says ready), and nothing here forks
after the import: every process is a fresh interpreter started with exec. On a GPU host the CUDA
context is created by the job itself, after the hand-off, in the process that uses it. A rank that
ran a GPU attempt frees what it does not keep before it parks again (`release_gpu`: the attempt's
process groups, NCCL communicators included, are destroyed; the caching allocator's blocks go back
with empty_cache) and keeps two things, which it states on stderr (the agent's log): its CUDA
context (hundreds of MiB of GPU memory per process, the price of not re-creating it; the parked
ranks are in the agent's process tree and not an ended attempt's, so the agent's preflight counts
them as its own) and its in-memory copies, in host memory (nodeagent.trainer.memory_state).

Environment read at interpreter start-up or at torch's import (LD_*, MALLOC_*, PYTHON* other than
PYTHONPATH, OpenMP/MKL variables) cannot be changed after the fact: the parked group is started with
the agent's own environment, and a launch whose environment differs there goes cold
(nodeagent.warm.pool). PYTHONPATH entries are added to sys.path and OMP_NUM_THREADS becomes
torch.set_num_threads at the hand-off.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import importlib
import json
import os
import queue
import re
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

PROTOCOL = 2  # 2: one hand-off per line, several attempts per group
MAX_HANDOFF_BYTES = 4 * 1024 * 1024  # the request's env and argv are bounded by gRPC's limit anyway
RANK_FAIL_GRACE_S = 5.0  # after a rank failed: TERM to the others, KILL after this
PARK_TIMEOUT_S = 300.0  # a rank that has not imported torch by then is stuck
EXIT_NOT_READY = 3  # a parked rank died (or hung) before it was ready
EXIT_BAD_HANDOFF = 4  # the hand-off was malformed (a bug in the agent, never guessed around)
EXIT_RENDEZVOUS = 5  # the warm rendezvous did not complete (a peer node fell back to cold, say)
EXIT_FENCED = 6  # a hand-off for an attempt this process already ran, or an older one
# A rank still inside the attempt this long after an abort prints every thread's stack (stderr: the
# agent's log), so a rank the agent then kills for missing its park bound (3 s) says where it was.
LEAVE_STACKS_AFTER_S = 1.5
PREFIX = "runwarden-warm"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_RDZV_ID = re.compile(r"^[A-Za-z0-9_.:@-]{1,256}$")


class HandOffError(ValueError):
    """The hand-off message is malformed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Rendezvous:
    """Where and with whom a warm rank meets its peers."""

    rdzv_id: str
    node_rank: int
    nnodes: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    timeout_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class HandOff:
    """What a parked rank is given at the launch (validated: it arrives on a pipe)."""

    argv: tuple[str, ...]  # the rank's command: a script and its args, or ("-m", module, args...)
    module: str  # "" for a script
    cwd: str
    env: Mapping[str, str]  # the cold path's rank environment, without what the rendezvous decides
    rendezvous: Rendezvous
    attempt: int  # the fence: a process runs each attempt once, and only newer ones after it


def _int(raw: Any, name: str, low: int, high: int) -> int:
    if not isinstance(raw, int) or isinstance(raw, bool) or not low <= raw <= high:
        raise HandOffError(f"{name}: an integer in {low}..{high}, got {raw!r}")
    return raw


def _text(raw: Any, name: str, *, limit: int = 4096, empty: bool = True) -> str:
    if not isinstance(raw, str) or "\0" in raw or len(raw) > limit or (not empty and not raw):
        raise HandOffError(f"{name}: a string without NUL of at most {limit} characters")
    return raw


def parse_handoff(data: bytes) -> HandOff:
    """One JSON hand-off -> HandOff; HandOffError for anything that is not exactly what it must be."""
    if len(data) > MAX_HANDOFF_BYTES:
        raise HandOffError(f"hand-off: over {MAX_HANDOFF_BYTES} bytes")
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HandOffError(f"hand-off: not JSON: {exc}") from None
    if not isinstance(raw, dict) or raw.get("v") != PROTOCOL:
        raise HandOffError(f"hand-off: not a protocol {PROTOCOL} object")
    argv_raw = raw.get("argv")
    if not isinstance(argv_raw, list) or not argv_raw:
        raise HandOffError("argv: a non-empty list")
    argv = tuple(_text(a, f"argv[{i}]", limit=1 << 16, empty=i > 0) for i, a in enumerate(argv_raw))
    module = ""
    if argv[0] == "-m":
        if len(argv) < 2 or not _MODULE.match(argv[1]):
            raise HandOffError("argv: -m needs a module name")
        module = argv[1]
    elif argv[0].startswith("-"):
        raise HandOffError(f"argv[0]: a script or -m, got the option {argv[0]!r}")
    env_raw = raw.get("env")
    if not isinstance(env_raw, dict):
        raise HandOffError("env: an object")
    env: dict[str, str] = {}
    for key, value in env_raw.items():
        if not isinstance(key, str) or not _ENV_NAME.match(key):
            raise HandOffError(f"env: bad variable name {key!r}")
        env[key] = _text(value, f"env.{key}", limit=1 << 20)
    r = raw.get("rendezvous")
    if not isinstance(r, dict):
        raise HandOffError("rendezvous: an object")
    nnodes = _int(r.get("nnodes"), "rendezvous.nnodes", 1, 1 << 20)
    local_world_size = _int(r.get("local_world_size"), "rendezvous.local_world_size", 1, 4096)
    rdzv_id = _text(r.get("rdzv_id"), "rendezvous.rdzv_id", limit=256, empty=False)
    if not _RDZV_ID.match(rdzv_id):
        raise HandOffError(f"rendezvous.rdzv_id: not a rendezvous id: {rdzv_id[:80]!r}")
    master_addr = _text(r.get("master_addr"), "rendezvous.master_addr", limit=253, empty=False)
    if any(c.isspace() or c in "/[]" for c in master_addr):
        raise HandOffError(f"rendezvous.master_addr: not a host: {master_addr[:80]!r}")
    timeout = r.get("timeout_s")
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not 0 < timeout <= 3600:
        raise HandOffError(f"rendezvous.timeout_s: a number in (0, 3600], got {timeout!r}")
    rendezvous = Rendezvous(
        rdzv_id=rdzv_id,
        node_rank=_int(r.get("node_rank"), "rendezvous.node_rank", 0, nnodes - 1),
        nnodes=nnodes,
        local_rank=_int(r.get("local_rank", 0), "rendezvous.local_rank", 0, local_world_size - 1),
        local_world_size=local_world_size,
        master_addr=master_addr,
        master_port=_int(r.get("master_port"), "rendezvous.master_port", 1, 65535),
        timeout_s=float(timeout),
    )
    return HandOff(
        argv=argv,
        module=module,
        cwd=_text(raw.get("cwd", ""), "cwd"),
        env=env,
        rendezvous=rendezvous,
        attempt=_int(raw.get("attempt"), "attempt", 0, 1 << 62),
    )


def encode_handoff(
    *,
    argv: tuple[str, ...],
    cwd: str,
    env: Mapping[str, str],
    rendezvous: Mapping[str, Any],
    attempt: int,
) -> bytes:
    """The agent's side of `parse_handoff` (local_rank is the leader's to add): one line's worth."""
    message = {
        "v": PROTOCOL,
        "attempt": attempt,
        "argv": list(argv),
        "cwd": cwd,
        "env": dict(env),
        "rendezvous": dict(rendezvous),
    }
    return json.dumps(message, separators=(",", ":")).encode()


def with_local_rank(data: bytes, local_rank: int) -> bytes:
    """The leader's copy of the hand-off for one rank (the rank validates all of it)."""
    raw = json.loads(data)
    if not isinstance(raw, dict) or not isinstance(raw.get("rendezvous"), dict):
        raise HandOffError("hand-off: no rendezvous object")
    raw["rendezvous"]["local_rank"] = local_rank
    return json.dumps(raw, separators=(",", ":")).encode()


# --- the rank -------------------------------------------------------------------------------------


class Lines:
    """Newline-framed messages on a pipe (JSON never holds a raw newline), each at most `limit` bytes."""

    def __init__(self, fd: int, limit: int = MAX_HANDOFF_BYTES) -> None:
        self.fd = fd
        self.limit = limit
        self.buf = b""
        self.eof = False

    def fill(self) -> bool:
        """One read (call it when the fd is readable or to block); False at EOF."""
        chunk = os.read(self.fd, 65536)
        if not chunk:
            self.eof = True
            return False
        self.buf += chunk
        if b"\n" not in self.buf and len(self.buf) > self.limit:
            raise HandOffError(f"a message over {self.limit} bytes")
        return True

    def pop(self) -> bytes | None:
        """The next complete line without its newline, or None."""
        if b"\n" not in self.buf:
            return None
        line, self.buf = self.buf.split(b"\n", 1)
        return line

    def read_line(self) -> bytes | None:
        """Blocking: the next line, None at EOF."""
        while (line := self.pop()) is None:
            if self.eof or not self.fill():
                return None
        return line


def attempt_sockets() -> dict[int, str]:
    """This process's socket fds -> their `socket:[inode]` names."""
    out: dict[int, str] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:"):
            out[int(name)] = link
    return out


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
            if line == b"abort":
                self.abort()
            elif line:
                self.handoffs.put(line)

    def abort(self) -> None:
        """Leave the running attempt's collectives (control thread): shut the attempt's TCP sockets,
        so every collective and store call of this rank fails at once and the script unwinds; on
        other backends than gloo the process group's own abort too (NCCL: ncclCommAbort)."""
        with self.lock:
            if not self.in_attempt:
                return
            shut = shut_sockets(self.before)
            faulthandler.dump_traceback_later(LEAVE_STACKS_AFTER_S, exit=False, file=sys.stderr)
        print(f"runwarden warm: leaving the attempt: {shut} socket(s) shut", file=sys.stderr, flush=True)
        import torch.distributed as dist

        try:
            if dist.is_initialized() and dist.get_backend() != "gloo":
                dist.distributed_c10d._get_default_group().abort()
        except Exception as exc:  # the sockets are what gloo needs; an abort that fails changes nothing
            print(f"runwarden warm: process group abort: {exc}", file=sys.stderr, flush=True)

    def run_attempt(self, data: bytes) -> int:
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
        saved = _ProcessState()
        with self.lock:
            self.before = set(attempt_sockets().values())
            self.in_attempt = True
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


# --- the leader -----------------------------------------------------------------------------------


def exit_code_of(returncode: int) -> int:
    """A rank's Popen returncode as a process exit code: -n (signal n) -> 128+n, like a shell."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass(slots=True, kw_only=True)
class _Rank:
    popen: subprocess.Popen[bytes]
    status: Lines  # its `ready` / `ended <code>` lines
    control: int  # the write end of its control pipe
    ended: int | None = None  # this attempt's exit code, once it ended (or died)

    def send(self, line: bytes) -> bool:
        try:
            os.write(self.control, line + b"\n")
        except OSError:
            return False  # it died: its exit is seen by poll()
        return True


class Leader:
    """The group: its ranks across attempts, and the agent's two pipes (stdin: commands; the ready
    fd: `ready <pids>`, then `ended <code>` after every attempt whose ranks all parked again)."""

    def __init__(
        self,
        local_ranks: int,
        ready_fd: int,
        preload: tuple[str, ...] = (),
        copy_budget_bytes: int | None = None,
    ) -> None:
        self.ready_fd = ready_fd
        self.agent = Lines(sys.stdin.fileno())
        self.early: list[bytes] = []  # hand-offs read while an attempt was still ending
        self.ranks: list[_Rank] = []
        self.terminated = False
        signal.signal(signal.SIGTERM, self._on_term)
        for _ in range(local_ranks):
            sr, sw = os.pipe()
            cr, cw = os.pipe()
            popen = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "nodeagent.warm.parked",
                    "rank",
                    "--status-fd",
                    str(sw),
                    "--control-fd",
                    str(cr),
                    "--preload",
                    ",".join(preload),
                    *(() if copy_budget_bytes is None else ("--copy-budget-bytes", str(copy_budget_bytes))),
                ],
                stdin=subprocess.DEVNULL,
                pass_fds=(sw, cr),
            )
            os.close(sw)
            os.close(cr)
            self.ranks.append(_Rank(popen=popen, status=Lines(sr, 4096), control=cw))

    def _on_term(self, _signum: int, _frame: Any) -> None:
        # torchrun forwards a TERM to every rank; so does the leader, and it keeps waiting for them
        self.terminated = True
        for r in self.ranks:
            if r.popen.poll() is None:
                r.popen.send_signal(signal.SIGTERM)

    def tell_agent(self, line: str) -> None:
        os.write(self.ready_fd, (line + "\n").encode())

    def run(self) -> int:
        deadline = time.monotonic() + PARK_TIMEOUT_S
        waiting = {r.status.fd: r for r in self.ranks}
        while waiting and not self.terminated:
            readable, _, _ = _select(list(waiting), deadline - time.monotonic())
            if not readable and time.monotonic() >= deadline:
                print(f"runwarden warm: ranks not ready after {PARK_TIMEOUT_S:g} s", file=sys.stderr)
                return self.end(EXIT_NOT_READY)
            for fd in readable:
                r = waiting[fd]
                if not r.status.fill():
                    print(f"runwarden warm: parked rank pid {r.popen.pid} died", file=sys.stderr)
                    return self.end(EXIT_NOT_READY)
                if r.status.pop() is not None:
                    del waiting[fd]
        if self.terminated:
            return self.end(0)
        self.tell_agent("ready " + " ".join(str(r.popen.pid) for r in self.ranks))
        while True:
            line = self.parked_command()
            if line is None:
                return self.end(0)  # the agent closed the pool (or a parked rank died: end() says so)
            try:
                copies = [with_local_rank(line, i) for i in range(len(self.ranks))]
            except (HandOffError, ValueError) as exc:
                print(f"runwarden warm: bad hand-off: {exc}", file=sys.stderr)
                return self.end(EXIT_BAD_HANDOFF)
            for r, copy in zip(self.ranks, copies, strict=True):
                r.ended = None
                r.send(copy)
            code, intact = self.supervise()
            if not intact or self.terminated or self.agent.eof:
                return self.end(code)
            try:
                self.tell_agent(f"ended {code}")
            except OSError:
                return self.end(code)

    def parked_command(self) -> bytes | None:
        """The agent's next hand-off while parked; None at EOF, a TERM or a parked rank's death."""
        while not self.terminated:
            line = self.early.pop(0) if self.early else self.agent.pop()
            if line is not None:
                if line.startswith(b"{"):
                    return line
                continue  # `end` while parked: nothing runs
            if self.agent.eof:
                return None
            if any(r.popen.poll() is not None for r in self.ranks):
                print("runwarden warm: a parked rank died", file=sys.stderr)
                return None
            readable, _, _ = _select([self.agent.fd], 0.5)
            if readable:
                self.agent.fill()
        return None

    def supervise(self) -> tuple[int, bool]:
        """Until every rank's attempt ended: (the group's exit code, whether every rank is alive).
        The first rank to fail (an exit code, or its death) gets the others out of the attempt
        (`abort`; KILLed after RANK_FAIL_GRACE_S), like torchrun --max-restarts=0 but without
        ending the processes; so does the agent's `end`."""
        failure: int | None = None
        dead = False
        kill_at = float("inf")
        while True:
            for r in self.ranks:
                if r.ended is None and r.popen.poll() is not None:
                    r.ended, dead = exit_code_of(r.popen.returncode), True
            running = [r for r in self.ranks if r.ended is None]
            for r in self.ranks:
                if failure is None and r.ended not in (None, 0):
                    failure = r.ended
                    print(
                        f"runwarden warm: rank pid {r.popen.pid} ended the attempt with {r.ended}"
                        f"{' (it died)' if r.popen.returncode is not None else ''}; the others leave it",
                        file=sys.stderr,
                        flush=True,
                    )
                    for q in running:
                        q.send(b"abort")
                    kill_at = time.monotonic() + RANK_FAIL_GRACE_S
            if not running:
                return (failure or 0), not dead
            if time.monotonic() >= kill_at:
                for q in running:
                    q.popen.kill()
            fds = [r.status.fd for r in running]
            if not self.agent.eof:
                fds.append(self.agent.fd)
            readable, _, _ = _select(fds, 0.05)
            for fd in readable:
                if fd == self.agent.fd:
                    # The agent gone (EOF) changes nothing now: like torchrun's ranks, the attempt goes
                    # on until it ends or the controller ends it (a lost node's ranks must not fail
                    # their peers before its lease expires); the group exits after it.
                    self.agent.fill()
                    while (line := self.agent.pop()) is not None:
                        if line == b"end":
                            for q in running:
                                q.send(b"abort")
                        elif line.startswith(b"{"):
                            self.early.append(line)  # the next attempt's, kept for when this one ended
                    continue
                r = next(q for q in running if q.status.fd == fd)
                if not r.status.fill():
                    continue  # its death is seen by poll()
                while (line := r.status.pop()) is not None:
                    words = line.split()
                    if len(words) == 2 and words[0] == b"ended" and words[1].isdigit():
                        r.ended = int(words[1])

    def end(self, code: int) -> int:
        """Close the ranks (EOF: a parked rank exits 0, a running one leaves its attempt first), KILL
        what is left after a moment."""
        for r in self.ranks:
            with contextlib.suppress(OSError):
                os.close(r.control)
        deadline = time.monotonic() + 2.0
        for r in self.ranks:
            try:
                r.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                r.popen.kill()
                r.popen.wait()
        return code


def _select(fds: list[int], timeout_s: float) -> tuple[list[int], list[int], list[int]]:
    try:
        return select.select(fds, [], [], max(0.0, timeout_s))
    except InterruptedError:  # a signal (TERM): the caller looks at its flags
        return [], [], []


def leader_main(
    local_ranks: int, ready_fd: int, preload: tuple[str, ...] = (), copy_budget_bytes: int | None = None
) -> int:
    return Leader(local_ranks, ready_fd, preload, copy_budget_bytes).run()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nodeagent.warm.parked", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="role", required=True)
    leader = sub.add_parser("leader")
    leader.add_argument("--local-ranks", type=int, required=True)
    leader.add_argument("--ready-fd", type=int, required=True)
    rank = sub.add_parser("rank")
    rank.add_argument("--status-fd", type=int, required=True)
    rank.add_argument("--control-fd", type=int, required=True)
    for role in (leader, rank):
        role.add_argument("--preload", default="", help="comma-separated modules to import while parked")
        role.add_argument(
            "--copy-budget-bytes", type=int, default=None, help="host bytes a rank's in-memory copies may use"
        )
    args = p.parse_args(argv)
    preload = tuple(m for m in args.preload.split(",") if m)
    if any(not _MODULE.fullmatch(m) for m in preload):
        p.error(f"--preload: dotted module names, got {args.preload!r}")
    if args.copy_budget_bytes is not None and args.copy_budget_bytes < 0:
        p.error("--copy-budget-bytes: >= 0")
    if args.role == "leader":
        if not 1 <= args.local_ranks <= 4096:
            p.error("--local-ranks: 1..4096")
        return leader_main(args.local_ranks, args.ready_fd, preload, args.copy_budget_bytes)
    return rank_main(args.status_fd, args.control_fd, preload, args.copy_budget_bytes)


if __name__ == "__main__":
    sys.exit(main())
