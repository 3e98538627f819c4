"""Storage: the checkpoint path is mounted and writable (write, fsync, read back, verify, delete a probe),
free space is above a floor, the dataset shard index is readable, and (full mode) how fast the
checkpoint path writes and reads: a checkpoint load that crawls stalls every restart (the OPT-175B
team's hanging downloads), so the read speed is measured, not assumed."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from preflight.checks.base import CheckContext, CheckSpec
from preflight.checks.expectations import no_floor
from preflight.config import StorageConfig
from preflight.result import CheckResult, CheckStatus, failed, passed, skipped

PROBE_BYTES = 1024 * 1024
CHUNK_BYTES = 4 * 1024 * 1024
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
    note = "" if cfg.free_space_floor_gb else no_floor("storage.free_space_floor_gb")
    return passed(name, f"{free_gb:.3g} GB free{note}", **kw)


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


@dataclass(frozen=True, slots=True, kw_only=True)
class Throughput:
    size_mb: float
    write_mbps: float  # write + fsync of the file
    read_mbps: float  # read back after its pages were dropped from the page cache
    uncached: bool  # whether the kernel accepted the drop (posix_fadvise DONTNEED)


def measure_throughput(directory: str, size_mb: int) -> Throughput:
    """Writes `size_mb` MiB of random-looking data, fsyncs it, drops its pages from the page cache,
    reads it back and verifies it. Raises OSError, or ValueError on a mismatch."""
    chunk = secrets.token_bytes(CHUNK_BYTES)
    total = size_mb * 1024 * 1024
    probe = os.path.join(
        directory, f".preflight-throughput-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    )
    try:
        t0 = time.perf_counter()
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            written = 0
            while written < total:
                view = memoryview(chunk)[: total - written]
                while view:
                    n = os.write(fd, view)
                    written += n
                    view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        write_s = time.perf_counter() - t0
        fd = os.open(probe, os.O_RDONLY)
        try:
            uncached = True
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                uncached = False  # this filesystem would not say; the read may be from memory
            t1 = time.perf_counter()
            read, want = 0, hashlib.sha256(chunk).digest()
            while read < total:
                block = os.read(fd, min(CHUNK_BYTES, total - read))
                if not block:
                    break
                if len(block) == CHUNK_BYTES and hashlib.sha256(block).digest() != want:
                    raise ValueError(f"read back different bytes at offset {read}")
                read += len(block)
            read_s = time.perf_counter() - t1
        finally:
            os.close(fd)
        if read != total:
            raise ValueError(f"read back {read} bytes of the {total} written")
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(probe)
    mb = total / 1e6
    return Throughput(
        size_mb=size_mb,
        write_mbps=mb / max(write_s, 1e-9),
        read_mbps=mb / max(read_s, 1e-9),
        uncached=uncached,
    )


def check_throughput(cfg: StorageConfig) -> CheckResult:
    name = "storage.throughput"
    remedy = "a slow checkpoint path stalls every save and restart: check the mount, the network, its load"
    try:
        t = measure_throughput(cfg.checkpoint_path, cfg.throughput_mb)
    except OSError as exc:
        return failed(
            name, f"{cfg.checkpoint_path}: throughput probe failed: {exc.strerror or exc}", remedy=remedy
        )
    except ValueError as exc:
        return failed(
            name, f"{cfg.checkpoint_path}: {exc}", remedy="the storage returns corrupt data: escalate"
        )
    evidence = (
        f"{t.size_mb:g} MiB: write+fsync {t.write_mbps:.0f} MB/s, read {t.read_mbps:.0f} MB/s"
        + ("" if t.uncached else " (page cache not dropped: the read may be from memory)"),
    )
    slow = [
        f"{what} {got:.0f} MB/s < {floor:g} MB/s"
        for what, got, floor in (
            ("write", t.write_mbps, cfg.min_write_mbps),
            ("read", t.read_mbps, cfg.min_read_mbps),
        )
        if floor and got < floor
    ]
    if slow:
        return failed(
            name,
            f"{cfg.checkpoint_path}: {'; '.join(slow)}",
            evidence=evidence,
            value=t.read_mbps,
            unit="MB/s",
            threshold=cfg.min_read_mbps or cfg.min_write_mbps,
            remedy=remedy,
        )
    unset_keys = [f"storage.{k}" for k in ("min_write_mbps", "min_read_mbps") if not getattr(cfg, k)]
    unset = no_floor(*unset_keys) if unset_keys else ""
    return passed(
        name,
        f"write {t.write_mbps:.0f} MB/s, read {t.read_mbps:.0f} MB/s{unset}",
        evidence=evidence,
        value=t.read_mbps,
        unit="MB/s",
    )


def run_storage(ctx: CheckContext) -> list[CheckResult]:
    cfg = ctx.config.storage
    results = []
    if cfg.checkpoint_path:
        results.append(check_writable(cfg))
        results.append(check_free_space(cfg))
        if ctx.mode == "full" and cfg.throughput_mb > 0 and results[0].status is not CheckStatus.FAIL:
            results.append(check_throughput(cfg))
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
