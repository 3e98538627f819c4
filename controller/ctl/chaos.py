"""`controllerctl chaos`: inject a real fault into a node, for drills, demos and tests.

    controllerctl chaos NODE kill-rank  [--local-rank N]     # SIGKILL a rank (crash)
    controllerctl chaos NODE stop-rank  [--local-rank N]     # SIGSTOP a rank (hang: the collective waits)
    controllerctl chaos NODE slow-rank  [--local-rank N] --seconds S   # sleep S each step (straggler)
    controllerctl chaos NODE xid        [--line LINE]        # feed a kernel-log line to the Xid monitor
    controllerctl chaos NODE kill-agent                      # the agent exits without releasing its lease

The node's agent address comes from the controller (`GetNode`); the fault is injected by the agent's
`InjectFault` RPC, which the agent refuses unless its config has `chaos_enabled = true`, and which
needs an admin certificate when TLS is on. Nothing here is special to tests: it is the same RPC an
operator drill uses.

Exit codes: 0 injected, 1 refused or failed, 2 bad arguments, 3 unreachable, 4 permission denied,
5 no such node.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import grpc

from controller.ctl.client import Client, CtlError, ExitCode, open_channel, resolve, rpc_error
from runwarden.v1 import agent_pb2, agent_pb2_grpc, controller_pb2

# A fatal Xid line as NVRM prints it: Xid 79, "GPU has fallen off the bus".
DEFAULT_XID_LINE = "NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus."

_KINDS = {
    "kill-rank": agent_pb2.FAULT_KIND_KILL_RANK,
    "stop-rank": agent_pb2.FAULT_KIND_STOP_RANK,
    "slow-rank": agent_pb2.FAULT_KIND_SLOW_RANK,
    "xid": agent_pb2.FAULT_KIND_XID,
    "kill-agent": agent_pb2.FAULT_KIND_KILL_AGENT,
}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "chaos",
        help="inject a fault into a node (drills, demos, tests)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("node", help="the node's name")
    p.add_argument("fault", choices=sorted(_KINDS), help="what to break")
    p.add_argument("--local-rank", type=int, default=0, help="which local rank (default 0)")
    p.add_argument("--seconds", type=float, default=0.0, help="slow-rank: extra seconds per step")
    p.add_argument("--line", default=DEFAULT_XID_LINE, help="xid: the kernel-log line to feed")
    p.add_argument("--agent", metavar="HOST:PORT", help="the agent's address (skips asking the controller)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)
    return p


def _request(args: argparse.Namespace) -> agent_pb2.InjectFaultRequest:
    if args.local_rank < 0 or args.local_rank > 4096:
        raise CtlError(f"--local-rank must be within 0..4096, got {args.local_rank}", ExitCode.USAGE)
    if args.fault == "slow-rank" and not 0 < args.seconds <= 3600:
        raise CtlError("slow-rank needs --seconds within (0, 3600]", ExitCode.USAGE)
    return agent_pb2.InjectFaultRequest(
        kind=_KINDS[args.fault],
        local_rank=args.local_rank,
        value=args.seconds,
        line=args.line if args.fault == "xid" else "",
    )


def run(args: argparse.Namespace) -> int:
    try:
        req = _request(args)
        address, cfg = resolve(args)
        agent_address = args.agent
        if not agent_address:
            client = Client(address, cfg)
            try:
                info = client.call("GetNode", controller_pb2.GetNodeRequest(node=args.node)).node
            finally:
                client.close()
            if not info.address:
                raise CtlError(f"node {args.node} has no agent address (is it alive?)", ExitCode.NOT_FOUND)
            agent_address = info.address
        channel = open_channel(agent_address, cfg)
        try:
            resp = agent_pb2_grpc.NodeAgentStub(channel).InjectFault(req, timeout=cfg.timeout_s)
        except grpc.RpcError as err:
            if (
                args.fault == "kill-agent"
                and isinstance(err, grpc.Call)
                and err.code() == grpc.StatusCode.UNAVAILABLE
            ):
                resp = agent_pb2.InjectFaultResponse(detail="agent exited")  # it died answering: the point
            else:
                raise rpc_error(err, agent_address) from None
        finally:
            channel.close()
    except CtlError as exc:
        print(f"controllerctl chaos: {exc}", file=sys.stderr)
        return int(exc.code)
    if args.json:
        print(
            json.dumps(
                {"node": args.node, "fault": args.fault, "agent": agent_address, "detail": resp.detail}
            )
        )
    else:
        print(f"{args.node}: {args.fault} injected via {agent_address}: {resp.detail}")
    return 0
