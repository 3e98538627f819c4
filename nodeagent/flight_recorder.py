"""Flight recording: the rank's setup, and the agent's collection of dumps over unix sockets.

Rank side (imports torch, lazily): `setup_flight_recording(socket_path)` before the process group
exists sets the ring size, then starts torch's `_WorkerServer` on a per-rank unix socket. That server
is C++ and answers `POST /handler/fr_trace_json` without the GIL, so a rank that hangs in a
collective or spins in Python still gives its dump. After the process groups are created the rank
calls `FlightRecording.record_process_groups()`: gloo writes `pg_config` before Python names the
group (`{'': ...}`), so the rank writes the real one next to its socket (`rank<N>.pg.json`) and the
agent puts it into every dump it collects; the in-process dumps (`dump_json`, `dump_pickle`) are
repaired the same way. Without the repair torch's own analyzer crashes with a KeyError.

Agent side (no torch): `collect_dumps({rank: socket_path}, timeout_s)` asks every rank at once. A
rank that cannot answer (stopped, dead, no socket, garbage) is a `CollectedDump(ok=False, error=...)`:
"no dump" is evidence, not an error of the agent.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import pickle
import re
import socket
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runwarden.flightrec import DEFAULT_MAX_DUMP_BYTES, FlightRecorderError, parse_dump, restricted_loads

_log = logging.getLogger(__name__)
ENV_SOCKET_DIR = "RUNWARDEN_FR_SOCKET_DIR"  # set by the launcher; one socket per rank inside it
ENV_BUFFER_SIZE = "TORCH_FR_BUFFER_SIZE"
DEFAULT_BUFFER_SIZE = 2000
FR_JSON_HANDLER = "/handler/fr_trace_json"
_MAX_UNIX_PATH = 107  # sun_path is 108 bytes with the terminating NUL
_MAX_PG_CONFIG_BYTES = 16 * 1024 * 1024


def socket_path_for(socket_dir: Path, rank: int) -> Path:
    return socket_dir / f"rank{rank}.sock"


def pg_config_path_for(socket_path: Path) -> Path:
    return socket_path.with_suffix(".pg.json")


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


# --- rank side ----------------------------------------------------------------------------------


class FlightRecording:
    """A rank's flight recorder: the worker server on its socket and the repaired pg_config."""

    def __init__(self, *, socket_path: Path, server: Any, since_ns: int = 0) -> None:
        self.socket_path = socket_path
        self._server = server
        self._pg_config: dict[str, dict[str, str]] | None = None
        # Entries recorded before this recording started belong to an earlier attempt of the same
        # process (a warm worker kept across attempts, nodeagent.warm.rank): torch's ring outlives the
        # process group, and a new default group is named "0" again with its sequence from 1, so
        # those entries would read as this attempt's collectives far ahead. They are left out.
        self.since_ns = since_ns

    def record_process_groups(self) -> dict[str, dict[str, str]]:
        """Write the real pg_config next to the socket; call after every new process group."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        config: dict[str, dict[str, str]] = {}
        for pg, name in c10d._world.pg_names.items():
            ranks = dist.get_process_group_ranks(pg)
            desc = getattr(pg, "group_desc", "") or ""
            config[name] = {"name": name, "desc": desc, "ranks": str(sorted(ranks))}
        target = pg_config_path_for(self.socket_path)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(json.dumps(config, sort_keys=True))
        os.replace(tmp, target)  # the agent never reads a half-written file
        self._pg_config = config
        return config

    def _repaired(self, dump: dict[str, Any]) -> dict[str, Any]:
        config = self._pg_config if self._pg_config is not None else self.record_process_groups()
        entries = dump.get("entries")
        if self.since_ns and isinstance(entries, list):
            dump = {
                **dump,
                "entries": [
                    e
                    for e in entries
                    if not isinstance(e, dict)
                    or int(e.get("time_created_ns", self.since_ns)) >= self.since_ns
                ],
            }
        return {**dump, "pg_config": config}

    def dump_json(self) -> bytes:
        """This rank's dump as JSON, pg_config repaired (works while another thread is blocked)."""
        from torch._C._distributed_c10d import _dump_fr_trace_json  # type: ignore[attr-defined]  # no stub

        raw = _dump_fr_trace_json(includeCollectives=True, onlyActive=False)
        return json.dumps(self._repaired(json.loads(raw))).encode()

    def dump_pickle(self, *, stack_traces: bool = False) -> bytes:
        """This rank's dump as a pickle (the format torch's analyzer reads), pg_config repaired."""
        from torch._C._distributed_c10d import _dump_fr_trace  # type: ignore[attr-defined]  # no stub

        raw = _dump_fr_trace(includeCollectives=True, includeStackTraces=stack_traces, onlyActive=False)
        dump = restricted_loads(raw)  # our own process's bytes, but never the standard unpickler
        if not isinstance(dump, dict):
            raise FlightRecorderError("torch returned a dump that is not a dict")
        return pickle.dumps(self._repaired(dump), protocol=pickle.HIGHEST_PROTOCOL)

    def close(self) -> None:
        self._server.shutdown()
        for path in (self.socket_path, pg_config_path_for(self.socket_path)):
            path.unlink(missing_ok=True)


def setup_flight_recording(
    socket_path: Path | str, *, buffer_size: int = DEFAULT_BUFFER_SIZE
) -> FlightRecording:
    """Call before `init_process_group`: sets the ring size and starts the worker server."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import _WorkerServer

    path = Path(socket_path)
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "setup_flight_recording must run before init_process_group (the ring size is read then)"
        )
    if not 0 <= buffer_size <= 10_000_000:  # 0 turns recording off (the server still answers, empty)
        raise ValueError(f"buffer_size must be in 0..10000000, got {buffer_size}")
    if len(os.fsencode(path)) > _MAX_UNIX_PATH:
        raise ValueError(f"socket path longer than {_MAX_UNIX_PATH} bytes: {path}")
    os.environ[ENV_BUFFER_SIZE] = str(buffer_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # a stale socket from an earlier attempt would make bind fail
    pg_config_path_for(path).unlink(missing_ok=True)
    return FlightRecording(socket_path=path, server=_WorkerServer(str(path)), since_ns=time.time_ns())


def setup_flight_recording_from_env(*, buffer_size: int | None = None) -> FlightRecording | None:
    """The trainer's one call: uses $RUNWARDEN_FR_SOCKET_DIR, $RANK and $TORCH_FR_BUFFER_SIZE.

    None when not launched by runwarden, or when the socket cannot be made (logged): flight recording
    is evidence for a postmortem, never a reason to stop training (the agent then reports "no dump").
    """
    socket_dir = os.environ.get(ENV_SOCKET_DIR)
    rank = os.environ.get("RANK")
    if not socket_dir or rank is None or not rank.isdigit():
        return None
    size_text = os.environ.get(ENV_BUFFER_SIZE, "")
    size = (
        buffer_size
        if buffer_size is not None
        else int(size_text)
        if size_text.isdigit()
        else DEFAULT_BUFFER_SIZE
    )
    try:
        return setup_flight_recording(socket_path_for(Path(socket_dir), int(rank)), buffer_size=size)
    except (OSError, ValueError) as exc:
        _log.warning("flight recording not started for rank %s: %s", rank, exc)
        return None


# --- agent side ---------------------------------------------------------------------------------


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
        conn.request("POST", FR_JSON_HANDLER)
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
