"""Storage: the checkpoint path is mounted and writable (write, fsync, read back, verify, delete a probe),
free space is above a floor, and the dataset shard index is readable."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import socket
from pathlib import Path

from preflight.checks.base import CheckContext, CheckSpec
from preflight.config import StorageConfig
from preflight.result import CheckResult, failed, passed, skipped

PROBE_BYTES = 1024 * 1024
MAX_INDEX_BYTES = 64 * 1024 * 1024  # read at most this much of the index (a bound, not a format limit)


def _unescape(field: str) -> str:
    # /proc/self/mounts escapes space, tab, newline and backslash as octal (\040 ...).
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_of(path: str) -> tuple[str, str]:
    """(mount point, filesystem type) holding `path`: the longest mount point above it in
    /proc/self/mounts (bind mounts included, which os.path.ismount cannot see); the last such line wins."""
    real = os.path.realpath(path)
    best, fstype = "/", "?"
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = _unescape(fields[1])
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, fstype = point, fields[2]
    except OSError:
        point = real
        while not os.path.ismount(point):
            point = os.path.dirname(point)
        return point, "?"
    return best, fstype


def write_probe(directory: str) -> str:
    """Writes, fsyncs, reads back, verifies and deletes a probe file; returns a one-line account.
    Raises OSError (with the step that failed in its message) or ValueError on a mismatch."""
    payload = secrets.token_bytes(PROBE_BYTES)
    probe = os.path.join(
        directory, f".preflight-probe-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    )
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the new directory entry is durable too
        finally:
            os.close(dir_fd)
        with open(probe, "rb") as fh:
            back = fh.read()
        if hashlib.sha256(back).digest() != hashlib.sha256(payload).digest():
            raise ValueError(f"read back {len(back)} bytes that differ from the {len(payload)} written")
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(probe)
    return f"wrote, fsynced, read back and deleted {PROBE_BYTES} bytes in {directory}"


def check_writable(cfg: StorageConfig) -> CheckResult:
    name = "storage.checkpoint_writable"
    path = cfg.checkpoint_path
    remedy = "fix the checkpoint mount (mounted? read-only? permissions? full?) before launching"
    if not os.path.isdir(path):
        what = "is not a directory" if os.path.exists(path) else "does not exist"
        return failed(name, f"{path} {what}", remedy=remedy)
    point, fstype = mount_of(path)
    evidence = (f"mount={point} fstype={fstype}",)
    if cfg.require_mount and point == "/":
        return failed(
            name, f"{path} is on the root filesystem, not on its own mount", evidence=evidence, remedy=remedy
        )
    try:
        account = write_probe(path)
    except OSError as exc:
        return failed(
            name, f"{path} is not writable: {exc.strerror or exc}", evidence=evidence, remedy=remedy
        )
    except ValueError as exc:
        return failed(
            name, f"{path}: {exc}", evidence=evidence, remedy="the storage returns corrupt data: escalate"
        )
    return passed(name, account, evidence=evidence)


def check_free_space(cfg: StorageConfig) -> CheckResult:
    name = "storage.free_space"
    try:
        st = os.statvfs(cfg.checkpoint_path)
    except OSError as exc:
        return failed(
            name, f"cannot stat {cfg.checkpoint_path}: {exc.strerror}", remedy="fix the checkpoint mount"
        )
    free_gb = st.f_bavail * st.f_frsize / 1e9
    kw = {
        "value": free_gb,
        "unit": "GB",
        "threshold": cfg.free_space_floor_gb,
        "evidence": (f"free={free_gb:.3f} GB total={st.f_blocks * st.f_frsize / 1e9:.3f} GB",),
    }
    if free_gb < cfg.free_space_floor_gb:
        return failed(
            name,
            f"{free_gb:.3g} GB free, below the floor {cfg.free_space_floor_gb:g} GB",
            remedy="free space or prune old checkpoints (keep the last committed one)",
            **kw,
        )
    return passed(name, f"{free_gb:.3g} GB free", **kw)


def check_dataset_index(cfg: StorageConfig) -> CheckResult:
    name = "storage.dataset_index"
    path = Path(cfg.dataset_index)
    remedy = "check the dataset mount and the index path in the run's config"
    try:
        with path.open("rb") as fh:
            data = fh.read(MAX_INDEX_BYTES)
    except OSError as exc:
        return failed(name, f"{path}: {exc.strerror or exc}", remedy=remedy)
    if not data.strip():
        return failed(name, f"{path} is empty", remedy=remedy)
    if path.suffix == ".json":
        try:
            entries = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            return failed(name, f"{path} is not valid JSON: {exc}", remedy=remedy)
        count = len(entries) if isinstance(entries, list | dict) else 1
    else:
        count = sum(1 for line in data.splitlines() if line.strip())
    return passed(name, f"{path} readable, {count} entries", value=float(count), unit="entries")


def run_storage(ctx: CheckContext) -> list[CheckResult]:
    cfg = ctx.config.storage
    results = []
    if cfg.checkpoint_path:
        results.append(check_writable(cfg))
        results.append(check_free_space(cfg))
    else:
        results.append(skipped("storage.checkpoint_writable", "no checkpoint_path configured"))
    if cfg.dataset_index:
        results.append(check_dataset_index(cfg))
    else:
        results.append(skipped("storage.dataset_index", "no dataset_index configured"))
    return results


SPEC = CheckSpec(
    name="storage",
    run=run_storage,
    timeout_s=lambda c, m: c.storage.timeout_s,
    modes=lambda c: c.storage.modes,
)
