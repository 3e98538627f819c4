"""A fleet: K `python -m lightfleet.process` children hosting N light agents between them.

Node i is `PREFIX + i` (zero-padded) on port FIRST_PORT + i (or a kernel-chosen port with 0); child
k hosts a contiguous range. `start()` waits until every child printed `ready`. `inject(line)` routes
a control line to the child hosting its node and returns that child's answer; a hang goes to every
child, stamped with one wall-clock time, so every node of the hung attempt, wherever it is hosted,
stops at the same step; after a crash or a lease-loss its owner's peers elsewhere get a `stall` at
the same time (their ranks wait for ranks that are gone). A child whose stdin closes exits, so a
dead fleet leaves no agent behind.
"""

from __future__ import annotations

import argparse
import contextlib
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace

from lightfleet import cli
from lightfleet.faults import STAMPED, FaultError, parse


class FleetError(RuntimeError):
    pass


@dataclass(kw_only=True)
class Child:
    index: int
    nodes: list[str]
    popen: subprocess.Popen[str]
    ready: str = ""  # its `ready ...` line
    failed: str = ""
    answers: queue.Queue[str] = field(default_factory=queue.Queue)
    started: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def ready_field(self, name: str) -> str:
        """A `name=value` of its ready line."""
        for word in self.ready.split():
            key, _, value = word.partition("=")
            if key == name:
                return value
        return ""


def common_argv(args: argparse.Namespace) -> list[str]:
    """The flags a child takes, from the parent's parsed ones (cli.add_common)."""
    out = [f"--etcd={e}" for e in cli.endpoints(args)]
    for flag, value in (
        ("--etcd-root", args.etcd_root),
        ("--etcd-tls-ca", args.etcd_tls_ca),
        ("--etcd-tls-cert", args.etcd_tls_cert),
        ("--etcd-tls-key", args.etcd_tls_key),
        ("--prefix", args.prefix),
        ("--ranks", args.ranks),
        ("--lease-ttl", args.lease_ttl),
        ("--progress-s", args.progress_s),
        ("--preflight-s", args.preflight_s),
        ("--launch-s", args.launch_s),
        ("--stop-s", args.stop_s),
        ("--dump-s", args.dump_s),
        ("--step-s", args.step_s),
        ("--startup-s", args.startup_s),
        ("--save-s", args.save_s),
        ("--ckpt-every", args.ckpt_every),
        ("--steps", args.steps),
        ("--seed", args.seed),
        ("--io-threads", args.io_threads),
        ("--log-level", args.log_level),
    ):
        out.append(f"{flag}={value}")
    return out + (["--no-revoke"] if args.no_revoke else []) + (["--cold"] if args.cold else [])


