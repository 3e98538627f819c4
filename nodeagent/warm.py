"""Warm workers, the parked side: rank processes started before the launch, torch already imported.

    python -m nodeagent.warm leader --local-ranks N --ready-fd FD    # started by the agent
    python -m nodeagent.warm rank --ready-fd FD                      # started by the leader

A parked group is one leader (the agent starts it in its own session, like torchrun on the cold
path, so the agent's stop, kill and stray-process rescan treat it exactly like torchrun's tree)
and one rank process per local rank, its children. Each rank imports `torch` and
`torch.distributed` and says "ready" on a pipe; the leader says "ready <pids>" to the agent once
every rank has. Then everything blocks on stdin:

* the launch: the agent writes one JSON hand-off (never a pickle: only plain data crosses) and closes
  the leader's stdin; the leader gives each rank the same hand-off with its local rank;
* the agent going away (stdin closed with nothing written): the group exits 0.

A rank that gets its hand-off joins a small rendezvous on a TCPStore that node rank 0's local rank 0
hosts at the controller's endpoint (node rank 0's torch host and rdzv_port, what torchrun's c10d
store would use): every node's local rank 0 writes its local rank count under
`runwarden-warm/<rendezvous id>/`, so global ranks follow the controller's node ranks and nodes
with different rank counts still get consecutive ranks. The rank then sets the environment the cold
path gives a rank (the agent's launch environment plus what torchrun adds: RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_*; TORCHELASTIC_USE_AGENT_STORE=True, so the job's
`init_process_group("env://")` connects to that same store as a client), sys.argv, the working
directory, and runs the script with runpy as `__main__` (or `-m module`, as `python -m` would).

The leader supervises like torchrun --max-restarts=0: the first rank to fail gets the others TERMed
(KILLed after RANK_FAIL_GRACE_S) and its code becomes the group's exit code (128+n for a rank
killed by signal n); all ranks exiting 0 is exit 0. A SIGTERM to the leader is forwarded to the
ranks and the leader keeps waiting for them (so a rank's save is not cut short; the agent's KILL
ends a grace that is over).

CUDA: a parked rank never touches CUDA (importing torch does not initialise it; the rank checks
`torch.cuda.is_initialized()` is False before it says ready), and nothing here forks after the
import: every process is a fresh interpreter started with exec. On a GPU host the CUDA context is
created by the job itself, after the hand-off, in the process that uses it.

Environment read at interpreter start-up or at torch's import (LD_*, MALLOC_*, PYTHON* other than
PYTHONPATH, OpenMP/MKL variables) cannot be changed after the fact: the parked group is started with
the agent's own environment, and a launch whose environment differs there goes cold
(nodeagent.warm_pool). PYTHONPATH entries are added to sys.path and OMP_NUM_THREADS becomes
torch.set_num_threads at the hand-off.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import runpy
import select
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

PROTOCOL = 1
MAX_HANDOFF_BYTES = 4 * 1024 * 1024  # the request's env and argv are bounded by gRPC's limit anyway
RANK_FAIL_GRACE_S = 5.0  # after a rank failed: TERM to the others, KILL after this
PARK_TIMEOUT_S = 300.0  # a rank that has not imported torch by then is stuck
EXIT_NOT_READY = 3  # a parked rank died (or hung) before it was ready
EXIT_BAD_HANDOFF = 4  # the hand-off was malformed (a bug in the agent, never guessed around)
EXIT_RENDEZVOUS = 5  # the warm rendezvous did not complete (a peer node fell back to cold, say)
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
        argv=argv, module=module, cwd=_text(raw.get("cwd", ""), "cwd"), env=env, rendezvous=rendezvous
    )


def encode_handoff(
    *, argv: tuple[str, ...], cwd: str, env: Mapping[str, str], rendezvous: Mapping[str, Any]
) -> bytes:
    """The agent's side of `parse_handoff` (local_rank is the leader's to add)."""
    message = {
        "v": PROTOCOL,
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


def _read_all(fd: int, limit: int) -> bytes:
    """Everything up to EOF (the writer closes after one message); HandOffError past `limit`."""
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            raise HandOffError(f"hand-off: over {limit} bytes")
        chunks.append(chunk)


# --- the rank -------------------------------------------------------------------------------------


def rank_main(ready_fd: int) -> int:
    import torch
    import torch.distributed  # the import is what a warm worker saves the launch

    if torch.cuda.is_initialized():  # never: importing torch does not create a CUDA context
        print("runwarden warm: CUDA is initialised in a parked rank; refusing to park", file=sys.stderr)
        return EXIT_NOT_READY
    os.write(ready_fd, b"R")
    os.close(ready_fd)
    data = _read_all(sys.stdin.fileno(), MAX_HANDOFF_BYTES)
    if not data:
        return 0  # the group was closed while parked
    try:
        handoff = parse_handoff(data)
    except HandOffError as exc:
        print(f"runwarden warm: bad hand-off: {exc}", file=sys.stderr)
        return EXIT_BAD_HANDOFF
    try:
        rank, world_size, store = rendezvous(handoff.rendezvous)
    except RendezvousError as exc:
        print(f"runwarden warm: {exc}", file=sys.stderr, flush=True)
        return EXIT_RENDEZVOUS
    # The store lives as long as this frame: node rank 0's local rank 0 serves it to the whole job.
    run_handoff(handoff, rank_env(handoff, rank=rank, world_size=world_size), keep=store)
    return 0


class RendezvousError(RuntimeError):
    pass


def rendezvous(r: Rendezvous) -> tuple[int, int, Any]:
    """(global rank, world size, the store): every node's local rank count, by node rank."""
    from torch.distributed import TCPStore

    hosts = r.node_rank == 0 and r.local_rank == 0
    timeout = timedelta(seconds=r.timeout_s)
    try:
        store = TCPStore(r.master_addr, r.master_port, None, hosts, timeout, wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        raise RendezvousError(
            f"cannot {'host' if hosts else 'reach'} the warm rendezvous store at "
            f"{r.master_addr}:{r.master_port}: {exc}"
        ) from None
    prefix = f"{PREFIX}/{r.rdzv_id}/local_world_size/"
    keys = [f"{prefix}{n}" for n in range(r.nnodes)]
    try:
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


def run_handoff(handoff: HandOff, env: Mapping[str, str], *, keep: Any = None) -> None:
    """Become the rank: environment, directory, sys.path and argv as `python <script>` would have
    them, then the script as __main__ (its SystemExit and exceptions end this process as usual)."""
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
    del keep


# --- the leader -----------------------------------------------------------------------------------


def exit_code_of(returncode: int) -> int:
    """A rank's Popen returncode as a process exit code: -n (signal n) -> 128+n, like a shell."""
    return 128 - returncode if returncode < 0 else returncode


def leader_main(local_ranks: int, ready_fd: int) -> int:
    ranks: list[subprocess.Popen[bytes]] = []
    terminated: list[bool] = [False]

    def on_term(_signum: int, _frame: Any) -> None:
        # torchrun forwards a TERM to every rank; so does the leader, and it keeps waiting for them
        terminated[0] = True
        for p in ranks:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)
    pipes: dict[int, int] = {}  # read end -> local rank
    for local_rank in range(local_ranks):
        r, w = os.pipe()
        ranks.append(
            subprocess.Popen(
                [sys.executable, "-m", "nodeagent.warm", "rank", "--ready-fd", str(w)],
                stdin=subprocess.PIPE,
                pass_fds=(w,),
            )
        )
        os.close(w)
        pipes[r] = local_rank
    deadline = time.monotonic() + PARK_TIMEOUT_S
    while pipes and not terminated[0]:
        readable, _, _ = select.select(list(pipes), [], [], max(0.0, deadline - time.monotonic()))
        if not readable:
            print(f"runwarden warm: ranks not ready after {PARK_TIMEOUT_S:g} s", file=sys.stderr)
            return _end(ranks, EXIT_NOT_READY)
        for fd in readable:
            if os.read(fd, 1) != b"R":
                print(f"runwarden warm: parked local rank {pipes[fd]} died", file=sys.stderr)
                return _end(ranks, EXIT_NOT_READY)
            os.close(fd)
            del pipes[fd]
    if terminated[0]:
        return _end(ranks, 0)
    os.write(ready_fd, ("ready " + " ".join(str(p.pid) for p in ranks) + "\n").encode())
    os.close(ready_fd)
    try:
        data = _read_all(sys.stdin.fileno(), MAX_HANDOFF_BYTES)
    except HandOffError as exc:
        print(f"runwarden warm: {exc}", file=sys.stderr)
        return _end(ranks, EXIT_BAD_HANDOFF)
    if not data:
        return _end(ranks, 0)  # the agent closed the pool
    for local_rank, p in enumerate(ranks):
        assert p.stdin is not None
        try:
            p.stdin.write(with_local_rank(data, local_rank))
            p.stdin.close()
        except (HandOffError, ValueError) as exc:
            print(f"runwarden warm: bad hand-off: {exc}", file=sys.stderr)
            return _end(ranks, EXIT_BAD_HANDOFF)
        except BrokenPipeError:
            pass  # that rank died while parked: its exit is seen below
    return supervise(ranks)


