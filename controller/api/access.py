"""Who may do what through the Controller API: roles, the `AccessPolicy`, and the TLS role mapping.

With mutual TLS the client certificate decides the role: a certificate whose common name is in
`AccessPolicy.admin_names`, or whose subject organization (O=) is in `admin_organizations`, is
admin; any other certificate the CA signed is read-only. Read-only callers may use the
Get/List/Watch RPCs (GetPolicy too); QuarantineNode, ReleaseNode, RequestStop, DrainNode,
SetPolicy and ReleaseClaims need admin. Plaintext is served on
loopback only (demo, tests) and gets `plaintext_role`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

import grpc


class Role(enum.Enum):
    READ_ONLY = "read-only"
    ADMIN = "admin"


@dataclass(frozen=True, slots=True, kw_only=True)
class AccessPolicy:
    """Who is admin (the module docstring has the rule). Plaintext callers get `plaintext_role`."""

    admin_names: frozenset[str] = frozenset()
    admin_organizations: frozenset[str] = frozenset({"runwarden:admin"})
    plaintext_role: Role = Role.ADMIN


@dataclass(frozen=True, slots=True, kw_only=True)
class Caller:
    role: Role
    identity: str  # the certificate's CN, or the peer address for plaintext


def _first(ctx: Mapping[str, object], key: str) -> str:
    # grpc-stubs types the values as bytes; at run time each is a list of bytes
    values = ctx.get(key) or []
    value = values if isinstance(values, bytes) else next(iter(values), b"")  # type: ignore[call-overload]  # grpc-stubs says bytes; it is a list
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else ""


def _subject_organizations(subject: str) -> set[str]:
    # gRPC's x509_subject is RFC 2253 style ("CN=alice,O=runwarden:admin"); escaped commas are rare
    # in organization names and would only make a certificate read-only, never admin.
    out = set()
    for part in subject.split(","):
        key, _, value = part.strip().partition("=")
        if key.strip().upper() == "O":
            out.add(value.strip())
    return out


def caller_of(context: grpc.ServicerContext, policy: AccessPolicy) -> Caller:
    """The caller's role and identity, from the connection's TLS auth context."""
    ctx = context.auth_context()
    if _first(ctx, "transport_security_type") != "ssl":
        return Caller(role=policy.plaintext_role, identity=context.peer())
    cn = _first(ctx, "x509_common_name")
    orgs = _subject_organizations(_first(ctx, "x509_subject"))
    admin = cn in policy.admin_names or bool(orgs & policy.admin_organizations)
    return Caller(role=Role.ADMIN if admin else Role.READ_ONLY, identity=cn or context.peer())
