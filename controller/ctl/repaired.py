"""`controllerctl repaired NAME --note TEXT`: mark a node held for repair as repaired (admin).

A node quarantined on fatal hardware evidence (a GPU off the bus, an uncorrectable ECC error, a
row-remap failure) is held with no burn-in until it was repaired; this is the mark that says so.
It is a release with the repair note as its reason: the node then runs its burn-in and, once that
passes, is a spare again. A repair hook calls the same RPC (ReleaseNode, reason "repaired: ...").
"""

from __future__ import annotations

import argparse
from typing import Any

from controller.ctl.args import client_of
from controller.ctl.client import CtlError, ExitCode
from controller.ctl.format import print_pool_state
from runwarden.v1 import controller_pb2


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "repaired", parents=[common], help="mark a node held for repair as repaired: burn-in, then a spare"
    )
    p.add_argument("name")
    p.add_argument("--note", required=True, help="what was repaired (reset, reseat, RMA ticket, ...)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    note = " ".join(args.note.split())
    if not note:
        raise CtlError("--note must say what was repaired", ExitCode.USAGE)
    resp = client_of(args).call(
        "ReleaseNode", controller_pb2.ReleaseNodeRequest(node=args.name, reason=f"repaired: {note}")
    )
    print_pool_state(resp, args.name, json_out=args.json_out)
    return 0
