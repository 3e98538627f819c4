"""DCGM diagnostics: `dcgmi diag -r 1|2 -j` (3 in the burn-in) when dcgmi is present, its JSON turned into check results.

dcgmi's JSON has changed across releases; the parser accepts each shape seen in the field:
top key "DCGM GPU Diagnostic" (2.x/3.x) or "DCGM Diagnostic" (4.x), holding "test_categories":
[{"category", "tests": [{"name", "results": [{"status", "gpu_id" | "gpu_ids" | "entity_id",
"warnings": str | [{"warning" | "message", "error_id"}], "info"}]}]}].
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from typing import Any

from preflight.checks.base import CheckContext, CheckSpec, budget_timeout, out_of_budget
from preflight.config import BURN_IN, DcgmConfig
from preflight.result import CheckResult, CheckStatus, failed, skipped, warned, worst

_STATUS = {
    "pass": CheckStatus.PASS,
    "warn": CheckStatus.WARN,
    "warning": CheckStatus.WARN,
    "fail": CheckStatus.FAIL,
    "skip": CheckStatus.SKIP,
    "not run": CheckStatus.SKIP,
}
_REMEDY = "drain the node; rerun `dcgmi diag -r 3` and follow DCGM's error text (RMA if it repeats)"


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in text.strip().lower()).strip("_") or "unnamed"


def _gpu_of(result: dict[str, Any]) -> int | None:
    for key in ("gpu_id", "gpu_ids", "entity_id"):
        value = result.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().isdigit():
            return int(value.strip())
    return None


def _messages(value: Any) -> list[str]:
    """dcgmi's "warnings"/"info": a string, a list of strings, or a list of {"warning"|"message": ...}."""
    if isinstance(value, str):
        return [value] if value.strip() else []
    if isinstance(value, list):
        out: list[str] = []
        for item in value:
            if isinstance(item, dict):
                text = item.get("warning") or item.get("message") or item.get("info")
                if text:
                    code = item.get("error_id")
                    out.append(f"[error {code}] {text}" if code is not None else str(text))
            elif isinstance(item, str) and item.strip():
                out.append(item)
        return out
    return []


def _test_result(category: str, test: dict[str, Any]) -> CheckResult | None:
    name = test.get("name")
    results = test.get("results")
    if not isinstance(name, str) or not isinstance(results, list):
        return None
    statuses, evidence, gpus = [], [], set()
    for item in results:
        if not isinstance(item, dict):
            continue
        status = _STATUS.get(str(item.get("status", "")).strip().lower())
        if status is None:
            continue
        gpu = _gpu_of(item)
        statuses.append(status)
        where = f"gpu{gpu}" if gpu is not None else "node"
        if status is not CheckStatus.PASS:
            gpus.add(gpu)
            texts = _messages(item.get("warnings")) or _messages(item.get("info")) or [status.value]
            evidence += [f"{where}: {status.value}: {t}" for t in texts]
    if not statuses:
        return None
    status = worst(statuses)
    check = f"dcgm.{_slug(category)}.{_slug(name)}"
    gpu_index = next(iter(gpus)) if len(gpus) == 1 else None
    message = f"DCGM {category}/{name}: {status.value}" + (f" on {len(gpus)} entity(ies)" if gpus else "")
    if status is CheckStatus.SKIP and not evidence:
        evidence = ["dcgmi did not run this test"]
    return CheckResult(
        name=check,
        status=status,
        message=message,
        evidence=tuple(evidence),
        gpu_index=gpu_index,
        remedy=_REMEDY if status is CheckStatus.FAIL else "",
    )


def parse_dcgm_diag(text: str, returncode: int = 0) -> list[CheckResult]:
    """Check results for dcgmi's JSON. Unparseable output is FAIL when dcgmi failed, else WARN."""
    try:
        data = json.loads(text)
        root = data.get("DCGM GPU Diagnostic") or data.get("DCGM Diagnostic")
        categories = root["test_categories"]
        if not isinstance(categories, list):
            raise TypeError("test_categories is not a list")
    # RecursionError: deeply nested output (tests/fuzz/test_parsers_fuzz.py)
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
        status = failed if returncode != 0 else warned
        head = text.strip().splitlines()[:5]
        return [
            status(
                "dcgm.diag",
                f"dcgmi output is not the expected JSON ({type(exc).__name__}: {exc}); "
                f"dcgmi exit code {returncode}",
                evidence=tuple(head),
                remedy=_REMEDY,
            )
        ]
    results = []
    for category in categories:
        if not isinstance(category, dict) or not isinstance(category.get("tests"), list):
            continue
        label = str(category.get("category", "diag"))
        for test in category["tests"]:
            if isinstance(test, dict) and (result := _test_result(label, test)) is not None:
                results.append(result)
    if not results:
        status = failed if returncode != 0 else warned
        return [
            status("dcgm.diag", f"dcgmi reported no test results (exit code {returncode})", remedy=_REMEDY)
        ]
    if returncode != 0 and all(r.status is not CheckStatus.FAIL for r in results):
        results.append(
            failed("dcgm.diag", f"dcgmi exited {returncode} without a failing test", remedy=_REMEDY)
        )
    return results


def _level_and_timeout(cfg: DcgmConfig, mode: str) -> tuple[int, float]:
    if mode == BURN_IN:
        return cfg.burn_in_level, cfg.burn_in_timeout_s
    if mode == "quick":
        return cfg.quick_level, cfg.quick_timeout_s
    return cfg.full_level, cfg.full_timeout_s


def run_dcgm(ctx: CheckContext) -> list[CheckResult]:
    cfg = ctx.config.dcgm
    binary = shutil.which(cfg.dcgmi)
    if binary is None:
        return [skipped("dcgm.diag", f"{cfg.dcgmi} not found on PATH (DCGM not installed)")]
    level, limit = _level_and_timeout(cfg, ctx.mode)
    timeout, by_budget = budget_timeout(ctx, limit)
    try:
        proc = subprocess.Popen(
            [binary, "diag", "-r", str(level), "-j"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError as exc:
        return [skipped("dcgm.diag", f"cannot run {binary}: {exc.strerror}")]
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole group: a child holding the pipe must not block us
        proc.communicate()
        if by_budget:
            return [
                out_of_budget("dcgm.diag", ctx, f"dcgmi diag -r {level} did not finish in {timeout:.0f} s")
            ]
        return [
            failed(
                "dcgm.diag",
                f"dcgmi diag -r {level} did not finish in {timeout:.0f} s (killed)",
                remedy="check nv-hostengine; a hung diag often means a hung GPU",
            )
        ]
    return parse_dcgm_diag(out.decode("utf-8", "replace"), proc.returncode)


SPEC = CheckSpec(
    name="dcgm",
    run=run_dcgm,
    timeout_s=lambda c, m: _level_and_timeout(c.dcgm, m)[1] + 2.0,
    modes=lambda c: c.dcgm.modes,
    serial=True,
)
