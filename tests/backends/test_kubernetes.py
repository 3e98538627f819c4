"""The Kubernetes backend against recorded API exchanges over real HTTP (no cluster here).

The official client talks to a local server (tests/backends/k8s_api.py) that answers with
bodies in the API server's shapes; the tests check what the client really sent. These shapes
were written from the Kubernetes and JobSet API references, not captured from a live cluster.
"""

from __future__ import annotations

import pytest

# The `kubernetes` client and `kubernetes-validate` (with PyYAML, jsonschema) are test/extra deps.
pytest.importorskip("kubernetes", reason="pip install kubernetes (the [kubernetes] extra)")
pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (dev extra)")

from collections.abc import Iterator

import kubernetes_validate

from controller.backends.base import AttemptHandle, AttemptSpec, AttemptState, BackendError
from controller.backends.kubernetes import KubernetesBackend, KubernetesConfig, jobset_manifest
from tests.backends.k8s_api import Exchange, RecordedApiServer, node, pod, status_failure

NODES = "/api/v1/nodes"
JOBSETS = "/apis/jobset.x-k8s.io/v1alpha2/namespaces/training/jobsets"
OPERATOR_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
OUR_TAINT = {"key": "runwarden.io/quarantined", "value": "true", "effect": "NoSchedule"}


def config(**overrides: object) -> KubernetesConfig:
    values: dict = {
        "image": "ghcr.io/example/trainer:2026.11",
        "namespace": "training",
        "checkpoint_save_s": 240.0,
        "checkpoint_commit_s": 15.0,
        "termination_grace_s": 600,
        "queue_name": "training",
    }
    values.update(overrides)
    return KubernetesConfig(**values)


@pytest.fixture
def api() -> Iterator[list[RecordedApiServer]]:
    servers: list[RecordedApiServer] = []
    yield servers
    for server in servers:
        server.close()


def backend_with(api: list[RecordedApiServer], exchanges: list[Exchange], **cfg: object):
    server = RecordedApiServer(exchanges)
    api.append(server)
    return KubernetesBackend(server.api_client(), config(**cfg)), server


SPEC = AttemptSpec(
    run="llm",
    attempt=3,
    nodes=("gpu-1", "gpu-3"),
    command=("python", "train.py"),
    procs_per_node=8,
    env={"RUNWARDEN_CHECKPOINT_DIR": "/ckpt/llm"},
)


def test_quarantine_taints_and_labels_the_node_keeping_other_taints(api) -> None:
    backend, server = backend_with(
        api,
        [
            Exchange(
                method="GET", path=f"{NODES}/gpu-2", status=200, body=node("gpu-2", taints=[OPERATOR_TAINT])
            ),
            Exchange(method="PATCH", path=f"{NODES}/gpu-2", status=200, body=node("gpu-2")),
        ],
    )
    backend.quarantine("gpu-2", "xid 79: GPU fell off the bus\n(step 1200)")
    server.assert_done()
    patch = server.requests[1]
    assert patch.content_type == "application/strategic-merge-patch+json"
    assert patch.body["metadata"]["labels"] == {"runwarden.io/health": "quarantined"}
    assert patch.body["metadata"]["annotations"] == {
        "runwarden.io/quarantine-reason": "xid 79: GPU fell off the bus (step 1200)"
    }
    assert patch.body["metadata"]["resourceVersion"] == "4711"
    assert patch.body["spec"]["taints"] == [OPERATOR_TAINT, OUR_TAINT]


def test_release_removes_only_runwarden_marks(api) -> None:
    quarantined = node(
        "gpu-2", labels={"runwarden.io/health": "quarantined"}, taints=[OPERATOR_TAINT, OUR_TAINT]
    )
    backend, server = backend_with(
        api,
        [
            Exchange(method="GET", path=f"{NODES}/gpu-2", status=200, body=quarantined),
            Exchange(method="PATCH", path=f"{NODES}/gpu-2", status=200, body=node("gpu-2")),
        ],
    )
    assert backend.release("gpu-2") is True
    server.assert_done()
    patch = server.requests[1].body
    assert patch["metadata"]["labels"] == {"runwarden.io/health": None}
    assert patch["spec"]["taints"] == [OPERATOR_TAINT]


