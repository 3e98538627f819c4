"""The parked group's leader: `python -m nodeagent.warm.leader --local-ranks N --ready-fd FD`.

The agent starts it in its own session (like torchrun on the cold path, so the agent's stop, kill
and stray-process rescan treat it exactly like torchrun's tree). It is the group's template: it
imports what a rank imports while parked (torch, torch.distributed, the preload modules) once,
touches neither CUDA nor any torch op, and forks one rank per local rank (nodeagent.warm.rank's
`rank_main` in the child; the pages torch's import wrote are shared copy-on-write, not imported
again per rank). It says `ready <pids>` on the ready fd once every rank is parked, and then serves
one attempt at a time (nodeagent.warm.protocol): a hand-off from the agent goes to every rank with
its local rank, and `ended <code>` goes back once every rank parked again alive.

It supervises like torchrun --max-restarts=0, without ending processes: the first rank to fail
gets the others out of the attempt (`abort`, KILLed after RANK_FAIL_GRACE_S) and its code becomes
the attempt's exit code (128+n for a rank killed by signal n); all ranks ending 0 is 0. A rank
that died in the attempt (a crash, the OOM killer) is forked again in its place right after the
`ended` (which `replacing` precedes, and `ready <pids>` naming the new set follows; the end is
told first, since the order in which nodes end decides "first to exit"): the group serves the
next attempt at once instead of a new group importing torch for seconds (a crash soon after a
launch found no parked group on that host). The survivors keep their in-memory copies; the new
rank holds none and gets its state from a peer or storage (nodeagent.trainer.memory_state). A
SIGTERM is forwarded to the ranks and the leader keeps waiting for them (so a rank's save is not
cut short), then exits. It exits (ending its ranks) after a TERM, at EOF from the agent while
parked, when a parked rank died or a rank forked again did not park, or once a running attempt
ended after the agent went away.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

from nodeagent.warm.protocol import (
    ABORT,
    END,
    EXIT_BAD_HANDOFF,
    EXIT_NOT_READY,
    LEADER_MODULE,
    MAX_STATUS_BYTES,
    REPLACING,
    HandOffError,
    Lines,
    add_process_options,
    parse_ended,
    process_options,
    with_local_rank,
)
from nodeagent.warm.rank import rank_main

RANK_FAIL_GRACE_S = 5.0  # after a rank failed: TERM to the others, KILL after this
PARK_TIMEOUT_S = 300.0  # a rank that has not imported torch by then is stuck
RANK_PROCESS_NAME = b"rw-warm-rank"  # a forked rank's /proc/<pid>/comm
_PR_SET_NAME = 15


def exit_code_of(returncode: int) -> int:
    """A rank's Popen returncode as a process exit code: -n (signal n) -> 128+n, like a shell."""
    return 128 - returncode if returncode < 0 else returncode


class Forked:
    """A rank forked from the leader: what the leader asks of its process (Popen's names)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None  # -n: killed by signal n, as Popen says it

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped already: cannot happen, only this object waits for it
                self.returncode = 255
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        return code

    def send_signal(self, sig: int) -> None:
        # no waitpid here (the TERM handler calls this): an unreaped pid is still this rank's
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def name_process(name: bytes) -> None:
    """Set /proc/self/comm (what top and `ps -o comm` show): a forked rank's command line is its
    leader's, so its name says what it is."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, ctypes.c_char_p(name[:15]), 0, 0, 0)


def load_template(preload: tuple[str, ...]) -> None:
    """Import what a parked rank imports, once, in the leader (a module that fails is the rank's to
    report: it imports it again); freeze the result out of the collector's reach, so no rank's
    collection writes (and copies) the pages it shares with the leader."""
    import torch
    import torch.distributed  # noqa: F401  (what a warm worker saves the launch)

    for module in preload:
        with contextlib.suppress(Exception):
            importlib.import_module(module)
    gc.collect()
    gc.freeze()


