"""runwarden.names.check_name: the one rule for run, node and election names."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runwarden import names
from runwarden.names import MAX_NAME_LENGTH, check_name


def _valid(value: str) -> bool:
    """The rule, written out the long way."""
    return (
        0 < len(value) <= MAX_NAME_LENGTH
        and "/" not in value
        and not any(c.isspace() for c in value)
        and value.isprintable()
        and value not in (".", "..")
    )


@pytest.mark.parametrize(
    "value", ["a", "gpu-07", "n00001", "a.b", "...", "run_1:x", "nœud-ü", "x" * MAX_NAME_LENGTH]
)
def test_good_names_come_back_unchanged(value: str) -> None:
    assert check_name("node name", value) == value


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("", "must not be empty"),
        ("a/b", "contains '/'"),
        ("a b", "contains ' '"),
        ("tab\there", "not allowed"),
        ("nl\n", "contains '\\n'"),
        ("nul\x00", "not allowed"),
        ("del\x7f", "not allowed"),
        ("nbsp\u00a0", "not allowed"),  # Unicode whitespace
        ("zw\u200bsp", "not allowed"),  # a format character: invisible, so refused
        (".", "must not be '.'"),
        ("..", "must not be '..'"),
        ("x" * (MAX_NAME_LENGTH + 1), "the limit is 128"),
        (None, "must be a string, got NoneType"),
        (12, "must be a string, got int"),
        (b"bytes", "must be a string, got bytes"),
    ],
)
def test_bad_names_raise_one_line_value_errors(value: object, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        check_name("NodeLost.node", value)
    text = str(caught.value)
    assert text.startswith("NodeLost.node: bad name ")
    assert message in text
    assert "\n" not in text


def test_a_long_bad_name_is_shortened_in_the_message() -> None:
    with pytest.raises(ValueError) as caught:
        check_name("run name", "y" * 10_000)
    assert len(str(caught.value)) < 200


@given(st.text(max_size=MAX_NAME_LENGTH + 8))
def test_accepts_exactly_what_the_rule_says(value: str) -> None:
    if _valid(value):
        assert check_name("name", value) == value
        assert check_name("name", value) == value  # the cached path agrees
    else:
        with pytest.raises(ValueError, match=r"^name: bad name "):
            check_name("name", value)


@given(st.text(min_size=1, max_size=20).filter(_valid))
def test_the_cache_never_admits_a_bad_name(value: str) -> None:
    check_name("name", value)
    assert value in names._good_names
    with pytest.raises(ValueError):
        check_name("name", value + "/")


def test_the_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(names, "_good_names", set())
    monkeypatch.setattr(names, "_CACHE_LIMIT", 3)
    for i in range(10):
        check_name("node", f"n{i}")
    assert len(names._good_names) == 3
    assert check_name("node", "n9") == "n9"  # past the limit names are still checked, just not kept


def test_a_str_subclass_is_checked_but_not_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    class Sly(str):
        pass

    monkeypatch.setattr(names, "_good_names", set())
    assert check_name("node", Sly("ok")) == "ok"
    assert not names._good_names
