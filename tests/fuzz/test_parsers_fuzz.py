"""Hostile input to the parsers that read what GPUs, tools and other processes wrote: the DCGM
diagnostic parser, the Xid parser (bytes and huge lines), the flight-recorder loader (JSON, pickle,
garbage, deep nesting, huge input) and the event-log reader (structured lines, huge lines, deep
nesting). Each returns a result or raises its own clear error type; none crashes, hangs or reads
an unbounded amount."""

from __future__ import annotations

import contextlib
import json
import pickle
import resource
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from preflight.checks.dcgm import parse_dcgm_diag
from preflight.xid import MAX_RAW_CHARS, parse_xid_line
from runwarden.eventlog import parse_log_bytes
from runwarden.flightrec import FlightRecorderError, _checked_entry, _plain_entry, parse_dump

FUZZ = settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=20)
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=12), kids, max_size=4)
    ),
    max_leaves=30,
)


def _dcgm_doc() -> st.SearchStrategy[object]:
    test = st.fixed_dictionaries(
        {},
        optional={
            "name": JSON_VALUES,
            "results": st.lists(
                st.dictionaries(
                    st.sampled_from(["gpu_id", "status", "info", "warnings", "entity_id"]),
                    JSON_VALUES,
                    max_size=4,
                ),
                max_size=3,
            ),
            "status": JSON_VALUES,
        },
    )
    category = st.fixed_dictionaries(
        {}, optional={"category": JSON_VALUES, "tests": st.one_of(st.lists(test, max_size=3), JSON_VALUES)}
    )
    return st.fixed_dictionaries(
        {
            "DCGM GPU Diagnostic": st.fixed_dictionaries(
                {"test_categories": st.one_of(st.lists(category, max_size=3), JSON_VALUES)}
            )
        }
    )


@FUZZ
@given(doc=st.one_of(_dcgm_doc(), JSON_VALUES), rc=st.integers(-1, 255))
def test_dcgm_parser_random_documents(doc: object, rc: int) -> None:
    results = parse_dcgm_diag(json.dumps(doc), rc)
    assert results, "always at least one result"
    if rc != 0:
        assert any(r.status.name == "FAIL" for r in results)


@FUZZ
@given(text=st.text(max_size=500), rc=st.integers(0, 3))
def test_dcgm_parser_random_text(text: str, rc: int) -> None:
    assert parse_dcgm_diag(text, rc)


def test_dcgm_parser_huge_and_deeply_nested_output() -> None:
    for text in ("[" * 200_000, '{"a":' * 100_000, "x" * (8 << 20)):
        t0 = time.monotonic()
        results = parse_dcgm_diag(text, 1)
        assert results and results[0].status.name == "FAIL"
        assert len(results[0].message) < 2000, "the message does not carry the whole input"
        assert time.monotonic() - t0 < 10


@FUZZ
@given(
    line=st.one_of(
        st.binary(max_size=600), st.text(max_size=600).map(lambda t: "NVRM: Xid (PCI:0000:3b:00): " + t)
    )
)
def test_xid_parser_random_bytes_and_prefixed_text(line: bytes | str) -> None:
    ev = parse_xid_line(line)
    assert ev is None or len(ev.raw) <= MAX_RAW_CHARS


def test_xid_parser_huge_line_is_bounded() -> None:
    t0 = time.monotonic()
    parse_xid_line("NVRM: Xid (PCI:0000:3b:00): " + "9" * (16 << 20))  # a huge number: no hang
    ev = parse_xid_line("NVRM: Xid (PCI:0000:3b:00): 79, pid=1, " + "y" * (16 << 20))
    assert ev is not None and ev.xid == 79 and len(ev.raw) <= MAX_RAW_CHARS
    assert time.monotonic() - t0 < 10


def _plain_pickles() -> st.SearchStrategy[bytes]:
    return st.tuples(JSON_VALUES, st.integers(2, pickle.HIGHEST_PROTOCOL)).map(
        lambda v: pickle.dumps(v[0], v[1])
    )


def _entry_like() -> st.SearchStrategy[dict[str, object]]:
    return st.dictionaries(
        st.sampled_from(
            [
                "record_id",
                "pg_id",
                "process_group",
                "collective_seq_id",
                "p2p_seq_id",
                "op_id",
                "profiling_name",
                "time_created_ns",
                "state",
                "input_sizes",
                "output_sizes",
                "frames",
                "timeout_ms",
                "is_p2p",
                "time_discovered_started_ns",
                "time_discovered_completed_ns",
                "retired",
            ]
        ),
        JSON_VALUES,
        max_size=10,
    )


def _dump_like() -> st.SearchStrategy[object]:
    entry = _entry_like()
    return st.fixed_dictionaries(
        {"version": JSON_VALUES},
        optional={
            "entries": st.one_of(st.lists(entry, max_size=4), JSON_VALUES),
            "pg_config": JSON_VALUES,
            "rank": JSON_VALUES,
            "pg_status": JSON_VALUES,
        },
    )


