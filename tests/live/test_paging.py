"""Paging: a real webhook (HTTP server on loopback) and a real command, rate-limited."""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

from controller.live.paging import Pager, PagerConfig


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _wait(pred, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def test_webhook_and_command_receive_the_page(tmp_path: Path) -> None:
    received: list[dict[str, object]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append(json.loads(body))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    out = tmp_path / "paged.txt"
    script = f"import sys; open({str(out)!r}, 'a').write(sys.argv[1] + '\\n')"
    pager = Pager(
        PagerConfig(
            webhook_url=f"http://127.0.0.1:{server.server_address[1]}/hook",
            command=(sys.executable, "-c", script),
        )
    )
    try:
        assert pager.page("crash loop: exit:1 at step 40 3 times", "critical")
        # the file exists as soon as the command opens it; wait for what it writes
        assert _wait(lambda: received and out.exists() and out.read_text().endswith("\n"))
        assert received[0]["reason"] == "crash loop: exit:1 at step 40 3 times"
        assert received[0]["severity"] == "critical"
        assert out.read_text().strip() == "crash loop: exit:1 at step 40 3 times"
    finally:
        server.shutdown()


def test_the_same_reason_is_paged_once_per_interval_and_bursts_are_capped() -> None:
    clock = _Clock()
    pager = Pager(PagerConfig(min_interval_s=300, burst=2), clock=clock)
    assert pager.page("a")
    assert not pager.page("a")  # same reason within the interval
    assert pager.page("b")
    assert not pager.page("c")  # the burst of 2 per interval is spent
    clock.now += 301
    assert pager.page("a") and pager.page("c")
    assert pager.suppressed == 2
    assert [r for _, r in pager.sent] == ["a", "b", "a", "c"]


def test_an_unreachable_webhook_never_raises() -> None:
    pager = Pager(
        PagerConfig(webhook_url="http://127.0.0.1:9/nothing", command=("/nonexistent/pager",), timeout_s=0.5)
    )
    assert pager.page("budget exhausted")
    assert pager.flush(30.0), "the delivery (a daemon thread) neither gave up nor finished"


def test_flush_waits_for_a_page_in_flight(tmp_path: Path) -> None:
    """A controller that exits right after paging (--exit-when-done on a crash loop) flushes first:
    the delivery runs on a daemon thread that would die with the process."""
    out = tmp_path / "paged.txt"
    script = f"import sys, time; time.sleep(0.5); open({str(out)!r}, 'a').write(sys.argv[1] + '\\n')"
    pager = Pager(PagerConfig(command=(sys.executable, "-c", script)))
    assert pager.page("crash loop", "critical")
    assert pager.flush()
    assert out.read_text() == "crash loop\n"
    assert pager.flush(0.0)  # nothing left in flight
