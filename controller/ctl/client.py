"""How `controllerctl` finds and talks to the controller, and how failures become exit codes.

The address comes from ``--controller`` > ``$RUNWARDEN_CONTROLLER`` > the config file's
``address`` > the default. The config file is ``--config``, ``$RUNWARDEN_CTL_CONFIG``,
``~/.config/runwarden/controllerctl.toml`` or ``/etc/runwarden/controllerctl.toml`` (first found);
it may hold a ``[controllerctl]`` table or the keys at top level::

    address = "controller.example:7070"
    ca = "/etc/runwarden/ca.pem"          # TLS: all three of ca, cert, key
    cert = "/etc/runwarden/alice.pem"
    key = "/etc/runwarden/alice.key"
    server_name = "controller"            # optional: the name in the server's certificate
    timeout_s = 10.0
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from runwarden.config import ConfigError, load_section, read_toml
from runwarden.v1 import controller_pb2_grpc

DEFAULT_ADDRESS = "127.0.0.1:7070"
ENV_ADDRESS = "RUNWARDEN_CONTROLLER"
ENV_CONFIG = "RUNWARDEN_CTL_CONFIG"
CONFIG_CANDIDATES = (
    Path("~/.config/runwarden/controllerctl.toml"),
    Path("/etc/runwarden/controllerctl.toml"),
)


class ExitCode(enum.IntEnum):
    """controllerctl's exit codes (also in `controllerctl --help`)."""

    OK = 0
    FAILED = 1  # the controller refused or failed the request
    USAGE = 2  # bad arguments or configuration (also argparse's code)
    UNREACHABLE = 3  # no controller answered at the address
    PERMISSION = 4  # the certificate is not allowed to do this (read-only), or was rejected
    NOT_FOUND = 5  # the node or run does not exist
    INTERRUPTED = 130  # Ctrl-C


EXIT_CODE_HELP = "\n".join(
    f"  {int(c):>3}  {c.name.lower().replace('_', ' ')}: {_doc}"
    for c, _doc in [
        (ExitCode.OK, "success"),
        (ExitCode.FAILED, "the controller refused or failed the request"),
        (ExitCode.USAGE, "bad arguments, config file or input file"),
        (ExitCode.UNREACHABLE, "no controller answered at the address"),
        (ExitCode.PERMISSION, "permission denied (a read-only certificate, or TLS rejected)"),
        (ExitCode.NOT_FOUND, "no such node or run"),
        (ExitCode.INTERRUPTED, "interrupted"),
    ]
)


class CtlError(Exception):
    """A failure to report in one line and exit with `code`."""

    def __init__(self, message: str, code: ExitCode) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True, kw_only=True)
class CtlConfig:
    address: str = ""
    ca: str = ""
    cert: str = ""
    key: str = ""
    server_name: str = ""
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        given = [bool(self.ca), bool(self.cert), bool(self.key)]
        if any(given) and not all(given):
            raise ConfigError("TLS needs all three of ca, cert and key")
        if not 0 < self.timeout_s <= 3600:
            raise ConfigError(f"timeout_s must be in (0, 3600], got {self.timeout_s}")


def find_config_file(flag: str | None, env: Mapping[str, str]) -> Path | None:
    if flag:
        return Path(flag)
    if env.get(ENV_CONFIG):
        return Path(env[ENV_CONFIG])
    for candidate in CONFIG_CANDIDATES:
        path = candidate.expanduser()
        if path.is_file():
            return path
    return None


def load_config(path: Path | None) -> CtlConfig:
    if path is None:
        return CtlConfig()
    try:
        data: Mapping[str, Any] = read_toml(path)
        section = data.get("controllerctl", data)
        return load_section(CtlConfig, section, f"{path} [controllerctl]")
    except ConfigError as exc:
        raise CtlError(str(exc), ExitCode.USAGE) from None


def resolve(args: Any, env: Mapping[str, str] | None = None) -> tuple[str, CtlConfig]:
    """The address and settings to use: flag > environment > config file > default."""
    env = os.environ if env is None else env
    cfg = load_config(find_config_file(getattr(args, "config", None), env))
    overrides = {name: getattr(args, name, None) for name in ("ca", "cert", "key", "server_name")}
    merged = {f: (overrides.get(f) or getattr(cfg, f)) for f in ("ca", "cert", "key", "server_name")}
    try:
        cfg = CtlConfig(
            address=cfg.address, timeout_s=getattr(args, "timeout", None) or cfg.timeout_s, **merged
        )
    except ConfigError as exc:
        raise CtlError(str(exc), ExitCode.USAGE) from None
    address = getattr(args, "controller", None) or env.get(ENV_ADDRESS) or cfg.address or DEFAULT_ADDRESS
    return address, cfg


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise CtlError(f"cannot read the {what} {path}: {exc.strerror}", ExitCode.USAGE) from None


def open_channel(address: str, cfg: CtlConfig) -> grpc.Channel:
    if not cfg.ca:
        return grpc.insecure_channel(address)
    creds = grpc.ssl_channel_credentials(
        root_certificates=_read(cfg.ca, "CA certificate"),
        private_key=_read(cfg.key, "client key"),
        certificate_chain=_read(cfg.cert, "client certificate"),
    )
    options = [("grpc.ssl_target_name_override", cfg.server_name)] if cfg.server_name else []
    return grpc.secure_channel(address, creds, options=options)


class Client:
    """A Controller stub whose calls raise CtlError with the right exit code."""

    def __init__(self, address: str, cfg: CtlConfig) -> None:
        self.address = address
        self.timeout_s = cfg.timeout_s
        self.channel = open_channel(address, cfg)
        self.stub = controller_pb2_grpc.ControllerStub(self.channel)

    def call(self, method: str, request: Any) -> Any:
        fn: Callable[..., Any] = getattr(self.stub, method)
        try:
            return fn(request, timeout=self.timeout_s)
        except grpc.RpcError as err:
            raise rpc_error(err, self.address) from None

    def close(self) -> None:
        self.channel.close()


def rpc_error(err: grpc.RpcError, address: str) -> CtlError:
    code = err.code() if isinstance(err, grpc.Call) else None
    details = (err.details() if isinstance(err, grpc.Call) else "") or ""
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        hint = f"; set --controller or ${ENV_ADDRESS}" if address == DEFAULT_ADDRESS else ""
        if "handshake" in details.lower() or "ssl" in details.lower() or "certificate" in details.lower():
            return CtlError(f"TLS with the controller at {address} failed: {details}", ExitCode.PERMISSION)
        return CtlError(
            f"cannot reach the controller at {address}: {details or code}{hint}", ExitCode.UNREACHABLE
        )
    if code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
        return CtlError(f"permission denied: {details}", ExitCode.PERMISSION)
    if code == grpc.StatusCode.NOT_FOUND:
        return CtlError(details or "not found", ExitCode.NOT_FOUND)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return CtlError(f"invalid request: {details}", ExitCode.USAGE)
    name = code.name if code is not None else "error"
    return CtlError(f"the controller answered {name}: {details}", ExitCode.FAILED)