@dataclass(slots=True, kw_only=True)
class _Rank:
    popen: Forked
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
        self.local_ranks = local_ranks
        self.preload = preload
        self.copy_budget_bytes = copy_budget_bytes
        signal.signal(signal.SIGTERM, self._on_term)

    def fork_rank(self) -> _Rank:
        """One rank, forked from this template; its pipes are the only ones it keeps."""
        sr, sw = os.pipe()
        cr, cw = os.pipe()
        others = [fd for r in self.ranks for fd in (r.status.fd, r.control)]
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the rank: never returns
            code = 1
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a rank's own, as a fresh process has it
                for fd in (sr, cw, self.ready_fd, *others):  # else a peer's pipe never sees EOF
                    os.close(fd)
                devnull = os.open(os.devnull, os.O_RDONLY)
                os.dup2(devnull, 0)  # not the agent's pipe to the leader
                os.close(devnull)
                name_process(RANK_PROCESS_NAME)
                code = rank_main(sw, cr, self.preload, self.copy_budget_bytes)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException:
                traceback.print_exc()
            finally:
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)
        os.close(sw)
        os.close(cr)
        return _Rank(popen=Forked(pid), status=Lines(sr, MAX_STATUS_BYTES), control=cw)

    def start(self) -> bool:
        """Import the template and fork every rank; False after a TERM (nothing forked)."""
        load_template(self.preload)
        if self.terminated:
            return False
        for _ in range(self.local_ranks):
            self.ranks.append(self.fork_rank())
        return True

    def wait_parked(self, ranks: list[_Rank], timeout_s: float) -> bool:
        """Until every rank of `ranks` said ready: False if one died, a TERM came, or time ran out."""
        deadline = time.monotonic() + timeout_s
        waiting = {r.status.fd: r for r in ranks}
        while waiting and not self.terminated:
            readable, _, _ = _select(list(waiting), deadline - time.monotonic())
            if not readable and time.monotonic() >= deadline:
                print(f"runwarden warm: ranks not ready after {timeout_s:g} s", file=sys.stderr)
                return False
            for fd in readable:
                r = waiting[fd]
                if not r.status.fill():
                    print(f"runwarden warm: parked rank pid {r.popen.pid} died", file=sys.stderr)
                    return False
                if r.status.pop() is not None:
                    del waiting[fd]
        return not self.terminated

    def replace_dead(self) -> bool:
        """Fork a rank in place of each that died in the attempt and wait for it to park: the group
        goes on (see the module doc). False if one did not park (the group then ends)."""
        dead = [i for i, r in enumerate(self.ranks) if r.popen.poll() is not None]
        for i in dead:
            new = self.fork_rank()  # (the child closes the dead rank's pipes with its peers')
            old, self.ranks[i] = self.ranks[i], new
            for fd in (old.status.fd, old.control):
                with contextlib.suppress(OSError):
                    os.close(fd)
        if not self.wait_parked([self.ranks[i] for i in dead], PARK_TIMEOUT_S):
            return False
        print(
            f"runwarden warm: rank(s) {[self.ranks[i].popen.pid for i in dead]} forked in place of the "
            "one(s) that died; the group parks again",
            file=sys.stderr,
            flush=True,
        )
        return True

    def _on_term(self, _signum: int, _frame: Any) -> None:
        # torchrun forwards a TERM to every rank; so does the leader, and it keeps waiting for them
        self.terminated = True
        for r in self.ranks:
            r.popen.send_signal(signal.SIGTERM)

    def tell_agent(self, line: str) -> None:
        os.write(self.ready_fd, (line + "\n").encode())

    def pids(self) -> str:
        return " ".join(str(r.popen.pid) for r in self.ranks)

    def run(self) -> int:
        if not self.start():
            return self.end(0)
        if not self.wait_parked(self.ranks, PARK_TIMEOUT_S):
            return self.end(0 if self.terminated else EXIT_NOT_READY)
        self.tell_agent("ready " + self.pids())
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
            if self.terminated or self.agent.eof:
                return self.end(code)
            try:
                if not intact:
                    self.tell_agent(REPLACING)  # the attempt's end first: its time decides "first to exit"
                self.tell_agent(f"ended {code}")
                if not intact:
                    if not self.replace_dead():
                        return self.end(code)
                    self.tell_agent("ready " + self.pids())
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
                if r.ended is None and (returncode := r.popen.poll()) is not None:
                    r.ended, dead = exit_code_of(returncode), True
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
                        q.send(ABORT)
                    kill_at = time.monotonic() + RANK_FAIL_GRACE_S
            if not running:
                return (failure or 0), not dead
            if time.monotonic() >= kill_at:
                for q in running:
                    q.popen.kill()
            # The agent's lines already read: an `end` that came in the same read as this attempt's
            # hand-off is in the buffer, and its pipe will not turn readable for it again.
            while (line := self.agent.pop()) is not None:
                if line == END:
                    for q in running:
                        q.send(ABORT)
                elif line.startswith(b"{"):
                    self.early.append(line)  # the next attempt's, kept for when this one ended
            fds = [r.status.fd for r in running]
            if not self.agent.eof:
                fds.append(self.agent.fd)
            readable, _, _ = _select(fds, 0.05)
            for fd in readable:
                if fd == self.agent.fd:
                    # The agent gone (EOF) changes nothing now: like torchrun's ranks, the attempt goes
                    # on until it ends or the controller ends it (a lost node's ranks must not fail
                    # their peers before its lease expires); the group exits after it. Its lines are
                    # taken at the top of the next turn.
                    self.agent.fill()
                    continue
                r = next(q for q in running if q.status.fd == fd)
                if not r.status.fill():
                    continue  # its death is seen by poll()
                while (line := r.status.pop()) is not None:
                    code = parse_ended(line)
                    if code is not None:
                        r.ended = code

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
    p = argparse.ArgumentParser(prog=f"python -m {LEADER_MODULE}", description=__doc__.splitlines()[0])
    p.add_argument("--local-ranks", type=int, required=True)
    p.add_argument("--ready-fd", type=int, required=True)
    add_process_options(p)
    args = p.parse_args(argv)
    preload, copy_budget_bytes = process_options(p, args)
    if not 1 <= args.local_ranks <= 4096:
        p.error("--local-ranks: 1..4096")
    return leader_main(args.local_ranks, args.ready_fd, preload, copy_budget_bytes)


if __name__ == "__main__":
    sys.exit(main())
