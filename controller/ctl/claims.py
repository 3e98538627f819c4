"""`controllerctl claims release (NODE | --run RUN)`: give back node claims (admin).

A run holds its nodes through claims that outlive its controllers (controller/fleet/claims.py), so a
run that is gone without ending (every controller of it removed) leaves them behind; this gives them
back to the shared pool. A run that has a leader is refused: it gives its nodes back itself.
`controllerctl nodes` shows which run holds each node."""

from __future__ import annotations

import argparse
import json
from typing import Any

from controller.ctl.args import client_of
from controller.ctl.client import CtlError, ExitCode
from runwarden.v1 import controller_pb2


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("claims", help="give back node claims of a run that is gone (admin)")
    actions = p.add_subparsers(dest="claims_action", metavar="ACTION", required=True)
    rel = actions.add_parser("release", parents=[common], help="give back a node's claim, or a run's claims")
    rel.add_argument("node", nargs="?", default="", help="the node whose claim to give back")
    rel.add_argument("--run", default="", help="every claim of this run instead")
    rel.add_argument("--reason", default="", help="why")
    rel.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if bool(args.node) == bool(args.run):
        raise CtlError("name a node or --run RUN (one of them)", ExitCode.USAGE)
    resp = client_of(args).call(
        "ReleaseClaims", controller_pb2.ReleaseClaimsRequest(node=args.node, run=args.run, reason=args.reason)
    )
    if args.json_out:
        print(json.dumps({"nodes": list(resp.nodes)}))
    elif resp.nodes:
        print(f"given back to the shared pool: {', '.join(resp.nodes)}")
    else:
        print("no claim given back")
    return 0
