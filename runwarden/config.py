"""Loading config sections into frozen dataclasses, validated once.

raft's `Config.validate()` habit: every component has one frozen config; unknown keys are errors
(NVRx silently drops them, which hides typos); durations are seconds as floats in TOML and are
range-checked here. Precedence is file < environment < flags; each component's `from_sources`
merges those mappings and calls `load_section` once.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value or file is wrong; the message names the file/section and the key."""


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such config file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror}") from None


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")
    if origin in (tuple, list):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
        item_t = args[0] if args else Any
        items = [_coerce(v, item_t, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a table, got {type(value).__name__}")
        return {str(k): _coerce(v, args[1] if args else Any, f"{where}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {type(value).__name__}")
        return value
    if isinstance(tp, type) and issubclass(tp, Path):
        if not isinstance(value, str | Path):
            raise ConfigError(f"{where}: expected a path, got {type(value).__name__}")
        return Path(value)
    raise ConfigError(f"{where}: unsupported config type {tp!r}")


def load_section(cls: type[T], mapping: Mapping[str, Any], where: str) -> T:
    """Build dataclass `cls` from `mapping`: unknown keys and wrong types are errors.

    Fields absent from `mapping` take the dataclass default. After construction the dataclass's
    own `__post_init__` can check ranges and combinations (raise ConfigError there).
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    if not isinstance(mapping, Mapping):
        raise ConfigError(f"{where}: expected a table, got {type(mapping).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(mapping) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(fields))}")
    hints = typing.get_type_hints(cls)
    kwargs = {name: _coerce(value, hints[name], f"{where}.{name}") for name, value in mapping.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def require_positive(where: str, **values: float) -> None:
    """Range check used by configs' __post_init__: every named value must be > 0."""
    for name, v in values.items():
        if not v > 0:
            raise ConfigError(f"{where}.{name}: must be > 0, got {v!r}")
