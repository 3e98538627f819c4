"""`controllerctl attribute DUMP_DIR`: blame from a directory of flight-recorder dumps, offline.

For operators and postmortems: no controller, no etcd, no torch. Reads one dump per rank, named as
torch writes them, `<prefix><rank>` (default prefix `nccl_trace_rank_`; an optional `.json` or
`.pkl` suffix is accepted), JSON or pickle (pickles through the restricted loader: plain data only,
never code). Prints the suspects strongest first with their evidence, and the process groups.

Exit codes:
  0  at least one suspect
  1  the dumps were read but show no suspect (a software or data problem, or no hang at all)
  2  bad input: no such directory, no readable dump, bad arguments
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from controller.supervisor.flight_recorder import FrFindings, analyze_flight_recorder
from runwarden.flightrec import DEFAULT_MAX_DUMP_BYTES, TORCH_DEFAULT_PREFIX, read_dump_dir

EXIT_SUSPECTS = 0
EXIT_NO_SUSPECT = 1
EXIT_BAD_INPUT = 2


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `attribute` on controllerctl's subparsers; the handler is `run`."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "attribute",
        help="blame ranks from a directory of flight-recorder dumps (offline)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("dump_dir", type=Path, metavar="DUMP_DIR")
    p.add_argument(
        "--prefix", default=TORCH_DEFAULT_PREFIX, help="file name prefix before the rank (%(default)s)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument(
        "--world-size", type=int, default=None, help="ranks 0..N-1 are expected: a missing file is 'no dump'"
    )
    p.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_DUMP_BYTES, help="largest dump file read")
    p.set_defaults(func=run)
    return p


def _as_json(
    dump_dir: Path, prefix: str, ranks: list[int], errors: dict[int, str], f: FrFindings
) -> dict[str, Any]:
    ordered = sorted(f.suspects.items(), key=lambda kv: (-kv[1][0], kv[0]))
    return {
        "dump_dir": str(dump_dir),
        "prefix": prefix,
        "ranks_read": ranks,
        "unreadable": {str(r): why for r, why in sorted(errors.items())},
        "method": "flight_recorder" if ordered else "none",
        "suspects": [{"rank": r, "confidence": c, "reason": why} for r, (c, why) in ordered],
        "groups": [
            {
                "name": g.pg_name,
                "desc": g.pg_desc,
                "members": list(g.members),
                "seq": g.seq,
                "front": list(g.front),
                "lagging": list(g.lagging),
                "no_dump": list(g.no_dump),
                "unknown": list(g.unknown),
                "op": g.op,
                "stuck": g.stuck,
            }
            for g in f.groups
        ],
        "explanation": list(f.explanation),
    }


def _print_text(report: dict[str, Any]) -> None:
    print(f"read {len(report['ranks_read'])} dumps from {report['dump_dir']} (prefix {report['prefix']!r})")
    for rank, why in report["unreadable"].items():
        print(f"  rank {rank}: unreadable: {why}")
    if not report["suspects"]:
        print("no suspect: every rank reached the same collective and the collectives match")
    for s in report["suspects"]:
        print(f"suspect rank {s['rank']} (confidence {s['confidence']:.2f}): {s['reason']}")
    if report["explanation"]:
        print("evidence:")
        for line in report["explanation"]:
            print(f"  {line}")


def run(args: argparse.Namespace) -> int:
    dump_dir: Path = args.dump_dir
    if not dump_dir.is_dir():
        print(f"controllerctl attribute: {dump_dir} is not a directory", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.world_size is not None and not 0 < args.world_size <= 1_000_000:
        print("controllerctl attribute: --world-size must be in 1..1000000", file=sys.stderr)
        return EXIT_BAD_INPUT
    read = read_dump_dir(dump_dir, prefix=args.prefix, max_bytes=args.max_bytes)
    if not read.dumps:
        why = "; ".join(f"rank {r}: {e}" for r, e in sorted(read.errors.items())) or "no file matches"
        print(f"controllerctl attribute: no readable dump named {args.prefix}<rank> in {dump_dir} ({why})",
              file=sys.stderr)  # fmt: skip
        return EXIT_BAD_INPUT
    expected = range(args.world_size) if args.world_size is not None else ()
    findings = analyze_flight_recorder(read.dumps, expected_ranks=expected, no_dump=read.errors)
    report = _as_json(dump_dir, args.prefix, sorted(read.dumps), dict(read.errors), findings)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_text(report)
    return EXIT_SUSPECTS if report["suspects"] else EXIT_NO_SUSPECT


def main(argv: list[str] | None = None) -> int:
    """Standalone use: `python -m controller.ctl.attribute attribute DUMP_DIR`."""
    parser = argparse.ArgumentParser(prog="controllerctl")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
