"""The event log: durable appends, strictly increasing seq, torn tails reported and skipped."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runwarden.eventlog import (
    MAX_LINE_BYTES,
    EventLog,
    EventLogError,
    LogEntry,
    decode_line,
    encode_entry,
    parse_log_bytes,
    read_events,
    read_tail,
)
from runwarden.v1 import events_pb2


def _event(kind: int = events_pb2.EVENT_KIND_LAUNCH, step: int = 0) -> LogEntry:
    ev = LogEntry(ts=1000.0 + step, run="r", attempt=1, step=step, kind=kind, message="m")
    ev.launch.rendezvous_id = "r-1"
    ev.launch.nodes.extend(["n1", "n2"])
    return ev


def test_append_assigns_increasing_seq_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    with EventLog(path) as log:
        written = [log.append(_event(step=i)) for i in range(5)]
    assert [e.seq for e in written] == [1, 2, 3, 4, 5]
    read = read_events(path)
    assert read.torn_tail is None and read.errors == []
    assert [e.step for e in read.entries] == [0, 1, 2, 3, 4]
    assert read.entries[0].launch.nodes == ["n1", "n2"]
    # Reopening continues the sequence rather than restarting it.
    with EventLog(path) as log:
        assert log.append(_event(step=9)).seq == 6


def test_a_batch_is_one_write_and_one_fsync_and_durable_when_it_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A supervisor batch's entries (a fleet's reconcile logs thousands) cost one disk flush."""
    path = tmp_path / "events.jsonl"
    flushes: list[int] = []
    real_fsync = os.fsync
    with EventLog(path) as log:
        log.append(_event(step=0))
        monkeypatch.setattr("runwarden.eventlog.os.fsync", lambda fd: (flushes.append(fd), real_fsync(fd)))
        written = log.append_all([_event(step=i) for i in range(1, 2049)])
        assert log.append_all([]) == []
    assert len(flushes) == 1
    assert [e.seq for e in written] == list(range(2, 2050))
    assert [e.step for e in read_events(path).entries] == list(range(2049))


