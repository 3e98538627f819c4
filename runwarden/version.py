"""Which runwarden versions work together, for rolling upgrades of runwarden itself.

The wire and the store say their schema in their names: the gRPC package ``runwarden.v1`` and the
etcd keys under ``<root>/v1/``; a change that breaks either gets a new name, beside the old. Within
them, each agent's node record carries its ``agent_version`` and each attempt record the launching
leader's ``controller_version``.

The skew rule (Kubernetes' kubelet/apiserver rule, for the same reason): the controller is upgraded
first, then the agents host by host, so an agent may run the controller's version or one minor
version older, never newer and never another major version. The controller drives only the agents
the rule admits; another agent's node drains for its version (logged once with both versions): no
new placement and never seen as lost (controller.live.translate).
"""

from __future__ import annotations

import re

_VERSION = re.compile(r"(\d+)\.(\d+)\.(\d+)")


def parse(version: str) -> tuple[int, int, int] | None:
    """``"0.1.0"`` (or ``"0.1.0.dev3"``, ``"0.1.0+local"``) -> ``(0, 1, 0)``; anything else -> None."""
    match = _VERSION.match(version)
    return None if match is None else (int(match[1]), int(match[2]), int(match[3]))


def agent_skew(agent: str, controller: str) -> str:
    """Why an agent at version ``agent`` cannot be driven by a controller at ``controller``; "" when
    it can."""
    theirs, ours = parse(agent), parse(controller)
    if ours is None:
        return f"this controller's version {controller!r} is not a version"
    if theirs is None:
        return f"the agent reports no version ({agent!r}); this controller is {controller}"
    if theirs[0] != ours[0]:
        return f"agent {agent} and controller {controller} are different major versions"
    if theirs[1] > ours[1]:
        return f"agent {agent} is newer than controller {controller}: upgrade the controller first"
    if theirs[1] < ours[1] - 1:
        return (
            f"agent {agent} is more than one minor version older than controller {controller}: "
            "upgrade the agent"
        )
    return ""
