"""The built-in `controllerctl` subcommands: status, nodes, node, events, quarantine, release, stop."""

from __future__ import annotations

import argparse
import datetime as dt
import re
import sys
import time
from collections.abc import Iterator
from typing import Any

import grpc

from controller.ctl.client import Client, CtlError, ExitCode, rpc_error
from controller.ctl.format import Cell, Painter, ago, duration, enum_label, message_to_json, print_json, table
from runwarden.v1 import common_pb2, controller_pb2, events_pb2

_PHASE_COLOUR = {"running": "green", "recovering": "yellow", "preflight": "yellow", "launching": "yellow",
                 "stopping": "yellow", "waiting": "yellow", "failed": "red", "completed": "blue"}
_POOL_COLOUR = {"spare": "green", "assigned": "blue", "quarantined": "red", "held": "red", "burn-in": "yellow"}
_KIND_COLOUR = {"detection": "red", "attribution": "red", "quarantine": "red", "page": "red",
                "first-step": "green", "checkpoint-commit": "green", "launch": "blue", "stop-request": "yellow",
                "checkpoint-failed": "yellow", "control-plane": "yellow"}


def since_arg(text: str, now: float | None = None) -> float:
    """'10m', '2h', '3d', '90s' ago; an ISO date/time (UTC unless it says otherwise); or unix seconds."""
    now = time.time() if now is None else now
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhdw])", text.strip())
    if m:
        unit = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[m.group(2)]
        return now - float(m.group(1)) * unit
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a time: use 10m / 2h / 3d ago, an ISO date like 2026-11-30T12:00, or unix seconds"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


def kind_arg(text: str) -> list[int]:
    kinds: list[int] = []
    for part in text.split(","):
        name = part.strip().upper().replace("-", "_")
        if not name:
            continue
        full = name if name.startswith("EVENT_KIND_") else f"EVENT_KIND_{name}"
        if full not in events_pb2.EventKind.keys() or full == "EVENT_KIND_UNSPECIFIED":  # noqa: SIM118
            known = ", ".join(enum_label(k, "EVENT_KIND_") for k in events_pb2.EventKind.keys()[1:])
            raise argparse.ArgumentTypeError(f"unknown event kind {part!r}; known: {known}")
        kinds.append(int(events_pb2.EventKind.Value(full)))
    return kinds


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("status", parents=[common], help="runs: phase, attempt, step, committed step, budget")
    p.add_argument("run", nargs="?", default="", help="one run (default: every run)")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("nodes", parents=[common], help="nodes: pool state, liveness, heartbeat, evidence")
    p.set_defaults(func=cmd_nodes)

    p = sub.add_parser("node", parents=[common], help="one node in detail: evidence, reputation, preflight")
    p.add_argument("name")
    p.set_defaults(func=cmd_node)

    p = sub.add_parser("events", parents=[common], help="the event log, filtered; --follow to stream")
    p.add_argument("--run", default="", help="only this run")
    p.add_argument("--kind", type=kind_arg, action="extend", default=[],
                   help="only these kinds, comma-separated (detection,attribution,...)")
    p.add_argument("--since", type=since_arg, default=0.0, help="10m, 2h, 3d, an ISO time, or unix seconds")
    p.add_argument("--limit", type=int, default=50, help="the last N events (default 50; 0: server default)")
    p.add_argument("--follow", "-f", action="store_true", help="keep streaming new events (Ctrl-C to stop)")
    p.set_defaults(func=cmd_events)

    p = sub.add_parser("quarantine", parents=[common], help="take a node out of service (admin)")
    p.add_argument("name")
    p.add_argument("--reason", required=True, help="why (goes into the event log)")
    p.set_defaults(func=cmd_quarantine)

    p = sub.add_parser("release", parents=[common], help="return a quarantined or held node via burn-in (admin)")
    p.add_argument("name")
    p.add_argument("--reason", default="", help="why")
    p.set_defaults(func=cmd_release)

    p = sub.add_parser("stop", parents=[common], help="ask a run to stop: finish the step, save, commit (admin)")
    p.add_argument("run")
    p.add_argument("--reason", default="", help="why (time limit, drain, ...)")
    p.set_defaults(func=cmd_stop)


def _client(args: argparse.Namespace) -> Client:
    client: Client = args.client_factory()
    return client


