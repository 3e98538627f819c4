"""Parse and validate PyTorch flight-recorder dumps (torch's format version 2.x).

A dump comes from a process we do not trust (a rank, a file an operator copied, the network), so
pickle dumps go through `restricted_loads` (plain data only), sizes are bounded (bytes in, entries,
tensors per entry, dims, frames, string lengths), and every field is type-checked; an unknown extra
field is ignored (torch adds fields over versions). Pickle and JSON dumps both normalise to the same
frozen `FrDump`. The node agent and the rank check dumps with it; the controller's attribution and
`controllerctl attribute` read them.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import pickletools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

DEFAULT_MAX_DUMP_BYTES = 64 * 1024 * 1024
MAX_ENTRIES = 200_000
MAX_TENSORS_PER_ENTRY = 4096
MAX_DIMS = 32
MAX_FRAMES = 512
MAX_STRING = 16 * 1024
MAX_GROUPS = 65_536
MAX_GROUP_RANKS = 1_000_000
TORCH_DEFAULT_PREFIX = "nccl_trace_rank_"

DumpFormat = Literal["json", "pickle"]


class FlightRecorderError(ValueError):
    """Base class: a dump could not be read. The message is one line and names the problem."""


class DumpTooLarge(FlightRecorderError):
    pass


class UnsafePickle(FlightRecorderError):
    """The pickle asks for a global, a call or an object build: refused, nothing was executed."""


class MalformedDump(FlightRecorderError):
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class PgInfo:
    name: str
    desc: str
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class FrFrame:
    name: str
    filename: str
    line: int


@dataclass(frozen=True, slots=True, kw_only=True)
class FrEntry:
    record_id: int
    pg_id: int
    pg_name: str
    pg_desc: str
    collective_seq_id: int
    p2p_seq_id: int
    op_id: int
    is_p2p: bool
    profiling_name: str
    input_sizes: tuple[tuple[int, ...], ...]
    input_dtypes: tuple[str, ...]
    output_sizes: tuple[tuple[int, ...], ...]
    output_dtypes: tuple[str, ...]
    state: str
    retired: bool
    timeout_ms: int
    time_created_ns: int
    frames: tuple[FrFrame, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class FrDump:
    """One rank's dump, whichever format it came in.

    JSON dumps write 0 where pickle writes None and lists where pickle writes tuples; this hides
    that. The gloo backend writes `pg_config` before Python names the group (`{'': {...}}`): such an
    unnamed, rank-less group is dropped, and `pg_config` is then empty unless the rank repaired it
    (see nodeagent/trainer/flight_recording.py).
    """

    rank: int | None
    version: str
    format: DumpFormat
    pg_config: tuple[PgInfo, ...]
    entries: tuple[FrEntry, ...]

    def group(self, name: str) -> PgInfo | None:
        for pg in self.pg_config:
            if pg.name == name:
                return pg
        return None

    @property
    def wrapped(self) -> bool:
        """True when the ring buffer dropped older records (the oldest kept record is not the first)."""
        return bool(self.entries) and min(e.record_id for e in self.entries) > 0


# --- the restricted unpickler -------------------------------------------------------------------

# Opcodes that import a name, call something, or build an object: the only ways a pickle runs code.
_FORBIDDEN_OPCODES = frozenset(
    {
        "GLOBAL", "STACK_GLOBAL", "REDUCE", "BUILD", "INST", "OBJ", "NEWOBJ", "NEWOBJ_EX",
        "PERSID", "BINPERSID", "EXT1", "EXT2", "EXT4", "READONLY_BUFFER", "NEXT_BUFFER",
        "BYTEARRAY8", "FROZENSET", "ADDITEMS", "EMPTY_SET",
    }
)  # fmt: skip


class _PlainDataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        raise UnsafePickle(f"pickle refers to {module}.{name}: only plain data is accepted")

    def persistent_load(self, pid: object) -> object:
        raise UnsafePickle("pickle uses persistent ids: only plain data is accepted")


def restricted_loads(data: bytes, *, max_bytes: int = DEFAULT_MAX_DUMP_BYTES) -> object:
    """Unpickle plain data only; raise UnsafePickle before running anything else.

    Plain data: dict, list, tuple, str, int, float, bool, None, bytes. Any opcode that names a
    global, calls a callable or builds an object is refused before unpickling starts, and
    `find_class` refuses too (two independent locks)."""
    if len(data) > max_bytes:
        raise DumpTooLarge(f"pickle is {len(data)} bytes, over the limit of {max_bytes}")
    try:
        for opcode, _arg, pos in pickletools.genops(data):
            if opcode.name in _FORBIDDEN_OPCODES:
                raise UnsafePickle(f"pickle opcode {opcode.name} at byte {pos}: only plain data is accepted")
    except UnsafePickle:
        raise
    except Exception as exc:  # pickletools raises ValueError and others on truncated or garbage input
        raise MalformedDump(f"not a valid pickle: {type(exc).__name__}: {exc}") from None
    try:
        return _PlainDataUnpickler(io.BytesIO(data)).load()
    except FlightRecorderError:
        raise
    except Exception as exc:
        raise MalformedDump(f"not a valid pickle: {type(exc).__name__}: {exc}") from None


# --- field validation ---------------------------------------------------------------------------


def _where(field: str, index: int | None) -> str:
    return field if index is None else f"entries[{index}].{field}"


def _int(value: object, field: str, index: int | None = None, *, none_is: int | None = None) -> int:
    if value is None and none_is is not None:
        return none_is
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str) and re.fullmatch(r"-?\d{1,19}", value):
            return int(value)  # JSON dumps write some counters as strings
        raise MalformedDump(f"{_where(field, index)}: expected an integer, got {type(value).__name__}")
    return value


def _str(value: object, field: str, index: int | None = None) -> str:
    if not isinstance(value, str):
        raise MalformedDump(f"{_where(field, index)}: expected a string, got {type(value).__name__}")
    if len(value) > MAX_STRING:
        raise MalformedDump(f"{_where(field, index)}: string longer than {MAX_STRING} characters")
    return value


def _bool(value: object, field: str, index: int | None = None) -> bool:
    if not isinstance(value, bool):
        raise MalformedDump(f"{_where(field, index)}: expected a boolean, got {type(value).__name__}")
    return value


def _seq(value: object, field: str, index: int | None, limit: int) -> list[object] | tuple[object, ...]:
    if not isinstance(value, list | tuple):
        raise MalformedDump(f"{_where(field, index)}: expected a list, got {type(value).__name__}")
    if len(value) > limit:
        raise MalformedDump(f"{_where(field, index)}: {len(value)} items, over the limit of {limit}")
    return value


def _sizes(value: object, field: str, index: int) -> tuple[tuple[int, ...], ...]:
    tensors = _seq(value, field, index, MAX_TENSORS_PER_ENTRY)
    return tuple(
        tuple(_int(d, field, index) for d in _seq(shape, field, index, MAX_DIMS)) for shape in tensors
    )


def _strs(value: object, field: str, index: int) -> tuple[str, ...]:
    return tuple(_str(s, field, index) for s in _seq(value, field, index, MAX_TENSORS_PER_ENTRY))


def _frames(value: object, index: int) -> tuple[FrFrame, ...]:
    frames = []
    for raw in _seq(value, "frames", index, MAX_FRAMES):
        if not isinstance(raw, Mapping):
            raise MalformedDump(f"entries[{index}].frames: expected objects")
        frames.append(
            FrFrame(
                name=_str(raw.get("name", ""), "frames.name", index),
                filename=_str(raw.get("filename", ""), "frames.filename", index),
                line=_int(raw.get("line", 0), "frames.line", index, none_is=0),
            )
        )
    return tuple(frames)


def _require(raw: Mapping[object, object], field: str, index: int | None) -> object:
    if field not in raw:
        raise MalformedDump(f"{_where(field, index)}: missing")
    return raw[field]


def _entry(raw: object, index: int, frames_seen: dict[tuple[str, str, int], FrFrame]) -> FrEntry:
    return _plain_entry(raw, frames_seen) or _checked_entry(raw, index)


_LISTS = (list, tuple)


def _plain_entry(raw: object, frames_seen: dict[tuple[str, str, int], FrFrame]) -> FrEntry | None:
    """The entry when every field it has is of the type torch writes, checked in one pass (a hang at
    16,384 ranks parses 131,072 entries; the field-by-field path cost 2.3 s of the controller's
    thread there); None sends it to `_checked_entry`, which gives the same entry or the error."""
    if type(raw) is not dict:
        return None
    get = raw.get
    pg, name, state = get("process_group"), get("profiling_name"), get("state", "")
    record_id, seq = get("record_id"), get("collective_seq_id")
    pg_id, p2p_seq, op_id = get("pg_id", 0), get("p2p_seq_id", 0), get("op_id", 0)
    timeout_ms, created = get("timeout_ms", 0), get("time_created_ns", 0)
    is_p2p, retired = get("is_p2p", False), get("retired", False)
    if not (
        isinstance(pg, _LISTS) and len(pg) == 2 and type(pg[0]) is str and type(pg[1]) is str
        and type(name) is str and type(state) is str
        and len(pg[0]) <= MAX_STRING and len(pg[1]) <= MAX_STRING
        and len(name) <= MAX_STRING and len(state) <= MAX_STRING
        and type(record_id) is int and type(seq) is int and type(pg_id) is int and type(p2p_seq) is int
        and type(op_id) is int and type(timeout_ms) is int and type(created) is int
        and type(is_p2p) is bool and type(retired) is bool
    ):  # fmt: skip
        return None
    input_sizes, output_sizes = _plain_sizes(get("input_sizes", ())), _plain_sizes(get("output_sizes", ()))
    input_dtypes, output_dtypes = _plain_strs(get("input_dtypes", ())), _plain_strs(get("output_dtypes", ()))
    frames = _plain_frames(get("frames", ()), frames_seen)
    if input_sizes is None or output_sizes is None or input_dtypes is None or output_dtypes is None:
        return None
    if frames is None:
        return None
    return FrEntry(
        record_id=record_id,
        pg_id=pg_id,
        pg_name=pg[0],
        pg_desc=pg[1],
        collective_seq_id=seq,
        p2p_seq_id=p2p_seq,
        op_id=op_id,
        is_p2p=is_p2p,
        profiling_name=name,
        input_sizes=input_sizes,
        input_dtypes=input_dtypes,
        output_sizes=output_sizes,
        output_dtypes=output_dtypes,
        state=state,
        retired=retired,
        timeout_ms=timeout_ms,
        time_created_ns=created,
        frames=frames,
    )


def _plain_sizes(value: object) -> tuple[tuple[int, ...], ...] | None:
    if not isinstance(value, _LISTS) or len(value) > MAX_TENSORS_PER_ENTRY:
        return None
    shapes = []
    for shape in value:
        if type(shape) not in _LISTS or len(shape) > MAX_DIMS:
            return None
        for d in shape:
            if type(d) is not int:
                return None
        shapes.append(tuple(shape))
    return tuple(shapes)


def _plain_strs(value: object) -> tuple[str, ...] | None:
    if not isinstance(value, _LISTS) or len(value) > MAX_TENSORS_PER_ENTRY:
        return None
    for s in value:
        if type(s) is not str or len(s) > MAX_STRING:
            return None
    return tuple(value)


def _plain_frames(value: object, seen: dict[tuple[str, str, int], FrFrame]) -> tuple[FrFrame, ...] | None:
    """The same stack repeats in entry after entry: each distinct frame is built once per dump."""
    if not isinstance(value, _LISTS) or len(value) > MAX_FRAMES:
        return None
    frames = []
    for raw in value:
        if type(raw) is not dict:
            return None
        name, filename, line = raw.get("name", ""), raw.get("filename", ""), raw.get("line", 0)
        if not (type(name) is str and type(filename) is str and type(line) is int):
            return None
        key = (name, filename, line)
        frame = seen.get(key)
        if frame is None:
            if len(name) > MAX_STRING or len(filename) > MAX_STRING:
                return None
            frame = seen[key] = FrFrame(name=name, filename=filename, line=line)
        frames.append(frame)
    return tuple(frames)


def _checked_entry(raw: object, index: int) -> FrEntry:
    """Field by field: the defaults and coercions of both formats, and an error that names the field."""
    if not isinstance(raw, Mapping):
        raise MalformedDump(f"entries[{index}]: expected an object, got {type(raw).__name__}")
    pg = _seq(_require(raw, "process_group", index), "process_group", index, 2)
    if len(pg) != 2:
        raise MalformedDump(f"entries[{index}].process_group: expected [name, desc]")
    return FrEntry(
        record_id=_int(_require(raw, "record_id", index), "record_id", index),
        pg_id=_int(raw.get("pg_id", 0), "pg_id", index, none_is=0),
        pg_name=_str(pg[0], "process_group", index),
        pg_desc=_str(pg[1], "process_group", index),
        collective_seq_id=_int(_require(raw, "collective_seq_id", index), "collective_seq_id", index),
        p2p_seq_id=_int(raw.get("p2p_seq_id", 0), "p2p_seq_id", index, none_is=0),
        op_id=_int(raw.get("op_id", 0), "op_id", index, none_is=0),
        is_p2p=_bool(raw.get("is_p2p", False), "is_p2p", index),
        profiling_name=_str(_require(raw, "profiling_name", index), "profiling_name", index),
        input_sizes=_sizes(raw.get("input_sizes", []), "input_sizes", index),
        input_dtypes=_strs(raw.get("input_dtypes", []), "input_dtypes", index),
        output_sizes=_sizes(raw.get("output_sizes", []), "output_sizes", index),
        output_dtypes=_strs(raw.get("output_dtypes", []), "output_dtypes", index),
        state=_str(raw.get("state", ""), "state", index),
        retired=_bool(raw.get("retired", False), "retired", index),
        timeout_ms=_int(raw.get("timeout_ms", 0), "timeout_ms", index, none_is=0),
        time_created_ns=_int(raw.get("time_created_ns", 0), "time_created_ns", index, none_is=0),
        frames=_frames(raw.get("frames", []), index),
    )


def parse_ranks(text: object, where: str) -> tuple[int, ...]:
    """pg_config's `ranks` is a string like '[0, 1, 2]' (a list is accepted too); never eval it."""
    if isinstance(text, list | tuple):
        items: list[object] = list(text)
    elif isinstance(text, str):
        if len(text) > 16 * MAX_GROUP_RANKS or not re.fullmatch(r"\s*\[[\d,\s]*\]\s*", text):
            raise MalformedDump(f"{where}: ranks must look like '[0, 1, 2]'")
        items = [int(t) for t in re.findall(r"\d+", text)]
    else:
        raise MalformedDump(f"{where}: ranks must be a string or a list")
    if len(items) > MAX_GROUP_RANKS:
        raise MalformedDump(f"{where}: more than {MAX_GROUP_RANKS} ranks")
    return tuple(_int(r, where) for r in items)


