"""Paging a human: a configured webhook and/or command, rate-limited.

A crash loop or an exhausted restart budget pages; a page storm helps no one, so pages with the
same reason are sent at most once per `min_interval_s`, and at most `burst` pages per interval.
"""

from __future__ import annotations

import json
import logging
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class PagerConfig:
    webhook_url: str = ""  # POSTed a JSON body {"reason", "severity", "ts"}
    command: tuple[str, ...] = ()  # run with the reason as the last argument
    min_interval_s: float = 300.0
    burst: int = 3
    timeout_s: float = 5.0


class Pager:
    def __init__(self, cfg: PagerConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg or PagerConfig()
        self._clock = clock
        self._lock = threading.Lock()
        self._last_by_reason: dict[str, float] = {}
        self._window: list[float] = []
        self.sent: list[tuple[str, str]] = []
        self._deliveries: list[threading.Thread] = []
        self.suppressed = 0

    def page(self, reason: str, severity: str = "critical") -> bool:
        """Send (or suppress) one page; returns whether it was sent. Never raises."""
        now = self._clock()
        with self._lock:
            last = self._last_by_reason.get(reason)
            self._window = [t for t in self._window if now - t < self.cfg.min_interval_s]
            if (last is not None and now - last < self.cfg.min_interval_s) or len(
                self._window
            ) >= self.cfg.burst:
                self.suppressed += 1
                log.info("page suppressed by rate limit: %s", reason)
                return False
            self._last_by_reason[reason] = now
            self._window.append(now)
            self.sent.append((severity, reason))
        log.error("PAGE (%s): %s", severity, reason)
        thread = threading.Thread(target=self._deliver, args=(reason, severity), daemon=True)
        with self._lock:
            self._deliveries = [t for t in self._deliveries if t.is_alive()] + [thread]
        thread.start()
        return True

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for the pages still being delivered (a controller about to exit: the crash loop's
        page must not die with its daemon thread); at most ``timeout_s`` (default: what one
        delivery may take). True when none is left."""
        budget = 2 * self.cfg.timeout_s + 1.0 if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget
        with self._lock:
            pending = list(self._deliveries)
        for thread in pending:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in pending)

    def _deliver(self, reason: str, severity: str) -> None:
        if self.cfg.webhook_url:
            body = json.dumps({"reason": reason, "severity": severity, "ts": time.time()}).encode()
            req = urllib.request.Request(
                self.cfg.webhook_url, data=body, headers={"Content-Type": "application/json"}, method="POST"
            )
            try:
                with urllib.request.urlopen(req, timeout=self.cfg.timeout_s) as resp:
                    resp.read(1024)
            except Exception as exc:
                log.warning("page webhook failed: %s", type(exc).__name__)
        if self.cfg.command:
            try:
                subprocess.run(
                    [*self.cfg.command, reason],
                    timeout=self.cfg.timeout_s,
                    check=False,
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                )
            except (OSError, subprocess.SubprocessError) as exc:
                log.warning("page command failed: %s", type(exc).__name__)
