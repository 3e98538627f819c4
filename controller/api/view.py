"""What the Controller API needs from the controller: the `ControllerView` protocol and its errors.

The live controller shell implements it (`controller.live.view`); `controller.api.store_view`
implements it from etcd for tools and tests. A view method reports a failure by raising one of the
errors below; the servicer turns each into a status code (NOT_FOUND, FAILED_PRECONDITION,
UNAVAILABLE, INVALID_ARGUMENT), never a crash.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from runwarden.v1 import common_pb2, controller_pb2


class ViewNotFound(LookupError):
    """The node or run named in a request does not exist."""


class ViewUnavailable(RuntimeError):
    """The view's backing store did not answer; worth retrying."""


class ViewRefused(RuntimeError):
    """The request is valid but cannot be done in the current state (e.g. releasing a spare)."""


class ViewInvalid(ValueError):
    """The request names a bad key or value (a policy change SupervisorConfig refuses)."""


class ControllerView(Protocol):
    """What the API needs from the controller. Methods may raise the View* errors above."""

    @property
    def event_log_path(self) -> Path: ...

    def run_statuses(self) -> Sequence[controller_pb2.RunStatus]: ...

    def node_infos(self) -> Sequence[controller_pb2.NodeInfo]: ...

    def leader(self) -> tuple[str, int]:
        """The leader's identity and fencing token ("", 0 when unknown)."""
        ...

    def quarantine(self, node: str, reason: str, actor: str) -> common_pb2.PoolState.ValueType: ...

    def release(self, node: str, reason: str, actor: str) -> common_pb2.PoolState.ValueType: ...

    def request_stop(self, run: str, reason: str, actor: str, relaunch: bool = False) -> bool: ...

    def drain(self, node: str, reason: str, actor: str, *, undo: bool = False) -> bool:
        """Drain the node through its agent (or end the drain); whether it drains now."""
        ...

    def release_claims(self, *, node: str, run: str, actor: str) -> list[str]:
        """Give back a node's claim or a run's claims (ViewRefused while that run has a leader)."""
        ...

    def policy(self, run: str) -> controller_pb2.GetPolicyResponse:
        """The run's stored supervisor policy ("" : the controller's run)."""
        ...

    def set_policy(
        self,
        run: str,
        values: Mapping[str, common_pb2.PolicyValue],
        *,
        replace: bool,
        actor: str,
        reason: str,
    ) -> controller_pb2.SetPolicyResponse:
        """Change the run's policy (controller/api/policy.py); ViewInvalid names a bad key or value."""
        ...
