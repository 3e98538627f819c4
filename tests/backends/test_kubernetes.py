"""The Kubernetes scheduler against hand-written API server answers over real HTTP (no cluster here).

The official client talks to a local server (tests/backends/k8s_api.py) that answers with
bodies in the API server's shapes; the tests check what the client really sent. These shapes
were written from the Kubernetes and JobSet API references, not captured from a live cluster.
"""

from __future__ import annotations

import pytest

# The `kubernetes` client and `kubernetes-validate` (with PyYAML, jsonschema) are test/extra deps.
pytest.importorskip("kubernetes", reason="pip install kubernetes (the [kubernetes] extra)")
pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (dev extra)")

import socket
import time
from collections.abc import Iterator
from typing import Any

import kubernetes_validate
from kubernetes import client as k8s

from controller.backends.base import BackendError, RunOutcome, Scheduler
from controller.backends.kubernetes import KubernetesConfig, KubernetesScheduler, agent_jobset
from controller.live.schedulers import build_scheduler
from runwarden.config import ConfigError
from tests.backends.k8s_api import (
    Exchange,
    ScriptedApiServer,
    jobset,
    jobset_list,
    node,
    status_failure,
)

NODES = "/api/v1/nodes"
JOBSETS = "/apis/jobset.x-k8s.io/v1alpha2/namespaces/training/jobsets"
OPERATOR_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
OUR_TAINT = {"key": "runwarden.io/quarantined", "value": "true", "effect": "NoSchedule"}
DELETED = {"kind": "Status", "apiVersion": "v1", "status": "Success", "metadata": {}}
SECTION: dict[str, Any] = {
    "run": "llm",
    "image": "ghcr.io/example/runwarden:0.1.0",
    "namespace": "training",
    "queue_name": "training",
    "termination_grace_s": 600,
    "agent_tls_secret": "runwarden-agent-tls",
    "shared_claim": "runwarden-shared",
    "node_selector": {"nvidia.com/gpu.present": "true"},
}


def config(**overrides: object) -> KubernetesConfig:
    return KubernetesConfig(**{**SECTION, **overrides})


@pytest.fixture
def api() -> Iterator[list[ScriptedApiServer]]:
    servers: list[ScriptedApiServer] = []
    yield servers
    for server in servers:
        server.close()


def scheduler_with(
    api: list[ScriptedApiServer], exchanges: list[Exchange], **cfg: object
) -> tuple[KubernetesScheduler, ScriptedApiServer]:
    server = ScriptedApiServer(exchanges)
    api.append(server)
    return KubernetesScheduler(config(**cfg), server.api_client()), server


def not_found(name: str) -> dict[str, Any]:
    return status_failure(404, "NotFound", f'jobsets.jobset.x-k8s.io "{name}" not found')


def pod_spec_of(body: dict[str, Any]) -> dict[str, Any]:
    return body["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def node_terms(body: dict[str, Any]) -> list[dict[str, Any]]:
    affinity = pod_spec_of(body)["affinity"]["nodeAffinity"]
    return affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
        "matchExpressions"
    ]


