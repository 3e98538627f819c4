"""runwarden.flightrec: the restricted unpickler, validation, bounds, and normalisation of both formats."""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path

import pytest

from runwarden.flightrec import (
    DumpTooLarge,
    FlightRecorderError,
    MalformedDump,
    UnsafePickle,
    _PlainDataUnpickler,
    parse_dump,
    read_dump_dir,
    read_dump_file,
    restricted_loads,
)

ENTRY = {
    "record_id": 0, "pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": 1, "p2p_seq_id": 0,
    "op_id": 1, "is_p2p": False, "profiling_name": "gloo:all_reduce", "input_sizes": [[8]],
    "input_dtypes": ["Float"], "output_sizes": [[8]], "output_dtypes": ["Float"], "state": "scheduled",
    "retired": True, "timeout_ms": 2000, "time_created_ns": 1, "time_discovered_started_ns": 0,
}  # fmt: skip
DUMP = {
    "version": "2.10",
    "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
    "pg_status": {"0": {"last_enqueued_collective": "1"}},
    "entries": [ENTRY],
}


class _RunsACommand:
    """What an attacker pickles: unpickling it would run `touch <marker>`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("protocol", [0, 2, pickle.HIGHEST_PROTOCOL])
def test_malicious_pickle_is_refused_and_its_command_never_runs(tmp_path: Path, protocol: int) -> None:
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"version": "2.10", "entries": [_RunsACommand(marker)]}, protocol=protocol)
    with pytest.raises(UnsafePickle, match=r"REDUCE|GLOBAL"):
        restricted_loads(payload)
    with pytest.raises(FlightRecorderError):  # protocol 0 is not even sniffed as a pickle
        parse_dump(payload)
    dump_file = tmp_path / "nccl_trace_rank_0"
    dump_file.write_bytes(payload)
    read = read_dump_dir(tmp_path)
    assert not read.dumps and 0 in read.errors
    assert not marker.exists()


def test_second_lock_find_class_refuses_even_without_the_opcode_scan(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_RunsACommand(marker), protocol=pickle.HIGHEST_PROTOCOL)
    with pytest.raises(UnsafePickle, match=r"posix\.system|os\.system"):
        _PlainDataUnpickler(io.BytesIO(payload)).load()
    assert not marker.exists()


def test_plain_data_pickle_loads() -> None:
    value = {"a": [1, 2.5, None, True], "b": (b"raw", "s"), "c": {"n": -(2**70)}}
    assert restricted_loads(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)) == value


def test_json_and_pickle_normalise_to_the_same_dump() -> None:
    as_pickle = {
        **DUMP,
        "entries": [{**ENTRY, "process_group": ("0", "default_pg"), "time_discovered_started_ns": None}],
    }
    from_json = parse_dump(json.dumps(DUMP).encode(), rank=1)
    from_pickle = parse_dump(pickle.dumps(as_pickle, protocol=pickle.HIGHEST_PROTOCOL), rank=1)
    assert from_json.format == "json" and from_pickle.format == "pickle"
    assert from_json.entries == from_pickle.entries and from_json.pg_config == from_pickle.pg_config
    entry = from_json.entries[0]
    assert (entry.pg_name, entry.pg_desc, entry.collective_seq_id, entry.input_sizes) == (
        "0",
        "default_pg",
        1,
        ((8,),),
    )
    assert from_json.group("0") is not None and from_json.group("0").ranks == (0, 1)
    assert not from_json.wrapped


def test_gloo_placeholder_pg_config_is_dropped() -> None:
    dump = parse_dump(
        json.dumps({**DUMP, "pg_config": {"": {"name": "", "desc": "", "ranks": "[]"}}}).encode()
    )
    assert dump.pg_config == ()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("version"), "version: missing"),
        (lambda d: d.update(version="3.0"), "not a supported"),
        (lambda d: d.update(entries="nope"), "entries: expected a list"),
        (lambda d: d["entries"][0].pop("collective_seq_id"), r"entries\[0\].collective_seq_id: missing"),
        (lambda d: d["entries"][0].update(collective_seq_id="x1"), "expected an integer"),
        (lambda d: d["entries"][0].update(is_p2p="yes"), "expected a boolean"),
        (lambda d: d["entries"][0].update(input_sizes=[[1] * 100]), "over the limit"),
        (lambda d: d["entries"][0].update(process_group=["0"]), r"expected \[name, desc\]"),
        (lambda d: d["entries"][0].update(profiling_name="x" * 20_000), "longer than"),
        (lambda d: d["pg_config"]["0"].update(ranks="__import__('os').system('x')"), "ranks must look like"),
    ],
)
def test_bad_fields_are_refused_with_the_field_named(mutate: object, message: str) -> None:
    dump = json.loads(json.dumps(DUMP))
    mutate(dump)
    with pytest.raises(MalformedDump, match=message):
        parse_dump(json.dumps(dump).encode())


def test_truncated_garbage_and_deeply_nested_dumps_are_malformed() -> None:
    good = pickle.dumps(DUMP, protocol=pickle.HIGHEST_PROTOCOL)
    for data in (
        good[: len(good) // 2],
        good[:-1],
        b"\x80\x05garbage",
        json.dumps(DUMP).encode()[:-5],
        b"hello",
        b"",
    ):
        with pytest.raises(MalformedDump):
            parse_dump(data)
    with pytest.raises(MalformedDump, match="not valid JSON"):
        parse_dump(b"{" + b'"a":[' * 100_000)
    nested = b"\x80\x04" + b"]" * 200_000 + b"."  # only EMPTY_LIST: valid opcodes, not a dump
    with pytest.raises(MalformedDump):
        parse_dump(nested)


def test_self_referencing_pickle_is_refused_not_looped() -> None:
    sizes: list[object] = []
    sizes.append(sizes)
    dump = {**DUMP, "entries": [{**ENTRY, "input_sizes": sizes}]}
    with pytest.raises(MalformedDump, match="input_sizes"):
        parse_dump(pickle.dumps(dump, protocol=pickle.HIGHEST_PROTOCOL))


def test_huge_dumps_are_refused_before_reading(tmp_path: Path) -> None:
    with pytest.raises(DumpTooLarge):
        parse_dump(b"{" + b" " * 2000, max_bytes=1000)
    huge = tmp_path / "nccl_trace_rank_3"
    with open(huge, "wb") as f:
        f.truncate(200 * 1024 * 1024)  # sparse: costs nothing, and must not be read
    with pytest.raises(DumpTooLarge, match="over the limit"):
        read_dump_file(huge)
    many = {**DUMP, "entries": [ENTRY] * 300_000}
    with pytest.raises(MalformedDump, match="entries: 300000 items"):
        parse_dump(pickle.dumps(many, protocol=pickle.HIGHEST_PROTOCOL))


def test_read_dump_dir_matches_prefix_and_rank_and_reports_bad_files(tmp_path: Path) -> None:
    (tmp_path / "nccl_trace_rank_0").write_text(json.dumps(DUMP))
    (tmp_path / "nccl_trace_rank_1.pkl").write_bytes(pickle.dumps(DUMP, protocol=pickle.HIGHEST_PROTOCOL))
    (tmp_path / "nccl_trace_rank_2").write_bytes(b"\x80garbage")
    (tmp_path / "other_5").write_text(json.dumps(DUMP))
    (tmp_path / "nccl_trace_rank_x").write_text("ignored")
    read = read_dump_dir(tmp_path)
    assert sorted(read.dumps) == [0, 1] and read.dumps[1].rank == 1
    assert list(read.errors) == [2] and "pickle" in read.errors[2]
    assert sorted(read_dump_dir(tmp_path, prefix="other_").dumps) == [5]
