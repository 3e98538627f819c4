"""`controllerctl drain NODE --reason ...` / `controllerctl drain NODE --undo`: take a node out for
maintenance (admin). A planned stop of the attempt it is in, a spare takes its node rank, nothing is
quarantined; the same as `systemctl stop nodeagent` on that host, but the agent stays up."""

from __future__ import annotations

import argparse
from typing import Any

from controller.ctl.args import client_of
from controller.ctl.client import CtlError, ExitCode
from controller.ctl.format import print_json
from runwarden.v1 import controller_pb2


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("drain", parents=[common], help="drain a node for maintenance, or --undo it (admin)")
    p.add_argument("name")
    p.add_argument("--reason", default="", help="why (goes into the event log); required unless --undo")
    p.add_argument("--undo", action="store_true", help="put the node back in service")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not args.undo and not args.reason.strip():
        raise CtlError("drain needs --reason (or --undo)", ExitCode.USAGE)
    resp = client_of(args).call(
        "DrainNode", controller_pb2.DrainNodeRequest(node=args.name, reason=args.reason, undo=args.undo)
    )
    if args.json_out:
        print_json(resp)
    else:
        print(f"node {args.name}: {'draining' if resp.draining else 'in service'}")
    return 0
