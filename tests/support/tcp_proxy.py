"""A TCP forwarder on loopback whose link can be cut: a partition between one process and a server.

    with TcpProxy(("127.0.0.1", etcd_port)) as proxy:   # the client dials proxy.endpoint
        ...
        proxy.cut()     # every connection is closed and new ones are refused (the link is down)
        proxy.heal()    # connections are accepted again

Only loopback: it listens on 127.0.0.1 and forwards to the target it was given.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
from types import TracebackType


class TcpProxy:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.port = int(self._listener.getsockname()[1])
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._peers: dict[socket.socket, socket.socket] = {}
        self._lock = threading.Lock()
        self._cut = False
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tcp-proxy", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cut(self) -> None:
        with self._lock:
            self._cut = True
            for s in list(self._peers):
                self._drop(s)

    def heal(self) -> None:
        with self._lock:
            self._cut = False

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)
        with self._lock:
            for s in list(self._peers):
                self._drop(s)
        with contextlib.suppress(Exception):
            self._sel.unregister(self._listener)
        self._listener.close()
        self._sel.close()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(
        self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _drop(self, s: socket.socket) -> None:
        other = self._peers.pop(s, None)
        for sock in (s, other):
            if sock is None:
                continue
            self._peers.pop(sock, None)
            with contextlib.suppress(Exception):
                self._sel.unregister(sock)
            with contextlib.suppress(OSError):
                sock.close()

    def _run(self) -> None:
        while not self._closed.is_set():
            for key, _ in self._sel.select(timeout=0.05):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                with self._lock:
                    if sock is self._listener:
                        self._accept()
                    elif sock in self._peers:
                        self._pump(sock)

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        if self._cut:
            client.close()
            return
        try:
            upstream = socket.create_connection(self.target, timeout=2)
        except OSError:
            client.close()
            return
        for s in (client, upstream):
            s.setblocking(False)
            self._sel.register(s, selectors.EVENT_READ, None)
        self._peers[client] = upstream
        self._peers[upstream] = client

    def _pump(self, sock: socket.socket) -> None:
        other = self._peers[sock]
        try:
            data = sock.recv(65536)
            if not data:
                raise OSError("closed")
            other.setblocking(True)
            other.sendall(data)
            other.setblocking(False)
        except OSError:
            self._drop(sock)
