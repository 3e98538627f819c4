"""Parse NVIDIA Xid lines from the kernel log and classify each code by severity (`XID_TABLE`, from
NVIDIA's Xid catalog, https://docs.nvidia.com/deploy/xid-errors/). Pure functions, no I/O: the Xid
check and the node agent's live /dev/kmsg monitor call them. A code not in the table is WARNING,
"unknown Xid", so nothing unknown is silently ignored.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from runwarden.v1 import common_pb2

MAX_LINE_CHARS = 4096  # longer input is cut before matching: bounded work per line
MAX_RAW_CHARS = 512  # what an XidEvent keeps of its line


class XidSeverity(enum.Enum):
    """FATAL: the GPU or node must be reset, drained or repaired before it runs work again. WARNING: a
    hardware event worth watching that does not by itself take the node out. APPLICATION: most often
    caused by the application (bad address, illegal instruction); the node is not to blame.
    """

    FATAL = "fatal"
    WARNING = "warning"
    APPLICATION = "application"

    def to_proto(self) -> common_pb2.Severity.ValueType:
        return {
            XidSeverity.FATAL: common_pb2.SEVERITY_FATAL,
            XidSeverity.WARNING: common_pb2.SEVERITY_WARNING,
            XidSeverity.APPLICATION: common_pb2.SEVERITY_APPLICATION,
        }[self]


F, W, A = XidSeverity.FATAL, XidSeverity.WARNING, XidSeverity.APPLICATION

# code -> (severity, short description). Source: NVIDIA Xid catalog (docs.nvidia.com/deploy/xid-errors),
# "Xid Error Listing" table and the per-Xid sections on recommended actions.
XID_TABLE: dict[int, tuple[XidSeverity, str]] = {
    13: (A, "Graphics Engine Exception"),  # catalog: usually an application bug (e.g. out-of-range access)
    31: (A, "GPU memory page fault"),  # catalog: illegal memory access by the application
    43: (A, "GPU stopped processing"),  # catalog: the application hit a software-induced fault
    45: (
        A,
        "Preemptive cleanup, due to previous errors",
    ),  # catalog: seen when a process is killed / exits after errors
    48: (F, "Double Bit ECC Error"),  # catalog: DBE; reset the GPU; RMA if it recurs
    61: (
        W,
        "Internal micro-controller breakpoint/warning",
    ),  # catalog: firmware warning; report if persistent
    62: (F, "Internal micro-controller halt"),  # catalog: firmware halt; GPU reset required
    63: (
        W,
        "ECC page retirement or row remapping recording event",
    ),  # catalog: recorded; takes effect at next reset
    64: (
        F,
        "ECC page retirement or row remapper recording failure",
    ),  # catalog: recording failed; drain + diagnose
    74: (F, "NVLink Error"),  # catalog: NVLink hardware error; reset, check the link
    79: (F, "GPU has fallen off the bus"),  # catalog: GPU no longer reachable; node reboot / reseat
    92: (W, "High single-bit ECC error rate"),  # catalog: SBE rate high; watch, RMA if it persists
    94: (F, "Contained ECC error"),  # catalog: uncorrectable error contained to one app;
    # row remap pending until a GPU reset, so drain + reset
    95: (F, "Uncontained ECC error"),  # catalog: all apps on the GPU affected; GPU reset required
    119: (F, "GSP RPC timeout"),  # catalog: GPU System Processor timed out; reset the GPU
    120: (F, "GSP error"),  # catalog: GSP firmware error; reset the GPU
    140: (F, "Unrecovered ECC error"),  # catalog: ECC error the driver could not recover
    154: (F, "GPU recovery action changed"),  # catalog (R550+): NVML recovery action set (reset/reboot/drain)
}

# `NVRM: Xid (PCI:0000:3b:00): 79, rest` ; PCI id as the driver prints it (domain optional).
_XID_RE = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9a-fA-F]{1,8}(?::[0-9a-fA-F]{1,2}){1,2}(?:\.[0-7])?)\): "
    r"(?P<code>\d{1,5})(?:,\s*(?P<rest>.*))?"
)
_PID_RE = re.compile(r"\bpid=(?P<pid>'?<?\w+>?'?)")
_DMESG_TS_RE = re.compile(r"^\s*\[\s*(?P<sec>\d{1,12})\.(?P<frac>\d{1,9})\]")
_KMSG_RE = re.compile(r"^(?P<pri>\d{1,4}),(?P<seq>\d{1,20}),(?P<usec>\d{1,20}),[^;]{0,16};")


@dataclass(frozen=True, slots=True, kw_only=True)
class XidEvent:
    xid: int
    pci_bus_id: str  # as printed by the driver, e.g. "0000:3b:00"
    severity: XidSeverity
    description: str
    detail: str  # the driver's text after the code, bounded
    pid: int | None
    timestamp_s: float | None  # seconds since boot from the dmesg/kmsg prefix, when the line has one
    raw: str  # the line, bounded


def classify_xid(code: int) -> tuple[XidSeverity, str]:
    return XID_TABLE.get(code, (XidSeverity.WARNING, f"unknown Xid {code}"))


def kernel_timestamp(line: str) -> float | None:
    """Seconds since boot from a dmesg `[ 123.456789]` prefix or a /dev/kmsg `pri,seq,usec,flags;` header."""
    line = line[:MAX_LINE_CHARS]
    match = _KMSG_RE.match(line)
    if match:
        return int(match["usec"]) / 1e6
    match = _DMESG_TS_RE.match(line)
    if match:
        return int(match["sec"]) + int(match["frac"]) / 10 ** len(match["frac"])
    return None


def parse_xid_line(line: str | bytes) -> XidEvent | None:
    """An XidEvent for an Xid line, None for anything else (including malformed or truncated Xid lines)."""
    if isinstance(line, bytes):
        line = line[: MAX_LINE_CHARS * 4].decode("utf-8", "replace")
    line = line[:MAX_LINE_CHARS].rstrip("\r\n")
    match = _XID_RE.search(line)
    if match is None:
        return None
    code = int(match["code"])
    if code == 0:
        return None
    rest = (match["rest"] or "").strip()
    severity, description = classify_xid(code)
    return XidEvent(
        xid=code,
        pci_bus_id=match["pci"].lower(),
        severity=severity,
        description=description,
        detail=rest[:MAX_RAW_CHARS],
        pid=_pid(rest),
        timestamp_s=kernel_timestamp(line),
        raw=line[:MAX_RAW_CHARS],
    )


def _pid(rest: str) -> int | None:
    match = _PID_RE.search(rest)
    if match is None:
        return None
    text = match["pid"].strip("'<>")
    return int(text) if text.isdigit() else None


def xid_evidence(
    event: XidEvent, *, node: str, observed_at: float, source: str, gpu_index: int | None = None
) -> common_pb2.Evidence:
    """The Evidence record the agent publishes for an Xid (severity from the table above)."""
    evidence = common_pb2.Evidence(
        node=node,
        kind=common_pb2.EVIDENCE_KIND_XID,
        severity=event.severity.to_proto(),
        xid=event.xid,
        pci_bus_id=event.pci_bus_id,
        detail=f"Xid {event.xid} ({event.description}) on {event.pci_bus_id}",
        raw=event.raw,
        observed_at=observed_at,
        source=source,
    )
    if gpu_index is not None:
        evidence.gpu_index = gpu_index
    return evidence


def normalize_pci_bus_id(bus_id: str) -> str:
    """NVML's `00000000:3B:00.0` and the driver's `0000:3b:00` to one form, `0000:3b:00`, for matching."""
    text = bus_id.strip().lower()
    if "." in text:
        text = text.rsplit(".", 1)[0]
    parts = text.split(":")
    if len(parts) == 3:
        domain = parts[0][-4:].rjust(4, "0")
        return f"{domain}:{parts[1]}:{parts[2]}"
    if len(parts) == 2:
        return f"0000:{parts[0]}:{parts[1]}"
    return text
