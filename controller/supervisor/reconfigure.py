"""The policy changed live (`PolicyChanged`, or a `StoreListed` carrying the stored policy): swap it in.

The new `SupervisorConfig` was validated whole where it was built (the API, SIGHUP, the shell's
translation from etcd); here it only takes effect. Every rule reads `sv.cfg` when it decides, so the
next decision uses the new values; a `SetTimer` due now makes that next decision come at once, not
at a deadline armed under the old policy (a shorter hang floor re-arms the hang timer on that tick).
What an attempt fixed when it started stays until the next one: its straggler window's length.
The change is logged with only the changed keys, old and new. The codec between policy values and
`runwarden.v1.PolicyValue` is `to_value` here and `runwarden.run_policy.from_value` (the agents read
values too), so the API, the store, the agents and the event log spell values alike.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from controller.supervisor.actions import SetTimer
from controller.supervisor.events import PolicyChanged
from controller.supervisor.policy import SupervisorConfig
from runwarden.run_policy import from_value
from runwarden.v1 import common_pb2
from runwarden.v1 import events_pb2 as E

if TYPE_CHECKING:
    from controller.supervisor.run import Run


def values_of(cfg: SupervisorConfig) -> dict[str, Any]:
    """Every policy field and its value, in declaration order."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def to_value(value: Any) -> common_pb2.PolicyValue:
    """A policy value as `runwarden.v1.PolicyValue` (bool before int: a bool is an int in Python)."""
    if value is None:
        return common_pb2.PolicyValue(unset=True)
    if isinstance(value, bool):
        return common_pb2.PolicyValue(flag=value)
    if isinstance(value, int):
        return common_pb2.PolicyValue(integer=value)
    if isinstance(value, float):
        return common_pb2.PolicyValue(number=value)
    if isinstance(value, str):
        return common_pb2.PolicyValue(text=value)
    raise ValueError(f"not a policy value: {value!r}")


def show(value: Any) -> str:
    """A value as the operator writes it (`controllerctl config set KEY VALUE`)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"{value:g}" if isinstance(value, float) else str(value)


def changes(old: SupervisorConfig, new: SupervisorConfig) -> list[common_pb2.PolicyChange]:
    """The keys whose values differ, old and new, in declaration order."""
    before, after = values_of(old), values_of(new)
    return [
        common_pb2.PolicyChange(key=k, old=to_value(before[k]), new=to_value(after[k]))
        for k in before
        if before[k] != after[k]
    ]


def describe(changed: list[common_pb2.PolicyChange]) -> str:
    return ", ".join(f"{c.key} {show(from_value(c.old))} -> {show(from_value(c.new))}" for c in changed)


def on_policy_changed(sv: Run, ev: PolicyChanged) -> None:
    """Every state: the new policy from the next decision on (nothing when nothing changed)."""
    apply(sv, ev)


def apply(sv: Run, ev: PolicyChanged) -> None:
    changed = changes(sv.cfg, ev.config)
    if not changed:
        return  # the same values written again (a seed, an apply of the file in force)
    sv.cfg = ev.config
    sv.pool.reconfigure(ev.config)
    who = f" by {ev.changed_by}" if ev.changed_by else ""
    why = f" ({ev.reason})" if ev.reason else ""
    sv.log(
        E.EVENT_KIND_POLICY_CHANGED,
        f"policy changed{who}{why}: {describe(changed)}",
        policy=E.PolicyDetail(changes=changed, changed_by=ev.changed_by, reason=ev.reason),
    )
    sv.emit(SetTimer(key="policy", at=sv.now))
