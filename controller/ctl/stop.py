"""`controllerctl stop RUN [--relaunch]`: ask a run to stop: finish the step, save, commit (admin).

With --relaunch it is a planned restart: the run comes back from that commit, nothing quarantined."""

from __future__ import annotations

import argparse
from typing import Any

from controller.ctl.args import client_of
from controller.ctl.client import ExitCode
from controller.ctl.format import print_json
from runwarden.v1 import controller_pb2


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "stop", parents=[common], help="ask a run to stop: finish the step, save, commit (admin)"
    )
    p.add_argument("run")
    p.add_argument("--reason", default="", help="why (time limit, drain, ...)")
    p.add_argument(
        "--relaunch",
        action="store_true",
        help="a planned restart: relaunch from the commit, quarantine nothing",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    resp = client_of(args).call(
        "RequestStop",
        controller_pb2.ControllerRequestStopRequest(run=args.run, reason=args.reason, relaunch=args.relaunch),
    )
    what = "restart" if args.relaunch else "stop"
    if args.json_out:
        print_json(resp)
    else:
        print(f"run {args.run}: {what} {'requested' if resp.accepted else 'NOT accepted'}")
    return 0 if resp.accepted else int(ExitCode.FAILED)
