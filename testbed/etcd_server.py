"""A private single-member etcd on loopback, for tests and the demo's embedded default.
``EtcdServer(data_dir).start()`` picks free ports, waits until ``/health`` says true and remembers
the PID; ``stop()``, ``kill()`` (a crash), ``restart()`` (same data dir and ports) and ``discard()`` (killed and
its data deleted) control it.
Nothing is left behind: ``__exit__``, an atexit hook and, on Linux, setpriv --pdeathsig (etcd dies
with the thread that started it: start servers from a long-lived thread).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
import weakref
from dataclasses import dataclass
from pathlib import Path

from runwarden.net import free_port

ETCD_BINARY = "etcd"
_LOCALHOST = "127.0.0.1"
__all__ = ["EtcdServer", "EtcdServerError", "EtcdTls", "free_port"]
_PORT_ATTEMPTS = 5

# Loopback health checks must not go through an http_proxy from the environment.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_running: weakref.WeakSet[EtcdServer] = weakref.WeakSet()
_running_lock = threading.Lock()


class EtcdServerError(RuntimeError):
    """etcd could not be started or stopped; the message says why (with the log's last lines)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EtcdTls:
    """Serve clients over TLS with these PEM files.

    ``client_cert_auth`` demands client certificates signed by ``ca_file``."""

    cert_file: str
    key_file: str
    ca_file: str
    client_cert_auth: bool = True


class EtcdServer:
    """One etcd process. ``fast=True`` (tests) uses --heartbeat-interval 50 --election-timeout 500:
    a quicker start and a minimum lease TTL of 1 s.

    The health check uses a separate plain-HTTP metrics listener, so it works with TLS and client-cert
    auth on the client port without holding a client certificate.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        name: str = "runwarden",
        fast: bool = False,
        tls: EtcdTls | None = None,
        binary: str = ETCD_BINARY,
        ready_timeout_s: float = 15.0,
        log_path: str | os.PathLike[str] | None = None,
        extra_args: tuple[str, ...] = (),
        client_port: int | None = None,
        peer_port: int | None = None,
        metrics_port: int | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.name = name
        self.fast = fast
        self.tls = tls
        self.binary = binary
        self.ready_timeout_s = ready_timeout_s
        self.log_path = (
            Path(log_path) if log_path is not None else self.data_dir.with_name(self.data_dir.name + ".log")
        )
        self.extra_args = extra_args
        fixed = (client_port, peer_port, metrics_port)
        if any(p is not None for p in fixed) and any(p is None for p in fixed):
            raise EtcdServerError("give all of client_port, peer_port and metrics_port, or none")
        self.client_port = client_port
        self.peer_port = peer_port
        self.metrics_port = metrics_port
        self._process: subprocess.Popen[bytes] | None = None

    # ------------------------------------------------------------------------------------ properties

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:PORT`` of the client listener (what StoreConfig.endpoints wants)."""
        if self.client_port is None:
            raise EtcdServerError("etcd has not been started yet: no endpoint")
        return f"{_LOCALHOST}:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.endpoint}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    # ------------------------------------------------------------------------------------- lifecycle

    def start(self) -> EtcdServer:
        """Start and wait until healthy. The first start picks free ports (unless given); later starts
        reuse them, so clients reconnect to the same endpoint."""
        if self.running:
            raise EtcdServerError(f"etcd {self.name} is already running (pid {self.pid})")
        if shutil.which(self.binary) is None:
            raise EtcdServerError(
                f"etcd binary {self.binary!r} not found on PATH (Debian: apt-get install etcd-server)"
            )
        first = self.client_port is None
        fresh_dir = not self.data_dir.exists() or not any(self.data_dir.iterdir())
        for attempt in range(_PORT_ATTEMPTS if first else 1):
            if first:
                self.client_port, self.peer_port, self.metrics_port = _three_free_ports()
            try:
                self._spawn_and_wait()
                return self
            except _PortClash:
                if fresh_dir:
                    shutil.rmtree(self.data_dir, ignore_errors=True)
                if attempt == _PORT_ATTEMPTS - 1 or not first:
                    raise EtcdServerError(
                        f"etcd {self.name}: port {self.endpoint} or a sibling is in use: {self._log_tail()}"
                    ) from None
        raise AssertionError("unreachable")

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout_s``. Idempotent."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                process.wait()
        self._forget()

    def kill(self) -> None:
        """SIGKILL (a crash: no clean shutdown) and reap."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
        process.wait()
        self._forget()

    def discard(self) -> None:
        """Kill it and delete its data dir; the log beside it stays. A test's etcd preallocates
        two 64 MB WAL files, and a whole suite starts about a hundred of them."""
        self.kill()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def restart(self) -> EtcdServer:
        """Stop if running, then start again on the same data dir and ports."""
        self.stop()
        return self.start()

    def __enter__(self) -> EtcdServer:
        return self.start() if not self.running else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------- internals

    def command(self) -> list[str]:
        assert self.client_port is not None and self.peer_port is not None and self.metrics_port is not None
        peer = f"http://{_LOCALHOST}:{self.peer_port}"
        args = [
            self.binary,
            "--name",
            self.name,
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            self.client_url,
            "--advertise-client-urls",
            self.client_url,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"{self.name}={peer}",
            "--initial-cluster-state",
            "new",
            "--listen-metrics-urls",
            f"http://{_LOCALHOST}:{self.metrics_port}",
            "--logger",
            "zap",
            "--log-level",
            "warn",
        ]
        if self.fast:
            args += ["--heartbeat-interval", "50", "--election-timeout", "500"]
        if self.tls is not None:
            args += [
                "--cert-file",
                self.tls.cert_file,
                "--key-file",
                self.tls.key_file,
                "--trusted-ca-file",
                self.tls.ca_file,
            ]
            if self.tls.client_cert_auth:
                args += ["--client-cert-auth"]
        return args + list(self.extra_args)

    def _spawn_and_wait(self) -> None:
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                _die_with_parent() + self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        with _running_lock:
            _running.add(self)
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                self._forget()
                tail = self._log_tail()
                if "address already in use" in tail:
                    raise _PortClash()
                raise EtcdServerError(f"etcd {self.name} exited during start: {tail}")
            if self._healthy():
                return
            time.sleep(0.05)
        self.kill()
        raise EtcdServerError(
            f"etcd {self.name} not healthy within {self.ready_timeout_s:g} s: {self._log_tail()}"
        )

    def _healthy(self) -> bool:
        url = f"http://{_LOCALHOST}:{self.metrics_port}/health"
        try:
            with _DIRECT.open(url, timeout=1.0) as reply:
                return bool(json.loads(reply.read()).get("health") == "true")
        except (OSError, urllib.error.URLError, ValueError):
            return False

    def _forget(self) -> None:
        self._process = None
        with _running_lock:
            _running.discard(self)

    def _log_tail(self, lines: int = 3) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(line[:300] for line in text[-lines:]) or "(empty log)"


class _PortClash(Exception):
    pass


def _three_free_ports() -> tuple[int, int, int]:
    ports: set[int] = set()
    while len(ports) < 3:
        ports.add(free_port())
    client, peer, metrics = ports
    return client, peer, metrics


def _die_with_parent() -> list[str]:
    """A command prefix that makes etcd get SIGKILL when the thread that started it dies.

    util-linux's ``setpriv --pdeathsig`` sets PR_SET_PDEATHSIG and execs (same PID). A Python
    ``preexec_fn`` would do the same but forks a process that has gRPC threads, which can crash
    the child before exec.
    """
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []


@atexit.register
def _stop_all() -> None:
    with _running_lock:
        servers = list(_running)
    for server in servers:
        with contextlib.suppress(Exception):
            server.kill()
