"""The control channel's language: one fault per line, parsed and checked before anything happens.

    crash NODE [rank R] [exit CODE | signal SIG]   a rank dies; torchrun exits 1 (default) or the
                                                   group is killed by SIG (name or number)
    hang NODE [culprit-rank R] [stopped]           local rank R (default 0) stops before the next
                                                   collective; every node of its attempt stops at the
                                                   same step. `stopped`: R gives no dump and reads as
                                                   stopped (SIGSTOP), else its dump lags by one
    lease-loss NODE [revoke] [return S]            the host goes dark: keepalives stop (the lease
                                                   expires within its TTL) or, with `revoke`, the lease
                                                   is revoked now; RPCs answer UNAVAILABLE. `return S`:
                                                   after S seconds its agent restarts under a new lease
    xid NODE [code N] [gpu I]                      a kernel-log Xid (default 79, fatal) as evidence
    slow-preflight NODE SECONDS|LO:HI [times N]    its next N preflights (default: all) take that long
    fail-preflight NODE [check NAME] [times N]     its next N preflights (default: all) fail NAME
    drain NODE [REASON...] / undrain NODE          as the Drain RPC
    clear NODE                                     drop the node's preflight faults
    stall NODE                                     the other nodes of NODE's attempt stop stepping
                                                   (their ranks wait for ranks that are gone): what a
                                                   crash and a lease-loss do to their peers

A crash, a hang and a lease-loss carry `at T` (wall-clock seconds) once the fleet stamps them; the
fleet then sends the hang, or a `stall ... at T` after the other two, to every process, so every node
of the attempt, wherever it is hosted, stops at the step it had reached at T: in a real job the
survivors block in the next collective, and nobody commits a checkpoint the lost ranks never saved.
"""

from __future__ import annotations

import math
import signal as signals
from dataclasses import dataclass, replace

from lightfleet.settings import Latency, SettingsError
from runwarden.names import check_name

KINDS = (
    "crash",
    "hang",
    "lease-loss",
    "xid",
    "slow-preflight",
    "fail-preflight",
    "drain",
    "undrain",
    "clear",
    "stall",
)
STAMPED = ("crash", "hang", "lease-loss", "stall")  # faults whose time every process must agree on


