"""Where etcd is and how to log in: ``StoreConfig``, validated on construction."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from runwarden.keys import DEFAULT_ROOT, validate_root
from runwarden.store.types import StoreError

_ENDPOINT = re.compile(
    r"^(?:(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://)?"
    r"(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(?P<port>[0-9]+)/?$"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Endpoint:
    host: str
    port: int
    secure: bool | None  # None: no scheme given, TLS decided by the TLS files

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoint(text: object) -> Endpoint:
    """Parse ``host:port``, ``http://host:port`` or ``https://host:port`` (IPv6 as ``[::1]:2379``)."""
    if not isinstance(text, str):
        raise StoreError(f"store endpoint must be a string like '127.0.0.1:2379', got {type(text).__name__}")
    match = _ENDPOINT.match(text.strip())
    if match is None:
        raise StoreError(f"store endpoint {text!r} is not host:port (for example '127.0.0.1:2379')")
    scheme = (match["scheme"] or "").lower()
    if scheme not in ("", "http", "https"):
        raise StoreError(f"store endpoint {text!r}: scheme must be http or https, not {scheme!r}")
    port = int(match["port"])
    if not 1 <= port <= 65535:
        raise StoreError(f"store endpoint {text!r}: port {port} is outside 1..65535")
    return Endpoint(host=match["host"], port=port, secure=None if not scheme else scheme == "https")


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreConfig:
    """Where etcd is and how to log in. Validated on construction (StoreError says what is wrong).

    TLS is used when ``ca_file`` or a client certificate is given, or an endpoint says ``https://``
    (without ``ca_file`` the system's trusted roots verify the server).
    """

    endpoints: tuple[str, ...]
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    timeout_s: float = 5.0
    root: str = DEFAULT_ROOT

    def __post_init__(self) -> None:
        endpoints = self.endpoints
        if isinstance(endpoints, str):
            endpoints = tuple(e for e in endpoints.split(",") if e.strip())
        if not isinstance(endpoints, list | tuple) or not endpoints:
            raise StoreError("store endpoints must be a non-empty list of 'host:port' strings")
        object.__setattr__(
            self, "endpoints", tuple(e.strip() if isinstance(e, str) else e for e in endpoints)
        )
        parsed = self.parsed_endpoints()
        schemes = {e.secure for e in parsed if e.secure is not None}
        if len(schemes) > 1:
            raise StoreError("store endpoints mix http:// and https://; use one or the other")
        if (self.cert_file is None) != (self.key_file is None):
            raise StoreError("store TLS: cert_file and key_file must be given together")
        if schemes == {False} and self.tls_files_given:
            raise StoreError("store endpoints say http:// but TLS files are given; use https:// or drop them")
        if (self.user is None) != (self.password is None):
            raise StoreError("store credentials: user and password must be given together")
        if self.user is not None and not self.user:
            raise StoreError("store credentials: user must not be empty")
        if (
            isinstance(self.timeout_s, bool)
            or not isinstance(self.timeout_s, int | float)
            or not self.timeout_s > 0
        ):
            raise StoreError(f"store timeout_s must be a positive number of seconds, got {self.timeout_s!r}")
        try:
            validate_root(self.root)
        except ValueError as err:
            raise StoreError(f"store root: {err}") from None

    def parsed_endpoints(self) -> list[Endpoint]:
        return [parse_endpoint(e) for e in self.endpoints]

    @property
    def tls_files_given(self) -> bool:
        return self.ca_file is not None or self.cert_file is not None

    @property
    def secure(self) -> bool:
        return self.tls_files_given or any(e.secure for e in self.parsed_endpoints())