def _pg_config(raw: object) -> tuple[PgInfo, ...]:
    if not isinstance(raw, Mapping):
        raise MalformedDump(f"pg_config: expected an object, got {type(raw).__name__}")
    if len(raw) > MAX_GROUPS:
        raise MalformedDump(f"pg_config: more than {MAX_GROUPS} groups")
    groups = []
    for key, info in raw.items():
        where = f"pg_config[{str(key)[:64]!r}]"
        if not isinstance(info, Mapping):
            raise MalformedDump(f"{where}: expected an object")
        name = _str(info.get("name", key), f"{where}.name")
        ranks = parse_ranks(info.get("ranks", "[]"), f"{where}.ranks")
        if not name and not ranks:
            continue  # gloo's placeholder, written before Python named the group
        groups.append(PgInfo(name=name, desc=_str(info.get("desc", ""), f"{where}.desc"), ranks=ranks))
    return tuple(groups)


def dump_from_object(obj: object, *, fmt: DumpFormat, rank: int | None = None) -> FrDump:
    """Validate an already-decoded dump (a dict of plain data) and normalise it."""
    if not isinstance(obj, Mapping):
        raise MalformedDump(f"a dump is an object at the top level, got {type(obj).__name__}")
    version = _str(_require(obj, "version", None), "version")
    if not re.fullmatch(r"2\.\d+", version):
        raise MalformedDump(f"version {version[:32]!r} is not a supported flight-recorder version (2.x)")
    raw_entries = _seq(obj.get("entries", []), "entries", None, MAX_ENTRIES)
    frames_seen: dict[tuple[str, str, int], FrFrame] = {}
    entries = tuple(_entry(raw, i, frames_seen) for i, raw in enumerate(raw_entries))
    return FrDump(
        rank=rank,
        version=version,
        format=fmt,
        pg_config=_pg_config(obj.get("pg_config", {})),
        entries=tuple(sorted(entries, key=lambda e: e.record_id)),
    )


