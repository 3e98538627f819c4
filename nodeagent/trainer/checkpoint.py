"""The checkpoint commit protocol: a checkpoint exists only once its commit marker does.

Layout under a root directory:

    <root>/step_000000000120/rank0.pt ...      the step's files, written and fsynced first
    <root>/step_000000000120/COMMITTED         the marker: JSON {step, files: {name: size},
                                               sha256: {name: hex}, shard_xxh3: {name: hex},
                                               meta: {...}, committed_at}

Order of obligations: write every file, fsync each, fsync the step directory; then write the
marker to a temporary name, fsync it, rename it to COMMITTED (atomic), fsync the directory.
`latest_committed(root)` returns the newest step whose marker parses and whose listed files all
exist with the recorded sizes (and, for the small files the marker hashes in `sha256`, the recorded
SHA-256), so a crash at any point leaves the previous committed step as the answer. The large files'
checksums (`shard_xxh3`: XXH3-128, at memory speed; markers written before it have `shard_sha256`,
still checked) are checked by the load that reads them (`mismatched`), not by every look at the
directory: even at memory speed, reading a model's shards costs a storage read. The same holds for a
torch.distributed.checkpoint step (nodeagent.trainer.dcp: its shards, DCP's `.metadata` and each rank's
state and shard digest files are the listed files; `.metadata` is hashed, each shard's digest recorded
by the rank that wrote it). No torch here: `nodeagent.trainer` saves and restores models on top of this.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

MARKER = "COMMITTED"
_STEP_DIR = re.compile(r"^step_(\d{12})$")
_MAX_MARKER_BYTES = 1024 * 1024
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_XXH3 = re.compile(r"^[0-9a-f]{32}$")


class CheckpointError(Exception):
    """A checkpoint could not be written or read; the message names the path."""


class CorruptCheckpoint(CheckpointError):
    """A committed step's content is not what its commit recorded (a shard's checksum differs): it
    is no resume point. Raised alike on every rank of the load."""

    def __init__(self, step: int, message: str) -> None:
        super().__init__(message)
        self.step = step


@dataclass(frozen=True, slots=True, kw_only=True)
class CommittedCheckpoint:
    step: int
    path: Path
    files: Mapping[str, int]
    committed_at: float
    meta: Mapping[str, Any]
    sha256: Mapping[str, str] = field(default_factory=dict)  # file name -> hex digest (the hashed ones)
    # file name -> the shard's XXH3-128 (hex), checked at load (`mismatched`); empty: none recorded
    shard_xxh3: Mapping[str, str] = field(default_factory=dict)
    # the same as SHA-256, as markers written before XXH3 recorded them
    shard_sha256: Mapping[str, str] = field(default_factory=dict)


def is_sha256(value: object) -> bool:
    """A SHA-256 as the markers and digest files record it: 64 lower-case hex digits."""
    return isinstance(value, str) and _SHA256.fullmatch(value) is not None


def is_xxh3(value: object) -> bool:
    """An XXH3-128 as the markers and digest files record it: 32 lower-case hex digits."""
    return isinstance(value, str) and _XXH3.fullmatch(value) is not None


def step_dir(root: Path | str, step: int) -> Path:
    if not 0 <= step < 10**12:
        raise CheckpointError(f"step {step} out of range 0..10^12")
    return Path(root) / f"step_{step:012d}"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def xxh3_file(path: Path) -> str:
    """A file's XXH3-128 (hex): a shard's checksum, at memory speed (xxhash, the [torch] extra)."""
    import xxhash

    h = xxhash.xxh3_128()
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointWriter:
    """Writes one step's files; `commit()` writes the marker last. Not committed = not there."""

    def __init__(self, root: Path | str, step: int) -> None:
        self.root = Path(root)
        self.step = step
        self.path = step_dir(root, step)
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / MARKER).unlink(missing_ok=True)  # re-saving a step un-commits it first
        fsync_dir(self.path)

    @contextmanager
    def open(self, name: str) -> Iterator[IO[bytes]]:
        """A file of this step, flushed and fsynced when the block exits without error."""
        if "/" in name or name in ("", ".", "..", MARKER) or name.startswith("."):
            raise CheckpointError(f"{self.path}: bad file name {name!r}")
        with open(self.path / name, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())

    def write_bytes(self, name: str, data: bytes) -> None:
        with self.open(name) as f:
            f.write(data)

    def commit(
        self,
        *,
        files: list[str] | None = None,
        meta: Mapping[str, Any] | None = None,
        hashed: tuple[str, ...] = (),
        shard_xxh3: Mapping[str, str] | None = None,
    ) -> CommittedCheckpoint:
        """Write the marker listing `files` (default: every file in the step dir) with sizes, and the
        SHA-256 of the `hashed` ones among them (small files a reader must trust, e.g. DCP's
        `.metadata`). `shard_xxh3`: checksums the writers computed of large files among them, which
        the load checks. `files` may name dot-files (the default listing leaves them out)."""
        fsync_dir(self.path)
        names = (
            sorted(files)
            if files is not None
            else sorted(
                p.name
                for p in self.path.iterdir()
                if p.is_file() and not p.name.startswith(".") and p.name != MARKER
            )
        )
        sizes: dict[str, int] = {}
        for name in names:
            try:
                sizes[name] = (self.path / name).stat().st_size
            except FileNotFoundError:
                raise CheckpointError(f"{self.path}: file {name!r} to commit is missing") from None
        for name in hashed:
            if name not in sizes:
                raise CheckpointError(f"{self.path}: file {name!r} to hash is not among the committed files")
        digests = {name: sha256_file(self.path / name) for name in hashed}
        shards = dict(shard_xxh3 or {})
        for name, digest in shards.items():
            if name not in sizes or not is_xxh3(digest):
                raise CheckpointError(
                    f"{self.path}: shard digest {name!r}: {digest!r} is not of a committed file"
                )
        now = time.time()
        doc: dict[str, Any] = {
            "step": self.step,
            "files": sizes,
            "committed_at": now,
            "meta": dict(meta or {}),
        }
        if digests:
            doc["sha256"] = digests
        if shards:
            doc["shard_xxh3"] = shards
        body = json.dumps(doc)
        tmp = self.path / f".{MARKER}.tmp"
        with open(tmp, "wb") as f:
            f.write(body.encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path / MARKER)
        fsync_dir(self.path)
        return CommittedCheckpoint(
            step=self.step,
            path=self.path,
            files=sizes,
            committed_at=now,
            meta=dict(meta or {}),
            sha256=digests,
            shard_xxh3=shards,
        )


