"""`controllerctl quarantine NAME --reason ...`: take a node out of service (admin)."""

from __future__ import annotations

import argparse
from typing import Any

from controller.ctl.args import client_of
from controller.ctl.format import print_pool_state
from runwarden.v1 import controller_pb2


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("quarantine", parents=[common], help="take a node out of service (admin)")
    p.add_argument("name")
    p.add_argument("--reason", required=True, help="why (goes into the event log)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    resp = client_of(args).call(
        "QuarantineNode", controller_pb2.QuarantineNodeRequest(node=args.name, reason=args.reason)
    )
    print_pool_state(resp, args.name, json_out=args.json_out)
    return 0
