"""Output for `controllerctl`: aligned tables, colour only on a terminal, relative times, JSON."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from google.protobuf import json_format
from google.protobuf.message import Message

from runwarden.v1 import common_pb2, controller_pb2

_CODES = {"red": "31", "green": "32", "yellow": "33", "blue": "34", "grey": "90", "bold": "1"}


def colour_wanted(mode: str, stream: TextIO, env: Mapping[str, str] | None = None) -> bool:
    """--color auto: only on a terminal, and not when NO_COLOR is set or TERM=dumb."""
    env = os.environ if env is None else env
    if mode == "always":
        return True
    if mode == "never":
        return False
    return stream.isatty() and "NO_COLOR" not in env and env.get("TERM") != "dumb"


@dataclass(frozen=True, slots=True)
class Painter:
    enabled: bool

    def __call__(self, text: str, colour: str | None) -> str:
        if not self.enabled or not colour or colour not in _CODES:
            return text
        return f"\x1b[{_CODES[colour]}m{text}\x1b[0m"


Cell = str | tuple[str, str | None]  # text, or (text, colour)


def table(headers: Sequence[str], rows: Sequence[Sequence[Cell]], paint: Painter) -> str:
    """Columns padded to their widest cell (measured before colouring, so colour never misaligns)."""
    plain: list[list[str]] = [[c if isinstance(c, str) else c[0] for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for texts in plain:
        for i, text in enumerate(texts):
            widths[i] = max(widths[i], len(text))
    lines = ["  ".join(paint(h.upper().ljust(widths[i]), "bold") for i, h in enumerate(headers)).rstrip()]
    for row, row_texts in zip(rows, plain, strict=True):
        cells = []
        for i, (cell, text) in enumerate(zip(row, row_texts, strict=True)):
            colour = None if isinstance(cell, str) else cell[1]
            cells.append(paint(text.ljust(widths[i]), colour))
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def duration(seconds: float) -> str:
    """A short human duration: 45s, 12m, 3h05m, 2d04h."""
    if seconds < 0 or seconds != seconds:
        return "-"
    s = round(seconds)
    if s < 120:
        return f"{s}s"
    m = s // 60
    if m < 120:
        return f"{m}m"
    h = m // 60
    if h < 48:
        return f"{h}h{m % 60:02d}m"
    return f"{h // 24}d{h % 24:02d}h"


def ago(ts: float, now: float) -> str:
    if ts <= 0:
        return "-"
    delta = now - ts
    return f"in {duration(-delta)}" if delta < 0 else f"{duration(delta)} ago"


def message_to_json(msg: Message) -> dict[str, Any]:
    return json_format.MessageToDict(
        msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def print_json(obj: Any, out: TextIO | None = None) -> None:
    out = out or sys.stdout
    if isinstance(obj, Message):
        obj = message_to_json(obj)
    json.dump(obj, out, indent=2, sort_keys=True)
    out.write("\n")


def enum_label(name: str, prefix: str) -> str:
    """RUN_PHASE_RUNNING -> running."""
    return name.removeprefix(prefix).lower().replace("_", "-") if name else "-"


def step_label(step: int) -> str:
    """A step number, or "-" for none yet (-1)."""
    return "-" if step < 0 else str(step)


def pool_label(state: common_pb2.PoolState.ValueType) -> str:
    return enum_label(common_pb2.PoolState.Name(state), "POOL_STATE_") if state else "-"


def print_pool_state(
    resp: controller_pb2.QuarantineNodeResponse | controller_pb2.ReleaseNodeResponse,
    node: str,
    *,
    json_out: bool,
) -> None:
    """A quarantine or release answer: the node's pool state now."""
    if json_out:
        print_json(resp)
    else:
        print(f"node {node}: {pool_label(resp.pool_state)}")
