"""The event log: append-only JSON lines, one `runwarden.v1.Event` per line.

It is the truth for goodput, so its two rules are about never losing or inventing an event:

* Writing: one line per event; a batch of lines (`append_all`: the entries of one supervisor batch)
  is written with a single `write` and `fsync`ed once before it returns, so every entry is durable
  before any action it explains is taken, at one disk flush per batch instead of per line (a fleet's
  reconcile logs thousands). A write that fails is cut back off, so nothing of it is left half
  written. Only the leader controller writes. `seq` is assigned here and strictly increases.
* Reading: every line is validated. A torn last line (a crash mid-write: no trailing newline or
  invalid JSON at the end) is reported as `torn_tail` and skipped, never merged with the next
  line. On open for append, a torn tail is cut off (after being reported) so the next event
  starts on a fresh line. A bad line in the middle is reported in `errors`; reading goes on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import json_format

from runwarden.v1 import events_pb2

log = logging.getLogger(__name__)

# One line of the log: the proto message runwarden.v1.Event as written (seq assigned). Not the
# supervisor's events (controller/supervisor/events.py), which are its inputs.
LogEntry = events_pb2.Event

# A line longer than this is refused on write and reported on read: bounded memory for a hostile file.
# Fleet-wide entries grow with the fleet: a preflight plan of 16,384 hosts is 1.7 MB.
MAX_LINE_BYTES = 16 << 20


class EventLogError(Exception):
    """The event log cannot be opened or written."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LineError:
    """One line that could not be read, with its 1-based number and why."""

    line_no: int
    reason: str
    excerpt: str


@dataclass(frozen=True, slots=True, kw_only=True)
class EventLogRead:
    """Everything read from a log: the valid entries, a torn last line if any, and bad lines."""

    entries: list[LogEntry]
    torn_tail: str | None
    errors: list[LineError]


def encode_entry(entry: LogEntry) -> bytes:
    """One entry as one JSON line (protobuf JSON mapping, field names as in the .proto)."""
    text = json_format.MessageToJson(entry, preserving_proto_field_name=True, indent=None, sort_keys=True)
    data = text.encode() + b"\n"
    if len(data) > MAX_LINE_BYTES:
        raise EventLogError(
            f"entry seq={entry.seq} is {len(data)} bytes, over the {MAX_LINE_BYTES}-byte limit"
        )
    return data


def decode_line(line: bytes) -> LogEntry:
    """Parse one line; raises ValueError with a clear reason."""
    if len(line) > MAX_LINE_BYTES:
        raise ValueError(f"line is {len(line)} bytes, over the {MAX_LINE_BYTES}-byte limit")
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8: {exc.reason}") from None
    try:
        obj = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc.msg} at column {exc.colno}") from None
    except RecursionError:  # a line that fits the bound can still nest deeper than the parser recurses
        raise ValueError("not JSON: nested too deeply") from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    entry = LogEntry()
    try:
        json_format.ParseDict(obj, entry, ignore_unknown_fields=False)
    except (json_format.ParseError, ValueError, TypeError, OverflowError, RecursionError) as exc:
        # protobuf's parser raises more than ParseError on values of the wrong kind (an enum of 1e400)
        raise ValueError(f"not an Event: {type(exc).__name__}: {str(exc)[:200]}") from None
    if entry.kind == events_pb2.EVENT_KIND_UNSPECIFIED:
        raise ValueError("event has no kind")
    return entry


def _no_constant(name: str) -> object:
    """json.loads' hook for NaN and Infinity: no event field holds one (the writer never writes them)."""
    raise json.JSONDecodeError(f"{name} is not a value an event holds", name, 0)


def _split_lines(data: bytes) -> tuple[list[bytes], bytes]:
    """Complete lines and the unterminated remainder (a torn tail when non-empty)."""
    parts = data.split(b"\n")
    return parts[:-1], parts[-1]


def read_events(path: str | os.PathLike[str]) -> EventLogRead:
    """Read a whole log, validating each line. A missing file is an empty log."""
    p = Path(path)
    if not p.exists():
        return EventLogRead(entries=[], torn_tail=None, errors=[])
    return parse_log_bytes(p.read_bytes())