def read_commit(path: Path) -> CommittedCheckpoint | None:
    """The commit of one step directory, or None if it is not (completely) committed."""
    match = _STEP_DIR.match(path.name)
    if not match:
        return None
    try:
        raw = (path / MARKER).read_bytes()[: _MAX_MARKER_BYTES + 1]
        doc = json.loads(raw)
    except (OSError, ValueError):
        return None
    if len(raw) > _MAX_MARKER_BYTES or not isinstance(doc, dict) or doc.get("step") != int(match.group(1)):
        return None
    files = doc.get("files")
    if not isinstance(files, dict) or not all(
        _plain_name(k) and isinstance(v, int) and not isinstance(v, bool) for k, v in files.items()
    ):
        return None
    digests = doc.get("sha256", {})
    shards = doc.get("shard_xxh3", {})
    old_shards = doc.get("shard_sha256", {})
    for named, valid in ((digests, is_sha256), (shards, is_xxh3), (old_shards, is_sha256)):
        if not isinstance(named, dict) or not all(k in files and valid(v) for k, v in named.items()):
            return None
    for name, size in files.items():
        try:
            if (path / name).stat().st_size != size:
                return None
        except OSError:
            return None
    for name, digest in digests.items():
        try:
            if sha256_file(path / name) != digest:
                return None
        except OSError:
            return None
    at = doc.get("committed_at")
    meta = doc.get("meta")
    return CommittedCheckpoint(
        step=doc["step"],
        path=path,
        files=files,
        committed_at=float(at) if isinstance(at, int | float) else 0.0,
        meta=meta if isinstance(meta, dict) else {},
        sha256=digests,
        shard_xxh3=shards,
        shard_sha256=old_shards,
    )


def shard_names(commit: CommittedCheckpoint) -> list[str]:
    """The shards whose checksums `commit` records (either kind)."""
    return sorted({*commit.shard_xxh3, *commit.shard_sha256})


def mismatched(commit: CommittedCheckpoint, names: list[str]) -> list[str]:
    """Those of `names` whose content is not what the commit records of it (its XXH3-128, or an
    older marker's SHA-256; a file gone or unreadable counts); a name the commit records no checksum
    of is not checked."""
    bad = []
    for name in names:
        recorded = (
            (commit.shard_xxh3[name], xxh3_file)
            if name in commit.shard_xxh3
            else (commit.shard_sha256[name], sha256_file)
            if name in commit.shard_sha256
            else None
        )
        if recorded is None:
            continue
        digest, of = recorded
        try:
            if of(commit.path / name) != digest:
                bad.append(name)
        except OSError:
            bad.append(name)
    return bad


def _plain_name(name: object) -> bool:
    """A file directly in the step directory (a marker naming ../x or a/b lists nothing of ours)."""
    return (
        isinstance(name, str) and name not in ("", ".", "..", MARKER) and "/" not in name and "\0" not in name
    )


def latest_committed(root: Path | str) -> CommittedCheckpoint | None:
    """The newest fully committed checkpoint under root, or None. Never a half-written one."""
    try:
        entries = [p for p in Path(root).iterdir() if _STEP_DIR.match(p.name)]
    except (FileNotFoundError, NotADirectoryError):
        return None
    for path in sorted(entries, key=lambda p: p.name, reverse=True):
        commit = read_commit(path)
        if commit is not None:
            return commit
    return None
