"""`controllerctl nodes`: every node's pool state, liveness, heartbeat, evidence, and the run that
holds it (its claim: one run at a time on a shared fleet; "-" when the node is free for any run)."""

from __future__ import annotations

import argparse
from typing import Any

from controller.ctl.args import client_of
from controller.ctl.format import Cell, Painter, duration, enum_label, pool_label, print_json, table
from runwarden.v1 import common_pb2, controller_pb2

_POOL_COLOUR = {
    "spare": "green",
    "assigned": "blue",
    "quarantined": "red",
    "held": "red",
    "burn-in": "yellow",
}


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("nodes", parents=[common], help="nodes: pool state, liveness, heartbeat, evidence")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    resp = client_of(args).call("ListNodes", controller_pb2.ListNodesRequest())
    if args.json_out:
        print_json(resp)
        return 0
    paint: Painter = args.paint
    rows: list[list[Cell]] = []
    for n in resp.nodes:
        pool = pool_label(n.pool_state)
        alive = ("yes", "green") if n.alive else ("no", "red")
        fatal = sum(1 for e in n.evidence if e.severity == common_pb2.SEVERITY_FATAL)
        evidence = f"{len(n.evidence)} ({fatal} fatal)" if n.evidence else "-"
        rows.append(
            [
                n.node,
                (pool, _POOL_COLOUR.get(pool)),
                enum_label(common_pb2.NodeState.Name(n.state), "NODE_STATE_") if n.state else "-",
                alive,
                duration(n.last_heartbeat_age_s) if n.last_heartbeat_age_s >= 0 else "-",
                str(n.failures),
                f"{n.reputation_score:g}",
                n.claimed_by or "-",
                (evidence, "red" if fatal else None),
                n.reason or "-",
            ]
        )
    if not rows:
        print("no nodes")
        return 0
    print(
        table(
            [
                "node",
                "pool",
                "state",
                "alive",
                "heartbeat",
                "failures",
                "reputation",
                "held by",
                "evidence",
                "reason",
            ],
            rows,
            paint,
        )
    )
    return 0
