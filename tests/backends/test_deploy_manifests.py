"""Every manifest in deploy/kubernetes/ (and the JobSet the scheduler builds) checked offline:
against the Kubernetes OpenAPI schemas that kubernetes-validate ships (strict: unknown fields
are errors), by loading it into the official client's models and back without loss, every config a
ConfigMap ships through the program's own loader, and every container command through the program's
own argument parser (with the `$(VAR)` references Kubernetes expands resolved as it would)."""

from __future__ import annotations

import pytest

# The `kubernetes` client and `kubernetes-validate` (with PyYAML, jsonschema) are test/extra deps.
pytest.importorskip("kubernetes", reason="pip install kubernetes (the [kubernetes] extra)")
pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (dev extra)")

import argparse
import json
import os
import re
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml
from kubernetes import client as k8s

from controller.backends.kubernetes import KubernetesConfig, KubernetesScheduler, agent_jobset
from controller.ctl import main as controllerctl
from controller.live import main as controller_main
from controller.live.config import ControllerConfig, load_controller_config
from nodeagent.daemon import cli as nodeagent_cli
from nodeagent.daemon import config as nodeagent_config

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
    assert {"Deployment", "ClusterRole", "Role", "ConfigMap", "JobSet", "PersistentVolumeClaim"} <= kinds
    # no DaemonSet: the agents are the pods of the run's JobSets, placed by the controller
    assert "DaemonSet" not in kinds


@pytest.mark.parametrize(("name", "doc"), documents(), ids=[n for n, _ in documents()])
def test_manifest_is_valid_offline(name: str, doc: dict[str, Any]) -> None:
    if doc["kind"] == "JobSet":
        validate_jobset(doc)
        return
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    roundtrip(doc)


def test_schema_validation_catches_a_typo() -> None:
    """The strict check is real: a misspelt field is rejected, a missing required one too."""
    _, deployment = next(d for d in documents() if d[1]["kind"] == "Deployment")
    typo = json.loads(json.dumps(deployment))
    typo["spec"]["template"]["spec"]["hostPid"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, K8S_VERSION, strict=True)
    broken = json.loads(json.dumps(deployment))
    del broken["spec"]["template"]["spec"]["containers"][0]["name"]
    with pytest.raises(ValueError):
        roundtrip(broken)


def test_the_schedulers_jobset_is_valid_offline() -> None:
    config = KubernetesConfig(run="llm", image="runwarden:1", namespace="training", queue_name="q")
    validate_jobset(agent_jobset(config, index=0, count=5))
    validate_jobset(agent_jobset(config, index=3, count=1, exclude=("gpu-1", "gpu-2"), reason="xid 79"))


# ---- the configs and commands inside the manifests, through the programs' own code -------------------

# What the downward API would give a pod (fieldRef -> a sample value), to expand `$(VAR)` as the kubelet does.
FIELD_SAMPLES = {
    "spec.nodeName": "gpu-017",
    "status.hostIP": "10.1.2.17",
    "status.podIP": "10.244.7.3",
    "metadata.name": "runwarden-controller-5d9c7-x2x4q",
}


def pod_specs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc["kind"] in ("Deployment", "DaemonSet", "StatefulSet", "Job"):
        return [doc["spec"]["template"]["spec"]]
    if doc["kind"] == "JobSet":
        return [r["template"]["spec"]["template"]["spec"] for r in doc["spec"]["replicatedJobs"]]
    return []


