"""The one result type every preflight check returns, and its wire / JSON forms.

SKIP always carries the reason in `message` and never counts as PASS: a node whose GPU checks
were skipped because NVML is missing has not shown that its GPUs are healthy. INCONCLUSIVE: the
check ran and could not tell (it measured its host's load, not the node); it is no pass and no
evidence against the node: run it again later. A FAIL marked `fail_closed` says GPUs are expected
here (config, the scheduler's allocation, the PCI bus) and cannot be reached: the host must run
nothing until it is repaired (the node agent marks itself unhealthy).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace
from typing import Any

from runwarden.v1 import common_pb2

# Bounds on what one result carries, so a chatty check cannot bloat a report or an etcd record.
MAX_EVIDENCE_ITEMS = 32
MAX_EVIDENCE_CHARS = 512
MAX_MESSAGE_CHARS = 400


class CheckStatus(enum.Enum):
    PASS = "PASS"
    WARN = "WARN"
    FAIL = "FAIL"
    SKIP = "SKIP"
    INCONCLUSIVE = "INCONCLUSIVE"

    def to_proto(self) -> common_pb2.CheckStatus.ValueType:
        return _STATUS_TO_PROTO[self]


_STATUS_TO_PROTO = {
    CheckStatus.PASS: common_pb2.CHECK_STATUS_PASS,
    CheckStatus.WARN: common_pb2.CHECK_STATUS_WARN,
    CheckStatus.FAIL: common_pb2.CHECK_STATUS_FAIL,
    CheckStatus.SKIP: common_pb2.CHECK_STATUS_SKIP,
    CheckStatus.INCONCLUSIVE: common_pb2.CHECK_STATUS_INCONCLUSIVE,
}

# Worst first: the status of a group of results is the worst member's (SKIP is not "better" than
# PASS for a group; a group with a PASS and a SKIP is reported per member anyway).
SEVERITY_ORDER = (
    CheckStatus.FAIL,
    CheckStatus.INCONCLUSIVE,  # not judged: worse than a WARN, never a FAIL
    CheckStatus.WARN,
    CheckStatus.SKIP,
    CheckStatus.PASS,
)


def worst(statuses: list[CheckStatus]) -> CheckStatus:
    for status in SEVERITY_ORDER:
        if status in statuses:
            return status
    return CheckStatus.PASS


def _clip(text: str, limit: int) -> str:
    text = text.replace("\n", " ").replace("\r", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckResult:
    """One check's outcome: what was measured, against what, and what to do about it."""

    name: str
    status: CheckStatus
    message: str
    value: float | None = None
    unit: str = ""
    threshold: float | None = None
    evidence: tuple[str, ...] = ()
    duration_s: float = 0.0
    remedy: str = ""
    gpu_index: int | None = None
    fail_closed: bool = False  # a FAIL because expected GPUs cannot be reached (module docstring)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("CheckResult.name must not be empty")
        if not isinstance(self.status, CheckStatus):
            raise TypeError(f"CheckResult.status must be a CheckStatus, got {self.status!r}")
        if self.status in (CheckStatus.SKIP, CheckStatus.INCONCLUSIVE) and not self.message:
            raise ValueError(f"check {self.name}: a {self.status.value} must say why (empty message)")
        if self.fail_closed and self.status is not CheckStatus.FAIL:
            raise ValueError(f"check {self.name}: only a FAIL is fail_closed, not {self.status.value}")
        if self.value is not None and not math.isfinite(self.value):
            object.__setattr__(self, "value", None)
        object.__setattr__(self, "message", _clip(self.message, MAX_MESSAGE_CHARS))
        clipped = tuple(_clip(str(e), MAX_EVIDENCE_CHARS) for e in self.evidence[:MAX_EVIDENCE_ITEMS])
        if len(self.evidence) > MAX_EVIDENCE_ITEMS:
            clipped += (f"... {len(self.evidence) - MAX_EVIDENCE_ITEMS} more items not shown",)
        object.__setattr__(self, "evidence", clipped)

    def with_duration(self, duration_s: float) -> CheckResult:
        return replace(self, duration_s=duration_s)

    def to_proto(self) -> common_pb2.CheckResult:
        msg = common_pb2.CheckResult(
            name=self.name,
            status=self.status.to_proto(),
            unit=self.unit,
            evidence=list(self.evidence),
            duration_s=self.duration_s,
            remedy=self.remedy,
            message=self.message,
        )
        if self.value is not None:
            msg.value = self.value
        if self.threshold is not None:
            msg.threshold = self.threshold
        if self.gpu_index is not None:
            msg.gpu_index = self.gpu_index
        return msg

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status.value,
            "value": self.value,
            "unit": self.unit,
            "threshold": self.threshold,
            "evidence": list(self.evidence),
            "duration_s": self.duration_s,
            "remedy": self.remedy,
            "message": self.message,
            "gpu_index": self.gpu_index,
            "fail_closed": self.fail_closed,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CheckResult:
        try:
            return cls(
                name=str(data["name"]),
                status=CheckStatus(data["status"]),
                value=None if data.get("value") is None else float(data["value"]),
                unit=str(data.get("unit", "")),
                threshold=None if data.get("threshold") is None else float(data["threshold"]),
                evidence=tuple(str(e) for e in data.get("evidence", ())),
                duration_s=float(data.get("duration_s", 0.0)),
                remedy=str(data.get("remedy", "")),
                message=str(data.get("message", "")),
                gpu_index=None if data.get("gpu_index") is None else int(data["gpu_index"]),
                fail_closed=bool(data.get("fail_closed", False)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a preflight check result: {exc}") from exc


def passed(name: str, message: str, **kw: Any) -> CheckResult:
    return CheckResult(name=name, status=CheckStatus.PASS, message=message, **kw)


def warned(name: str, message: str, **kw: Any) -> CheckResult:
    return CheckResult(name=name, status=CheckStatus.WARN, message=message, **kw)


def failed(name: str, message: str, **kw: Any) -> CheckResult:
    return CheckResult(name=name, status=CheckStatus.FAIL, message=message, **kw)


def skipped(name: str, reason: str, **kw: Any) -> CheckResult:
    return CheckResult(name=name, status=CheckStatus.SKIP, message=reason, **kw)


def inconclusive(name: str, reason: str, **kw: Any) -> CheckResult:
    return CheckResult(name=name, status=CheckStatus.INCONCLUSIVE, message=reason, **kw)


__all__ = [
    "CheckResult",
    "CheckStatus",
    "failed",
    "inconclusive",
    "passed",
    "skipped",
    "warned",
    "worst",
]