def cmd_status(args: argparse.Namespace) -> int:
    resp = _client(args).call("GetStatus", controller_pb2.GetStatusRequest(run=args.run))
    if args.json_out:
        print_json(resp)
        return 0
    paint: Painter = args.paint
    rows: list[list[Cell]] = []
    for r in resp.runs:
        phase = enum_label(controller_pb2.RunPhase.Name(r.phase), "RUN_PHASE_")
        rows.append([r.run, (phase, _PHASE_COLOUR.get(phase)), str(r.attempt), _step(r.current_step),
                     _step(r.last_committed_step), str(r.restart_budget_left),
                     duration(r.since_last_progress_s) if r.since_last_progress_s >= 0 else "-",
                     str(len(r.nodes)), r.reason or "-"])
    leader = f"{resp.leader} (fence {resp.fence})" if resp.leader else "unknown"
    print(f"leader: {leader}")
    if not rows:
        print("no runs")
        return 0
    print(table(["run", "phase", "attempt", "step", "committed", "budget", "last progress", "nodes", "reason"],
                rows, paint))
    return 0


def _step(step: int) -> str:
    return "-" if step < 0 else str(step)


def _pool(state: common_pb2.PoolState.ValueType) -> str:
    return enum_label(common_pb2.PoolState.Name(state), "POOL_STATE_") if state else "-"


def cmd_nodes(args: argparse.Namespace) -> int:
    resp = _client(args).call("ListNodes", controller_pb2.ListNodesRequest())
    if args.json_out:
        print_json(resp)
        return 0
    paint: Painter = args.paint
    rows: list[list[Cell]] = []
    for n in resp.nodes:
        pool = _pool(n.pool_state)
        alive = ("yes", "green") if n.alive else ("no", "red")
        fatal = sum(1 for e in n.evidence if e.severity == common_pb2.SEVERITY_FATAL)
        evidence = f"{len(n.evidence)} ({fatal} fatal)" if n.evidence else "-"
        rows.append([n.node, (pool, _POOL_COLOUR.get(pool)), enum_label(common_pb2.NodeState.Name(n.state),
                     "NODE_STATE_") if n.state else "-", alive,
                     duration(n.last_heartbeat_age_s) if n.last_heartbeat_age_s >= 0 else "-",
                     str(n.failures), f"{n.reputation_score:g}", n.run or "-",
                     (evidence, "red" if fatal else None), n.reason or "-"])
    if not rows:
        print("no nodes")
        return 0
    print(table(["node", "pool", "state", "alive", "heartbeat", "failures", "reputation", "run", "evidence",
                 "reason"], rows, paint))
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    n = _client(args).call("GetNode", controller_pb2.GetNodeRequest(node=args.name)).node
    if args.json_out:
        print_json(n)
        return 0
    paint: Painter = args.paint
    now = time.time()
    pf = n.last_preflight
    preflight = (f"{'passed' if pf.passed else 'FAILED'} ({pf.mode}, {pf.pass_count} pass, {pf.warn_count} warn, "
                 f"{pf.fail_count} fail, {pf.skip_count} skip) {ago(pf.finished_at, now)}"
                 if pf.finished_at else "never")
    fields = [("node", n.node), ("address", n.address or "-"), ("pool", _pool(n.pool_state)),
              ("state", enum_label(common_pb2.NodeState.Name(n.state), "NODE_STATE_") if n.state else "-"),
              ("alive", "yes" if n.alive else "no"), ("run", n.run or "-"), ("gpus", str(n.gpu_count)),
              ("failures", str(n.failures)), ("straggler flags", str(n.straggler_flags)),
              ("reputation", f"{n.reputation_score:g}"), ("reason", n.reason or "-"), ("last preflight", preflight)]
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
            rows.append([ago(e.observed_at, now), enum_label(common_pb2.EvidenceKind.Name(e.kind), "EVIDENCE_KIND_"),
                         (sev, "red" if sev == "fatal" else None),
                         str(e.gpu_index) if e.HasField("gpu_index") else "-", e.detail or "-"])
        print(table(["seen", "evidence", "severity", "gpu", "detail"], rows, paint))
    return 0


def event_row(ev: events_pb2.Event, now: float) -> list[Cell]:
    kind = enum_label(events_pb2.EventKind.Name(ev.kind), "EVENT_KIND_")
    return [ago(ev.ts, now), str(ev.seq), ev.run or "-", str(ev.attempt), _step(ev.step),
            (kind, _KIND_COLOUR.get(kind)), ev.message or _detail_summary(ev)]


