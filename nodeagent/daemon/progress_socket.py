"""The agent's end of the ranks' progress path: unix datagrams, one serialized ReportProgressRequest each.

Why not the gRPC ReportProgress call (which also exists): a gRPC call costs the agent about a
millisecond of CPU when calls are sparse (thread hand-offs, polling), and 8 ranks reporting every
second took the agent over its 1%-of-a-core budget. A datagram costs one recvfrom and a parse.

Path: nodeagent.wire.progress_socket_path, `<unix_socket>.progress` (mode 0660, like the gRPC socket). The agent answers each datagram
that comes from a bound address with a ReportProgressResponse (stop flag, injected slow-down);
a rank that binds an (abstract, auto) address gets it. Bad datagrams are dropped (and logged).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from google.protobuf.message import DecodeError

from nodeagent.daemon.validate import ValidationError, progress_request
from runwarden.v1 import agent_pb2

log = logging.getLogger(__name__)
MAX_DATAGRAM = 64 * 1024
Handler = Callable[[agent_pb2.ReportProgressRequest], agent_pb2.ReportProgressResponse]


class ProgressDatagramServer:
    def __init__(self, path: str, handle: Handler, on_done: Callable[[str, float], None]) -> None:
        self.path = path
        self._handle = handle
        self._on_done = on_done
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).unlink(missing_ok=True)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._sock.bind(path)
        os.chmod(path, 0o660)
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="progress-dgram", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        Path(self.path).unlink(missing_ok=True)

    def _loop(self) -> None:
        while not self._closed:
            try:
                data, addr = self._sock.recvfrom(MAX_DATAGRAM)
            except OSError:
                if self._closed:
                    return
                continue
            start = time.perf_counter()
            code = "OK"
            try:
                request = agent_pb2.ReportProgressRequest.FromString(data)
                progress_request(request)
                reply = self._handle(request)
            except (DecodeError, ValidationError) as exc:
                code = "INVALID_ARGUMENT"
                log.debug("progress datagram dropped: %s", exc)
                continue
            except Exception:
                code = "INTERNAL"
                log.exception("progress datagram not handled")
                continue
            finally:
                self._on_done(code, time.perf_counter() - start)
            if addr:
                with contextlib.suppress(OSError):  # the rank is gone or its buffer is full: fine
                    self._sock.sendto(reply.SerializeToString(), socket.MSG_DONTWAIT, addr)