def supervise(ranks: list[subprocess.Popen[bytes]]) -> int:
    """Wait for every rank; the first failure ends the others and is the group's exit code."""
    failure: int | None = None
    kill_at = float("inf")
    while True:
        running = [p for p in ranks if p.poll() is None]
        for local_rank, p in enumerate(ranks):
            if failure is None and p.returncode not in (None, 0):
                failure = exit_code_of(p.returncode)
                print(
                    f"runwarden warm: local rank {local_rank} (pid {p.pid}) exited with "
                    f"{'code ' + str(p.returncode) if p.returncode > 0 else 'signal ' + str(-p.returncode)}"
                    f"; stopping the other ranks",
                    file=sys.stderr,
                    flush=True,
                )
                for q in running:
                    q.send_signal(signal.SIGTERM)
                kill_at = time.monotonic() + RANK_FAIL_GRACE_S
        if not running:
            return failure or 0
        if time.monotonic() >= kill_at:
            for q in running:
                q.kill()
        time.sleep(0.05)


def _end(ranks: list[subprocess.Popen[bytes]], code: int) -> int:
    """Close the parked ranks (EOF: they exit 0), KILL what is left after a moment."""
    for p in ranks:
        if p.stdin is not None:
            with contextlib.suppress(OSError):
                p.stdin.close()
    deadline = time.monotonic() + 2.0
    for p in ranks:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nodeagent.warm", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="role", required=True)
    leader = sub.add_parser("leader")
    leader.add_argument("--local-ranks", type=int, required=True)
    leader.add_argument("--ready-fd", type=int, required=True)
    rank = sub.add_parser("rank")
    rank.add_argument("--ready-fd", type=int, required=True)
    args = p.parse_args(argv)
    if args.role == "leader":
        if not 1 <= args.local_ranks <= 4096:
            p.error("--local-ranks: 1..4096")
        return leader_main(args.local_ranks, args.ready_fd)
    return rank_main(args.ready_fd)


if __name__ == "__main__":
    sys.exit(main())
