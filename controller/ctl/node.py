"""`controllerctl node NAME`: one node in detail: evidence, reputation, last preflight."""

from __future__ import annotations

import argparse
import time
from typing import Any

from controller.ctl.args import client_of
from controller.ctl.format import Cell, Painter, ago, enum_label, pool_label, print_json, table
from runwarden.v1 import common_pb2, controller_pb2


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("node", parents=[common], help="one node in detail: evidence, reputation, preflight")
    p.add_argument("name")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    n = client_of(args).call("GetNode", controller_pb2.GetNodeRequest(node=args.name)).node
    if args.json_out:
        print_json(n)
        return 0
    paint: Painter = args.paint
    now = time.time()
    pf = n.last_preflight
    preflight = (
        f"{'passed' if pf.passed else 'FAILED'} ({pf.mode}, {pf.pass_count} pass, {pf.warn_count} warn, "
        f"{pf.fail_count} fail, {pf.skip_count} skip) {ago(pf.finished_at, now)}"
        if pf.finished_at
        else "never"
    )
    fields = [
        ("node", n.node),
        ("address", n.address or "-"),
        ("pool", pool_label(n.pool_state)),
        ("state", enum_label(common_pb2.NodeState.Name(n.state), "NODE_STATE_") if n.state else "-"),
        ("alive", "yes" if n.alive else "no"),
        ("run", n.run or "-"),
        ("gpus", str(n.gpu_count)),
        ("agent version", n.agent_version or "-"),
        ("failures", str(n.failures)),
        ("straggler flags", str(n.straggler_flags)),
        ("reputation", f"{n.reputation_score:g}"),
        ("reason", n.reason or "-"),
        ("last preflight", preflight),
    ]
    width = max(len(k) for k, _ in fields)
    for k, v in fields:
        print(f"{paint(k.ljust(width), 'bold')}  {v}")
    if pf.failed_checks:
        print(f"{'failed checks'.ljust(width)}  {', '.join(pf.failed_checks)}")
    if n.evidence:
        print()
        rows: list[list[Cell]] = []
        for e in n.evidence:
            sev = enum_label(common_pb2.Severity.Name(e.severity), "SEVERITY_")
            rows.append(
                [
                    ago(e.observed_at, now),
                    enum_label(common_pb2.EvidenceKind.Name(e.kind), "EVIDENCE_KIND_"),
                    (sev, "red" if sev == "fatal" else None),
                    str(e.gpu_index) if e.HasField("gpu_index") else "-",
                    e.detail or "-",
                ]
            )
        print(table(["seen", "evidence", "severity", "gpu", "detail"], rows, paint))
    return 0
