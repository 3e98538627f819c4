"""The agent's side of the flight recorder: collect the ranks' dumps over their unix sockets.

`collect_dumps({rank: socket_path}, timeout_s)` asks every rank at once (no torch here). A rank that
cannot answer (stopped, dead, no socket, garbage) is a `CollectedDump(ok=False, error=...)`: "no
dump" is evidence, not an error of the agent. Each dump gets the rank's real pg_config merged in
(nodeagent.trainer.flight_recording writes it) and loses the entries of earlier attempts.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from nodeagent.wire import FR_JSON_HANDLER
from nodeagent.wire import fr_pg_config_path as pg_config_path_for
from runwarden.flightrec import DEFAULT_MAX_DUMP_BYTES, FlightRecorderError, parse_dump

_MAX_PG_CONFIG_BYTES = 16 * 1024 * 1024


def discover_sockets(socket_dir: Path) -> dict[int, Path]:
    """The ranks' sockets in a directory, by rank (what the launcher's ranks created)."""
    found: dict[int, Path] = {}
    if not socket_dir.is_dir():
        return found
    for path in socket_dir.iterdir():
        match = re.fullmatch(r"rank(\d{1,9})\.sock", path.name)
        if match:
            found[int(match.group(1))] = path
    return found


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectedDump:
    """One rank's answer; maps one-to-one onto agent_pb2.RankDump."""

    rank: int
    ok: bool
    error: str  # why there is no dump: "no dump: ..." (evidence for attribution)
    format: str  # "json" when ok
    data: bytes


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout_s: float) -> None:
        super().__init__("localhost", timeout=timeout_s)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(os.fspath(self._path))
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def _since(data: bytes, since_ns: int) -> bytes:
    """The dump without the entries recorded before `since_ns` (wall clock): a warm rank kept across
    attempts still holds its earlier attempts' collectives in torch's ring, and a new default group
    is named "0" again with its sequence from 1, so they would read as this attempt's, far ahead.
    torch's own handler (what the agent asks) knows nothing of attempts; the agent cuts them here."""
    if not since_ns:
        return data
    dump = json.loads(data)
    entries = dump.get("entries") if isinstance(dump, dict) else None
    if not isinstance(entries, list):
        return data
    kept = [
        e
        for e in entries
        if not isinstance(e, dict)
        or not isinstance(e.get("time_created_ns"), int)
        or e["time_created_ns"] >= since_ns
    ]
    if len(kept) == len(entries):
        return data
    return json.dumps({**dump, "entries": kept}).encode()


def _merge_pg_config(data: bytes, socket_path: Path, max_bytes: int) -> bytes:
    sidecar = pg_config_path_for(socket_path)
    try:
        if sidecar.stat().st_size > _MAX_PG_CONFIG_BYTES:
            return data
        config = json.loads(sidecar.read_bytes())
    except (OSError, ValueError):
        return data  # no repair available: the dump is still valid, only its pg_config is gloo's
    if not isinstance(config, dict):
        return data
    dump = json.loads(data)
    dump["pg_config"] = config
    merged = json.dumps(dump).encode()
    parse_dump(merged, max_bytes=max_bytes)  # the repair must not make a dump unreadable
    return merged


def fetch_dump(
    rank: int, socket_path: Path, timeout_s: float, max_bytes: int, since_ns: int = 0
) -> CollectedDump:
    """Ask one rank's worker server for its JSON dump; any failure becomes "no dump" with the reason.
    since_ns: the attempt's launch (wall clock); older entries are an earlier attempt's (`_since`)."""

    def no_dump(why: str) -> CollectedDump:
        return CollectedDump(rank=rank, ok=False, error=f"no dump: {why}", format="", data=b"")

    if not socket_path.exists():
        return no_dump(f"no socket at {socket_path}")
    conn = _UnixHTTPConnection(socket_path, timeout_s)
    try:
        conn.request("POST", f"/handler/{FR_JSON_HANDLER}")
        response = conn.getresponse()
        length = response.getheader("Content-Length")
        if length is not None and length.isdigit() and int(length) > max_bytes:
            return no_dump(f"dump is {length} bytes, over the limit of {max_bytes}")
        body = response.read(max_bytes + 1)
        if response.status != 200:
            return no_dump(f"HTTP {response.status}: {body[:200].decode(errors='replace')}")
        if len(body) > max_bytes:
            return no_dump(f"dump over the limit of {max_bytes} bytes")
        parse_dump(body, rank=rank, max_bytes=max_bytes)  # refuse garbage here, not at the controller
        body = _since(body, since_ns)
        return CollectedDump(
            rank=rank, ok=True, error="", format="json", data=_merge_pg_config(body, socket_path, max_bytes)
        )
    except TimeoutError:
        return no_dump(f"no answer within {timeout_s:g} s (stopped or wedged)")
    except ConnectionRefusedError:
        return no_dump("connection refused (the rank is gone)")
    except FlightRecorderError as exc:
        return no_dump(f"invalid dump: {exc}")
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return no_dump(f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()


def collect_dumps(
    socket_paths: Mapping[int, Path],
    timeout_s: float,
    *,
    max_bytes: int = DEFAULT_MAX_DUMP_BYTES,
    since_ns: int = 0,
) -> list[CollectedDump]:
    """Fetch every rank's dump in parallel; returns one CollectedDump per rank, sorted by rank.

    Takes about `timeout_s` in the worst case (all ranks asked at once), never raises for a rank.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    if not socket_paths:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(socket_paths)), thread_name_prefix="fr-collect") as pool:
        futures = [
            pool.submit(fetch_dump, rank, Path(path), timeout_s, max_bytes, since_ns)
            for rank, path in sorted(socket_paths.items())
        ]
        return [f.result() for f in futures]
