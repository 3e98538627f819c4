"""The Kubernetes scheduler: node agents as the pods of a JobSet, quarantine as a taint plus a label.

Like every backend, Kubernetes only places the node agents; the agents place the ranks (the
structured torchrun launch, controller/backends/local.py), so the ranks get the same contract here
as anywhere else. `KubernetesScheduler` is the `Scheduler` (controller/backends/base.py) the live
controller calls; it never restarts anything behind the supervisor's back, never touches an
operator's cordon, and goes through the official ``kubernetes`` client (errors become
:class:`BackendError`).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

import urllib3
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from controller.backends.base import (
    Allocation,
    BackendError,
    NodeRequest,
    RunOutcome,
    validate_node_name,
    validate_run_name,
)
from runwarden.config import ConfigError, load_section

HEALTH_LABEL = "runwarden.io/health"
QUARANTINED = "quarantined"
TAINT_KEY = "runwarden.io/quarantined"
REASON_ANNOTATION = "runwarden.io/quarantine-reason"
REQUEST_REASON_ANNOTATION = "runwarden.io/request-reason"
RUN_LABEL = "runwarden.io/run"
PART_LABEL = "runwarden.io/part"  # "allocation" (n0) or "request" (n1, n2, ...)
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
HOSTNAME_LABEL = "kubernetes.io/hostname"
JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"
REPLICATED_JOB = "agent"
AGENT_COMMAND = ("nodeagent", "--config", "/etc/runwarden/agent.toml")
AGENT_CONFIG_DIR = "/etc/runwarden"
AGENT_TLS_DIR = "/etc/runwarden-tls"  # not under the ConfigMap's mount: a nested mount point there fails
AGENT_RUN_DIR = "/run/runwarden"

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_JOBSET_INDEX = re.compile(r"-n(\d+)$")


@dataclass(frozen=True, slots=True, kw_only=True)
class KubernetesConfig:
    """The controller config's ``[kubernetes]`` section (unknown keys refused)."""

    run: str  # the run's name in the cluster: JobSets <run>-n0, <run>-n1, ...; label runwarden.io/run
    image: str  # the runwarden image (nodeagent, torch, the trainer's code or a shared mount of it)
    namespace: str = "default"
    agent_config_map: str = "runwarden-agent"  # a ConfigMap in `namespace` with the key agent.toml
    agent_tls_secret: str = ""  # a Secret mounted at /etc/runwarden-tls ("" = none)
    agent_port: int = 50052  # the agent's TCP listener (RUNWARDEN_AGENT_LISTEN / _ADVERTISE)
    host_network: bool = True  # advertise the node's address (status.hostIP) instead of the pod's
    gpus_per_node: int = 8  # nvidia.com/gpu requested by each agent pod (its ranks are its children)
    node_selector: dict[str, str] = field(default_factory=dict)
    queue_name: str = ""  # a Kueue LocalQueue in `namespace` ("" = no Kueue)
    priority_class: str = ""
    runtime_class: str = ""  # e.g. "nvidia" (the GPU operator's RuntimeClass)
    service_account: str = ""
    shared_claim: str = ""  # a ReadWriteMany PVC (run directory, checkpoints) mounted at shared_mount
    shared_mount: str = "/shared"
    termination_grace_s: int = 600
    stop_margin_s: float = 30.0  # on top of the observed save + commit: finishing the step, exiting
    request_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        validate_run_name(self.run)
        if not self.image or any(c.isspace() for c in self.image):
            raise BackendError(f"kubernetes.image: not an image reference: {self.image!r}")
        if not _DNS_LABEL.match(self.namespace):
            raise BackendError(f"kubernetes.namespace: not a DNS-1123 label: {self.namespace!r}")
        for key in (
            "agent_config_map",
            "agent_tls_secret",
            "priority_class",
            "runtime_class",
            "service_account",
        ):
            value = getattr(self, key)
            if (value or key == "agent_config_map") and not _DNS_SUBDOMAIN.match(value):
                raise BackendError(f"kubernetes.{key}: not a DNS-1123 name: {value!r}")
        if self.shared_claim and not _DNS_SUBDOMAIN.match(self.shared_claim):
            raise BackendError(f"kubernetes.shared_claim: not a DNS-1123 name: {self.shared_claim!r}")
        if not self.shared_mount.startswith("/") or self.shared_mount in (AGENT_CONFIG_DIR, AGENT_RUN_DIR):
            raise BackendError(
                f"kubernetes.shared_mount: an absolute path of its own, got {self.shared_mount!r}"
            )
        if self.queue_name and not _LABEL_VALUE.match(self.queue_name):
            raise BackendError(f"kubernetes.queue_name: not a label value: {self.queue_name!r}")
        for key, value in self.node_selector.items():
            if not _LABEL_KEY.match(key) or not _LABEL_VALUE.match(value):
                raise BackendError(f"kubernetes.node_selector: bad label {key!r}={value!r}")
        if not 1 <= self.agent_port <= 65535:
            raise BackendError(f"kubernetes.agent_port: must be within 1..65535, got {self.agent_port}")
        if self.gpus_per_node < 0:
            raise BackendError(f"kubernetes.gpus_per_node: must be >= 0, got {self.gpus_per_node}")
        if self.termination_grace_s < 1:
            raise BackendError(
                f"kubernetes.termination_grace_s: must be >= 1, got {self.termination_grace_s}"
            )
        if self.stop_margin_s < 0 or self.request_timeout_s <= 0:
            raise BackendError("kubernetes.stop_margin_s must be >= 0 and request_timeout_s > 0")


