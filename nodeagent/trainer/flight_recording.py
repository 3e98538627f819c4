"""A rank's flight recorder (runs in the training process; imports torch lazily).

`setup_flight_recording(socket_path)` before the process group exists sets the ring size, then
starts torch's `_WorkerServer` on a per-rank unix socket (nodeagent.wire's layout). That server is
C++ and answers `POST /handler/fr_trace_json` without the GIL, so a rank that hangs in a collective
or spins in Python still gives its dump. After the process groups are created the rank calls
`FlightRecording.record_process_groups()`: gloo writes `pg_config` before Python names the group
(`{'': ...}`), so the rank writes the real one beside its socket and the agent
(nodeagent.daemon.flight_recorder) puts it into every dump it collects; the in-process dumps
(`dump_json`, `dump_pickle`) are repaired the same way (torch's own analyzer needs it).

A torch whose worker server has no `fr_trace_json` handler (2.9: it dumps NCCL's ring alone, so a
gloo job's dump would come back empty) gets `PythonWorkerServer` on the same socket instead: the same
request answered from `_dump_fr_trace_json` on a thread of its own, which needs the GIL only while
it answers (a rank blocked in a collective has released it; one spinning in Python delays it).
"""

from __future__ import annotations

import http.server
import json
import logging
import os
import pickle
import socketserver
import threading
import time
from pathlib import Path
from typing import Any

from nodeagent.trainer.torch_api import c10d_private, has_worker_handler
from nodeagent.wire import FR_DEFAULT_BUFFER_SIZE as DEFAULT_BUFFER_SIZE
from nodeagent.wire import FR_ENV_BUFFER_SIZE as ENV_BUFFER_SIZE
from nodeagent.wire import FR_ENV_SOCKET_DIR as ENV_SOCKET_DIR
from nodeagent.wire import FR_JSON_HANDLER, FR_MAX_SOCKET_PATH
from nodeagent.wire import fr_pg_config_path as pg_config_path_for
from nodeagent.wire import fr_socket_path as socket_path_for
from runwarden.flightrec import FlightRecorderError, restricted_loads

_log = logging.getLogger(__name__)


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class PythonWorkerServer:
    """torch's worker server protocol for the flight recorder's JSON dump, in Python: POST
    /handler/fr_trace_json on a unix socket, answered with `_dump_fr_trace_json`'s bytes."""

    def __init__(self, path: str) -> None:
        dump = c10d_private("_dump_fr_trace_json")

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                if self.path != f"/handler/{FR_JSON_HANDLER}":
                    self.send_error(404, f"Handler {self.path} not found")
                    return
                body = dump(includeCollectives=True, onlyActive=False)
                body = body if isinstance(body, bytes) else str(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return

        self._server = _UnixHTTPServer(path, Handler)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.2}, name="runwarden-fr", daemon=True
        )
        self._thread.start()

    def shutdown(self) -> None:
        self._server.shutdown()
        self._server.server_close()


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
        raw = c10d_private("_dump_fr_trace_json")(includeCollectives=True, onlyActive=False)
        return json.dumps(self._repaired(json.loads(raw))).encode()

    def dump_pickle(self, *, stack_traces: bool = False) -> bytes:
        """This rank's dump as a pickle (the format torch's analyzer reads), pg_config repaired."""
        raw = c10d_private("_dump_fr_trace")(
            includeCollectives=True, includeStackTraces=stack_traces, onlyActive=False
        )
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

    # torch's C++ server where it answers the JSON dump of every backend's ring; else ours
    worker_server = (
        c10d_private("_WorkerServer") if has_worker_handler(FR_JSON_HANDLER) else PythonWorkerServer
    )
    path = Path(socket_path)
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "setup_flight_recording must run before init_process_group (the ring size is read then)"
        )
    if not 0 <= buffer_size <= 10_000_000:  # 0 turns recording off (the server still answers, empty)
        raise ValueError(f"buffer_size must be in 0..10000000, got {buffer_size}")
    if len(os.fsencode(path)) > FR_MAX_SOCKET_PATH:
        raise ValueError(f"socket path longer than {FR_MAX_SOCKET_PATH} bytes: {path}")
    os.environ[ENV_BUFFER_SIZE] = str(buffer_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # a stale socket from an earlier attempt would make bind fail
    pg_config_path_for(path).unlink(missing_ok=True)
    return FlightRecording(socket_path=path, server=worker_server(str(path)), since_ns=time.time_ns())


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