class Fleet:
    def __init__(
        self,
        args: argparse.Namespace,
        *,
        nodes: int,
        procs: int,
    ) -> None:
        if not 1 <= procs <= nodes:
            raise cli.UsageError(f"--procs: 1..--nodes ({nodes}), got {procs}")
        cli.settings(args)  # a bad flag is an error here, not in K children
        cli.store_config(args)
        self.args = args
        self.width = cli.width_for(nodes)
        self.names = cli.node_names(args.prefix, 0, nodes, self.width)
        self.procs = procs
        self.children: list[Child] = []
        self._owner: dict[str, Child] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_flags(cls, flags: list[str], *, nodes: int, procs: int) -> Fleet:
        """A fleet from the flags `python -m lightfleet` takes (cli.add_common's), for embedding."""
        parser = argparse.ArgumentParser(prog="lightfleet")
        cli.add_common(parser)
        return cls(parser.parse_args(flags), nodes=nodes, procs=procs)

    def start(self, timeout_s: float = 120.0) -> float:
        """Start the children; returns the seconds until every agent was registered."""
        started = time.monotonic()
        n = len(self.names)
        bounds = [n * k // self.procs for k in range(self.procs + 1)]
        base = common_argv(self.args)
        for k in range(self.procs):
            first, count = bounds[k], bounds[k + 1] - bounds[k]
            port = self.args.first_port + first if self.args.first_port else 0
            argv = [
                sys.executable,
                "-m",
                "lightfleet.process",
                *base,
                f"--first-index={first}",
                f"--count={count}",
                f"--width={self.width}",
                f"--first-port={port}",
            ]
            popen = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
            )
            child = Child(index=k, nodes=self.names[first : first + count], popen=popen)
            self.children.append(child)
            self._owner.update(dict.fromkeys(child.nodes, child))
            threading.Thread(target=self._read, args=(child,), name=f"fleet-{k}", daemon=True).start()
        deadline = time.monotonic() + timeout_s
        for child in self.children:
            child.started.wait(max(0.0, deadline - time.monotonic()))
            if child.failed or not child.ready:
                self.stop()
                why = child.failed or f"not ready within {timeout_s:g} s"
                raise FleetError(f"process {child.index} ({child.nodes[0]}..{child.nodes[-1]}): {why}")
        return time.monotonic() - started

    def _read(self, child: Child) -> None:
        assert child.popen.stdout is not None
        for line in child.popen.stdout:
            line = line.rstrip("\n")
            if line.startswith("ready "):
                child.ready = line
                child.started.set()
            elif line.startswith("failed "):
                child.failed = line[len("failed ") :]
                child.started.set()
            elif line.startswith(("ok ", "error ")):
                child.answers.put(line)
        child.failed = child.failed or f"exited with {child.popen.wait()}"
        child.started.set()
        child.ended.set()
        child.answers.put(f"error process {child.index} is gone: {child.failed}")

    def describe(self) -> str:
        return ", ".join(
            f"pid {c.pid} {c.nodes[0]}..{c.nodes[-1]} ports {c.ready_field('ports')}" for c in self.children
        )

    def dead(self) -> list[Child]:
        return [c for c in self.children if c.ended.is_set()]

    def _ask(self, children: list[Child], line: str, timeout_s: float) -> list[str]:
        for c in children:
            assert c.popen.stdin is not None
            try:
                c.popen.stdin.write(line + "\n")
                c.popen.stdin.flush()
            except OSError:
                c.answers.put(f"error process {c.index} is gone")
        answers = []
        for c in children:
            try:
                answers.append(c.answers.get(timeout=timeout_s))
            except queue.Empty:
                answers.append(f"error {line}: process {c.index} did not answer within {timeout_s:g} s")
        return answers

    def inject(self, line: str, timeout_s: float = 30.0) -> str:
        """Route one control line; returns the answer (`ok ...` or `error ...`)."""
        text = line.strip()
        with self._lock:
            if text == "stats":
                return "\n".join(self._ask(self.children, text, timeout_s))
            try:
                fault = parse(text)
            except FaultError as exc:
                return f"error {text}: {exc}"
            owner = self._owner.get(fault.node)
            if owner is None:
                return f"error {text}: node {fault.node} is not in this fleet"
            if fault.kind not in STAMPED:
                return self._ask([owner], fault.line(), timeout_s)[0]
            fault = fault.stamped(time.time())
            if fault.kind in ("hang", "stall"):  # every process freezes its nodes of the attempt
                answers = self._ask(self.children, fault.line(), timeout_s)
                mine = answers[self.children.index(owner)]
                if mine.startswith("error"):
                    return mine
                return f"ok {fault.line()} -> " + "; ".join(
                    a.rsplit("-> ", 1)[-1] for a in answers if a.startswith("ok")
                )
            # a crash or a dead host: the owner first, then the peers elsewhere stop where they were at T
            mine = self._ask([owner], fault.line(), timeout_s)[0]
            others = [c for c in self.children if c is not owner]
            if mine.startswith("ok") and others:
                stall = replace(fault, kind="stall").line()
                stalled = [a.rsplit("-> ", 1)[-1] for a in self._ask(others, stall, timeout_s)]
                mine += "; elsewhere: " + "; ".join(stalled)
            return mine

    def stop(self, timeout_s: float = 30.0) -> None:
        """Close every child's stdin (it revokes its leases and exits); kill what is left."""
        for c in self.children:
            with contextlib.suppress(OSError):
                if c.popen.stdin is not None:
                    c.popen.stdin.close()
        deadline = time.monotonic() + timeout_s
        for c in self.children:
            try:
                c.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.popen.kill()
                c.popen.wait(5)

    def __enter__(self) -> Fleet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
