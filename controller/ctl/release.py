"""`controllerctl release NAME`: return a quarantined or held node to service via burn-in (admin)."""

from __future__ import annotations

import argparse
from typing import Any

from controller.ctl.args import client_of
from controller.ctl.format import print_pool_state
from runwarden.v1 import controller_pb2


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "release", parents=[common], help="return a quarantined or held node via burn-in (admin)"
    )
    p.add_argument("name")
    p.add_argument("--reason", default="", help="why")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    resp = client_of(args).call(
        "ReleaseNode", controller_pb2.ReleaseNodeRequest(node=args.name, reason=args.reason)
    )
    print_pool_state(resp, args.name, json_out=args.json_out)
    return 0