def check_grace_period(config: KubernetesConfig, save_commit_s: float) -> None:
    """Refuse to launch ranks that a preemption would kill in the middle of their last save."""
    needs = max(0.0, save_commit_s) + config.stop_margin_s
    if config.termination_grace_s < needs:
        raise BackendError(
            f"terminationGracePeriodSeconds={config.termination_grace_s} is shorter than a stop needs "
            f"(observed save + commit {save_commit_s:.0f}s + margin {config.stop_margin_s:.0f}s = {needs:.0f}s): "
            "a preempted attempt would lose its checkpoint; raise kubernetes.termination_grace_s"
        )


def jobset_name(run: str, index: int) -> str:
    return f"{run}-n{index}"


def agent_jobset(
    config: KubernetesConfig, *, index: int, count: int, exclude: tuple[str, ...] = (), reason: str = ""
) -> dict[str, Any]:
    """The JobSet of ``count`` node agents (plain data: what goes over the wire)."""
    if count < 1:
        raise BackendError(f"a JobSet of agents needs at least one pod, got {count}")
    for node in exclude:
        validate_node_name(node)
    name = jobset_name(config.run, index)
    labels = {RUN_LABEL: config.run, PART_LABEL: "allocation" if index == 0 else "request"}
    if config.queue_name:
        labels[QUEUE_LABEL] = config.queue_name
    pod_labels = {RUN_LABEL: config.run}
    match = [{"key": HEALTH_LABEL, "operator": "NotIn", "values": [QUARANTINED]}]
    if exclude:
        match.append({"key": HOSTNAME_LABEL, "operator": "NotIn", "values": sorted(set(exclude))})
    address = "status.hostIP" if config.host_network else "status.podIP"
    env = [
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "ADVERTISE_IP", "valueFrom": {"fieldRef": {"fieldPath": address}}},
        {"name": "RUNWARDEN_AGENT_NODE", "value": "$(NODE_NAME)"},
        {"name": "RUNWARDEN_AGENT_LISTEN", "value": f"0.0.0.0:{config.agent_port}"},
        {"name": "RUNWARDEN_AGENT_ADVERTISE", "value": f"$(ADVERTISE_IP):{config.agent_port}"},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": AGENT_CONFIG_DIR, "readOnly": True},
        {"name": "run", "mountPath": AGENT_RUN_DIR},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": config.agent_config_map}},
        {"name": "run", "emptyDir": {}},
    ]
    if config.agent_tls_secret:
        mounts.append({"name": "tls", "mountPath": AGENT_TLS_DIR, "readOnly": True})
        volumes.append(
            {"name": "tls", "secret": {"secretName": config.agent_tls_secret, "defaultMode": 0o400}}
        )
    if config.shared_claim:
        mounts.append({"name": "shared", "mountPath": config.shared_mount})
        volumes.append({"name": "shared", "persistentVolumeClaim": {"claimName": config.shared_claim}})
    container: dict[str, Any] = {
        "name": "agent",
        "image": config.image,
        "command": list(AGENT_COMMAND),
        "env": env,
        "ports": [{"name": "agent", "containerPort": config.agent_port, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": config.agent_port}, "periodSeconds": 10},
        # The kernel log (Xid, ECC): syslog(2) is not namespaced, so `dmesg` with CAP_SYSLOG reads the
        # node's (the agent's kernel_log = "auto" falls back to it; /dev/kmsg needs a privileged pod).
        "securityContext": {"capabilities": {"add": ["SYSLOG"]}},
        "volumeMounts": mounts,
    }
    if config.gpus_per_node:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(config.gpus_per_node)}}
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": config.termination_grace_s,
        "automountServiceAccountToken": False,  # the agents call no Kubernetes API
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": match}]
                }
            },
            "podAntiAffinity": {  # one agent of the run per node, across all of its JobSets
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {"labelSelector": {"matchLabels": {RUN_LABEL: config.run}}, "topologyKey": HOSTNAME_LABEL}
                ]
            },
        },
        "containers": [container],
        "volumes": volumes,
    }
    if config.host_network:
        pod_spec["hostNetwork"] = True
        pod_spec["dnsPolicy"] = "ClusterFirstWithHostNet"
    if config.node_selector:
        pod_spec["nodeSelector"] = dict(sorted(config.node_selector.items()))
    for key, value in (
        ("priorityClassName", config.priority_class),
        ("runtimeClassName", config.runtime_class),
        ("serviceAccountName", config.service_account),
    ):
        if value:
            pod_spec[key] = value
    metadata: dict[str, Any] = {"name": name, "namespace": config.namespace, "labels": labels}
    if reason:
        metadata["annotations"] = {REQUEST_REASON_ANNOTATION: " ".join(reason.split())[:500]}
    return {
        "apiVersion": f"{JOBSET_GROUP}/{JOBSET_VERSION}",
        "kind": "JobSet",
        "metadata": metadata,
        "spec": {
            "failurePolicy": {"maxRestarts": 0},
            "replicatedJobs": [
                {
                    "name": REPLICATED_JOB,
                    "replicas": 1,
                    "template": {
                        "metadata": {"labels": dict(pod_labels)},
                        "spec": {
                            "parallelism": count,
                            "completions": count,
                            "completionMode": "Indexed",
                            "backoffLimitPerIndex": 0,  # a lost agent fails its index only
                            "template": {"metadata": {"labels": dict(pod_labels)}, "spec": pod_spec},
                        },
                    },
                }
            ],
        },
    }


