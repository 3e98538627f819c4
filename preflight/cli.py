"""`preflight run [--quick|--full|--burn-in] [--json] [--config FILE]` and `preflight baseline`.

Exit codes: 0 every check passed (WARN and SKIP do not fail), 1 a check failed, 2 could not run.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from preflight.baseline import BaselineError, baseline_header, measure_baseline
from preflight.config import BURN_IN, BURN_IN_STAGES, ConfigError, config_to_toml, load_config
from preflight.report import EXIT_CANNOT_RUN, EXIT_FAIL, EXIT_PASS
from preflight.result import CheckResult
from preflight.runner import ALL_SPECS, run_preflight


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="preflight", description="Node checks before a GPU training launch."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the checks and print a table or a JSON report")
    mode = run.add_mutually_exclusive_group()
    mode.add_argument(
        "--quick", dest="mode", action="store_const", const="quick", help="the default; <= 15 s"
    )
    mode.add_argument(
        "--full", dest="mode", action="store_const", const="full", help="adds the collective; <= 120 s"
    )
    mode.add_argument(
        "--burn-in",
        dest="mode",
        action="store_const",
        const=BURN_IN,
        help="the burn-in pipeline ([burn_in] stages: sustained matmul, memory test, dcgmi diag -r 3, "
        "all-reduce soak, storage); <= [run] burn_in_budget_s (1 h)",
    )
    run.add_argument("--json", action="store_true", help="print the versioned JSON report instead of a table")
    run.add_argument("--config", type=Path, help="TOML thresholds (see preflight/defaults.toml)")
    run.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="CHECK",
        help=f"run only this unit (repeatable): {', '.join(s.name for s in ALL_SPECS)}; "
        f"with --burn-in, a stage: {', '.join(BURN_IN_STAGES)}",
    )
    run.add_argument(
        "--budget", type=float, default=None, help="total budget in seconds (default: the mode's)"
    )
    run.add_argument("--stream", action="store_true", help="print each result as it finishes (to stderr)")
    run.add_argument("-v", "--verbose", action="store_true", help="show the evidence of every check")
    base = sub.add_parser("baseline", help="measure this known-good node and write the floors to the config")
    base.add_argument("--config", type=Path, help="the config to start from (and to update, unless --out)")
    base.add_argument("--out", type=Path, help="where to write the config (default: --config, else stdout)")
    base.add_argument(
        "--margin", type=float, default=0.2, help="floor = measured x (1 - margin); default 0.2"
    )
    return parser


def _stream(result: CheckResult) -> None:
    gpu = "" if result.gpu_index is None else f"[gpu{result.gpu_index}]"
    print(f"{result.status.value:4} {result.name}{gpu}: {result.message}", file=sys.stderr, flush=True)


def _cmd_run(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    report = run_preflight(
        config,
        args.mode or "quick",
        only=args.only,
        budget_s=args.budget,
        on_result=_stream if args.stream else None,
    )
    print(report.dumps() if args.json else report.render_table(verbose=args.verbose), flush=True)
    if report.abandoned:
        # A timed-out check may sit in a driver call forever; exiting normally could wait on it.
        sys.stderr.flush()
        os._exit(report.exit_code)
    return report.exit_code


def _write_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or Path("."))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _cmd_baseline(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    try:
        baseline = measure_baseline(config, args.margin)
    except BaselineError as exc:
        print(f"preflight baseline: {exc}", file=sys.stderr)
        return EXIT_FAIL
    text = config_to_toml(baseline.config, baseline_header(baseline, args.margin))
    out = args.out or args.config
    if out is None:
        sys.stdout.write(text)
    else:
        _write_atomically(out, text)
        print(
            f"preflight baseline: wrote {out} (tflops_floor={baseline.config.compute.tflops_floor}, "
            f"busbw_floor_gbps={baseline.config.collective.busbw_floor_gbps})",
            file=sys.stderr,
        )
    return EXIT_PASS


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "run":
            return _cmd_run(args)
        return _cmd_baseline(args)
    except (ConfigError, ValueError) as exc:
        print(f"preflight: {exc}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    except Exception as exc:  # the runner itself broke: "could not run", not "the node failed"
        print(f"preflight: could not run: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def console_main() -> None:
    code = main()
    # A check that timed out may leave a daemon thread inside a driver call; do not wait for it.
    os._exit(code)


if __name__ == "__main__":
    console_main()
