"""Tiny TCP tools the fleet tests run on their hosts (``python nettools.py COMMAND ...``).

serve-echo PORT          echo every line back, one thread per connection, until killed
serve-sink PORT          per connection: read to EOF, answer the byte count, close
echo ADDR PORT TEXT      send TEXT, print the answer; exit 1 when the connect fails (2 s)
send ADDR PORT NBYTES    send NBYTES, wait for the count; print {"bytes": N, "seconds": S}
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time

CONNECT_TIMEOUT_S = 2.0


def _listen(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("0.0.0.0", port))  # every address of this host's namespace, and only those
    sock.listen(64)
    return sock


def _serve(port: int, handle) -> None:
    sock = _listen(port)
    print("listening", flush=True)
    while True:
        conn, _ = sock.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


def _echo(conn: socket.socket) -> None:
    with conn, conn.makefile("rwb") as f:
        for line in f:
            f.write(line)
            f.flush()


def _sink(conn: socket.socket) -> None:
    with conn:
        total = 0
        while chunk := conn.recv(1 << 16):
            total += len(chunk)
        conn.sendall(f"{total}\n".encode())


def main(argv: list[str]) -> int:
    cmd, *args = argv
    if cmd == "serve-echo":
        _serve(int(args[0]), _echo)
    if cmd == "serve-sink":
        _serve(int(args[0]), _sink)
    try:
        conn = socket.create_connection((args[0], int(args[1])), timeout=CONNECT_TIMEOUT_S)
    except OSError as exc:
        print(f"connect failed: {exc}", file=sys.stderr)
        return 1
    conn.settimeout(60)
    with conn:
        if cmd == "echo":
            conn.sendall(args[2].encode() + b"\n")
            print(conn.makefile("rb").readline().decode().strip())
            return 0
        if cmd == "send":
            n = int(args[2])
            block = b"x" * (1 << 16)
            t0 = time.perf_counter()
            sent = 0
            while sent < n:
                sent += conn.send(block[: min(len(block), n - sent)])
            conn.shutdown(socket.SHUT_WR)
            count = int(conn.makefile("rb").readline())
            print(json.dumps({"bytes": count, "seconds": time.perf_counter() - t0}))
            return 0
    raise SystemExit(f"unknown command {cmd!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
