"""A local HTTP server that answers the official kubernetes client from a script of hand-written exchanges.

Each exchange is (method, path) -> (status, JSON body), served in order; every request the
client really sent (method, path, query, content type, JSON body) is kept for the test to
check. A request that does not match the next exchange gets a 500 and is kept as a
mismatch, so a test cannot pass by accident.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from kubernetes import client as k8s


@dataclass(frozen=True, slots=True, kw_only=True)
class Exchange:
    method: str
    path: str
    status: int
    body: dict[str, Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class SeenRequest:
    method: str
    path: str
    query: dict[str, list[str]]
    content_type: str
    body: Any


@dataclass
class ScriptedApiServer:
    exchanges: list[Exchange]
    requests: list[SeenRequest] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                url = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                server.requests.append(
                    SeenRequest(
                        method=self.command,
                        path=url.path,
                        query=parse_qs(url.query),
                        content_type=self.headers.get("Content-Type", ""),
                        body=json.loads(raw) if raw else None,
                    )
                )
                expected = server.exchanges.pop(0) if server.exchanges else None
                if expected is None or (expected.method, expected.path) != (self.command, url.path):
                    server.mismatches.append(f"{self.command} {url.path} (expected {expected})")
                    status, body = (
                        500,
                        {"kind": "Status", "status": "Failure", "message": "unexpected request"},
                    )
                else:
                    status, body = expected.status, expected.body
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = _serve

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def api_client(self) -> k8s.ApiClient:
        config = k8s.Configuration()
        config.host = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        return k8s.ApiClient(config)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def assert_done(self) -> None:
        assert not self.mismatches, self.mismatches
        assert not self.exchanges, f"exchanges never requested: {self.exchanges}"


# ---- response bodies in the API server's shapes (Kubernetes API reference, v1.30) -----------------


def node(
    name: str,
    *,
    ready: str = "True",
    labels: dict[str, str] | None = None,
    taints: list[dict[str, str]] | None = None,
    unschedulable: bool = False,
    resource_version: str = "4711",
) -> dict[str, Any]:
    spec: dict[str, Any] = {"podCIDR": "10.244.1.0/24"}
    if taints:
        spec["taints"] = taints
    if unschedulable:
        spec["unschedulable"] = True
    return {
        "kind": "Node",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "uid": f"6f1c1c8e-0000-4000-8000-{abs(hash(name)) % 10**12:012d}",
            "resourceVersion": resource_version,
            "creationTimestamp": "2026-11-02T08:00:00Z",
            "labels": {"kubernetes.io/hostname": name, "nvidia.com/gpu.present": "true", **(labels or {})},
        },
        "spec": spec,
        "status": {
            "conditions": [
                {
                    "type": "Ready",
                    "status": ready,
                    "lastHeartbeatTime": "2026-12-01T00:00:00Z",
                    "lastTransitionTime": "2026-11-30T20:00:00Z",
                    "reason": "KubeletReady" if ready == "True" else "NodeStatusUnknown",
                    "message": "kubelet is posting ready status"
                    if ready == "True"
                    else "Kubelet stopped posting node status.",
                }
            ],
            "capacity": {"cpu": "192", "memory": "2113470Mi", "nvidia.com/gpu": "8"},
        },
    }


def status_failure(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def pod(name: str, node_name: str, jobset: str) -> dict[str, Any]:
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "namespace": "training",
            "labels": {"jobset.sigs.k8s.io/jobset-name": jobset},
        },
        "spec": {"nodeName": node_name, "containers": [{"name": "trainer", "image": "trainer:1"}]},
        "status": {"phase": "Running"},
    }


def jobset(body: dict[str, Any], *, uid: str = "0b6a1d2e-0000-4000-8000-000000000001") -> dict[str, Any]:
    """A JobSet as the API server returns it: what was created, plus server-set metadata and status."""
    return {
        **body,
        "metadata": {
            **body["metadata"],
            "uid": uid,
            "resourceVersion": "52017",
            "generation": 1,
            "creationTimestamp": "2026-12-01T08:00:00Z",
        },
        "status": {
            "replicatedJobsStatus": [
                {"name": "agent", "ready": 0, "active": 1, "succeeded": 0, "failed": 0, "suspended": 0}
            ]
        },
    }


def jobset_list(*items: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSetList",
        "metadata": {"continue": "", "resourceVersion": "52100"},
        "items": list(items),
    }