def read_tail(path: str | os.PathLike[str], max_bytes: int) -> EventLogRead:
    """The entries in a log's last `max_bytes` (the partial line they start in dropped): bounded
    reading for what only recent entries hold. A missing file is an empty log."""
    p = Path(path)
    if not p.exists():
        return EventLogRead(entries=[], torn_tail=None, errors=[])
    with p.open("rb") as f:
        start = max(0, f.seek(0, os.SEEK_END) - max_bytes)
        f.seek(start)
        data = f.read(max_bytes)
    if start > 0:
        data = data[data.find(b"\n") + 1 :] if b"\n" in data else b""
    return parse_log_bytes(data)


def parse_log_bytes(data: bytes) -> EventLogRead:
    lines, tail = _split_lines(data)
    entries: list[LogEntry] = []
    errors: list[LineError] = []
    torn: str | None = None
    last_seq = 0
    for i, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            entry = decode_line(raw)
        except ValueError as exc:
            is_last = i == len(lines) and not tail
            if is_last:
                # An invalid final line is a torn write that happened to end on a newline byte.
                torn = raw[:200].decode("utf-8", "replace")
            else:
                errors.append(
                    LineError(line_no=i, reason=str(exc), excerpt=raw[:120].decode("utf-8", "replace"))
                )
            continue
        if entry.seq <= last_seq:
            errors.append(
                LineError(
                    line_no=i, reason=f"seq {entry.seq} does not increase (after {last_seq})", excerpt=""
                )
            )
            continue
        last_seq = entry.seq
        entries.append(entry)
    if tail:
        torn = tail[:200].decode("utf-8", "replace")
    return EventLogRead(entries=entries, torn_tail=torn, errors=errors)


class EventLog:
    """The leader's append-only writer. Thread-safe; every append is durable when it returns."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        existing = read_events(self.path)
        if existing.torn_tail is not None:
            log.warning(
                "event log %s: torn last line from a crash skipped: %r", self.path, existing.torn_tail[:80]
            )
            self._truncate_torn_tail()
        for err in existing.errors:
            log.warning("event log %s: line %d unreadable: %s", self.path, err.line_no, err.reason)
        self.recovered = existing
        self._seq = existing.entries[-1].seq if existing.entries else 0
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            raise EventLogError(f"cannot open event log {self.path}: {exc.strerror}") from None
        _fsync_dir(self.path.parent)

    def _truncate_torn_tail(self) -> None:
        data = self.path.read_bytes()
        keep = data.rfind(b"\n") + 1
        lines, tail = _split_lines(data[:keep])
        # Also drop a newline-terminated final line that does not parse (torn at a newline byte).
        if not tail and lines:
            try:
                decode_line(lines[-1])
            except ValueError:
                keep -= len(lines[-1]) + 1
        with open(self.path, "r+b") as f:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())

    def append(self, entry: LogEntry) -> LogEntry:
        """Assign the next seq, write one line, fsync. Returns the entry as written."""
        return self.append_all([entry])[0]

    def append_all(self, entries: Sequence[LogEntry]) -> list[LogEntry]:
        """Assign the next seqs, write the lines at once, fsync once. Returns the entries as written;
        on EventLogError none of them is in the log."""
        with self._lock:
            out = []
            for i, entry in enumerate(entries, 1):
                line = LogEntry()
                line.CopyFrom(entry)
                line.seq = self._seq + i
                out.append(line)
            data = b"".join(encode_entry(line) for line in out)
            if not data:
                return out
            try:
                size = os.fstat(self._fd).st_size
            except OSError as exc:
                raise EventLogError(f"cannot append to event log {self.path}: {exc.strerror}") from None
            try:
                written = os.write(self._fd, data)
                if written != len(data):
                    raise EventLogError(f"short write to {self.path}: {written} of {len(data)} bytes")
                os.fsync(self._fd)
            except (OSError, EventLogError) as exc:
                with contextlib.suppress(OSError):  # what reached the file is not in the log: cut it off
                    os.ftruncate(self._fd, size)
                if isinstance(exc, EventLogError):
                    raise
                raise EventLogError(f"cannot append to event log {self.path}: {exc.strerror}") from None
            self._seq += len(out)
            return out

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
