"""Storage checks on real paths: writable, read-only bind mount, immutable dir, file-for-dir, full tmpfs.

The tests run as root, so "unwritable" must defeat root: a read-only bind mount (EROFS), an
immutable directory (chattr +i, EPERM) and a file where a directory is expected. "Full" is a real
64 KiB tmpfs. The mount-based cases skip (with the reason) where mounting is not permitted.
"""

from __future__ import annotations

import dataclasses
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from preflight.checks.storage import check_free_space, check_throughput, check_writable, mount_of
from preflight.config import PreflightConfig, StorageConfig
from preflight.result import CheckStatus
from preflight.runner import run_preflight


def storage(**kw: object) -> StorageConfig:
    return StorageConfig(**kw)


def _mount(args: list[str]) -> None:
    proc = subprocess.run(["mount", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount here ({proc.stderr.strip()}); needs root with CAP_SYS_ADMIN")


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    target = tmp_path / "ro"
    target.mkdir()
    _mount(["--bind", "-o", "ro", str(target), str(target)])
    try:
        yield target
    finally:
        subprocess.run(["umount", str(target)], check=False)


@pytest.fixture
def full_dir(tmp_path: Path) -> Iterator[Path]:
    target = tmp_path / "full"
    target.mkdir()
    _mount(["-t", "tmpfs", "-o", "size=64k", "tmpfs", str(target)])
    try:
        yield target
    finally:
        subprocess.run(["umount", str(target)], check=False)


def test_writable_directory_passes_and_leaves_nothing(tmp_path: Path) -> None:
    result = check_writable(storage(checkpoint_path=str(tmp_path)))
    assert result.status is CheckStatus.PASS and "fsynced" in result.message
    assert list(tmp_path.iterdir()) == []


def test_read_only_bind_mount_fails(read_only_dir: Path) -> None:
    result = check_writable(storage(checkpoint_path=str(read_only_dir)))
    assert result.status is CheckStatus.FAIL and "Read-only file system" in result.message
    assert any(f"mount={read_only_dir}" in e for e in result.evidence)


def test_immutable_directory_fails_even_for_root(tmp_path: Path) -> None:
    target = tmp_path / "immutable"
    target.mkdir()
    proc = subprocess.run(["chattr", "+i", str(target)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"chattr +i not supported here: {proc.stderr.strip()}")
    try:
        result = check_writable(storage(checkpoint_path=str(target)))
    finally:
        subprocess.run(["chattr", "-i", str(target)], check=False)
    assert result.status is CheckStatus.FAIL and "not permitted" in result.message


def test_file_where_a_directory_is_expected_fails(tmp_path: Path) -> None:
    blocker = tmp_path / "ckpt"
    blocker.write_text("not a directory")
    assert check_writable(storage(checkpoint_path=str(blocker))).status is CheckStatus.FAIL
    missing = check_writable(storage(checkpoint_path=str(blocker / "below")))
    assert missing.status is CheckStatus.FAIL and "does not exist" in missing.message


def test_full_filesystem_fails_write_and_free_space(full_dir: Path) -> None:
    cfg = storage(checkpoint_path=str(full_dir), free_space_floor_gb=0.001)
    write = check_writable(cfg)
    assert write.status is CheckStatus.FAIL and "No space left" in write.message
    assert list(full_dir.iterdir()) == []  # the partial probe was removed
    free = check_free_space(cfg)
    assert free.status is CheckStatus.FAIL and free.value is not None and free.value < 0.001


def test_free_space_floor_passes_when_met(tmp_path: Path) -> None:
    free = check_free_space(storage(checkpoint_path=str(tmp_path), free_space_floor_gb=0.0))
    assert free.status is CheckStatus.PASS and free.unit == "GB"


def test_require_mount_rejects_the_root_filesystem(tmp_path: Path) -> None:
    point, _ = mount_of(str(tmp_path))
    result = check_writable(storage(checkpoint_path=str(tmp_path), require_mount=True))
    assert (result.status is CheckStatus.FAIL) == (point == "/")


def test_dataset_index_readable_empty_missing_and_bad_json(tmp_path: Path) -> None:
    def run(index: Path) -> CheckStatus:
        cfg = dataclasses.replace(PreflightConfig(), storage=storage(dataset_index=str(index)))
        [_, result] = run_preflight(cfg, "quick", only=("storage",)).results
        assert result.name == "storage.dataset_index"
        return result.status

    good = tmp_path / "index.txt"
    good.write_text("shard-00000.tar\nshard-00001.tar\n")
    assert run(good) is CheckStatus.PASS
    good_json = tmp_path / "index.json"
    good_json.write_text('["shard-0.tar", "shard-1.tar"]')
    assert run(good_json) is CheckStatus.PASS
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert run(empty) is CheckStatus.FAIL
    assert run(tmp_path / "missing.txt") is CheckStatus.FAIL
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('["shard-0.tar", ')
    assert run(bad_json) is CheckStatus.FAIL


def test_unconfigured_paths_are_skip() -> None:
    report = run_preflight(PreflightConfig(), "quick", only=("storage",))
    assert [r.status for r in report.results] == [CheckStatus.SKIP, CheckStatus.SKIP]


def test_full_mode_measures_write_and_uncached_read_speed_and_leaves_nothing(tmp_path: Path) -> None:
    cfg = dataclasses.replace(
        PreflightConfig(),
        storage=storage(checkpoint_path=str(tmp_path), free_space_floor_gb=0.0, throughput_mb=8),
    )
    quick = run_preflight(cfg, "quick", only=("storage",))
    assert "storage.throughput" not in [r.name for r in quick.results]  # per attempt: no bulk write
    full = {r.name: r for r in run_preflight(cfg, "full", only=("storage",)).results}
    t = full["storage.throughput"]
    assert t.status is CheckStatus.PASS and t.unit == "MB/s" and t.value is not None and t.value > 0
    assert (
        "8 MiB: write+fsync" in t.evidence[0]
        and "no floor set: storage.min_write_mbps = 0, storage.min_read_mbps = 0" in t.message
    )
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_path_slower_than_its_floor_fails(tmp_path: Path) -> None:
    result = check_throughput(storage(checkpoint_path=str(tmp_path), throughput_mb=4, min_read_mbps=1e12))
    assert result.status is CheckStatus.FAIL and "read" in result.message and "< 1e+12 MB/s" in result.message


def test_the_throughput_probe_on_a_full_filesystem_fails_and_cleans_up(full_dir: Path) -> None:
    result = check_throughput(storage(checkpoint_path=str(full_dir), throughput_mb=1))
    assert result.status is CheckStatus.FAIL and "No space left" in result.message
    assert list(full_dir.iterdir()) == []
