"""preflight: node checks before a GPU training launch, as independent timed units with one result type.

The library API the node agent calls (no torch is imported into the caller; the matmul and the
all-reduce run in child processes):

    from preflight import load_config, run_preflight
    report = run_preflight(load_config(path_or_None), "quick", on_result=stream_one)
    report.summary()            # runwarden.v1.common_pb2.PreflightSummary
    [r.to_proto() for r in report.results]   # runwarden.v1.common_pb2.CheckResult
    report.to_json()            # the versioned JSON report (schema runwarden.preflight.report, v1)

The CLI is `preflight run [--quick|--full] [--json] [--config FILE]` and `preflight baseline`.
"""

from preflight.config import ConfigError, PreflightConfig, load_config
from preflight.report import PreflightReport
from preflight.result import CheckResult, CheckStatus
from preflight.runner import ALL_SPECS, run_preflight

UNIT_NAMES = tuple(spec.name for spec in ALL_SPECS)

__all__ = [
    "UNIT_NAMES",
    "CheckResult",
    "CheckStatus",
    "ConfigError",
    "PreflightConfig",
    "PreflightReport",
    "load_config",
    "run_preflight",
]
