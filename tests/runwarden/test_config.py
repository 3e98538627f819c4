"""Config loading: unknown keys and wrong types are errors that name the key."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runwarden.config import ConfigError, load_section, read_toml, require_positive


@dataclass(frozen=True, slots=True, kw_only=True)
class _Cfg:
    name: str = "x"
    ttl_s: float = 5.0
    count: int = 3
    enabled: bool = False
    tags: tuple[str, ...] = ()
    path: Path | None = None

    def __post_init__(self) -> None:
        require_positive("agent", ttl_s=self.ttl_s)


def test_defaults_and_coercion() -> None:
    cfg = load_section(_Cfg, {"ttl_s": 2, "tags": ["a", "b"], "enabled": "true", "path": "/tmp"}, "agent")
    assert cfg.ttl_s == 2.0 and isinstance(cfg.ttl_s, float)
    assert cfg.tags == ("a", "b") and cfg.enabled is True and cfg.path == Path("/tmp")
    assert load_section(_Cfg, {}, "agent") == _Cfg()


@pytest.mark.parametrize(
    ("mapping", "match"),
    [
        ({"ttl": 1}, r"unknown key\(s\) ttl"),
        ({"count": "three"}, r"agent\.count: expected an integer"),
        ({"count": True}, r"agent\.count: expected an integer"),
        ({"ttl_s": -1}, r"agent\.ttl_s: must be > 0"),
        ({"tags": "a"}, r"agent\.tags: expected a list"),
        ({"enabled": "maybe"}, r"agent\.enabled: expected true or false"),
    ],
)
def test_bad_values_name_the_key(mapping: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_section(_Cfg, mapping, "agent")


def test_read_toml_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("a = [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        read_toml(bad)
    with pytest.raises(ConfigError, match="no such config file"):
        read_toml(tmp_path / "missing.toml")


@given(
    st.dictionaries(
        st.text(max_size=10), st.one_of(st.integers(), st.text(max_size=10), st.none(), st.booleans())
    )
)
def test_loader_only_raises_config_error(mapping: dict[str, object]) -> None:
    with contextlib.suppress(ConfigError):
        load_section(_Cfg, mapping, "agent")
