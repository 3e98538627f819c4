"""Helpers for the store tests: peer processes with timestamped output."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class Peer:
    """A ``tests.store.peer`` process; its stdout lines arrive with the monotonic time they were read."""

    def __init__(self, *args: str) -> None:
        self.args = args
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.store.peer", *args],
            cwd=REPO,
            env=env,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.lines: queue.Queue[tuple[float, str]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put((time.monotonic(), line.strip()))

    def expect(self, prefix: str, timeout_s: float) -> tuple[float, str]:
        """The first line starting with ``prefix`` (skipping others) and when it was read."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            try:
                at, line = self.lines.get(timeout=max(remaining, 0.0))
            except queue.Empty:
                raise AssertionError(
                    f"peer {self.args} did not say {prefix!r} within {timeout_s} s; "
                    f"stderr: {self._stderr_tail()}"
                ) from None
            if line.startswith(prefix):
                return at, line

    def silent_for(self, prefix: str, seconds: float) -> bool:
        try:
            self.expect(prefix, seconds)
        except AssertionError:
            return True
        return False

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def signal(self, sig: signal.Signals) -> float:
        self.process.send_signal(sig)
        return time.monotonic()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()

    def _stderr_tail(self) -> str:
        if self.process.poll() is None or self.process.stderr is None:
            return "(still running)"
        return self.process.stderr.read()[-2000:]
