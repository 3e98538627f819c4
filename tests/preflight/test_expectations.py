"""The report's list of expected values and floors: what was checked against what, and what was not."""

from __future__ import annotations

import dataclasses

from preflight.checks.expectations import EXPECTED, expectations_result, no_floor
from preflight.config import PreflightConfig
from preflight.result import CheckStatus
from preflight.runner import run_preflight


def _all_set() -> PreflightConfig:
    c = PreflightConfig()
    return dataclasses.replace(
        c,
        inventory=dataclasses.replace(
            c.inventory, expected_gpu_count=8, driver_version="550.127.05", cuda_version="12.4"
        ),
        storage=dataclasses.replace(
            c.storage, checkpoint_path="/ckpt", min_write_mbps=500, min_read_mbps=900
        ),
        compute=dataclasses.replace(c.compute, tflops_floor=600.0),
        collective=dataclasses.replace(c.collective, busbw_floor_gbps=300.0),
        network=dataclasses.replace(c.network, min_speed_mbps=400_000, expected_nic_count=9),
    )


def test_the_defaults_leave_every_expected_value_unset_and_the_report_says_so() -> None:
    report = run_preflight(PreflightConfig(), "quick", only=["expectations"])
    (r,) = report.results
    assert r.name == "preflight.expected_values" and r.status is CheckStatus.SKIP
    assert r.value == len(EXPECTED)
    assert "compute.tflops_floor" in r.message and "network.expected_nic_count" in r.message
    assert (
        "`preflight baseline` on a known-good node measures compute.tflops_floor, collective.busbw_floor_gbps"
        in r.message
    )
    assert "compute.tflops_floor = 0.0 (unset: not checked)" in r.evidence
    assert "preflight.expected_values" in report.render_table()


def test_every_value_set_passes_and_says_where_each_came_from() -> None:
    r = expectations_result(_all_set(), {"inventory.expected_gpu_count": "agent config local_ranks"})
    assert r.status is CheckStatus.PASS
    assert "inventory.expected_gpu_count = 8 (agent config local_ranks)" in r.evidence
    assert "compute.tflops_floor = 600.0 (preflight config)" in r.evidence
    assert len(r.evidence) == len(EXPECTED)


def test_one_unset_floor_is_named_alone() -> None:
    c = _all_set()
    c = dataclasses.replace(c, storage=dataclasses.replace(c.storage, min_read_mbps=0.0))
    r = expectations_result(c, {})
    assert r.status is CheckStatus.SKIP and r.message == (
        f"1 of {len(EXPECTED)} not set, so not checked: storage.min_read_mbps"
    )


def test_the_words_for_an_unset_floor_are_one_phrase() -> None:
    assert no_floor("compute.tflops_floor") == " (no floor set: compute.tflops_floor = 0; not checked)"
    assert no_floor("a", "b") == " (no floor set: a = 0, b = 0; not checked)"