def jobset_pods(obj: Any) -> int:
    """How many agent pods a JobSet (plain JSON from the API) asks for, read strictly."""
    try:
        rjobs = obj["spec"]["replicatedJobs"]
        return sum(int(r.get("replicas", 1)) * int(r["template"]["spec"]["parallelism"]) for r in rjobs)
    except (KeyError, TypeError, ValueError, AttributeError):
        raise BackendError("JobSet spec.replicatedJobs is not what runwarden creates") from None


def _api_error(what: str, exc: ApiException) -> BackendError:
    return BackendError(f"{what}: HTTP {exc.status} {exc.reason}")


def _default_api_client() -> k8s.ApiClient:
    from kubernetes import config as kube_config

    try:
        kube_config.load_incluster_config()
    except kube_config.ConfigException:
        try:
            kube_config.load_kube_config()
        except (kube_config.ConfigException, OSError) as exc:
            raise BackendError(f"no in-cluster service account and no kubeconfig: {exc}") from None
    return k8s.ApiClient()


class KubernetesScheduler:
    """`backend = "kubernetes"`.

    * ``allocate(nodes, spares)`` -- one JobSet ``<run>-n0`` of ``nodes + spares`` pods, one per node
      (a required pod anti-affinity on the run's label, across every JobSet of the run), kept off every
      node labelled ``runwarden.io/health=quarantined``, each pod running
      ``nodeagent --config /etc/runwarden/agent.toml`` with the node's GPUs requested, its name and
      advertised address from the downward API. Kueue admits it through ``kueue.x-k8s.io/queue-name``
      when a queue is configured. Idempotent: a JobSet of that name that carries the run's label is
      adopted (a controller restart or a standby taking over creates nothing).
    * ``request_nodes(count, exclude, reason)`` -- another JobSet ``<run>-n<k>`` of ``count`` pods,
      off the excluded nodes (node affinity ``NotIn``) and off every node that already has an agent of
      the run. The agents join when they register in etcd.
    * ``quarantine`` -- taint ``runwarden.io/quarantined:NoSchedule``, label
      ``runwarden.io/health=quarantined``, the reason in an annotation. ``spec.unschedulable`` (an
      operator's cordon) is never touched; ``release`` removes only runwarden's marks and answers False
      while an operator's cordon holds the node.
    * ``check_stop_fits(save_commit_s)`` -- preemption and drains send SIGTERM and then, after
      ``terminationGracePeriodSeconds``, SIGKILL: refuse a launch when that window is shorter than the
      observed checkpoint save + commit plus a margin.
    * ``finish`` -- delete the run's JobSets.

    Each agent pod is an index of its own (``backoffLimitPerIndex: 0``, ``restartPolicy: Never``): a
    lost node fails its index only, the other agents keep running, and nothing is restarted behind the
    supervisor's back (``failurePolicy.maxRestarts: 0``); the supervisor asks for a replacement.
    """

    name = "kubernetes"

    def __init__(self, config: KubernetesConfig, api_client: k8s.ApiClient | None = None):
        self.config = config
        self._api_client = api_client  # built on first use: loading the config contacts nothing

    @classmethod
    def from_section(cls, raw: dict[str, Any], where: str, run: str = "") -> KubernetesScheduler:
        """``run``: the controller's run name, the default for the section's own ``run``."""
        if run and raw.setdefault("run", run) != run:
            raise BackendError(f"{where}: run {raw['run']!r} is not the controller's run {run!r}")
        try:
            return cls(load_section(KubernetesConfig, raw, where))
        except (ConfigError, BackendError) as exc:
            raise BackendError(str(exc)) from None

    # ---- the API ---------------------------------------------------------------------------------

    def _client(self) -> k8s.ApiClient:
        if self._api_client is None:
            self._api_client = _default_api_client()
        return self._api_client

    @property
    def _core(self) -> k8s.CoreV1Api:
        return k8s.CoreV1Api(self._client())

    @property
    def _custom(self) -> k8s.CustomObjectsApi:
        return k8s.CustomObjectsApi(self._client())

    def _api(self, what: str, fn: Any, *args: Any, allow: tuple[int, ...] = (), **kwargs: Any) -> Any:
        """One API call with the request timeout; None for a status in ``allow`` (404, 409)."""
        try:
            return fn(*args, _request_timeout=self.config.request_timeout_s, **kwargs)
        except ApiException as exc:
            if exc.status in allow:
                return None
            raise _api_error(what, exc) from None
        except urllib3.exceptions.HTTPError as exc:  # connection refused, timeout, TLS
            raise BackendError(f"{what}: {type(exc).__name__}: {str(exc)[:200]}") from None

    def _jobsets(self, what: str, method: str, *args: Any, allow: tuple[int, ...] = (), **kwargs: Any) -> Any:
        return self._api(
            what,
            getattr(self._custom, method),
            JOBSET_GROUP,
            JOBSET_VERSION,
            self.config.namespace,
            JOBSET_PLURAL,
            *args,
            allow=allow,
            **kwargs,
        )

    def _run_jobsets(self) -> list[dict[str, Any]]:
        listed = self._jobsets(
            f"list JobSets of {self.config.run}",
            "list_namespaced_custom_object",
            label_selector=f"{RUN_LABEL}={self.config.run}",
        )
        items = listed.get("items") if isinstance(listed, dict) else None
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            raise BackendError("JobSet list: items is not a list of objects")
        return items

    def _ref(self, name: str) -> str:
        return f"jobset:{self.config.namespace}/{name}"

    # ---- Scheduler -------------------------------------------------------------------------------

    def allocate(self, nodes: int, spares: int) -> Allocation:
        """Create (or adopt) the run's JobSet of ``nodes + spares`` agents; the pods schedule and the
        agents register by themselves, so the nodes are not known here."""
        if nodes < 1 or spares < 0:
            raise BackendError(f"allocate: need nodes >= 1 and spares >= 0, got {nodes}+{spares}")
        count = nodes + spares
        name = jobset_name(self.config.run, 0)
        get = f"get JobSet {name}"
        existing = self._jobsets(get, "get_namespaced_custom_object", name, allow=(404,))
        if existing is None:
            body = agent_jobset(self.config, index=0, count=count)
            created = self._jobsets(
                f"create JobSet {name}", "create_namespaced_custom_object", body, allow=(409,)
            )
            if created is not None:
                return Allocation(id=self._ref(name), nodes=())
            # 409: created meanwhile (the other controller replica): adopt it
            existing = self._jobsets(get, "get_namespaced_custom_object", name, allow=(404,))
            if existing is None:
                raise BackendError(f"JobSet {name}: the API answered 409 (exists), then 404 (not found)")
        self._check_adoptable(name, existing, count)
        return Allocation(id=self._ref(name), nodes=())

    def _check_adoptable(self, name: str, obj: Any, count: int) -> None:
        labels = ((obj.get("metadata") or {}).get("labels") or {}) if isinstance(obj, dict) else {}
        if labels.get(RUN_LABEL) != self.config.run:
            raise BackendError(
                f"JobSet {self.config.namespace}/{name} exists without {RUN_LABEL}={self.config.run}: "
                "not runwarden's, not adopted"
            )
        pods = jobset_pods(obj)
        if pods != count:
            raise BackendError(
                f"JobSet {self.config.namespace}/{name} of this run has {pods} agent pods, asked for {count}: "
                f"delete it (kubectl -n {self.config.namespace} delete jobset {name}) or set nodes + spares back"
            )
        if (obj.get("metadata") or {}).get("deletionTimestamp"):
            raise BackendError(
                f"JobSet {self.config.namespace}/{name} is being deleted: allocate again once it is gone"
            )

    def request_nodes(self, count: int, *, exclude: tuple[str, ...], reason: str) -> NodeRequest:
        """Another JobSet of ``count`` agents, off ``exclude`` and off the run's other agents' nodes."""
        if count < 1:
            raise BackendError(f"request_nodes: count must be >= 1, got {count}")
        for node in exclude:
            validate_node_name(node)  # before anything is sent
        taken = [0]
        for obj in self._run_jobsets():
            found = _JOBSET_INDEX.search(str((obj.get("metadata") or {}).get("name", "")))
            if found:
                taken.append(int(found.group(1)))
        index = max(taken) + 1
        for _ in range(3):  # a 409: the name was taken since the list (a JobSet being deleted): the next
            name = jobset_name(self.config.run, index)
            body = agent_jobset(self.config, index=index, count=count, exclude=exclude, reason=reason)
            created = self._jobsets(
                f"create JobSet {name}", "create_namespaced_custom_object", body, allow=(409,)
            )
            if created is not None:
                return NodeRequest(id=self._ref(name), count=count, submitted_at=time.time())
            index += 1
        raise BackendError(f"create JobSet {name}: HTTP 409 Conflict three times in a row")

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
            # Only the taints: spec.unschedulable is an operator's cordon, never runwarden's.
            "spec": {"taints": [self._client().sanitize_for_serialization(t) for t in taints]},
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
            "spec": {"taints": [self._client().sanitize_for_serialization(t) for t in taints] or None},
        }
        self._patch_node(node, body)
        return True

    def check_stop_fits(self, save_commit_s: float) -> None:
        check_grace_period(self.config, save_commit_s)

    def finish(self, outcome: RunOutcome) -> None:
        """Delete every JobSet of the run (its agents get SIGTERM and the pods' grace period)."""
        for obj in self._run_jobsets():
            name = str((obj.get("metadata") or {}).get("name", ""))
            if not name:
                continue
            self._jobsets(
                f"delete JobSet {name} ({outcome.value})",
                "delete_namespaced_custom_object",
                name,
                propagation_policy="Background",
                allow=(404,),  # gone already: what finish wants
            )

    # ---- nodes -----------------------------------------------------------------------------------

    def _read_node(self, node: str) -> Any:
        return self._api(f"read node {node}", self._core.read_node, node)

    def _patch_node(self, node: str, body: dict[str, Any]) -> None:
        self._api(f"patch node {node}", self._core.patch_node, node, body)