def assert_valid_job(body: dict[str, Any]) -> None:
    """The Job inside the JobSet is a valid batch/v1 Job by the Kubernetes 1.30 schema (strict)."""
    rjob = body["spec"]["replicatedJobs"][0]
    kubernetes_validate.validate(
        {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"}, **rjob["template"]},
        "1.30.0",
        strict=True,
    )


def test_allocate_creates_one_jobset_of_node_agents_against_hand_written_api_answers(api) -> None:
    scheduler, server = scheduler_with(
        api,
        [
            Exchange(method="GET", path=f"{JOBSETS}/llm-n0", status=404, body=not_found("llm-n0")),
            Exchange(
                method="POST", path=JOBSETS, status=201, body=jobset(agent_jobset(config(), index=0, count=3))
            ),
        ],
    )
    allocation = scheduler.allocate(2, 1)
    server.assert_done()
    assert allocation.id == "jobset:training/llm-n0" and allocation.nodes == ()  # the agents register
    sent = server.requests[1].body
    assert sent["metadata"]["name"] == "llm-n0"
    assert sent["metadata"]["labels"] == {
        "runwarden.io/run": "llm",
        "runwarden.io/part": "allocation",
        "kueue.x-k8s.io/queue-name": "training",
    }
    assert sent["spec"]["failurePolicy"] == {"maxRestarts": 0}  # nothing restarted behind the supervisor
    job = sent["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert (job["parallelism"], job["completions"], job["completionMode"]) == (
        3,
        3,
        "Indexed",
    )  # nodes + spares
    assert job["backoffLimitPerIndex"] == 0  # a lost agent fails its own index, not the others
    pod = pod_spec_of(sent)
    assert pod["terminationGracePeriodSeconds"] == 600 and pod["restartPolicy"] == "Never"
    assert pod["hostNetwork"] is True and pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert node_terms(sent) == [
        {"key": "runwarden.io/health", "operator": "NotIn", "values": ["quarantined"]}
    ]
    assert pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == [
        {
            "labelSelector": {"matchLabels": {"runwarden.io/run": "llm"}},
            "topologyKey": "kubernetes.io/hostname",
        }
    ]
    (agent,) = pod["containers"]
    assert agent["command"] == ["nodeagent", "--config", "/etc/runwarden/agent.toml"]
    assert agent["resources"] == {"limits": {"nvidia.com/gpu": "8"}}  # the ranks are the agent's children
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in agent["env"]}
    assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["ADVERTISE_IP"] == {"fieldRef": {"fieldPath": "status.hostIP"}}
    assert env["RUNWARDEN_AGENT_NODE"] == "$(NODE_NAME)"
    assert env["RUNWARDEN_AGENT_ADVERTISE"] == "$(ADVERTISE_IP):50052"
    mounts = {m["mountPath"]: m["name"] for m in agent["volumeMounts"]}
    assert mounts["/etc/runwarden"] == "config" and mounts["/etc/runwarden-tls"] == "tls"
    assert mounts["/shared"] == "shared"
    assert_valid_job(sent)


