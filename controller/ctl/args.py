"""Argument helpers shared by the `controllerctl` subcommands: time arguments and the client."""

from __future__ import annotations

import argparse
import datetime as dt
import re
import time

from controller.ctl.client import Client


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


def client_of(args: argparse.Namespace) -> Client:
    """The command's controller client (main.py connects on first use)."""
    client: Client = args.client_factory()
    return client
