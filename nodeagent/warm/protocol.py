"""The warm group's wire protocol: the agent, its parked leader and the leader's ranks, all lines
on pipes (JSON never holds a raw newline), plus the command lines that start them.

* agent -> leader (its stdin): a hand-off (one JSON object, `encode_handoff`: never a pickle, only
  plain data crosses), `end` (leave the running attempt and park again), EOF (close the group);
* leader -> rank (a control pipe): the hand-off with its local rank (`with_local_rank`), `abort`, EOF;
* rank -> leader (a status pipe): `ready`, then `ended <code>` after each attempt;
* leader -> agent (the ready fd): `ready <pids>`, then `ended <code>` after each attempt whose
  ranks all parked again alive (`parse_ready`, `parse_ended`); when a rank died in the attempt,
  `replacing`, `ended <code>`, then `ready <pids>` with the new set once the rank forked in its
  place parked (the group takes no launch in between); the leader exits instead when a rank could
  not be replaced, after a TERM, or when the agent is gone.

Fencing by attempt: a hand-off names its attempt and a rank runs only attempts newer than the last
it ran (EXIT_FENCED). `parse_handoff` validates every field (the bytes arrive on a pipe): anything
that is not exactly what it must be is a HandOffError, never guessed around. Pure: no process or
torch is touched here, so the agent, the leader and the ranks all import it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PROTOCOL = 2  # 2: one hand-off per line, several attempts per group
MAX_HANDOFF_BYTES = 4 * 1024 * 1024  # the request's env and argv are bounded by gRPC's limit anyway
MAX_STATUS_BYTES = 4096  # a `ready <pids>` or `ended <code>` line
EXIT_NOT_READY = 3  # a parked rank died (or hung) before it was ready
EXIT_BAD_HANDOFF = 4  # the hand-off was malformed (a bug in the agent, never guessed around)
EXIT_RENDEZVOUS = 5  # the warm rendezvous did not complete (a peer node fell back to cold, say)
EXIT_FENCED = 6  # a hand-off for an attempt this process already ran, or an older one
END = b"end"  # agent -> leader: the running attempt's ranks leave it and park again
REPLACING = "replacing"  # leader -> agent, before an `ended`: ranks that died are forked again next
ABORT = b"abort"  # leader -> rank: leave the running attempt now
LEADER_MODULE = "nodeagent.warm.leader"  # `python -m` of the leader (nodeagent.warm.leader)
RANK_MODULE = "nodeagent.warm.rank"  # `python -m` of a rank (nodeagent.warm.rank)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
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
        if len(argv) < 2 or not MODULE_NAME.match(argv[1]):
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


def parse_ready(line: bytes, local_ranks: int) -> tuple[int, ...]:
    """The leader's `ready <pid>...`, with exactly one pid > 1 per local rank; else ()."""
    words = line.decode("ascii", "replace").split()
    if len(words) != local_ranks + 1 or words[0] != "ready" or not all(w.isdigit() for w in words[1:]):
        return ()
    pids = tuple(int(w) for w in words[1:])
    return pids if all(p > 1 for p in pids) else ()


def parse_ended(line: bytes) -> int | None:
    """`ended <code>` (a leader's or a rank's word after an attempt) -> the code; None for anything else."""
    words = line.split()
    if len(words) == 2 and words[0] == b"ended" and words[1].isdigit():
        return int(words[1])
    return None


def process_command(
    interpreter: str, module: str, preload: tuple[str, ...], copy_budget_bytes: int | None, *args: str
) -> list[str]:
    """The command line that starts a leader (LEADER_MODULE) or a rank (RANK_MODULE)."""
    return [
        interpreter,
        "-m",
        module,
        *args,
        "--preload",
        ",".join(preload),
        *(() if copy_budget_bytes is None else ("--copy-budget-bytes", str(copy_budget_bytes))),
    ]


def add_process_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preload", default="", help="comma-separated modules to import while parked")
    parser.add_argument(
        "--copy-budget-bytes", type=int, default=None, help="host bytes a rank's in-memory copies may use"
    )


def process_options(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[tuple[str, ...], int | None]:
    """(preload, copy_budget_bytes), checked (parser.error otherwise)."""
    preload = tuple(m for m in args.preload.split(",") if m)
    if any(not MODULE_NAME.fullmatch(m) for m in preload):
        parser.error(f"--preload: dotted module names, got {args.preload!r}")
    if args.copy_budget_bytes is not None and args.copy_budget_bytes < 0:
        parser.error("--copy-budget-bytes: >= 0")
    return preload, args.copy_budget_bytes
