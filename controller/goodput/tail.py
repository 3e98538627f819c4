"""Follow the append-only event-log file (`LogTail`): each poll reads only the bytes appended since the
last one, validates lines exactly as ``read_events`` does, and counts, logs and skips a bad line,
never crashes. Called by the controller's metrics (`controller.goodput.windows` through
`WindowedRatesCollector`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from runwarden.eventlog import MAX_LINE_BYTES, LogEntry, decode_line

log = logging.getLogger(__name__)

CHUNK_BYTES = 4 << 20  # read a long backlog (a restart on a months-old log) in bounded pieces


class LogTail:
    """Calls ``on_event`` for each valid line appended to ``path``.

    A line still being written (no newline yet) waits for the next poll. The writer cuts a torn tail
    off when it reopens the log, so a file that shrank by that unfinished line goes on from the last
    complete line. A replaced file (another inode) or one that shrank below a line already read starts
    over: ``on_reset`` is called and every line is read again.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        on_event: Callable[[LogEntry], None],
        on_reset: Callable[[], None],
    ) -> None:
        self.path = Path(path)
        self._on_event = on_event
        self._on_reset = on_reset
        self._file_id: tuple[int, int] | None = None
        self._consumed = 0  # the offset just after the last complete line
        self._partial = b""  # bytes after it: a line still being written
        self._skipping = False  # inside an over-long line: drop bytes up to its newline
        self._last_seq = 0
        self.events = 0
        self.bad_lines = 0
        self.backlog_bytes = 0  # what the last poll saw in the file and left for later

    def poll(self, max_bytes: int | None = None) -> int:
        """Fold in the complete lines appended since the last poll (at most about ``max_bytes`` of
        them: a caller holding a lock lets others in between); the number of bytes read."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return 0  # no event yet: the leader creates the log on its first append
        except OSError as exc:
            log.warning("event log %s: cannot stat: %s", self.path, exc.strerror)
            return 0
        file_id = (st.st_dev, st.st_ino)
        end = self._consumed + len(self._partial)
        if file_id != self._file_id or st.st_size < self._consumed:
            if self._file_id is not None:
                log.warning("event log %s was replaced or truncated: reading it again", self.path)
                self._on_reset()
            self._file_id = file_id
            self._start_over()
            end = 0
        read = 0
        try:
            with open(self.path, "rb") as f:
                if self._partial and (st.st_size < end or self._rewritten(f)):
                    self._partial = b""  # the writer cut off a torn tail we had half-read
                    end = self._consumed
                f.seek(end)
                remaining = st.st_size - end  # what was there at the stat; the rest is the next poll's
                if max_bytes is not None:
                    remaining = min(remaining, max_bytes)
                while remaining > 0:
                    chunk = f.read(min(CHUNK_BYTES, remaining))
                    if not chunk:
                        break
                    remaining -= len(chunk)
                    read += len(chunk)
                    self._take(chunk)
        except OSError as exc:
            log.warning("event log %s: cannot read: %s", self.path, exc.strerror)
        self.backlog_bytes = max(0, st.st_size - self._consumed - len(self._partial))
        return read

    def _start_over(self) -> None:
        self._consumed, self._partial, self._skipping, self._last_seq = 0, b"", False, 0

    def _rewritten(self, f: BinaryIO) -> bool:
        """Whether the unfinished line we hold is no longer what the file has there (cut, rewritten)."""
        f.seek(self._consumed)
        return f.read(len(self._partial)) != self._partial

    def _take(self, chunk: bytes) -> None:
        if self._skipping:  # the rest of a line already reported as over-long: up to its newline
            nl = chunk.find(b"\n")
            self._consumed += len(chunk) if nl < 0 else nl + 1
            if nl < 0:
                return
            chunk, self._skipping = chunk[nl + 1 :], False
        data = self._partial + chunk
        start = 0
        while True:
            nl = data.find(b"\n", start)
            if nl < 0:
                break
            self._line(data[start:nl])
            start = nl + 1
        self._consumed += start  # data began at the old offset
        self._partial = data[start:]
        if len(self._partial) > MAX_LINE_BYTES:
            self._bad(f"line is over the {MAX_LINE_BYTES}-byte limit")
            self._consumed += len(self._partial)
            self._partial, self._skipping = b"", True

    def _line(self, line: bytes) -> None:
        if not line.strip():
            return
        try:
            ev = decode_line(line)
        except ValueError as exc:
            self._bad(str(exc))
            return
        if ev.seq <= self._last_seq:
            self._bad(f"seq {ev.seq} does not increase (after {self._last_seq})")
            return
        self._last_seq = ev.seq
        self.events += 1
        self._on_event(ev)

    def _bad(self, reason: str) -> None:
        self.bad_lines += 1
        log.warning("event log %s: skipped a line: %s", self.path, reason)
