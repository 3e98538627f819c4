"""The Kubernetes backend: one JobSet per attempt, quarantine as a taint plus a label.

* An attempt is a JobSet named ``<run>-<attempt>`` (the rendezvous id) with one indexed Job of N
  pods, one per node, pinned to the N chosen nodes and kept off every node labelled
  ``runwarden.io/health=quarantined``. ``failurePolicy.maxRestarts: 0`` and ``backoffLimit: 0``:
  the supervisor restarts attempts, not JobSet or the Job controller.
* Preemption and drains send SIGTERM and then, after ``terminationGracePeriodSeconds``, SIGKILL.
  A stop must fit a full checkpoint save plus its commit in that window, so ``launch`` refuses
  a grace period that is shorter than the configured save + commit time (plus a margin).
* Quarantine taints the node (``runwarden.io/quarantined:NoSchedule``) and labels it
  ``runwarden.io/health=quarantined`` with the reason in an annotation; release removes only
  those marks, and refuses (False) while an operator holds the node cordoned.

Everything goes through the official ``kubernetes`` client; errors become :class:`BackendError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from controller.backends.base import (
    Allocation,
    AttemptHandle,
    AttemptSpec,
    AttemptState,
    AttemptStatus,
    BackendError,
    attempt_env,
    torchrun_argv,
    validate_node_name,
    validate_run_name,
)

HEALTH_LABEL = "runwarden.io/health"
QUARANTINED = "quarantined"
TAINT_KEY = "runwarden.io/quarantined"
REASON_ANNOTATION = "runwarden.io/quarantine-reason"
JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB = "workers"


@dataclass(frozen=True, slots=True, kw_only=True)
class KubernetesConfig:
    image: str
    namespace: str = "default"
    checkpoint_save_s: float  # a full save, measured (not the async snapshot alone)
    checkpoint_commit_s: float  # fsync + writing the commit marker
    stop_margin_s: float = 30.0  # finishing the current step, process exit
    termination_grace_s: int = 600
    gpus_per_node: int = 8
    queue_name: str | None = None  # Kueue LocalQueue
    service_account: str | None = None
    rdzv_port: int = 29500
    torchrun: tuple[str, ...] = ("torchrun",)
    request_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if min(self.checkpoint_save_s, self.checkpoint_commit_s, self.stop_margin_s) < 0:
            raise BackendError("checkpoint save, commit and margin times must be >= 0")
        if self.termination_grace_s < 1 or self.gpus_per_node < 0 or self.request_timeout_s <= 0:
            raise BackendError("bad termination grace, GPU count or request timeout")

    @property
    def stop_needs_s(self) -> float:
        return self.checkpoint_save_s + self.checkpoint_commit_s + self.stop_margin_s


def check_grace_period(config: KubernetesConfig) -> None:
    """Refuse to launch pods that would be killed in the middle of their last save."""
    if config.termination_grace_s < config.stop_needs_s:
        raise BackendError(
            f"terminationGracePeriodSeconds={config.termination_grace_s} is shorter than a stop needs "
            f"(save {config.checkpoint_save_s:.0f}s + commit {config.checkpoint_commit_s:.0f}s + margin "
            f"{config.stop_margin_s:.0f}s = {config.stop_needs_s:.0f}s): a preempted attempt would lose its checkpoint"
        )


def jobset_manifest(spec: AttemptSpec, config: KubernetesConfig) -> dict[str, Any]:
    """The JobSet for one attempt (plain data: what goes over the wire)."""
    validate_run_name(spec.run)  # it becomes an object name: a DNS-1123 label
    for node in spec.nodes:
        validate_node_name(node)
    name = spec.rendezvous_id
    n = len(spec.nodes)
    # JobSet gives every pod a stable DNS name: <jobset>-<replicatedJob>-<jobIndex>-<podIndex>.<jobset>
    head = f"{name}-{REPLICATED_JOB}-0-0.{name}:{config.rdzv_port}"
    env = [{"name": k, "value": v} for k, v in sorted(attempt_env(spec).items())]
    labels = {"runwarden.io/run": spec.run, "runwarden.io/attempt": str(spec.attempt)}
    if config.queue_name:
        labels["kueue.x-k8s.io/queue-name"] = config.queue_name
    resources = {"limits": {"nvidia.com/gpu": str(config.gpus_per_node)}} if config.gpus_per_node else {}
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": config.termination_grace_s,
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {
                                    "key": "kubernetes.io/hostname",
                                    "operator": "In",
                                    "values": list(spec.nodes),
                                },
                                {"key": HEALTH_LABEL, "operator": "NotIn", "values": [QUARANTINED]},
                            ]
                        }
                    ]
                }
            },
            "podAntiAffinity": {  # one rank group per node
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "labelSelector": {"matchLabels": {JOBSET_NAME_LABEL: name}},
                        "topologyKey": "kubernetes.io/hostname",
                    }
                ]
            },
        },
        "containers": [
            {
                "name": "trainer",
                "image": config.image,
                "command": torchrun_argv(spec, endpoint=head, torchrun=config.torchrun),
                "env": env,
                "resources": resources,
            }
        ],
    }
    if config.service_account:
        pod_spec["serviceAccountName"] = config.service_account
    return {
        "apiVersion": f"{JOBSET_GROUP}/{JOBSET_VERSION}",
        "kind": "JobSet",
        "metadata": {"name": name, "namespace": config.namespace, "labels": labels},
        "spec": {
            "failurePolicy": {"maxRestarts": 0},
            "network": {"enableDNSHostnames": True},
            "replicatedJobs": [
                {
                    "name": REPLICATED_JOB,
                    "replicas": 1,
                    "template": {
                        "metadata": {"labels": labels},
                        "spec": {
                            "parallelism": n,
                            "completions": n,
                            "completionMode": "Indexed",
                            "backoffLimit": 0,
                            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
                        },
                    },
                }
            ],
        },
    }


def _api_error(what: str, exc: ApiException) -> BackendError:
    return BackendError(f"{what}: HTTP {exc.status} {exc.reason}")


class KubernetesBackend:
    name = "kubernetes"

    def __init__(self, api_client: k8s.ApiClient, config: KubernetesConfig):
        self.config = config
        self.core = k8s.CoreV1Api(api_client)
        self.custom = k8s.CustomObjectsApi(api_client)
        self._stopped: set[str] = set()

    # ---- nodes -----------------------------------------------------------------------------------

    def _healthy(self, node: Any) -> bool:
        labels = node.metadata.labels or {}
        ready = any(c.type == "Ready" and c.status == "True" for c in (node.status.conditions or []))
        return ready and not node.spec.unschedulable and labels.get(HEALTH_LABEL) != QUARANTINED

    def allocate(self, nodes: int, spares: int) -> Allocation:
        """Capacity is Kueue's quota on Kubernetes; here we check that N + S healthy nodes exist."""
        try:
            listed = self.core.list_node(_request_timeout=self.config.request_timeout_s)
        except ApiException as exc:
            raise _api_error("list nodes", exc) from None
        healthy = sorted(
            n.metadata.name for n in listed.items if n.metadata and n.metadata.name and self._healthy(n)
        )
        if len(healthy) < nodes + spares:
            raise BackendError(f"{len(healthy)} healthy nodes, need {nodes}+{spares}")
        return Allocation(id=f"namespace/{self.config.namespace}", nodes=tuple(healthy[: nodes + spares]))

    def quarantine(self, node: str, reason: str) -> None:
        validate_node_name(node)
        current = self._read_node(node)
        taints = [t for t in (current.spec.taints or []) if t.key != TAINT_KEY]
        taints.append(k8s.V1Taint(key=TAINT_KEY, value="true", effect="NoSchedule"))
        body = {
            "metadata": {
                "labels": {HEALTH_LABEL: QUARANTINED},
                "annotations": {REASON_ANNOTATION: " ".join(reason.split())[:500]},
                # Optimistic concurrency: the taint list is replaced whole, so fail on a race.
                "resourceVersion": current.metadata.resource_version,
            },
            "spec": {"taints": [self.core.api_client.sanitize_for_serialization(t) for t in taints]},
        }
        self._patch_node(node, body)

    def release(self, node: str) -> bool:
        validate_node_name(node)
        current = self._read_node(node)
        if current.spec.unschedulable:
            return False  # cordoned by an operator: theirs to lift, and ours stays until then
        ours = (current.metadata.labels or {}).get(HEALTH_LABEL) == QUARANTINED or any(
            t.key == TAINT_KEY for t in (current.spec.taints or [])
        )
        if not ours:
            return True
        taints = [t for t in (current.spec.taints or []) if t.key != TAINT_KEY]
        body = {
            "metadata": {
                "labels": {HEALTH_LABEL: None},
                "annotations": {REASON_ANNOTATION: None},
                "resourceVersion": current.metadata.resource_version,
            },
            "spec": {"taints": [self.core.api_client.sanitize_for_serialization(t) for t in taints] or None},
        }
        self._patch_node(node, body)
        return True

    def _read_node(self, node: str) -> Any:
        try:
            return self.core.read_node(node, _request_timeout=self.config.request_timeout_s)
        except ApiException as exc:
            raise _api_error(f"read node {node}", exc) from None

    def _patch_node(self, node: str, body: dict[str, Any]) -> None:
        try:
            self.core.patch_node(node, body, _request_timeout=self.config.request_timeout_s)
        except ApiException as exc:
            raise _api_error(f"patch node {node}", exc) from None

    # ---- attempts --------------------------------------------------------------------------------

    def launch(self, spec: AttemptSpec) -> AttemptHandle:
        check_grace_period(self.config)
        body = jobset_manifest(spec, self.config)
        try:
            self.custom.create_namespaced_custom_object(
                JOBSET_GROUP,
                JOBSET_VERSION,
                self.config.namespace,
                JOBSET_PLURAL,
                body,
                _request_timeout=self.config.request_timeout_s,
            )
        except ApiException as exc:
            raise _api_error(f"create JobSet {spec.rendezvous_id}", exc) from None
        return AttemptHandle(spec=spec, ref=f"jobset:{self.config.namespace}/{spec.rendezvous_id}")

    def status(self, handle: AttemptHandle) -> AttemptStatus:
        name = handle.spec.rendezvous_id
        try:
            obj = self.custom.get_namespaced_custom_object(
                JOBSET_GROUP,
                JOBSET_VERSION,
                self.config.namespace,
                JOBSET_PLURAL,
                name,
                _request_timeout=self.config.request_timeout_s,
            )
        except ApiException as exc:
            if exc.status == 404:
                state = AttemptState.STOPPED if name in self._stopped else AttemptState.UNKNOWN
                return AttemptStatus(state=state, detail="JobSet gone")
            raise _api_error(f"get JobSet {name}", exc) from None
        state, detail = jobset_state(obj)
        if name in self._stopped and state is not AttemptState.SUCCEEDED:
            state = AttemptState.STOPPED
        return AttemptStatus(state=state, failed_nodes=self._failed_nodes(name), detail=detail)

    def _failed_nodes(self, name: str) -> tuple[str, ...]:
        try:
            pods = self.core.list_namespaced_pod(
                self.config.namespace,
                label_selector=f"{JOBSET_NAME_LABEL}={name}",
                _request_timeout=self.config.request_timeout_s,
            )
            failed = []
            for node_name in sorted({p.spec.node_name for p in pods.items if p.spec and p.spec.node_name}):
                node = self._read_node(node_name)
                ready = [c for c in (node.status.conditions or []) if c.type == "Ready"]
                if not ready or ready[0].status != "True":
                    failed.append(node_name)
            return tuple(failed)
        except ApiException as exc:
            raise _api_error(f"list pods of {name}", exc) from None

    def stop(self, handle: AttemptHandle, grace_s: float) -> AttemptStatus:
        name = handle.spec.rendezvous_id
        self._stopped.add(name)
        try:
            self.custom.delete_namespaced_custom_object(
                JOBSET_GROUP,
                JOBSET_VERSION,
                self.config.namespace,
                JOBSET_PLURAL,
                name,
                grace_period_seconds=max(0, int(grace_s)),
                propagation_policy="Foreground",
                _request_timeout=self.config.request_timeout_s,
            )
        except ApiException as exc:
            if exc.status != 404:
                raise _api_error(f"delete JobSet {name}", exc) from None
        return AttemptStatus(state=AttemptState.STOPPED, detail=f"JobSet {name} deleted")


def jobset_state(obj: Any) -> tuple[AttemptState, str]:
    """Reads a JobSet's status (plain JSON from the API) strictly."""
    if not isinstance(obj, dict):
        raise BackendError("JobSet is not an object")
    status = obj.get("status") or {}
    if not isinstance(status, dict):
        raise BackendError("JobSet status is not an object")
    conditions = status.get("conditions") or []
    if not isinstance(conditions, list):
        raise BackendError("JobSet status.conditions is not a list")
    for cond in conditions:
        if not isinstance(cond, dict) or cond.get("status") != "True":
            continue
        message = str(cond.get("message", ""))[:200]
        if cond.get("type") == "Completed":
            return AttemptState.SUCCEEDED, message
        if cond.get("type") == "Failed":
            return AttemptState.FAILED, message
    jobs = status.get("replicatedJobsStatus") or []
    active = sum(int(j.get("active", 0) or 0) for j in jobs if isinstance(j, dict))
    return (AttemptState.RUNNING if active else AttemptState.PENDING), ""
