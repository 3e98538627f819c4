"""What this preflight checks against: each expected value and floor, its value and where it came from.

One result, `preflight.expected_values`: PASS when every one is set, else SKIP naming the unset ones,
so a report says which checks ran without a bar (a zero floor or an empty expected value means "not
checked"; each such check also says so in its own result, see `no_floor`). The sources are the
caller's: alone, every value is the preflight config's; the node agent fills some from its own config
and says which (nodeagent.daemon.preflight_defaults).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from preflight.checks.base import CheckContext, CheckSpec
from preflight.config import MODES, PreflightConfig
from preflight.result import CheckResult, passed, skipped

# (section, key): the expected values and floors a check compares with; 0 or "" leaves it unchecked.
EXPECTED: tuple[tuple[str, str], ...] = (
    ("inventory", "expected_gpu_count"),
    ("inventory", "driver_version"),
    ("inventory", "cuda_version"),
    ("storage", "checkpoint_path"),
    ("storage", "min_write_mbps"),
    ("storage", "min_read_mbps"),
    ("compute", "tflops_floor"),
    ("collective", "busbw_floor_gbps"),
    ("network", "min_speed_mbps"),
    ("network", "expected_nic_count"),
)
BASELINE_MEASURES = ("compute.tflops_floor", "collective.busbw_floor_gbps")  # preflight.baseline
DEFAULT_SOURCE = "preflight config"


def no_floor(*keys: str) -> str:
    """The words every check uses when its floor is unset (appended to its message)."""
    return f" (no floor set: {', '.join(f'{k} = 0' for k in keys)}; not checked)"


def expected_values(config: PreflightConfig, sources: Mapping[str, str]) -> list[tuple[str, object, str]]:
    """(section.key, value, source) for every entry of EXPECTED; the source of an unset one is "unset"."""
    out = []
    for section, key in EXPECTED:
        name = f"{section}.{key}"
        value = getattr(getattr(config, section), key)
        out.append((name, value, sources.get(name, DEFAULT_SOURCE) if value else "unset"))
    return out


def expectations_result(config: PreflightConfig, sources: Mapping[str, str]) -> CheckResult:
    name = "preflight.expected_values"
    values = expected_values(config, sources)
    evidence = tuple(
        f"{key} = {value!r} ({source})" if source != "unset" else f"{key} = {value!r} (unset: not checked)"
        for key, value, source in values
    )
    unset = [key for key, _, source in values if source == "unset"]
    if not unset:
        return passed(name, "every expected value and floor is set", evidence=evidence)
    measured = [key for key in unset if key in BASELINE_MEASURES]
    hint = f"; `preflight baseline` on a known-good node measures {', '.join(measured)}" if measured else ""
    return skipped(
        name,
        f"{len(unset)} of {len(values)} not set, so not checked: {', '.join(unset)}{hint}",
        value=float(len(unset)),
        unit="unset",
        evidence=evidence,
    )


def spec_with(sources: Mapping[str, str]) -> CheckSpec:
    """The unit, saying `sources[key]` for where each set value came from (the rest: DEFAULT_SOURCE)."""
    frozen = dict(sources)
    return dataclasses.replace(SPEC, run=lambda ctx: [expectations_result(ctx.config, frozen)])


def _run(ctx: CheckContext) -> list[CheckResult]:
    return [expectations_result(ctx.config, {})]


SPEC = CheckSpec(name="expectations", run=_run, timeout_s=lambda c, m: 1.0, modes=lambda c: MODES)
