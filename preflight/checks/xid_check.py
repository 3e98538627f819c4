"""Recent Xid errors from the kernel log, within a configured window."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import time
from collections.abc import Iterable

from preflight.checks.base import CheckContext, CheckSpec
from preflight.result import CheckResult, failed, passed, skipped, warned
from preflight.xid import MAX_LINE_CHARS, XidEvent, XidSeverity, parse_xid_line

MAX_RECORDS = 200_000  # a kernel ring buffer holds far fewer; a bound against a runaway source


class KernelLogUnavailable(RuntimeError):
    pass


def read_kmsg(path: str = "/dev/kmsg") -> list[str]:
    """Every record now in the kernel ring buffer, without blocking (needs CAP_SYSLOG or root)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise KernelLogUnavailable(f"{path}: {exc.strerror}") from exc
    lines: list[str] = []
    try:
        while len(lines) < MAX_RECORDS:
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                break  # caught up with the ring buffer
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    continue  # the record was overwritten while we read: skip to the next one
                raise KernelLogUnavailable(f"{path}: {exc.strerror}") from exc
            if not record:
                break
            lines.append(record[: MAX_LINE_CHARS * 4].decode("utf-8", "replace"))
    finally:
        os.close(fd)
    return lines


def read_dmesg(timeout_s: float) -> list[str]:
    dmesg = shutil.which("dmesg")
    if dmesg is None:
        raise KernelLogUnavailable("dmesg not found")
    try:
        proc = subprocess.run([dmesg], capture_output=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise KernelLogUnavailable("dmesg timed out") from exc
    if proc.returncode != 0:
        raise KernelLogUnavailable(
            f"dmesg exited {proc.returncode}: {proc.stderr[:200].decode(errors='replace')}"
        )
    return proc.stdout.decode("utf-8", "replace").splitlines()[-MAX_RECORDS:]


def read_file_lines(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return [line[:MAX_LINE_CHARS] for line in fh][-MAX_RECORDS:]
    except OSError as exc:
        raise KernelLogUnavailable(f"{path}: {exc.strerror}") from exc


def recent_xids(lines: Iterable[str], *, now_s: float, window_s: float) -> list[XidEvent]:
    """Xid events within the window. Lines without a kernel timestamp are kept (they cannot be dated)."""
    events = []
    for line in lines:
        event = parse_xid_line(line)
        if event is None:
            continue
        if event.timestamp_s is not None and now_s - event.timestamp_s > window_s:
            continue
        events.append(event)
    return events


def _read_source(source: str, timeout_s: float) -> tuple[list[str], str, float]:
    """(lines, source name, now in the lines' clock). Kernel timestamps count from boot (CLOCK_MONOTONIC)."""
    now = time.clock_gettime(time.CLOCK_MONOTONIC)
    if source == "kmsg":
        return read_kmsg(), "kmsg", now
    if source == "dmesg":
        return read_dmesg(timeout_s), "dmesg", now
    if source != "auto":
        return read_file_lines(source), source, now
    errors = []
    for name, reader in (("kmsg", read_kmsg), ("dmesg", lambda: read_dmesg(timeout_s))):
        try:
            return reader(), name, now
        except KernelLogUnavailable as exc:
            errors.append(f"{name}: {exc}")
    raise KernelLogUnavailable("; ".join(errors))


def evaluate_xids(events: list[XidEvent], window_s: float, source: str) -> CheckResult:
    name = "errors.xid"
    kw = {"value": float(len(events)), "unit": "count", "evidence": tuple(e.raw for e in events)}
    fatal = [e for e in events if e.severity is XidSeverity.FATAL]
    warning = [e for e in events if e.severity is XidSeverity.WARNING]
    window = f"in the last {window_s:.0f} s ({source})"
    if fatal:
        codes = sorted({e.xid for e in fatal})
        return failed(
            name,
            f"fatal Xid {', '.join(map(str, codes))} {window}",
            threshold=0.0,
            remedy="drain the node; reset the GPU or reboot, then run `preflight run --full`",
            **kw,
        )
    if warning:
        codes = sorted({e.xid for e in warning})
        return warned(name, f"Xid {', '.join(map(str, codes))} {window}", remedy="watch this node", **kw)
    if events:
        return passed(name, f"only application-caused Xids {window}", **kw)
    return passed(name, f"no Xid {window}", **kw)


def run_xid(ctx: CheckContext) -> list[CheckResult]:
    cfg = ctx.config.xid
    try:
        lines, source, now = _read_source(cfg.source, cfg.timeout_s)
    except KernelLogUnavailable as exc:
        return [skipped("errors.xid", f"kernel log not readable: {exc}")]
    return [evaluate_xids(recent_xids(lines, now_s=now, window_s=cfg.window_s), cfg.window_s, source)]


SPEC = CheckSpec(
    name="xid",
    run=run_xid,
    timeout_s=lambda c, m: c.xid.timeout_s,
    modes=lambda c: c.xid.modes,
)