def test_a_failed_batch_write_leaves_none_of_its_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A short write (a full disk) is cut back off: the log holds no half batch, and the seqs the
    failed batch would have taken are the next batch's."""
    path = tmp_path / "events.jsonl"
    real_write = os.write
    with EventLog(path) as log:
        log.append(_event(step=0))
        monkeypatch.setattr(
            "runwarden.eventlog.os.write", lambda fd, data: real_write(fd, data[: len(data) // 2])
        )
        with pytest.raises(EventLogError, match="short write"):
            log.append_all([_event(step=i) for i in range(1, 50)])
        monkeypatch.undo()
        assert [e.seq for e in log.append_all([_event(step=7)])] == [2]
    read = read_events(path)
    assert read.torn_tail is None and read.errors == []
    assert [(e.seq, e.step) for e in read.entries] == [(1, 0), (2, 7)]


def test_read_tail_reads_only_the_last_bytes_and_drops_the_line_they_start_in(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    with EventLog(path) as log:
        for i in range(20):
            log.append(_event(step=i))
    size = path.stat().st_size
    line = size // 20  # every line has about the same length
    tail = read_tail(path, 3 * line + line // 2)  # three and a half lines: the half is dropped
    assert tail.errors == [] and tail.torn_tail is None
    assert [e.step for e in tail.entries] == [17, 18, 19]
    assert [e.step for e in read_tail(path, 10 * size).entries] == list(range(20))
    assert read_tail(tmp_path / "missing.jsonl", 100).entries == []


def test_torn_tail_is_reported_skipped_and_cut_on_reopen(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    with EventLog(path) as log:
        log.append(_event(step=1))
        log.append(_event(step=2))
    whole = encode_entry(_event(step=3))
    with path.open("ab") as f:
        f.write(whole[: len(whole) // 2])  # a crash mid-write
    read = read_events(path)
    assert [e.step for e in read.entries] == [1, 2]
    assert read.torn_tail is not None
    with EventLog(path) as log:
        assert log.recovered.torn_tail is not None
        log.append(_event(step=4))
    read = read_events(path)
    assert read.torn_tail is None and read.errors == []
    assert [e.step for e in read.entries] == [1, 2, 4]
    assert [e.seq for e in read.entries] == [1, 2, 3]


def test_crash_of_a_writer_process_never_merges_lines(tmp_path: Path) -> None:
    """A real writer SIGKILLed while appending: every line read back is a whole event."""
    path = tmp_path / "events.jsonl"
    code = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from runwarden.eventlog import EventLog, LogEntry
        from runwarden.v1 import events_pb2
        log = EventLog({str(path)!r})
        i = 0
        while True:
            i += 1
            log.append(LogEntry(ts=i, run="r", kind=events_pb2.EVENT_KIND_EXIT, step=i, message="x" * 500))
            if i == 50:
                os.write(1, b"ready\\n")
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"ready\n"
    proc.kill()
    proc.wait()
    read = read_events(path)
    assert read.errors == []
    assert len(read.entries) >= 50
    assert [e.seq for e in read.entries] == list(range(1, len(read.entries) + 1))


def test_bad_lines_in_the_middle_are_reported_and_reading_goes_on() -> None:
    good1 = encode_entry(LogEntry(seq=1, kind=events_pb2.EVENT_KIND_EXIT))
    good2 = encode_entry(LogEntry(seq=2, kind=events_pb2.EVENT_KIND_EXIT))
    dup = encode_entry(LogEntry(seq=2, kind=events_pb2.EVENT_KIND_EXIT))
    data = good1 + b"{not json\n" + b'{"kind": "NO_SUCH_KIND"}\n' + b"[1]\n" + good2 + dup
    read = parse_log_bytes(data)
    assert [e.seq for e in read.entries] == [1, 2]
    reasons = [e.reason for e in read.errors]
    assert any("not JSON" in r for r in reasons)
    assert any("not an Event" in r for r in reasons)
    assert any("not a JSON object" in r for r in reasons)
    # A duplicate seq at the very end is a last line that parses, so it is an error, not a torn tail.
    assert any("does not increase" in r for r in reasons)


def test_event_without_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="no kind"):
        decode_line(b'{"seq": 3}')


def test_huge_line_is_refused_with_bounded_memory() -> None:
    with pytest.raises(ValueError, match="over the"):
        decode_line(b"x" * (MAX_LINE_BYTES + 1))
    with pytest.raises(EventLogError, match="over the"):
        encode_entry(LogEntry(seq=1, kind=events_pb2.EVENT_KIND_EXIT, message="x" * MAX_LINE_BYTES))


def test_a_preflight_plan_of_16384_hosts_fits_a_line() -> None:
    """The fleet-wide entries grow with the fleet; at 16,384 hosts they must still be written."""
    plan = events_pb2.PreflightPlanDetail(
        checked=[
            events_pb2.NodeReason(node=f"n{i:05d}", reason="no passing preflight on record")
            for i in range(16384)
        ]
    )
    message = "before attempt 1: preflight " + "; ".join(f"{r.node} ({r.reason})" for r in plan.checked)
    entry = LogEntry(seq=1, kind=events_pb2.EVENT_KIND_PREFLIGHT_PLAN, message=message, preflight_plan=plan)
    assert decode_line(encode_entry(entry)) == entry


def test_unwritable_directory_gives_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises((EventLogError, OSError)):
        EventLog(blocker / "events.jsonl")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=4096))
def test_reader_never_crashes_on_arbitrary_bytes(data: bytes) -> None:
    read = parse_log_bytes(data)
    assert all(e.kind != events_pb2.EVENT_KIND_UNSPECIFIED for e in read.entries)


def test_fsync_is_called_per_append(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])
    with EventLog(tmp_path / "e.jsonl") as log:
        before = len(calls)
        log.append(_event())
        log.append(_event())
        assert len(calls) - before == 2


@pytest.mark.parametrize(
    ("line", "why"),
    [
        (b'{"seq": 1, "kind": Infinity}', "Infinity is not a value an event holds"),
        (b'{"seq": 1, "kind": NaN}', "NaN is not a value an event holds"),
        (b'{"seq": 1, "kind": 1e400}', "OverflowError"),  # found by the fuzzer: not a ParseError
        (b'{"seq": 1, "kind": "EVENT_KIND_LAUNCH", "ts": [1]}', "not an Event"),
    ],
)
def test_a_number_no_event_holds_is_a_bad_line_not_a_crash(line: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        decode_line(line)
    good = _event()
    good.seq = 2
    read = parse_log_bytes(line + b"\n" + encode_entry(good))  # a bad line before a good one
    assert len(read.entries) == 1 and len(read.errors) == 1 and read.torn_tail is None


def test_a_nan_loss_the_writer_wrote_reads_back() -> None:
    entry = LogEntry(seq=1, ts=1.0, run="r", kind=events_pb2.EVENT_KIND_LOSS_ANOMALY)
    entry.loss.points.add(rank=0, loss=float("nan"))
    back = decode_line(encode_entry(entry).rstrip(b"\n"))
    assert math.isnan(back.loss.points[0].loss)
