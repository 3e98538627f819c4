"""The on-disk format of a DCP checkpoint step, read side: the names of its files, this rank's own
state file (`rank<r>.state.json`: RNG, data position, scheduler, extra) written and checked field by
field, and DCP's `.metadata` read through a restricted unpickler and checked against the commit
marker. Pure reads and checks, no collectives: `nodeagent.trainer.dcp` (save and load) and
`nodeagent.trainer.memory_state` (in-memory copies, peer loads) both build on it.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import math
import pickle
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nodeagent.trainer.checkpoint import CheckpointError, CommittedCheckpoint, is_xxh3

FORMAT = "dcp"
DCP_METADATA = ".metadata"
MAX_METADATA_BYTES = 256 * 1024 * 1024
MAX_RANK_STATE_BYTES = 64 * 1024 * 1024


def rank_state_name(rank: int) -> str:
    return f"rank{int(rank)}.state.json"


# --- this rank's own state (JSON) -------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def rng_state_json() -> dict[str, Any]:
    import torch

    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "torch": _b64(torch.get_rng_state().numpy().tobytes()),
    }
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = [_b64(s.numpy().tobytes()) for s in torch.cuda.get_rng_state_all()]
    return state


def rank_state(
    fmt: str, step: int, rank: int, world_size: int, *, scheduler: Any, data_state: Any, extra: Any
) -> dict[str, Any]:
    """A rank's own state at `step` (its RNG states now, data position, scheduler): JSON data, the
    part of a save (`fmt` "dcp") or a snapshot ("snapshot") that is this rank's alone."""
    return {
        "format": fmt,
        "step": step,
        "rank": rank,
        "world_size": world_size,
        "rng": rng_state_json(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "data_state": data_state,
        "extra": extra,
    }


def bad(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: {what}")


def _int_list(value: object, path: Path, field: str, *, length: int | None = None) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise bad(path, f"{field}: expected a list of integers")
    if length is not None and len(value) != length:
        raise bad(path, f"{field}: expected {length} integers, got {len(value)}")
    return value


def _bytes_tensor(value: object, path: Path, field: str) -> Any:
    import torch

    if not isinstance(value, str):
        raise bad(path, f"{field}: expected base64 text")
    try:
        raw = base64.b64decode(value, validate=True)
    except ValueError:
        raise bad(path, f"{field}: not base64") from None
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def rng_restorer(state: object, path: Path) -> Callable[[], None]:
    """Check every field of a saved RNG state now; the returned call sets the generators (so a bad
    file is refused before anything, model included, is loaded)."""
    import torch

    if not isinstance(state, dict) or "python" not in state or "torch" not in state:
        raise bad(path, "rng: expected an object with python and torch states")
    py = state["python"]
    if not (isinstance(py, list) and len(py) == 3 and isinstance(py[0], int)):
        raise bad(path, "rng.python: expected [version, state, gauss]")
    internal = tuple(_int_list(py[1], path, "rng.python[1]", length=625))
    gauss = py[2]
    if gauss is not None and not isinstance(gauss, float):
        raise bad(path, "rng.python[2]: expected a number or null")
    torch_state = _bytes_tensor(state["torch"], path, "rng.torch")
    numpy_state: tuple[Any, ...] | None = None
    if "numpy" in state:
        np_raw = state["numpy"]
        if not (isinstance(np_raw, list) and len(np_raw) == 5 and isinstance(np_raw[0], str)):
            raise bad(path, "rng.numpy: expected [kind, keys, pos, has_gauss, gauss]")
        keys = _int_list(np_raw[1], path, "rng.numpy[1]", length=624)
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in np_raw[2:]):
            raise bad(path, "rng.numpy: pos, has_gauss and gauss must be numbers")
        numpy_state = (np_raw[0], keys, int(np_raw[2]), int(np_raw[3]), float(np_raw[4]))
    cuda_raw = state.get("cuda", [])
    if not isinstance(cuda_raw, list):
        raise bad(path, "rng.cuda: expected a list")
    cuda = [_bytes_tensor(s, path, f"rng.cuda[{i}]") for i, s in enumerate(cuda_raw)]
    if torch_state.numel() != torch.get_rng_state().numel():
        raise bad(path, f"rng.torch: {torch_state.numel()} bytes, not a CPU generator state")

    def restore() -> None:
        random.setstate((py[0], internal, gauss))
        torch.set_rng_state(torch_state)
        if numpy_state is not None:
            try:
                import numpy as np

                kind, np_keys, pos, has_gauss, cached = numpy_state
                np.random.set_state((kind, np.array(np_keys, dtype=np.uint32), pos, has_gauss, cached))
            except ImportError:
                pass
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda)

    return restore


def _read_json(path: Path) -> Any:
    """A small JSON file of a step (a rank's state or shard digests), bounded in size."""
    try:
        size = path.stat().st_size
        if size > MAX_RANK_STATE_BYTES:
            raise bad(path, f"{size} bytes, over the limit of {MAX_RANK_STATE_BYTES}")
        return json.loads(path.read_bytes())
    except OSError as exc:
        raise bad(path, f"cannot read: {exc}") from None
    except ValueError as exc:
        raise bad(path, f"not JSON: {exc}") from None


