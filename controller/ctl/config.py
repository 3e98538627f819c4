"""`controllerctl config show|set|apply`: the supervisor policy of a running controller.

    controllerctl config show [--run RUN]
    controllerctl config set KEY VALUE [--reason ...]     # admin: one key; VALUE as in TOML, or none
    controllerctl config apply FILE [--reason ...]         # admin: the file's [policy] is the whole policy

The controller validates the whole new policy before anything changes (an unknown key or a bad value
is refused, naming the key), writes it to etcd with a compare-and-swap, and the leader decides with
it from its next decision on; a standby and any later leader see the same stored policy. `apply`
takes a TOML file whose [policy] table (the controller's own config file works) or top-level keys
are the policy; keys it leaves out take their defaults, as SIGHUP to `controller run` does.
"""

from __future__ import annotations

import argparse
import datetime as dt
from collections.abc import Mapping
from typing import Any

from controller.ctl.args import client_of
from controller.ctl.client import CtlError, ExitCode
from controller.ctl.format import Painter, print_json, table
from runwarden.config import ConfigError, read_toml
from runwarden.v1 import common_pb2, controller_pb2


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("config", help="show or change the supervisor policy of the running controller")
    actions = p.add_subparsers(dest="config_action", metavar="ACTION", required=True)
    show = actions.add_parser("show", parents=[common], help="the policy in force, key by key")
    show.add_argument("--run", default="", help="the run (default: the controller's run)")
    show.set_defaults(func=run_show)
    put = actions.add_parser("set", parents=[common], help="change one key (admin)")
    # dests not named key/config: the global options own args.key (TLS) and args.config (the file)
    put.add_argument("policy_key", metavar="KEY")
    put.add_argument(
        "policy_value", metavar="VALUE", help="as in TOML: 5, 2.5, true, full; none unsets an optional key"
    )
    put.add_argument("--run", default="", help="the run (default: the controller's run)")
    put.add_argument("--reason", default="", help="why (goes into the event log)")
    put.set_defaults(func=run_set)
    apply = actions.add_parser("apply", parents=[common], help="a TOML file's policy, whole (admin)")
    apply.add_argument("policy_file", metavar="FILE")
    apply.add_argument("--run", default="", help="the run (default: the controller's run)")
    apply.add_argument("--reason", default="", help="why (goes into the event log)")
    apply.set_defaults(func=run_apply)


def _show(value: common_pb2.PolicyValue) -> str:
    # imported here, not at the top: `controllerctl status` loads this module and stays light
    from controller.supervisor.reconfigure import from_value, show

    return show(from_value(value)) if value.WhichOneof("value") else "none"


def run_show(args: argparse.Namespace) -> int:
    resp = client_of(args).call("GetPolicy", controller_pb2.GetPolicyRequest(run=args.run))
    if args.json_out:
        print_json(resp)
        return 0
    when = dt.datetime.fromtimestamp(resp.changed_at, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    why = f" ({resp.reason})" if resp.reason else ""
    print(f"run {resp.run}: policy revision {resp.revision}, set {when} by {resp.changed_by or '?'}{why}")
    paint: Painter = args.paint
    print(table(["key", "value"], [[k, _show(resp.values[k])] for k in sorted(resp.values)], paint))
    return 0


def _report(args: argparse.Namespace, resp: controller_pb2.SetPolicyResponse) -> int:
    if args.json_out:
        print_json(resp)
        return 0
    if not resp.changes:
        print("no change: the policy in force already has these values")
        return 0
    for c in resp.changes:
        print(f"{c.key}: {_show(c.old)} -> {_show(c.new)}")
    print(
        f"policy revision {resp.revision}: "
        + (
            "the leader decides with it now"
            if resp.applied
            else "written to etcd; the leader applies it from its watch"
        )
    )
    return 0


def run_set(args: argparse.Namespace) -> int:
    request = controller_pb2.SetPolicyRequest(run=args.run, reason=args.reason)
    request.values[args.policy_key].text = args.policy_value  # read as the key's type by the controller
    return _report(args, client_of(args).call("SetPolicy", request))


def _typed(key: str, value: Any) -> common_pb2.PolicyValue:
    """A TOML value on the wire, spelled as the core spells it (controller.supervisor.reconfigure)."""
    from controller.supervisor.reconfigure import to_value

    try:
        return to_value(value)
    except ValueError:
        raise CtlError(
            f"policy key {key}: expected a number, true/false or a string, got {value!r}", ExitCode.USAGE
        ) from None


def policy_table(data: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    """A config file's [policy] table, or its top-level keys when it is a bare policy file."""
    section = data.get("policy")
    if isinstance(section, Mapping):
        return section
    tables = sorted(k for k, v in data.items() if isinstance(v, Mapping))
    if tables:
        raise CtlError(f"{where}: no [policy] table (it has [{'], ['.join(tables)}])", ExitCode.USAGE)
    return data


def run_apply(args: argparse.Namespace) -> int:
    try:
        data = read_toml(args.policy_file)
    except ConfigError as exc:
        raise CtlError(str(exc), ExitCode.USAGE) from None
    request = controller_pb2.SetPolicyRequest(
        run=args.run, reason=args.reason or f"applied {args.policy_file}", replace=True
    )
    for key, value in policy_table(data, args.policy_file).items():
        request.values[key].CopyFrom(_typed(key, value))
    return _report(args, client_of(args).call("SetPolicy", request))
