"""The key schema: layout, versioned prefix, configurable root, name validation."""

from __future__ import annotations

import pytest

from runwarden.keys import KeySchema
from runwarden.names import MAX_NAME_LENGTH, check_name


def test_layout_under_versioned_default_root() -> None:
    keys = KeySchema()
    assert keys.base == "/runwarden/v1/"
    assert keys.node("gpu-001") == "/runwarden/v1/nodes/gpu-001"
    assert keys.nodes_prefix() == "/runwarden/v1/nodes/"
    assert keys.progress("llm", "gpu-001") == "/runwarden/v1/runs/llm/progress/gpu-001"
    assert keys.progress_prefix("llm") == "/runwarden/v1/runs/llm/progress/"
    assert keys.checkpoint("llm", 1200) == "/runwarden/v1/runs/llm/checkpoints/0000000000001200"
    assert keys.stop("llm") == "/runwarden/v1/runs/llm/stop"
    assert keys.attempt("llm") == "/runwarden/v1/runs/llm/attempt"
    assert keys.spec("llm") == "/runwarden/v1/runs/llm/spec"
    assert keys.evidence("gpu-001", 7) == "/runwarden/v1/evidence/gpu-001/0000000000000007"
    assert keys.evidence_prefix() == "/runwarden/v1/evidence/"
    assert keys.evidence_prefix("gpu-001") == "/runwarden/v1/evidence/gpu-001/"
    assert keys.pool("gpu-001") == "/runwarden/v1/pool/gpu-001"
    assert keys.reputation("gpu-001") == "/runwarden/v1/reputation/gpu-001"
    assert keys.election("controller") == "/runwarden/v1/elections/controller/"


def test_configurable_root() -> None:
    keys = KeySchema("/tenant-a/rw")
    assert keys.node("n1") == "/tenant-a/rw/v1/nodes/n1"
    for bad in ("runwarden", "/", "/a/", "/a//b", "", "/a b"):
        with pytest.raises(ValueError, match="root"):
            KeySchema(bad)


def test_prefixes_do_not_capture_longer_names() -> None:
    keys = KeySchema()
    assert not keys.node("a10").startswith(keys.node("a1") + "/")
    assert keys.node("a1").startswith(keys.nodes_prefix())
    assert not keys.progress("run10", "n").startswith(keys.progress_prefix("run1"))


def test_numbers_sort_lexically_in_numeric_order() -> None:
    keys = KeySchema()
    steps = [0, 9, 10, 99, 100, 123456789]
    assert sorted(keys.checkpoint("r", s) for s in steps) == [keys.checkpoint("r", s) for s in steps]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("", "must not be empty"),
        ("a/b", "'/'"),
        ("a b", "whitespace"),
        ("tab\there", "not allowed"),
        ("nul\x00", "not allowed"),
        ("..", "must not be"),
        ("x" * (MAX_NAME_LENGTH + 1), "limit is 128"),
        (None, "must be a string"),
        (12, "must be a string"),
    ],
)
def test_bad_names_raise_clear_value_errors(name: object, message: str) -> None:
    keys = KeySchema()
    with pytest.raises(ValueError, match="node name") as caught:
        keys.node(name)  # deliberately wrong types too
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_bad_numbers() -> None:
    keys = KeySchema()
    for bad in (-1, 10**16, True, 1.5, "3"):
        with pytest.raises(ValueError, match="checkpoint step"):
            keys.checkpoint("r", bad)


def test_names_at_the_limit_and_unicode_are_fine() -> None:
    assert check_name("name", "x" * MAX_NAME_LENGTH) == "x" * MAX_NAME_LENGTH
    assert KeySchema().node("nœud-ü") == "/runwarden/v1/nodes/nœud-ü"


def test_parse_names_and_numbers_back() -> None:
    keys = KeySchema()
    assert keys.name_under(keys.nodes_prefix(), keys.node("gpu-7")) == "gpu-7"
    assert keys.number_under(keys.checkpoints_prefix("r"), keys.checkpoint("r", 42)) == 42
    with pytest.raises(ValueError):
        keys.name_under(keys.nodes_prefix(), keys.pool("gpu-7"))
    with pytest.raises(ValueError):
        keys.name_under(keys.nodes_prefix(), keys.nodes_prefix() + "a/b")