class FaultError(ValueError):
    """A control line that is not a fault: one line saying why."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Fault:
    kind: str
    node: str
    rank: int = 0  # crash: the rank that died (for the log); hang: the culprit's local rank
    exit_code: int | None = None
    signal: int | None = None
    stopped: bool = False
    revoke: bool = False
    return_after_s: float | None = None
    xid: int = 79
    gpu: int = 0
    latency: Latency | None = None
    times: int = -1  # preflight faults: how many preflights (-1: every one until `clear`)
    check: str = "lightfleet.injected"
    reason: str = ""
    at: float | None = None  # when (wall clock): stamped by the fleet (STAMPED kinds)

    def stamped(self, now: float) -> Fault:
        return self if self.at is not None else replace(self, at=now)

    def line(self) -> str:
        """The fault as a control line (parse(f.line()) == f)."""
        words = [self.kind, self.node]
        if self.kind == "crash":
            words += ["rank", str(self.rank)]
            words += ["signal", str(self.signal)] if self.signal is not None else []
            words += ["exit", str(self.exit_code)] if self.exit_code is not None else []
        elif self.kind == "hang":
            words += ["culprit-rank", str(self.rank)] + (["stopped"] if self.stopped else [])
        elif self.kind == "lease-loss":
            words += ["revoke"] if self.revoke else []
            words += ["return", repr(self.return_after_s)] if self.return_after_s is not None else []
        elif self.kind == "xid":
            words += ["code", str(self.xid), "gpu", str(self.gpu)]
        elif self.kind == "slow-preflight":
            words += [str(self.latency), "times", str(self.times)]
        elif self.kind == "fail-preflight":
            words += ["check", self.check, "times", str(self.times)]
        if self.kind in STAMPED and self.at is not None:
            words += ["at", repr(self.at)]
        if self.kind == "drain" and self.reason:
            words.append(self.reason)
        return " ".join(words)


def _int(word: str, what: str, low: int, high: int) -> int:
    try:
        value = int(word)
    except ValueError:
        raise FaultError(f"{what}: expected an integer, got {word!r}") from None
    if not low <= value <= high:
        raise FaultError(f"{what}: must be within {low}..{high}, got {value}")
    return value


def _seconds(word: str, what: str) -> float:
    try:
        value = float(word)
    except ValueError:
        raise FaultError(f"{what}: expected seconds, got {word!r}") from None
    if not math.isfinite(value) or value < 0:
        raise FaultError(f"{what}: expected seconds >= 0, got {word!r}")
    return value


def _signal(word: str) -> int:
    name = word.upper()
    if not name.isdigit():
        try:
            return int(signals.Signals[name if name.startswith("SIG") else f"SIG{name}"])
        except KeyError:
            raise FaultError(f"signal: not a signal name: {word!r}") from None
    return _int(word, "signal", 1, 64)


def parse(line: str) -> Fault:
    """One control line -> its Fault (FaultError naming what is wrong)."""
    words = line.split()
    if len(words) < 2:
        raise FaultError(f"expected `KIND NODE [options]` with KIND one of {', '.join(KINDS)}, got {line!r}")
    kind, node, rest = words[0].lower(), words[1], words[2:]
    if kind not in KINDS:
        raise FaultError(f"unknown fault {kind!r}: one of {', '.join(KINDS)}")
    try:
        check_name("node", node)
    except ValueError as exc:
        raise FaultError(str(exc)) from None
    if kind == "drain":
        return Fault(kind=kind, node=node, reason=" ".join(rest)[:500])
    f = Fault(kind=kind, node=node)
    i = 0

    def value() -> str:
        nonlocal i
        if i + 1 >= len(rest):
            raise FaultError(f"{kind}: {rest[i]!r} needs a value")
        i += 1
        return rest[i]

    while i < len(rest):
        word = rest[i].lower()
        if kind == "crash" and word == "rank":
            f = replace(f, rank=_int(value(), "rank", 0, 1 << 20))
        elif kind == "crash" and word == "exit":
            f = replace(f, exit_code=_int(value(), "exit", 0, 255))
        elif kind == "crash" and word == "signal":
            f = replace(f, signal=_signal(value()))
        elif kind == "hang" and word in ("culprit-rank", "rank"):
            f = replace(f, rank=_int(value(), "culprit-rank", 0, 1023))
        elif kind == "hang" and word == "stopped":
            f = replace(f, stopped=True)
        elif kind in STAMPED and word == "at":
            f = replace(f, at=_seconds(value(), "at"))
        elif kind == "lease-loss" and word == "revoke":
            f = replace(f, revoke=True)
        elif kind == "lease-loss" and word == "return":
            f = replace(f, return_after_s=_seconds(value(), "return"))
        elif kind == "xid" and word == "code":
            f = replace(f, xid=_int(value(), "code", 1, 65535))
        elif kind == "xid" and word == "gpu":
            f = replace(f, gpu=_int(value(), "gpu", 0, 255))
        elif kind in ("slow-preflight", "fail-preflight") and word == "times":
            f = replace(f, times=_int(value(), "times", -1, 1 << 30))
        elif kind == "fail-preflight" and word == "check":
            try:
                f = replace(f, check=check_name("check", value()))
            except ValueError as exc:
                raise FaultError(str(exc)) from None
        elif kind == "slow-preflight" and f.latency is None:
            try:
                f = replace(f, latency=Latency.parse(rest[i], "slow-preflight"))
            except SettingsError as exc:
                raise FaultError(str(exc)) from None
        else:
            raise FaultError(f"{kind}: unexpected {rest[i]!r}")
        i += 1
    if f.signal is not None and f.exit_code is not None:
        raise FaultError("crash: give `exit CODE` or `signal SIG`, not both")
    if kind == "slow-preflight" and f.latency is None:
        raise FaultError("slow-preflight: the seconds are required (SECONDS or LOW:HIGH)")
    return f
