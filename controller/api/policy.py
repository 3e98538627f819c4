"""The supervisor policy as stored in etcd, and changing it: the one path for every writer.

`<root>/v1/runs/<run>/policy` holds a `PolicyRecord` with every `SupervisorConfig` field. The first
leader seeds it from its config file (`seed`); after that it is the policy in force: a standby sees
it, a new leader starts with it (the shell's StoreListed carries it), and the leader's watch hands each
change to the core as `PolicyChanged`. Writers (`controllerctl config set/apply` through the API,
SIGHUP to `controller run`) go through `update`: the new policy is built from the stored one and
validated whole (`runwarden.config.load_section`: unknown keys and bad types refused naming the key,
then SupervisorConfig's own checks), then written with a compare-and-swap on the record's mod
revision; a concurrent writer makes it re-read and re-apply, so two `set`s never lose one.
A bad value leaves the store as it was.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError

from controller.supervisor.policy import SupervisorConfig
from controller.supervisor.reconfigure import changes, from_value, to_value, values_of
from runwarden.config import ConfigError, load_section
from runwarden.store import Store
from runwarden.v1 import common_pb2, store_pb2

CAS_TRIES = 8
# An optional field (hang_timeout_s) is unset by this word, as `controllerctl config set` takes it.
UNSET_WORDS = ("none", "unset")


class PolicyConflict(RuntimeError):
    """The record kept changing under us for CAS_TRIES rounds; nothing was written."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredPolicy:
    """The policy in force as read back: validated, with the record's etcd mod revision."""

    config: SupervisorConfig
    revision: int
    record: store_pb2.PolicyRecord


def _optional(name: str) -> bool:
    hint = typing.get_type_hints(SupervisorConfig)[name]
    return type(None) in typing.get_args(hint)


def plain(values: Mapping[str, common_pb2.PolicyValue], where: str) -> dict[str, Any]:
    """Wire values as Python values; "none" unsets an optional field. ConfigError names the key."""
    known = {f.name for f in dataclasses.fields(SupervisorConfig)}
    out: dict[str, Any] = {}
    for key, pv in values.items():
        try:
            value = from_value(pv)
        except ValueError as exc:
            raise ConfigError(f"{where}.{key}: {exc}") from None
        if (
            key in known
            and isinstance(value, str)
            and value.strip().lower() in UNSET_WORDS
            and _optional(key)
        ):
            value = None
        out[key] = value
    return out


def build(
    base: SupervisorConfig | None, proposed: Mapping[str, Any], *, replace: bool, where: str
) -> SupervisorConfig:
    """The whole new policy: `proposed` over `base` (or over the defaults with replace), validated."""
    merged = dict(proposed) if replace or base is None else {**values_of(base), **proposed}
    return load_section(SupervisorConfig, merged, where)


def record_of(cfg: SupervisorConfig, run: str, *, changed_by: str, reason: str, now: float) -> bytes:
    rec = store_pb2.PolicyRecord(run=run, changed_at=now, changed_by=changed_by, reason=reason)
    for key, value in values_of(cfg).items():
        rec.values[key].CopyFrom(to_value(value))
    return rec.SerializeToString()


def decode(data: bytes, where: str) -> tuple[SupervisorConfig, store_pb2.PolicyRecord]:
    """A stored record as a validated policy; ConfigError for a bad one (written by hand, or by a
    newer version with keys this one does not know)."""
    rec = store_pb2.PolicyRecord()
    try:
        rec.ParseFromString(data)
    except DecodeError as exc:
        raise ConfigError(f"{where}: not a PolicyRecord: {exc}") from None
    return build(None, plain(rec.values, where), replace=True, where=where), rec


def read(store: Store, run: str) -> StoredPolicy | None:
    """The stored policy (None: none stored yet). StoreError when etcd does not answer."""
    key = store.keys.policy(run)
    kv = store.get(key)
    if kv is None:
        return None
    cfg, rec = decode(kv.value, key)
    return StoredPolicy(config=cfg, revision=kv.mod_revision, record=rec)


def seed(store: Store, run: str, cfg: SupervisorConfig, *, changed_by: str, now: float) -> bool:
    """Store `cfg` when no policy is stored yet (a new run's first leader); whether it wrote."""
    data = record_of(cfg, run, changed_by=changed_by, reason="the first leader's config file", now=now)
    return store.cas(store.keys.policy(run), data, 0)


def update(
    store: Store,
    run: str,
    change: Callable[[SupervisorConfig | None], SupervisorConfig],
    *,
    changed_by: str,
    reason: str,
    now: float,
) -> tuple[list[common_pb2.PolicyChange], int]:
    """Read, `change` (raises ConfigError for a bad policy: nothing written), compare-and-swap.

    `change` gets the stored policy, or None when none is stored or the stored record does not
    decode (only a whole policy replaces such a record). Returns the changed keys (against the
    defaults when nothing was stored; empty: the values were in force already, nothing written)
    and the record's revision after the write."""
    key = store.keys.policy(run)
    for _ in range(CAS_TRIES):
        kv = store.get(key)
        current: SupervisorConfig | None = None
        if kv is not None:
            try:
                current = decode(kv.value, key)[0]
            except ConfigError:
                current = None
        new = change(current)
        diff = changes(current or SupervisorConfig(), new)
        if current is not None and not diff:
            return [], kv.mod_revision if kv is not None else 0
        data = record_of(new, run, changed_by=changed_by, reason=reason, now=now)
        if store.cas(key, data, kv.mod_revision if kv is not None else 0):
            after = store.get(key)
            return diff, after.mod_revision if after is not None else 0
    raise PolicyConflict(f"{key} kept changing for {CAS_TRIES} tries; nothing written, try again")
