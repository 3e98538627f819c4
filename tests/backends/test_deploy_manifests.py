"""Every manifest in deploy/kubernetes/ (and the JobSet the backend builds) checked offline:
against the Kubernetes OpenAPI schemas that kubernetes-validate ships (strict: unknown fields
are errors), and by loading it into the official client's models and back without loss."""

from __future__ import annotations

import pytest

# The `kubernetes` client and `kubernetes-validate` (with PyYAML, jsonschema) are test/extra deps.
pytest.importorskip("kubernetes", reason="pip install kubernetes (the [kubernetes] extra)")
pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (dev extra)")

import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml
from kubernetes import client as k8s

from controller.backends.kubernetes import KubernetesConfig, agent_jobset

K8S_VERSION = "1.30.0"
DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"

# JobSet is a CRD, so kubernetes-validate has no schema for it: this is the part of
# jobset.x-k8s.io/v1alpha2 we use, from the JobSet API reference; its Job templates are then
# validated as batch/v1 Jobs by the real schema.
JOBSET_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "jobset.x-k8s.io/v1alpha2"},
        "kind": {"const": "JobSet"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["replicatedJobs"],
            "properties": {
                "failurePolicy": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"maxRestarts": {"type": "integer", "minimum": 0}},
                },
                "network": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "enableDNSHostnames": {"type": "boolean"},
                        "subdomain": {"type": "string"},
                    },
                },
                "suspend": {"type": "boolean"},
                "replicatedJobs": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name", "template"],
                        "properties": {
                            "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                            "replicas": {"type": "integer", "minimum": 1},
                            "template": {"type": "object"},
                        },
                    },
                },
            },
        },
    },
}


def documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc))
    return docs


def validate_jobset(doc: dict[str, Any]) -> None:
    jsonschema.validate(doc, JOBSET_SCHEMA)
    for rjob in doc["spec"]["replicatedJobs"]:
        job = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": rjob["name"]},
            **rjob["template"],
        }
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)
        roundtrip(job)


def roundtrip(doc: dict[str, Any]) -> None:
    """Loads into the client's model (required fields enforced) and back: nothing may be lost."""
    group_version = doc["apiVersion"].split("/")[-1]
    model = f"{group_version.capitalize()}{doc['kind']}"
    api = k8s.ApiClient()
    obj = api.deserialize(json.dumps(doc), model, "application/json")
    assert type(obj).__name__ == model
    assert api.sanitize_for_serialization(obj) == doc


def test_deploy_has_the_promised_manifests() -> None:
    kinds = {name.split(":")[1].split("/")[0] for name, _ in documents()}
    assert {"DaemonSet", "Deployment", "ClusterRole", "ConfigMap", "JobSet"} <= kinds


@pytest.mark.parametrize(("name", "doc"), documents(), ids=[n for n, _ in documents()])
def test_manifest_is_valid_offline(name: str, doc: dict[str, Any]) -> None:
    if doc["kind"] == "JobSet":
        validate_jobset(doc)
        return
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    roundtrip(doc)


def test_schema_validation_catches_a_typo() -> None:
    """The strict check is real: a misspelt field is rejected, a missing required one too."""
    _, daemonset = next(d for d in documents() if d[1]["kind"] == "DaemonSet")
    typo = json.loads(json.dumps(daemonset))
    typo["spec"]["template"]["spec"]["hostPid"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, K8S_VERSION, strict=True)
    broken = json.loads(json.dumps(daemonset))
    del broken["spec"]["template"]["spec"]["containers"][0]["name"]
    with pytest.raises(ValueError):
        roundtrip(broken)


def test_the_schedulers_jobset_is_valid_offline() -> None:
    config = KubernetesConfig(run="llm", image="runwarden:1", namespace="training", queue_name="q")
    validate_jobset(agent_jobset(config, index=0, count=5))
    validate_jobset(agent_jobset(config, index=3, count=1, exclude=("gpu-1", "gpu-2"), reason="xid 79"))