def _detail_summary(ev: events_pb2.Event) -> str:
    which = ev.WhichOneof("detail")
    if which is None:
        return ""
    parts = []
    for key, value in sorted(message_to_json(getattr(ev, which)).items()):
        if isinstance(value, list) and value and all(not isinstance(v, dict | list) for v in value):
            parts.append(f"{key}={','.join(map(str, value))}")
        elif isinstance(value, dict) and "passed" in value:
            parts.append("passed" if value["passed"] else "FAILED")
        elif not isinstance(value, dict | list) and value not in ("", 0, "0", False):
            parts.append(f"{key}={value}")
    text = " ".join(parts)
    return text if len(text) <= 100 else text[:99] + "…"


EVENT_HEADERS = ["when", "seq", "run", "attempt", "step", "kind", "message"]


def cmd_events(args: argparse.Namespace) -> int:
    client = _client(args)
    if args.limit < 0:
        raise CtlError("--limit must be >= 0", ExitCode.USAGE)
    resp = client.call("ListEvents", controller_pb2.ListEventsRequest(
        run=args.run, kinds=args.kind, since=args.since, limit=args.limit))
    events = list(resp.events)
    if args.json_out and not args.follow:
        print_json({"events": [message_to_json(e) for e in events]})
        return 0
    last_seq = events[-1].seq if events else 0
    if args.json_out:
        for e in events:
            print_json_line(e)
    elif events or not args.follow:
        now = time.time()
        print(table(EVENT_HEADERS, [event_row(e, now) for e in events], args.paint) if events else "no events")
    if not args.follow:
        return 0
    if not events:
        last_seq = _latest_seq(client, args)
    return follow(client, args, last_seq)


def print_json_line(ev: events_pb2.Event) -> None:
    import json

    print(json.dumps(message_to_json(ev), sort_keys=True), flush=True)


def _latest_seq(client: Client, args: argparse.Namespace) -> int:
    resp = client.call("ListEvents", controller_pb2.ListEventsRequest(limit=1))
    return resp.events[-1].seq if resp.events else 0


def follow(client: Client, args: argparse.Namespace, after_seq: int, *, max_outage_s: float = 30.0) -> int:
    """Stream events after `after_seq`; on a lost connection resume from the last seq seen."""
    outage_started: float | None = None
    while True:
        try:
            for ev in _stream(client, args, after_seq):
                outage_started = None
                after_seq = ev.seq
                if args.json_out:
                    print_json_line(ev)
                else:
                    print(table(EVENT_HEADERS, [event_row(ev, time.time())], args.paint).split("\n", 1)[1],
                          flush=True)
            return 0
        except grpc.RpcError as err:
            failure = rpc_error(err, client.address)
            if failure.code != ExitCode.UNREACHABLE:
                raise failure from None
            outage_started = outage_started or time.monotonic()
            if time.monotonic() - outage_started > max_outage_s:
                raise failure from None
            print(f"controllerctl: connection lost ({failure}); resuming after seq {after_seq}", file=sys.stderr)
            time.sleep(1.0)


def _stream(client: Client, args: argparse.Namespace, after_seq: int) -> Iterator[events_pb2.Event]:
    request = controller_pb2.WatchEventsRequest(run=args.run, kinds=args.kind, after_seq=after_seq)
    for resp in client.stub.WatchEvents(request):
        yield resp.event


def cmd_quarantine(args: argparse.Namespace) -> int:
    resp = _client(args).call("QuarantineNode",
                              controller_pb2.QuarantineNodeRequest(node=args.name, reason=args.reason))
    return _report_pool(args, args.name, resp)


def cmd_release(args: argparse.Namespace) -> int:
    resp = _client(args).call("ReleaseNode", controller_pb2.ReleaseNodeRequest(node=args.name, reason=args.reason))
    return _report_pool(args, args.name, resp)


def _report_pool(args: argparse.Namespace, node: str, resp: Any) -> int:
    if args.json_out:
        print_json(resp)
    else:
        print(f"node {node}: {_pool(resp.pool_state)}")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    resp = _client(args).call("RequestStop", controller_pb2.ControllerRequestStopRequest(run=args.run,
                                                                                         reason=args.reason))
    if args.json_out:
        print_json(resp)
    else:
        print(f"run {args.run}: stop {'requested' if resp.accepted else 'NOT accepted'}")
    return 0 if resp.accepted else int(ExitCode.FAILED)