def sniff_format(data: bytes) -> DumpFormat:
    if data[:1] == b"\x80":
        return "pickle"
    if data.lstrip()[:1] == b"{":
        return "json"
    raise MalformedDump("neither a JSON object nor a pickle (protocol 2+)")


def parse_dump(data: bytes, *, rank: int | None = None, max_bytes: int = DEFAULT_MAX_DUMP_BYTES) -> FrDump:
    """Parse a JSON or pickle dump (format sniffed from the first byte)."""
    if len(data) > max_bytes:
        raise DumpTooLarge(f"dump is {len(data)} bytes, over the limit of {max_bytes}")
    if not data:
        raise MalformedDump("empty dump")
    fmt = sniff_format(data)
    if fmt == "pickle":
        return dump_from_object(restricted_loads(data, max_bytes=max_bytes), fmt=fmt, rank=rank)
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise MalformedDump(f"not valid JSON: {str(exc)[:200]}") from None
    return dump_from_object(obj, fmt="json", rank=rank)


def read_dump_file(path: Path, *, rank: int | None = None, max_bytes: int = DEFAULT_MAX_DUMP_BYTES) -> FrDump:
    """Read one dump file, never more than max_bytes + 1 bytes of it."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:
                raise DumpTooLarge(f"{path.name} is {size} bytes, over the limit of {max_bytes}")
            data = f.read(max_bytes + 1)
    except OSError as exc:
        raise FlightRecorderError(f"cannot read {path}: {exc.strerror or exc}") from None
    return parse_dump(data, rank=rank, max_bytes=max_bytes)


@dataclass(frozen=True, slots=True, kw_only=True)
class DumpDirRead:
    dumps: Mapping[int, FrDump]
    errors: Mapping[int, str]  # rank -> why its file could not be read (a suspect, like a missing dump)


def read_dump_dir(
    directory: Path, *, prefix: str = TORCH_DEFAULT_PREFIX, max_bytes: int = DEFAULT_MAX_DUMP_BYTES
) -> DumpDirRead:
    """Read every `<prefix><rank>` file in a directory (no recursion). Bad files become errors."""
    pattern = re.compile(re.escape(prefix) + r"(\d{1,9})(?:\.json|\.pkl|\.pickle)?")
    dumps: dict[int, FrDump] = {}
    errors: dict[int, str] = {}
    for path in sorted(directory.iterdir()):
        match = pattern.fullmatch(path.name)
        if not match or not path.is_file():
            continue
        rank = int(match.group(1))
        if rank in dumps or rank in errors:
            errors[rank] = f"more than one dump file for rank {rank}"
            dumps.pop(rank, None)
            continue
        try:
            dumps[rank] = read_dump_file(path, rank=rank, max_bytes=max_bytes)
        except FlightRecorderError as exc:
            errors[rank] = str(exc)
    return DumpDirRead(dumps=dumps, errors=errors)
