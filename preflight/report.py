"""A preflight run's report: a versioned JSON document, a readable table, and the proto summary."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from preflight.result import CheckResult, CheckStatus
from runwarden.v1 import common_pb2

REPORT_SCHEMA = "runwarden.preflight.report"
REPORT_VERSION = 1

EXIT_PASS = 0  # no FAIL (WARN and SKIP do not fail a node)
EXIT_FAIL = 1  # at least one FAIL
EXIT_CANNOT_RUN = 2  # bad config or arguments, or the runner itself could not run
EXIT_INCONCLUSIVE = 3  # no FAIL, but a check could not tell (its host was loaded): run it again later


def result_label(result: CheckResult) -> str:
    return result.name if result.gpu_index is None else f"{result.name}[gpu{result.gpu_index}]"


@dataclass(frozen=True, slots=True, kw_only=True)
class PreflightReport:
    mode: str
    host: str
    started_at: float  # wall clock, seconds since the epoch
    duration_s: float
    budget_s: float
    results: tuple[CheckResult, ...]
    abandoned: tuple[str, ...] = ()  # units that timed out and were left running

    def count(self, status: CheckStatus) -> int:
        return sum(1 for r in self.results if r.status is status)

    @property
    def passed(self) -> bool:
        """No FAIL, and no check that could not tell (an INCONCLUSIVE is no pass)."""
        return self.count(CheckStatus.FAIL) == 0 and self.count(CheckStatus.INCONCLUSIVE) == 0

    @property
    def exit_code(self) -> int:
        if self.count(CheckStatus.FAIL):
            return EXIT_FAIL
        return EXIT_INCONCLUSIVE if self.count(CheckStatus.INCONCLUSIVE) else EXIT_PASS

    @property
    def failed_checks(self) -> list[str]:
        return [result_label(r) for r in self.results if r.status is CheckStatus.FAIL]

    @property
    def inconclusive_checks(self) -> list[str]:
        return [result_label(r) for r in self.results if r.status is CheckStatus.INCONCLUSIVE]

    def summary(self) -> common_pb2.PreflightSummary:
        return common_pb2.PreflightSummary(
            mode=self.mode,
            passed=self.passed,
            pass_count=self.count(CheckStatus.PASS),
            warn_count=self.count(CheckStatus.WARN),
            fail_count=self.count(CheckStatus.FAIL),
            skip_count=self.count(CheckStatus.SKIP),
            finished_at=self.started_at + self.duration_s,
            duration_s=self.duration_s,
            failed_checks=self.failed_checks,
            inconclusive_count=self.count(CheckStatus.INCONCLUSIVE),
            inconclusive_checks=self.inconclusive_checks,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": REPORT_SCHEMA,
            "version": REPORT_VERSION,
            "mode": self.mode,
            "host": self.host,
            "started_at": self.started_at,
            "finished_at": self.started_at + self.duration_s,
            "duration_s": self.duration_s,
            "budget_s": self.budget_s,
            "passed": self.passed,
            "counts": {s.value: self.count(s) for s in CheckStatus},
            "failed_checks": self.failed_checks,
            "inconclusive_checks": self.inconclusive_checks,
            "abandoned": list(self.abandoned),
            "results": [r.to_json() for r in self.results],
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=False)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PreflightReport:
        if not isinstance(data, dict) or data.get("schema") != REPORT_SCHEMA:
            raise ValueError(f"not a preflight report (schema {REPORT_SCHEMA!r} expected)")
        if data.get("version") != REPORT_VERSION:
            raise ValueError(f"preflight report version {data.get('version')!r} is not {REPORT_VERSION}")
        try:
            return cls(
                mode=str(data["mode"]),
                host=str(data["host"]),
                started_at=float(data["started_at"]),
                duration_s=float(data["duration_s"]),
                budget_s=float(data["budget_s"]),
                results=tuple(CheckResult.from_json(r) for r in data["results"]),
                abandoned=tuple(str(a) for a in data.get("abandoned", ())),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed preflight report: {exc}") from exc

    def stages(self) -> list[tuple[str, CheckStatus, str]]:
        """A burn-in's stages in the order they ran: (stage, verdict, counts). The verdict is the
        worst of FAIL / INCONCLUSIVE / WARN / PASS among its results, SKIP only when every result
        was skipped."""
        groups: dict[str, list[CheckResult]] = {}
        for r in self.results:
            parts = r.name.split(".")
            if len(parts) > 1 and parts[0] == "burn_in":
                groups.setdefault(parts[1], []).append(r)
        out = []
        for stage, results in groups.items():
            statuses = [r.status for r in results]
            verdict = next(
                (
                    s
                    for s in (CheckStatus.FAIL, CheckStatus.INCONCLUSIVE, CheckStatus.WARN, CheckStatus.PASS)
                    if s in statuses
                ),
                CheckStatus.SKIP,
            )
            counts = ", ".join(f"{statuses.count(s)} {s.value}" for s in CheckStatus if s in statuses)
            out.append((stage, verdict, counts))
        return out

    def render_table(self, verbose: bool = False) -> str:
        rows = [("STATUS", "CHECK", "VALUE", "DURATION", "MESSAGE")]
        for r in self.results:
            value = "" if r.value is None else f"{r.value:.4g} {r.unit}".strip()
            if r.threshold is not None:
                value += f" (limit {r.threshold:.4g})"
            rows.append((r.status.value, result_label(r), value, f"{r.duration_s:.2f}s", r.message))
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = [
            "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:4])) + "  " + row[4] for row in rows
        ]
        for r in self.results:
            if r.status in (CheckStatus.FAIL, CheckStatus.WARN) and r.remedy:
                lines.append(f"  remedy for {result_label(r)}: {r.remedy}")
            if verbose or r.status is CheckStatus.FAIL:
                lines += [f"    {result_label(r)}: {e}" for e in r.evidence]
        for stage, status, counts in self.stages():
            lines.append(f"stage {stage}: {status.value} ({counts})")
        verdict = "PASSED" if self.passed else "FAILED"
        counts = ", ".join(f"{self.count(s)} {s.value}" for s in CheckStatus)
        lines.append(
            f"preflight {self.mode} on {self.host}: {verdict} ({counts}) in {self.duration_s:.1f} s "
            f"of a {self.budget_s:.0f} s budget"
        )
        return "\n".join(lines)