def container_env(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: fieldRefs sampled, `$(VAR)` expanded in order."""
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        if "valueFrom" in entry:
            env[entry["name"]] = FIELD_SAMPLES[entry["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[entry["name"]] = expand(entry["value"], env)
    return env


def expand(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def containers() -> list[tuple[str, dict[str, Any], dict[str, Any], dict[str, Any]]]:
    """(id, manifest, pod spec, container) of every container any manifest ships."""
    found = []
    for name, doc in documents():
        for pod in pod_specs(doc):
            for c in pod.get("initContainers", []) + pod["containers"]:
                found.append((f"{name}:{c['name']}", doc, pod, c))
    return found


def config_maps() -> dict[tuple[str, str], dict[str, str]]:
    return {
        (doc["metadata"]["namespace"], doc["metadata"]["name"]): doc["data"]
        for _, doc in documents()
        if doc["kind"] == "ConfigMap"
    }


def shipped_controller_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ControllerConfig:
    monkeypatch.delenv("RUNWARDEN_ETCD_ENDPOINTS", raising=False)
    path = tmp_path / "controller.toml"
    path.write_text(config_maps()[("runwarden", "runwarden-controller")]["controller.toml"])
    return load_controller_config(path)


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:  # argparse's way of saying no
        raise AssertionError(f"{parser.prog} refuses {argv}: exit {exc.code}") from None


PARSERS: dict[str, Callable[[list[str]], argparse.Namespace]] = {
    "controller": lambda argv: _parse(controller_main.build_parser(), argv),
    "nodeagent": lambda argv: _parse(nodeagent_cli.build_parser(), argv),
    "controllerctl": lambda argv: _parse(controllerctl.build_parser(argv), argv),
}


def test_every_container_command_parses_through_the_real_parsers() -> None:
    seen = set()
    for cid, doc, pod, c in containers():
        env = container_env(c)
        argv = [expand(a, env) for a in c.get("command", []) + c.get("args", [])]
        assert argv and argv[0] in PARSERS, f"{cid}: {argv[:1]} is not one of runwarden's programs"
        args = PARSERS[argv[0]](argv[1:])
        seen.add(argv[0])
        if argv[0] == "controller":
            assert args.command == "run" and args.identity == FIELD_SAMPLES["metadata.name"], cid
        config = getattr(args, "config", None)
        if config:  # the file it reads is a key of a ConfigMap mounted there, in the pod's namespace
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            volumes = {v["name"]: v for v in pod.get("volumes", [])}
            volume = volumes[mounts[str(Path(config).parent)]]
            data = config_maps()[(doc["metadata"]["namespace"], volume["configMap"]["name"])]
            assert Path(config).name in data, f"{cid}: {config} is not in the ConfigMap"
    assert seen == {"controller", "nodeagent"}


def test_a_bad_command_is_refused_by_the_parsers() -> None:
    with pytest.raises(AssertionError, match="refuses"):
        PARSERS["controller"](["--config", "/etc/runwarden/controller.toml"])  # no `run`: what shipped before
    with pytest.raises(AssertionError, match="refuses"):
        PARSERS["nodeagent"](["--confg", "/etc/runwarden/agent.toml"])
    with pytest.raises(AssertionError, match="refuses"):
        PARSERS["controllerctl"](["no-such-command"])


def test_every_shipped_config_loads_through_the_real_loaders(tmp_path: Path, monkeypatch) -> None:
    """Each ConfigMap's TOML through the program that reads it: the controller's file through
    load_controller_config and its [kubernetes] section through the scheduler it builds; the agents'
    file through nodeagent's loader with the environment the agent pod really gets."""
    for key in [k for k in list(os.environ) if k.startswith(nodeagent_config.ENV_PREFIX)]:
        monkeypatch.delenv(key)
    loaded = set()
    for (namespace, name), data in config_maps().items():
        for key, text in data.items():
            path = tmp_path / namespace / name / key
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            tomllib.loads(text)
            if key == "controller.toml":
                cfg = shipped_controller_config(tmp_path, monkeypatch)
                assert cfg.run.backend == "kubernetes" and cfg.backend_section
                scheduler = (
                    cfg.scheduler()
                )  # the [kubernetes] section through KubernetesScheduler.from_section
                assert isinstance(scheduler, KubernetesScheduler)
                assert scheduler.config.run == cfg.run.run
            elif key == "agent.toml":
                (_, _, _, agent) = next(c for c in containers() if c[3]["command"][0] == "nodeagent")
                env = container_env(agent)
                agent_cfg = nodeagent_config.from_sources(file=path, environ=env)
                assert agent_cfg.node == FIELD_SAMPLES["spec.nodeName"]
                assert agent_cfg.advertise == f"{FIELD_SAMPLES['status.hostIP']}:50052"
                assert agent_cfg.listen == "0.0.0.0:50052" and agent_cfg.tls_enabled
                assert agent_cfg.torchrun[0] in agent_cfg.allowed_executables
            else:
                raise AssertionError(f"ConfigMap {namespace}/{name}: no loader for {key}")
            loaded.add(key)
    assert loaded == {"controller.toml", "agent.toml"}


def test_a_typo_in_a_shipped_config_is_refused(tmp_path: Path, monkeypatch) -> None:
    """The loaders are strict, so the test above means something: the keys that shipped before fail."""
    from runwarden.config import ConfigError

    monkeypatch.delenv("RUNWARDEN_ETCD_ENDPOINTS", raising=False)
    old_agent = tmp_path / "agent.toml"
    old_agent.write_text('[store]\nendpoints = ["e:2379"]\n[agent]\nlisten = "0.0.0.0:50052"\n')
    with pytest.raises(ConfigError, match="unknown key"):
        nodeagent_config.from_sources(file=old_agent, environ={})
    text = config_maps()[("runwarden", "runwarden-controller")]["controller.toml"]
    bad = tmp_path / "controller.toml"
    bad.write_text(
        text.replace("termination_grace_s = 600", "termination_grace_s = 600\ncheckpoint_save_s = 240.0")
    )
    with pytest.raises(ConfigError, match=r"unknown key\(s\) checkpoint_save_s"):
        load_controller_config(bad).scheduler()


def test_the_jobset_example_is_what_allocate_builds_from_the_shipped_config(
    tmp_path: Path, monkeypatch
) -> None:
    cfg = shipped_controller_config(tmp_path, monkeypatch)
    scheduler = cfg.scheduler()
    assert isinstance(scheduler, KubernetesScheduler)
    example = yaml.safe_load((DEPLOY / "jobset-example.yaml").read_text())
    assert example == expected_jobset_example(cfg), (
        "deploy/kubernetes/jobset-example.yaml is stale: python -m tests.backends.test_deploy_manifests"
    )
    # what it refers to is shipped too, in its namespace
    names = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for _, d in documents()}
    k = scheduler.config
    assert ("ConfigMap", k.namespace, k.agent_config_map) in names
    assert ("ServiceAccount", k.namespace, k.service_account) in names
    assert ("PersistentVolumeClaim", k.namespace, k.shared_claim) in names


def expected_jobset_example(cfg: ControllerConfig) -> dict[str, Any]:
    scheduler = cfg.scheduler()
    assert isinstance(scheduler, KubernetesScheduler)
    return agent_jobset(scheduler.config, index=0, count=cfg.run.nodes + cfg.run.spares)


if __name__ == "__main__":  # rewrite jobset-example.yaml's body from the shipped config (its header kept)
    import tempfile

    target = DEPLOY / "jobset-example.yaml"
    header = "".join(line for line in target.read_text().splitlines(True) if line.startswith("#"))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "controller.toml"
        path.write_text(config_maps()[("runwarden", "runwarden-controller")]["controller.toml"])
        body = expected_jobset_example(load_controller_config(path))
    target.write_text(header + yaml.safe_dump(body, sort_keys=False, width=100))
    print(f"wrote {target}", file=sys.stderr)