def test_release_refuses_a_node_an_operator_cordoned(api) -> None:
    cordoned = node(
        "gpu-4", labels={"runwarden.io/health": "quarantined"}, taints=[OUR_TAINT], unschedulable=True
    )
    backend, server = backend_with(
        api, [Exchange(method="GET", path=f"{NODES}/gpu-4", status=200, body=cordoned)]
    )
    assert backend.release("gpu-4") is False
    server.assert_done()
    assert [r.method for r in server.requests] == ["GET"]  # nothing changed


def test_launch_creates_a_jobset_pinned_to_the_chosen_nodes_and_off_quarantined_ones(api) -> None:
    manifest = jobset_manifest(SPEC, config())
    backend, server = backend_with(api, [Exchange(method="POST", path=JOBSETS, status=201, body=manifest)])
    handle = backend.launch(SPEC)
    server.assert_done()
    assert handle.ref == "jobset:training/llm-3"
    sent = server.requests[0].body
    assert sent["metadata"]["name"] == "llm-3"
    assert sent["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "training"
    assert sent["spec"]["failurePolicy"] == {"maxRestarts": 0}
    job = sent["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert (job["parallelism"], job["completions"], job["backoffLimit"]) == (2, 2, 0)
    pod_spec = job["template"]["spec"]
    assert pod_spec["terminationGracePeriodSeconds"] == 600
    terms = pod_spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    exprs = terms["nodeSelectorTerms"][0]["matchExpressions"]
    assert {"key": "kubernetes.io/hostname", "operator": "In", "values": ["gpu-1", "gpu-3"]} in exprs
    assert {"key": "runwarden.io/health", "operator": "NotIn", "values": ["quarantined"]} in exprs
    command = pod_spec["containers"][0]["command"]
    assert "--rdzv-id=llm-3" in command and "--max-restarts=0" in command and "--nnodes=2" in command
    assert "--rdzv-endpoint=llm-3-workers-0-0.llm-3:29500" in command
    assert command[-2:] == ["python", "train.py"]
    env = {e["name"]: e["value"] for e in pod_spec["containers"][0]["env"]}
    assert env["RUNWARDEN_RENDEZVOUS_ID"] == "llm-3" and env["RUNWARDEN_CHECKPOINT_DIR"] == "/ckpt/llm"
    # The Job inside the JobSet is a valid batch/v1 Job by the Kubernetes schema.
    kubernetes_validate.validate(
        {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "llm-3-workers-0"}, "spec": job},
        "1.30.0",
        strict=True,
    )


def test_launch_is_refused_when_the_grace_period_cannot_fit_a_save_and_commit(api) -> None:
    backend, server = backend_with(api, [], termination_grace_s=120)
    with pytest.raises(BackendError, match=r"terminationGracePeriodSeconds=120 is shorter .* 285s"):
        backend.launch(SPEC)
    assert server.requests == []  # nothing was sent


def test_status_reports_running_with_a_dead_node_then_failed(api) -> None:
    running = {
        **jobset_manifest(SPEC, config()),
        "status": {
            "replicatedJobsStatus": [
                {"name": "workers", "ready": 1, "active": 1, "succeeded": 0, "failed": 0, "suspended": 0}
            ]
        },
    }
    failed = {
        **running,
        "status": {
            "conditions": [
                {
                    "type": "Failed",
                    "status": "True",
                    "reason": "FailedJobs",
                    "message": "jobset failed due to reaching max number of restarts",
                    "lastTransitionTime": "2026-12-01T00:10:00Z",
                }
            ]
        },
    }
    pods = {
        "kind": "PodList",
        "apiVersion": "v1",
        "metadata": {"resourceVersion": "9"},
        "items": [pod("llm-3-workers-0-0-x", "gpu-1", "llm-3"), pod("llm-3-workers-0-1-y", "gpu-3", "llm-3")],
    }
    backend, server = backend_with(
        api,
        [
            Exchange(method="GET", path=f"{JOBSETS}/llm-3", status=200, body=running),
            Exchange(method="GET", path="/api/v1/namespaces/training/pods", status=200, body=pods),
            Exchange(method="GET", path=f"{NODES}/gpu-1", status=200, body=node("gpu-1")),
            Exchange(method="GET", path=f"{NODES}/gpu-3", status=200, body=node("gpu-3", ready="Unknown")),
            Exchange(method="GET", path=f"{JOBSETS}/llm-3", status=200, body=failed),
            Exchange(
                method="GET", path="/api/v1/namespaces/training/pods", status=200, body={**pods, "items": []}
            ),
        ],
    )
    handle = AttemptHandle(spec=SPEC, ref="jobset:training/llm-3")
    first = backend.status(handle)
    assert (first.state, first.failed_nodes) == (AttemptState.RUNNING, ("gpu-3",))
    assert server.requests[1].query["labelSelector"] == ["jobset.sigs.k8s.io/jobset-name=llm-3"]
    second = backend.status(handle)
    assert second.state is AttemptState.FAILED and "max number of restarts" in second.detail
    server.assert_done()


def test_stop_deletes_the_jobset_with_the_grace_period(api) -> None:
    backend, server = backend_with(
        api,
        [
            Exchange(
                method="DELETE",
                path=f"{JOBSETS}/llm-3",
                status=200,
                body={"kind": "Status", "apiVersion": "v1", "status": "Success", "metadata": {}},
            ),
            Exchange(
                method="GET",
                path=f"{JOBSETS}/llm-3",
                status=404,
                body=status_failure(404, "NotFound", 'jobsets.jobset.x-k8s.io "llm-3" not found'),
            ),
        ],
    )
    handle = AttemptHandle(spec=SPEC, ref="jobset:training/llm-3")
    assert backend.stop(handle, grace_s=300).state is AttemptState.STOPPED
    sent = server.requests[0]
    options = sent.body or {}
    assert options.get("gracePeriodSeconds", int(sent.query.get("gracePeriodSeconds", ["-1"])[0])) == 300
    assert options.get("propagationPolicy", sent.query.get("propagationPolicy", [""])[0]) == "Foreground"
    assert backend.status(handle).state is AttemptState.STOPPED
    server.assert_done()


def test_allocate_counts_only_ready_unquarantined_uncordoned_nodes(api) -> None:
    listing = {
        "kind": "NodeList",
        "apiVersion": "v1",
        "metadata": {"resourceVersion": "77"},
        "items": [
            node("gpu-1"),
            node("gpu-2", labels={"runwarden.io/health": "quarantined"}),
            node("gpu-3", ready="False"),
            node("gpu-4"),
            node("gpu-5", unschedulable=True),
        ],
    }
    backend, server = backend_with(
        api,
        [
            Exchange(method="GET", path=NODES, status=200, body=listing),
            Exchange(method="GET", path=NODES, status=200, body=listing),
        ],
    )
    assert backend.allocate(1, 1).nodes == ("gpu-1", "gpu-4")
    with pytest.raises(BackendError, match="2 healthy nodes, need 2\\+1"):
        backend.allocate(2, 1)
    server.assert_done()


def test_an_api_error_becomes_a_backend_error(api) -> None:
    backend, server = backend_with(
        api,
        [
            Exchange(method="GET", path=f"{NODES}/gpu-2", status=200, body=node("gpu-2")),
            Exchange(
                method="PATCH",
                path=f"{NODES}/gpu-2",
                status=403,
                body=status_failure(
                    403,
                    "Forbidden",
                    'nodes "gpu-2" is forbidden: User "system:serviceaccount:x:y" cannot patch',
                ),
            ),
        ],
    )
    with pytest.raises(BackendError, match="patch node gpu-2: HTTP 403"):
        backend.quarantine("gpu-2", "straggler")
    server.assert_done()
