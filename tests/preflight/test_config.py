"""Config: documented defaults equal the dataclasses, unknown keys and bad values are errors."""

from __future__ import annotations

from pathlib import Path

import pytest

import preflight
from preflight.config import ConfigError, PreflightConfig, config_to_toml, load_config

DEFAULTS = Path(preflight.__file__).parent / "defaults.toml"


def test_defaults_file_equals_the_dataclass_defaults() -> None:
    assert load_config(DEFAULTS) == PreflightConfig()


def test_toml_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(config_to_toml(PreflightConfig(), "header\nline two"))
    assert load_config(path) == PreflightConfig()


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[inventory]\nexpected_gpus = 8\n", "unknown key(s) expected_gpus"),
        ("[inventroy]\nexpected_gpu_count = 8\n", "unknown section(s) [inventroy]"),
        ("[inventory]\nexpected_gpu_count = '8'\n", "expected an integer"),
        ("[inventory]\nexpected_gpu_count = -1\n", "must not be negative"),
        ("[inventory]\nmig_mode = 'maybe'\n", "not one of on, off, any"),
        ("[compute]\nmodes = ['fast']\n", "may contain only quick, full"),
        ("[errors]\nfail_throttle_reasons = ['hw_slow']\n", "unknown reason(s) hw_slow"),
        ("[storage]\nrequire_mount = 1\n", "expected true/false"),
        ("[run]\nquick_budget_s = 0\n", "budgets must be positive"),
        ("[run\n", "not valid TOML"),
    ],
)
def test_bad_config_names_file_and_key(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert words in str(info.value) and str(path) in str(info.value)


def test_partial_config_keeps_other_defaults(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[compute]\ntflops_floor = 600\n[storage]\ncheckpoint_path = '/ckpt'\n")
    config = load_config(path)
    assert config.compute.tflops_floor == 600.0 and config.storage.checkpoint_path == "/ckpt"
    assert config.compute.size_full == PreflightConfig().compute.size_full


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        load_config(tmp_path / "absent.toml")


def _float_keys() -> list[tuple[str, str]]:
    import dataclasses

    return [
        (section.name, key.name)
        for section in dataclasses.fields(PreflightConfig)
        for key in dataclasses.fields(getattr(PreflightConfig(), section.name))
        if key.type in ("float", float)
    ]


@pytest.mark.parametrize(("section", "key"), _float_keys())
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_numbers_are_refused_with_the_key_named(
    tmp_path: Path, section: str, key: str, value: str
) -> None:
    """TOML has nan and inf: a budget of inf never runs out, a floor of nan never fails."""
    path = tmp_path / "c.toml"
    path.write_text(f"[{section}]\n{key} = {value}\n")
    with pytest.raises(ConfigError, match=rf"\[{section}\]\.{key}: must be a finite number"):
        load_config(path)


def test_every_section_has_float_keys_checked() -> None:
    keys = _float_keys()
    assert ("run", "quick_budget_s") in keys and ("burn_in", "allreduce_min_ratio") in keys and len(keys) > 20