@FUZZ
@given(
    data=st.one_of(
        st.binary(max_size=300),
        st.binary(max_size=300).map(lambda b: b"\x80" + b),
        _plain_pickles(),
        _dump_like().map(lambda d: json.dumps(d).encode()),
        st.tuples(_dump_like(), st.integers(2, 5)).map(lambda v: pickle.dumps(v[0], v[1])),
    )
)
def test_flight_recorder_loader_random_input(data: bytes) -> None:
    try:
        parse_dump(data)
    except FlightRecorderError as exc:
        assert str(exc) and "\n" not in str(exc)[:300]


_PLAIN_ENTRY = {
    "record_id": st.integers(-(2**70), 2**70), "pg_id": st.integers(0, 9), "collective_seq_id": st.integers(0, 99),
    "process_group": st.lists(st.text(max_size=3), min_size=1, max_size=3), "profiling_name": st.text(max_size=5),
    "input_sizes": st.lists(st.lists(st.integers(0, 9), max_size=3), max_size=2), "is_p2p": st.booleans(),
    "input_dtypes": st.lists(st.text(max_size=3), max_size=2), "timeout_ms": st.none() | st.integers(0, 9),
    "frames": st.lists(st.fixed_dictionaries({}, optional={"name": st.text(max_size=3), "line": st.integers(0, 9)}),
                       max_size=2),
}  # fmt: skip


@FUZZ
@given(
    raw=st.one_of(
        _entry_like(),
        st.fixed_dictionaries({}, optional=_PLAIN_ENTRY),  # mostly well-typed: the one-pass path's ground
        st.tuples(st.fixed_dictionaries({}, optional=_PLAIN_ENTRY), _entry_like()).map(
            lambda t: {**t[0], **t[1]}
        ),
    )
)
def test_the_one_pass_entry_check_gives_the_field_by_field_entry_or_steps_aside(
    raw: dict[str, object],
) -> None:
    """`_plain_entry` is the fast path of `_checked_entry`: the same entry, or None (never an entry
    that the field-by-field path would refuse or build differently)."""
    fast = _plain_entry(raw, {})
    try:
        checked = _checked_entry(raw, 0)
    except FlightRecorderError:
        assert fast is None
        return
    assert fast is None or fast == checked


def test_flight_recorder_loader_huge_and_nested_input_bounded() -> None:
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for data, limit in (
        (b"{" + b" " * (64 << 20), 1 << 20),
        (b'{"entries":' + b"[" * 500_000, 16 << 20),
        (b"\x80\x04" + b"(" * 1_000_000, 16 << 20),
        (pickle.dumps([[]] * 2_000_000, 4), 1 << 20),
    ):
        t0 = time.monotonic()
        with contextlib.suppress(FlightRecorderError):
            parse_dump(data, max_bytes=limit)
        assert time.monotonic() - t0 < 10
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    assert grown_mib < 600, f"parsing grew the peak RSS by {grown_mib:.0f} MiB"


EVENT_LINE = st.fixed_dictionaries(
    {},
    optional={
        "seq": st.one_of(st.integers(-5, 2**64), st.text(max_size=5)),
        "kind": st.one_of(st.integers(-1, 40), JSON_VALUES),
        "run": JSON_VALUES,
        "ts": JSON_VALUES,
        "attempt": JSON_VALUES,
        "message": JSON_VALUES,
        "launch": st.one_of(
            st.dictionaries(st.sampled_from(["nodes", "resumeStep", "rendezvousId"]), JSON_VALUES),
            JSON_VALUES,
        ),
        "detection": JSON_VALUES,
        "bogus": JSON_VALUES,
    },
)


@FUZZ
@given(
    lines=st.lists(EVENT_LINE.map(lambda d: json.dumps(d).encode()), max_size=6), tail=st.binary(max_size=40)
)
def test_event_log_reader_random_structured_lines(lines: list[bytes], tail: bytes) -> None:
    read = parse_log_bytes(b"\n".join(lines) + b"\n" + tail)
    assert len(read.entries) + len(read.errors) <= len(lines) + 2


def test_event_log_reader_huge_and_nested_lines() -> None:
    ok = b'{"seq":"1","kind":"EVENT_KIND_RUN_START","run":"r","ts":1.0}\n'
    data = (
        ok
        + b'{"message":"'
        + b"m" * (4 << 20)
        + b'"}\n'
        + b'{"launch":' * 200_000
        + b"\n"
        + ok.replace(b'"1"', b'"2"')
    )
    t0 = time.monotonic()
    read = parse_log_bytes(data)
    assert [e.seq for e in read.entries] == [1, 2]
    assert len(read.errors) == 2 and all(len(str(e)) < 2000 for e in read.errors)
    assert time.monotonic() - t0 < 10
