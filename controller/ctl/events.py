"""`controllerctl events`: the event log, filtered by run, kind and time; `--follow` to stream."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from typing import Any

import grpc

from controller.ctl.args import client_of, since_arg
from controller.ctl.client import Client, CtlError, ExitCode, rpc_error
from controller.ctl.format import Cell, ago, enum_label, message_to_json, print_json, step_label, table
from runwarden.eventlog import LogEntry
from runwarden.v1 import controller_pb2, events_pb2

_KIND_COLOUR = {
    "detection": "red",
    "attribution": "red",
    "quarantine": "red",
    "page": "red",
    "loss-anomaly": "red",
    "divergence": "red",
    "first-step": "green",
    "checkpoint-commit": "green",
    "launch": "blue",
    "stop-request": "yellow",
    "checkpoint-failed": "yellow",
    "control-plane": "yellow",
}
EVENT_HEADERS = ["when", "seq", "run", "attempt", "step", "kind", "message"]


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


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("events", parents=[common], help="the event log, filtered; --follow to stream")
    p.add_argument("--run", default="", help="only this run")
    p.add_argument(
        "--kind",
        type=kind_arg,
        action="extend",
        default=[],
        help="only these kinds, comma-separated (detection,attribution,...)",
    )
    p.add_argument("--since", type=since_arg, default=0.0, help="10m, 2h, 3d, an ISO time, or unix seconds")
    p.add_argument("--limit", type=int, default=50, help="the last N events (default 50; 0: server default)")
    p.add_argument("--follow", "-f", action="store_true", help="keep streaming new events (Ctrl-C to stop)")
    p.set_defaults(func=run)


def event_row(ev: LogEntry, now: float) -> list[Cell]:
    kind = enum_label(events_pb2.EventKind.Name(ev.kind), "EVENT_KIND_")
    return [
        ago(ev.ts, now),
        str(ev.seq),
        ev.run or "-",
        str(ev.attempt),
        step_label(ev.step),
        (kind, _KIND_COLOUR.get(kind)),
        ev.message or _detail_summary(ev),
    ]


def _detail_summary(ev: LogEntry) -> str:
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


def run(args: argparse.Namespace) -> int:
    client = client_of(args)
    if args.limit < 0:
        raise CtlError("--limit must be >= 0", ExitCode.USAGE)
    resp = client.call(
        "ListEvents",
        controller_pb2.ListEventsRequest(run=args.run, kinds=args.kind, since=args.since, limit=args.limit),
    )
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
        print(
            table(EVENT_HEADERS, [event_row(e, now) for e in events], args.paint) if events else "no events"
        )
    if not args.follow:
        return 0
    if not events:
        last_seq = _latest_seq(client)
    return follow(client, args, last_seq)


def print_json_line(ev: LogEntry) -> None:
    print(json.dumps(message_to_json(ev), sort_keys=True), flush=True)


def _latest_seq(client: Client) -> int:
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
                    print(
                        table(EVENT_HEADERS, [event_row(ev, time.time())], args.paint).split("\n", 1)[1],
                        flush=True,
                    )
            return 0
        except grpc.RpcError as err:
            failure = rpc_error(err, client.address)
            if failure.code != ExitCode.UNREACHABLE:
                raise failure from None
            outage_started = outage_started or time.monotonic()
            if time.monotonic() - outage_started > max_outage_s:
                raise failure from None
            print(
                f"controllerctl: connection lost ({failure}); resuming after seq {after_seq}", file=sys.stderr
            )
            time.sleep(1.0)


def _stream(client: Client, args: argparse.Namespace, after_seq: int) -> Iterator[LogEntry]:
    request = controller_pb2.WatchEventsRequest(run=args.run, kinds=args.kind, after_seq=after_seq)
    for resp in client.stub.WatchEvents(request):
        yield resp.event