def test_allocate_without_host_network_advertises_the_pod_ip(api) -> None:
    body = agent_jobset(config(host_network=False, gpus_per_node=0, queue_name=""), index=0, count=1)
    pod = pod_spec_of(body)
    assert "hostNetwork" not in pod and "resources" not in pod["containers"][0]
    env = {e["name"]: e.get("valueFrom") for e in pod["containers"][0]["env"]}
    assert env["ADVERTISE_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert "kueue.x-k8s.io/queue-name" not in body["metadata"]["labels"]
    assert_valid_job(body)


def test_a_second_allocate_adopts_the_runs_jobset_against_hand_written_api_answers(api) -> None:
    existing = jobset(agent_jobset(config(), index=0, count=3))
    scheduler, server = scheduler_with(
        api,
        [
            Exchange(method="GET", path=f"{JOBSETS}/llm-n0", status=200, body=existing),
            # the standby raced the leader to create it: 409, then adopt what is there
            Exchange(method="GET", path=f"{JOBSETS}/llm-n0", status=404, body=not_found("llm-n0")),
            Exchange(
                method="POST",
                path=JOBSETS,
                status=409,
                body=status_failure(409, "AlreadyExists", 'jobsets.jobset.x-k8s.io "llm-n0" already exists'),
            ),
            Exchange(method="GET", path=f"{JOBSETS}/llm-n0", status=200, body=existing),
        ],
    )
    assert scheduler.allocate(2, 1).id == "jobset:training/llm-n0"
    assert scheduler.allocate(2, 1).id == "jobset:training/llm-n0"
    server.assert_done()
    assert [r.method for r in server.requests] == ["GET", "GET", "POST", "GET"]  # one create, refused


def test_allocate_refuses_to_adopt_a_foreign_or_resized_jobset_against_hand_written_api_answers(api) -> None:
    foreign = jobset(agent_jobset(config(), index=0, count=3))
    foreign["metadata"]["labels"] = {"app": "someone-else"}
    scheduler, server = scheduler_with(
        api,
        [
            Exchange(method="GET", path=f"{JOBSETS}/llm-n0", status=200, body=foreign),
            Exchange(
                method="GET",
                path=f"{JOBSETS}/llm-n0",
                status=200,
                body=jobset(agent_jobset(config(), index=0, count=3)),
            ),
        ],
    )
    with pytest.raises(BackendError, match=r"without runwarden\.io/run=llm: not runwarden.s"):
        scheduler.allocate(2, 1)
    with pytest.raises(BackendError, match="has 3 agent pods, asked for 5"):
        scheduler.allocate(4, 1)
    server.assert_done()
    assert all(r.method == "GET" for r in server.requests)  # nothing created or changed


def test_request_nodes_excludes_the_given_nodes_against_hand_written_api_answers(api) -> None:
    listing = jobset_list(
        jobset(agent_jobset(config(), index=0, count=3)),
        jobset(agent_jobset(config(), index=1, count=1, exclude=("gpu-2",), reason="first")),
    )
    scheduler, server = scheduler_with(
        api,
        [
            Exchange(method="GET", path=JOBSETS, status=200, body=listing),
            Exchange(method="POST", path=JOBSETS, status=201, body={}),
        ],
    )
    before = time.time()
    request = scheduler.request_nodes(2, exclude=("gpu-7", "gpu-2"), reason="xid 79 on gpu-7\nno spare left")
    server.assert_done()
    assert server.requests[0].query["labelSelector"] == ["runwarden.io/run=llm"]
    assert (request.id, request.count) == ("jobset:training/llm-n2", 2) and request.submitted_at >= before
    sent = server.requests[1].body
    assert sent["metadata"]["name"] == "llm-n2"
    assert sent["metadata"]["labels"]["runwarden.io/part"] == "request"
    assert sent["metadata"]["annotations"] == {"runwarden.io/request-reason": "xid 79 on gpu-7 no spare left"}
    assert sent["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"] == 2
    assert node_terms(sent) == [
        {"key": "runwarden.io/health", "operator": "NotIn", "values": ["quarantined"]},
        {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["gpu-2", "gpu-7"]},
    ]
    # and never next to one of the run's agents: the anti-affinity is on the run's label
    anti = pod_spec_of(sent)["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["labelSelector"] == {"matchLabels": {"runwarden.io/run": "llm"}}
    assert_valid_job(sent)
    with pytest.raises(BackendError, match="bad node name"):
        scheduler.request_nodes(1, exclude=("gpu 1; rm",), reason="x")
    assert len(server.requests) == 2  # refused before anything was sent


def test_request_nodes_takes_the_next_name_after_a_conflict_against_hand_written_api_answers(api) -> None:
    exists = status_failure(409, "AlreadyExists", 'jobsets.jobset.x-k8s.io "llm-n1" already exists')
    scheduler, server = scheduler_with(
        api,
        [
            Exchange(
                method="GET",
                path=JOBSETS,
                status=200,
                body=jobset_list(jobset(agent_jobset(config(), index=0, count=3))),
            ),
            Exchange(method="POST", path=JOBSETS, status=409, body=exists),
            Exchange(method="POST", path=JOBSETS, status=201, body={"kind": "JobSet"}),
        ],
    )
    assert scheduler.request_nodes(1, exclude=(), reason="node lost").id == "jobset:training/llm-n2"
    server.assert_done()
    assert [r.body["metadata"]["name"] for r in server.requests[1:]] == ["llm-n1", "llm-n2"]
    assert len(node_terms(server.requests[2].body)) == 1  # nothing to exclude: only the quarantine rule


def test_quarantine_taints_and_labels_keeping_other_taints_against_hand_written_api_answers(api) -> None:
    scheduler, server = scheduler_with(
        api,
        [
            Exchange(
                method="GET", path=f"{NODES}/gpu-2", status=200, body=node("gpu-2", taints=[OPERATOR_TAINT])
            ),
            Exchange(method="PATCH", path=f"{NODES}/gpu-2", status=200, body=node("gpu-2")),
        ],
    )
    scheduler.quarantine("gpu-2", "xid 79: GPU fell off the bus\n(step 1200)")
    server.assert_done()
    patch = server.requests[1]
    assert patch.content_type == "application/strategic-merge-patch+json"
    assert patch.body["metadata"]["labels"] == {"runwarden.io/health": "quarantined"}
    assert patch.body["metadata"]["annotations"] == {
        "runwarden.io/quarantine-reason": "xid 79: GPU fell off the bus (step 1200)"
    }
    assert patch.body["metadata"]["resourceVersion"] == "4711"
    assert patch.body["spec"] == {"taints": [OPERATOR_TAINT, OUR_TAINT]}  # no `unschedulable`: no cordon


def test_a_lost_node_is_tainted_and_its_replacement_avoids_it_against_hand_written_api_answers(api) -> None:
    """Node lost, as the live shell answers it once the agent's lease expired: the core quarantines
    the node (the node controller has marked it NotReady and tainted it unreachable; that taint
    stays) and, with no spare left, asks for one more node that is not the lost one."""
    unreachable = {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}
    lost = node("gpu-3", ready="Unknown", taints=[unreachable])
    scheduler, server = scheduler_with(
        api,
        [
            Exchange(method="GET", path=f"{NODES}/gpu-3", status=200, body=lost),
            Exchange(method="PATCH", path=f"{NODES}/gpu-3", status=200, body=lost),
            Exchange(
                method="GET",
                path=JOBSETS,
                status=200,
                body=jobset_list(jobset(agent_jobset(config(), index=0, count=3))),
            ),
            Exchange(method="POST", path=JOBSETS, status=201, body={"kind": "JobSet"}),
        ],
    )
    scheduler.quarantine("gpu-3", "heartbeat: its lease expired")
    request = scheduler.request_nodes(1, exclude=("gpu-3",), reason="gpu-3 lost; no spare left")
    server.assert_done()
    assert server.requests[1].body["spec"] == {"taints": [unreachable, OUR_TAINT]}
    assert server.requests[1].body["metadata"]["labels"] == {"runwarden.io/health": "quarantined"}
    assert request.count == 1 and request.id == "jobset:training/llm-n1"
    sent = server.requests[3].body
    assert node_terms(sent) == [
        {"key": "runwarden.io/health", "operator": "NotIn", "values": ["quarantined"]},
        {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["gpu-3"]},
    ]
    assert_valid_job(sent)


def test_quarantine_leaves_an_operators_cordon_alone_against_hand_written_api_answers(api) -> None:
    cordoned = node("gpu-4", unschedulable=True)
    scheduler, server = scheduler_with(
        api,
        [
            Exchange(method="GET", path=f"{NODES}/gpu-4", status=200, body=cordoned),
            Exchange(method="PATCH", path=f"{NODES}/gpu-4", status=200, body=cordoned),
        ],
    )
    scheduler.quarantine("gpu-4", "straggler")
    server.assert_done()
    assert server.requests[1].body["spec"] == {"taints": [OUR_TAINT]}


def test_release_removes_only_runwarden_marks_against_hand_written_api_answers(api) -> None:
    quarantined = node(
        "gpu-2", labels={"runwarden.io/health": "quarantined"}, taints=[OPERATOR_TAINT, OUR_TAINT]
    )
    scheduler, server = scheduler_with(
        api,
        [
            Exchange(method="GET", path=f"{NODES}/gpu-2", status=200, body=quarantined),
            Exchange(method="PATCH", path=f"{NODES}/gpu-2", status=200, body=node("gpu-2")),
            Exchange(method="GET", path=f"{NODES}/gpu-3", status=200, body=node("gpu-3")),
        ],
    )
    assert scheduler.release("gpu-2") is True
    assert scheduler.release("gpu-3") is True  # not ours to begin with: nothing to patch
    server.assert_done()
    patch = server.requests[1].body
    assert patch["metadata"]["labels"] == {"runwarden.io/health": None}
    assert patch["metadata"]["annotations"] == {"runwarden.io/quarantine-reason": None}
    assert patch["spec"] == {"taints": [OPERATOR_TAINT]}
    assert [r.method for r in server.requests] == ["GET", "PATCH", "GET"]


def test_release_refuses_under_an_operators_cordon_against_hand_written_api_answers(api) -> None:
    cordoned = node(
        "gpu-4", labels={"runwarden.io/health": "quarantined"}, taints=[OUR_TAINT], unschedulable=True
    )
    scheduler, server = scheduler_with(
        api, [Exchange(method="GET", path=f"{NODES}/gpu-4", status=200, body=cordoned)]
    )
    assert scheduler.release("gpu-4") is False
    server.assert_done()
    assert [r.method for r in server.requests] == ["GET"]  # nothing changed, our marks stay too


def test_check_stop_fits_refuses_a_grace_period_shorter_than_the_observed_save(api) -> None:
    scheduler, server = scheduler_with(api, [], termination_grace_s=300)
    scheduler.check_stop_fits(0.0)  # nothing observed yet: the margin alone fits
    scheduler.check_stop_fits(270.0)  # 270 + 30 = 300
    with pytest.raises(
        BackendError, match=r"terminationGracePeriodSeconds=300 is shorter .* 271s \+ margin 30s = 301s"
    ):
        scheduler.check_stop_fits(271.0)
    assert server.requests == []  # decided from the config alone


def test_finish_deletes_the_runs_jobsets_against_hand_written_api_answers(api) -> None:
    listing = jobset_list(
        jobset(agent_jobset(config(), index=0, count=3)),
        jobset(agent_jobset(config(), index=1, count=1)),
    )
    scheduler, server = scheduler_with(
        api,
        [
            Exchange(method="GET", path=JOBSETS, status=200, body=listing),
            Exchange(method="DELETE", path=f"{JOBSETS}/llm-n0", status=200, body=DELETED),
            Exchange(method="DELETE", path=f"{JOBSETS}/llm-n1", status=404, body=not_found("llm-n1")),
        ],
    )
    scheduler.finish(RunOutcome.COMPLETED)
    server.assert_done()
    assert server.requests[0].query["labelSelector"] == ["runwarden.io/run=llm"]
    sent = server.requests[1]
    options = sent.body or {}
    assert options.get("propagationPolicy", sent.query.get("propagationPolicy", [""])[0]) == "Background"


def test_an_api_error_or_no_api_server_becomes_a_backend_error(api) -> None:
    scheduler, server = scheduler_with(
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
        scheduler.quarantine("gpu-2", "straggler")
    server.assert_done()
    with socket.socket() as s:  # a port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = k8s.Configuration()
    cfg.host = f"http://127.0.0.1:{port}"
    cfg.retries = 0
    gone = KubernetesScheduler(config(request_timeout_s=2.0), k8s.ApiClient(cfg))
    with pytest.raises(BackendError, match="list JobSets of llm: "):
        gone.finish(RunOutcome.FAILED)


def test_from_section_refuses_unknown_keys_and_bad_values() -> None:
    scheduler = KubernetesScheduler.from_section(dict(SECTION), "controller.toml [kubernetes]")
    assert isinstance(scheduler, Scheduler) and scheduler.config.namespace == "training"
    with pytest.raises(BackendError, match=r"unknown key\(s\) checkpoint_save_s"):
        KubernetesScheduler.from_section({**SECTION, "checkpoint_save_s": 240.0}, "[kubernetes]")
    for bad, match in [
        ({"run": "Big_Run"}, "bad run name"),
        ({"namespace": "Training"}, "kubernetes.namespace"),
        ({"termination_grace_s": 0}, "termination_grace_s"),
        ({"agent_port": 70000}, "agent_port"),
        ({"node_selector": {"bad key!": "x"}}, "node_selector"),
        ({"gpus_per_node": "eight"}, "expected an integer"),
    ]:
        with pytest.raises(BackendError, match=match):
            KubernetesScheduler.from_section({**SECTION, **bad}, "[kubernetes]")
    raw = dict(SECTION)
    del raw["image"]
    with pytest.raises(BackendError, match="image"):
        KubernetesScheduler.from_section(raw, "[kubernetes]")


def test_the_live_shell_builds_it_from_its_section() -> None:
    built = build_scheduler("kubernetes", dict(SECTION), "[kubernetes]")
    assert isinstance(built, KubernetesScheduler) and built.config.run == "llm"
    with pytest.raises(ConfigError, match=r"\[kubernetes\]: .*unknown key"):
        build_scheduler("kubernetes", {**SECTION, "typo": 1}, "[kubernetes]")


def test_without_a_service_account_or_kubeconfig_a_call_is_a_backend_error(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-kubeconfig"))
    scheduler = KubernetesScheduler.from_section(dict(SECTION), "[kubernetes]")  # contacts nothing
    with pytest.raises(BackendError, match="no in-cluster service account and no kubeconfig"):
        scheduler.release("gpu-1")
