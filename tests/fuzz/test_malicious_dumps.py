"""A malicious pickle served as a rank's flight-recorder dump, through the agent's collection path
(a unix-socket HTTP server where the rank's dump server would be) and the controller's attribution
input path (a RankDump in an agent's reply): refused both times, and its command never runs.
(The file loader and `controllerctl attribute` are covered in tests/flightrec.)"""

from __future__ import annotations

import http.server
import os
import pickle
import socketserver
import threading
from pathlib import Path

from controller.supervisor.flight_recorder import dumps_from_rank_dumps
from nodeagent.daemon.flight_recorder import fetch_dump
from nodeagent.wire import FR_JSON_HANDLER
from runwarden.v1 import agent_pb2


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _serve_unix(path: Path, body: bytes) -> socketserver.BaseServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            assert self.path == f"/handler/{FR_JSON_HANDLER}"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

        def address_string(self) -> str:
            return "unix"

    class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
        daemon_threads = True

    server = Server(str(path), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_malicious_pickle_from_a_rank_socket_is_refused_and_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    for protocol in (2, pickle.HIGHEST_PROTOCOL):
        evil = pickle.dumps({"version": "2.4", "entries": [_Evil(marker)]}, protocol=protocol)
        sock = tmp_path / f"rank0-{protocol}.sock"
        server = _serve_unix(sock, evil)
        try:
            got = fetch_dump(0, sock, 5.0, 1 << 20)
        finally:
            server.shutdown()
            server.server_close()
        assert not got.ok and "invalid dump" in got.error and got.data == b""
        # the same bytes reaching the controller in an agent's reply
        dumps, no_dump = dumps_from_rank_dumps(
            [agent_pb2.RankDump(rank=3, ok=True, format="json", data=evil)]
        )
        assert dumps == {} and "unreadable dump" in no_dump[3]
    assert not marker.exists(), "the pickle's command ran"