def _read_rank_state(path: Path, step: int) -> dict[str, Any]:
    doc = _read_json(path)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("step") != step:
        raise bad(path, f"not the DCP rank state of step {step}")
    return doc


def read_rank_state(commit: CommittedCheckpoint, rank: int) -> dict[str, Any]:
    """Rank `rank`'s own state file of a committed DCP step, checked (listed, bounded, JSON, its)."""
    name = rank_state_name(rank)
    if name not in commit.files:
        saved = commit.meta.get("world_size")
        raise bad(commit.path, f"no state of rank {rank} (saved by {saved} ranks)")
    rank_state = _read_rank_state(commit.path / name, commit.step)
    if rank_state.get("rank") != rank:
        raise bad(commit.path / name, f"written by rank {rank_state.get('rank')!r}, not {rank}")
    return rank_state


def shard_digests_name(rank: int) -> str:
    """The file in which rank `rank` records the XXH3-128 of each shard file it wrote."""
    return f"rank{rank}.shards.json"


def read_shard_digests(path: Path) -> dict[str, str]:
    """One rank's shard checksum file: {file name: XXH3-128 hex}, checked (bounded, JSON, checksums).
    Only the names DCP's `.metadata` lists as shards are taken from it, and the commit marker accepts
    only committed files (nodeagent.trainer.checkpoint), so a stray name here is never trusted."""
    doc = _read_json(path)
    if not isinstance(doc, dict):
        raise bad(path, "not a JSON object of file name -> XXH3-128")
    for name, digest in doc.items():
        if not is_xxh3(digest):
            raise bad(path, f"{name}: {digest!r} is not an XXH3-128 hex digest")
    return doc


# --- reading DCP's .metadata without the standard unpickler ------------------------------------

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "pathlib": frozenset({"Path", "PosixPath", "PurePosixPath"}),
    "collections": frozenset({"OrderedDict"}),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Only the names a DCP `.metadata` pickle needs (see the module doc); anything else is refused
    before it is called."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise CheckpointError(
            f"DCP metadata refers to {module}.{name}: not a DCP metadata type of torch {torch.__version__}"
        )

    def persistent_load(self, pid: object) -> Any:
        raise CheckpointError("DCP metadata uses persistent ids: refused")


def load_metadata_pickle(raw: bytes, path: Path) -> Any:
    """DCP's Metadata from the bytes of a `.metadata` file, through the restricted unpickler."""
    try:
        return _MetadataUnpickler(io.BytesIO(raw)).load()
    except CheckpointError as exc:
        raise bad(path, str(exc)) from None
    except Exception as exc:
        raise bad(path, f"not a DCP metadata pickle: {type(exc).__name__}: {exc}") from None


def read_dcp_metadata(commit: CommittedCheckpoint) -> Any:
    """DCP's Metadata of a committed step, verified: hashed as the marker says, unpickled with the
    restricted unpickler, every shard it points into listed by the marker and long enough."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata

    path = commit.path / DCP_METADATA
    digest = commit.sha256.get(DCP_METADATA)
    if digest is None:
        raise bad(commit.path, f"the commit marker records no SHA-256 of {DCP_METADATA}: not trusted")
    size = commit.files.get(DCP_METADATA, -1)
    if not 0 < size <= MAX_METADATA_BYTES:
        raise bad(path, f"size {size} outside 1..{MAX_METADATA_BYTES}")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise bad(path, f"cannot read: {exc}") from None
    if len(raw) != size or hashlib.sha256(raw).hexdigest() != digest:
        raise bad(path, "does not match the commit marker's size and SHA-256")
    metadata = load_metadata_pickle(raw, path)
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise bad(path, "not a DCP Metadata with storage data")
    for info in metadata.storage_data.values():
        if not isinstance(info, _StorageInfo):
            raise bad(path, "storage data entry is not a _StorageInfo")
        name, offset, length = info.relative_path, info.offset, info.length
        if not isinstance(name, str) or name not in commit.files or name == DCP_METADATA:
            raise bad(path, f"points into {name!r}, which the commit marker does not list")
        if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and length >= 0):
            raise bad(path, f"bad offset/length in {name!r}")
        if offset + length > commit.files[name]:
            raise bad(path, f"{name!r}: bytes {offset}..{offset + length} past its size {commit.files[name]}")
    return metadata


def whole_tensors_bytes(metadata: Any) -> int | None:
    """The total bytes of a DCP save's tensors if every one was saved whole (one chunk at offset
    0 covering its size: state every rank holds in full, as DDP's replicas do, which DCP stores
    once), else None (sharded state: FSDP's or DTensor's pieces differ per rank)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    total = 0
    for item in metadata.state_dict_metadata.values():
        if not isinstance(item, TensorStorageMetadata):
            continue
        size = list(item.size)
        if len(item.chunks) != 1:
            return None
        (chunk,) = item.chunks
        if any(chunk.offsets) or list(chunk.sizes) != size:
            return None
        total += math.prod(size) * item.properties.dtype.itemsize
    return total
