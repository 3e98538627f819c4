"""Finding every process of a worker tree through /proc, so a stop leaves nothing behind.

A worker is started as the leader of its own session (and process group). Its tree is: every
process in that session or process group, plus every descendant of those (a child that called
setsid() leaves the session but keeps its parent link). The agent is a child subreaper, so a
process orphaned inside the tree is re-parented to the agent, stays findable and is reaped here.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

log = logging.getLogger(__name__)
PR_SET_CHILD_SUBREAPER = 36


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcInfo:
    pid: int
    ppid: int
    pgrp: int
    session: int
    state: str
    start_ticks: int  # when it started, in clock ticks since boot: with the pid, one process for ever


def read_proc(pid: int) -> ProcInfo | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    # comm is in parentheses and may contain spaces or ')': split at the last ')'.
    rest = raw[raw.rfind(")") + 2 :].split()
    try:
        return ProcInfo(
            pid=pid,
            state=rest[0],
            ppid=int(rest[1]),
            pgrp=int(rest[2]),
            session=int(rest[3]),
            start_ticks=int(rest[19]),
        )
    except (IndexError, ValueError):
        return None


def all_procs() -> list[ProcInfo]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            info = read_proc(int(name))
            if info is not None:
                out.append(info)
    return out


def tree_of(
    leader: int, procs: list[ProcInfo] | None = None, adopted: AbstractSet[int] = frozenset()
) -> list[ProcInfo]:
    """The leader's session/group members and all their descendants (zombies included).

    `adopted`: pids seen in this tree earlier; they still count while they are our children
    (an orphan that left the session was re-parented to us, the subreaper, and has no other link).
    """
    procs = all_procs() if procs is None else procs
    me = os.getpid()
    # Not `pid == leader`: once the leader is reaped its pid may be reused by a stranger.
    members = descendants(
        {
            p.pid
            for p in procs
            if p.session == leader or p.pgrp == leader or (p.pid in adopted and p.ppid == me)
        },
        procs,
    )
    return [p for p in procs if p.pid in members]


def descendants(roots: AbstractSet[int], procs: list[ProcInfo]) -> set[int]:
    """`roots` and every process below them (by parent links) in `procs`."""
    children: dict[int, list[int]] = {}
    for p in procs:
        children.setdefault(p.ppid, []).append(p.pid)
    found, stack = set(roots), list(roots)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def alive(procs: list[ProcInfo]) -> list[ProcInfo]:
    return [p for p in procs if p.state not in ("Z", "X")]


def become_subreaper() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError) as exc:
        log.warning("cannot become a child subreaper: %s", exc)
        return False


def reap(pids: list[int]) -> None:
    """Reap zombies that are our children (orphans re-parented to us); others are not ours."""
    me = os.getpid()
    for pid in pids:
        info = read_proc(pid)
        if info is None or info.ppid != me:
            continue
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
