"""The Xid parser on realistic kernel-log lines, including malformed and truncated ones."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from preflight.checks.xid_check import evaluate_xids, read_file_lines, recent_xids
from preflight.result import CheckStatus
from preflight.xid import (
    MAX_RAW_CHARS,
    XidSeverity,
    kernel_timestamp,
    normalize_pci_bus_id,
    parse_xid_line,
    xid_evidence,
)
from runwarden.v1 import common_pb2

FALLEN_OFF = "[ 2371.012345] NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
SM_EXCEPTION = (
    "[ 1234.567890] NVRM: Xid (PCI:0000:18:00): 13, Graphics SM Warp Exception on "
    "(GPC 0, TPC 0, SM 0): Out Of Range Address"
)
PAGE_FAULT = (
    "[12345.000001] NVRM: Xid (PCI:0000:b3:00): 31, pid=2437, name=python3, Ch 00000008, intr 10000000. "
    "MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f20_b4000000. Fault is of type FAULT_PDE "
    "ACCESS_TYPE_VIRT_READ"
)
KMSG_DBE = (
    "4,1523,98765432100,-;NVRM: Xid (PCI:0000:1b:00): 48, pid=1234, name=python, An uncorrectable double "
    "bit error (DBE) has been detected on GPU in the framebuffer at partition 6, subpartition 0."
)
JOURNAL_CONTAINED = (
    "Dec 01 00:00:00 gpu-node-07 kernel: NVRM: Xid (PCI:0000:9b:00): 94, pid=5121, "
    "name=pt_main_thread, Contained: SM (0x1). RST: No, D-RST: No"
)
ROW_REMAP = (
    "[  500.1] NVRM: Xid (PCI:0000:9b:00): 63, pid='<unknown>', name=<unknown>, Row Remapper: New row "
    "(0x0000000000123456) Marked for Remapping, reset gpu to activate."
)


def test_fallen_off_the_bus_is_fatal_with_pci_and_timestamp() -> None:
    event = parse_xid_line(FALLEN_OFF)
    assert event is not None
    assert (event.xid, event.pci_bus_id, event.severity) == (79, "0000:3b:00", XidSeverity.FATAL)
    assert event.timestamp_s == 2371.012345
    assert event.pid is None and "fallen off the bus" in event.detail


def test_application_xids_are_application_severity() -> None:
    for line, code in ((SM_EXCEPTION, 13), (PAGE_FAULT, 31)):
        event = parse_xid_line(line)
        assert event is not None and event.xid == code and event.severity is XidSeverity.APPLICATION
    page_fault = parse_xid_line(PAGE_FAULT)
    assert page_fault is not None and page_fault.pid == 2437


def test_kmsg_record_and_journal_prefixes() -> None:
    dbe = parse_xid_line(KMSG_DBE)
    assert dbe is not None and dbe.xid == 48 and dbe.severity is XidSeverity.FATAL
    assert dbe.timestamp_s == 98765.4321  # kmsg's third field is microseconds since boot
    contained = parse_xid_line(JOURNAL_CONTAINED)
    assert contained is not None and contained.xid == 94 and contained.timestamp_s is None
    remap = parse_xid_line(ROW_REMAP.encode())
    assert remap is not None and remap.severity is XidSeverity.WARNING and remap.timestamp_s == 500.1


def test_table_covers_the_issue_codes() -> None:
    fatal = [48, 64, 74, 79, 95, 119, 120]
    for code in fatal:
        event = parse_xid_line(f"NVRM: Xid (PCI:0000:01:00): {code}, something")
        assert event is not None and event.severity is XidSeverity.FATAL, code
    for code in (13, 31, 43):
        event = parse_xid_line(f"NVRM: Xid (PCI:0000:01:00): {code}, something")
        assert event is not None and event.severity is XidSeverity.APPLICATION, code
    unknown = parse_xid_line("NVRM: Xid (PCI:0000:01:00): 999, new in some driver")
    assert (
        unknown is not None and unknown.severity is XidSeverity.WARNING and "unknown" in unknown.description
    )


def test_malformed_and_truncated_lines_are_none() -> None:
    for line in (
        "",
        "NVRM: Xid (PCI:0000:3b:00): ",
        "NVRM: Xid (PCI:0000:3b",
        "[ 12.5] NVRM: Xid (PCI:zz:zz:zz): 79, x",
        "NVRM: Xid (PCI:0000:3b:00): abc, x",
        "NVRM: Xid (PCI:0000:3b:00): 0, x",
        "NVRM: GPU at PCI:0000:3b:00: GPU-1234",
        "kernel: usb 1-1: new high-speed USB device",
        "\x00\xff\xfe garbage",
    ):
        assert parse_xid_line(line) is None, line
    assert parse_xid_line(b"\xff\xfe NVRM: Xid (PCI:0000:3b:00): 79, ok\xff") is not None


def test_long_lines_are_bounded() -> None:
    huge = FALLEN_OFF + "x" * 1_000_000
    event = parse_xid_line(huge)
    assert event is not None and len(event.raw) <= MAX_RAW_CHARS and len(event.detail) <= MAX_RAW_CHARS
    assert parse_xid_line("y" * 1_000_000 + FALLEN_OFF) is None  # past the bound: not scanned at all


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_parser_never_raises(text: str) -> None:
    for line in (text, "NVRM: Xid (PCI:0000:3b:00): " + text, "[ 1.0] " + text):
        parse_xid_line(line)
        kernel_timestamp(line)


def test_window_filter_uses_kernel_timestamps(tmp_path: object) -> None:
    lines = [
        "[ 5000.000000] NVRM: Xid (PCI:0000:3b:00): 79, old",
        "[ 9000.000000] NVRM: Xid (PCI:0000:3c:00): 48, recent",
        JOURNAL_CONTAINED,  # undated: kept
        "[ 9001.000000] some other line",
    ]
    events = recent_xids(lines, now_s=10_000.0, window_s=3600.0)
    assert [e.xid for e in events] == [48, 94]


def test_evaluate_fatal_fails_warning_warns_application_passes() -> None:
    def ev(line: str) -> list:
        event = parse_xid_line(line)
        assert event is not None
        return [event]

    assert evaluate_xids(ev(FALLEN_OFF), 3600, "kmsg").status is CheckStatus.FAIL
    assert evaluate_xids(ev(ROW_REMAP), 3600, "kmsg").status is CheckStatus.WARN
    passed = evaluate_xids(ev(SM_EXCEPTION), 3600, "kmsg")
    assert passed.status is CheckStatus.PASS and passed.evidence == (SM_EXCEPTION,)


def test_xid_check_reads_a_log_file(tmp_path: object) -> None:
    from pathlib import Path

    log = Path(str(tmp_path)) / "kern.log"
    log.write_text("\n".join([JOURNAL_CONTAINED, "noise", "NVRM: Xid (PCI:0000:3b"]) + "\n")
    assert [e.xid for e in recent_xids(read_file_lines(str(log)), now_s=0.0, window_s=1.0)] == [94]


def test_evidence_for_a_fatal_xid() -> None:
    event = parse_xid_line(FALLEN_OFF)
    assert event is not None
    evidence = xid_evidence(event, node="gpu-node-07", observed_at=1700000000.0, source="kmsg", gpu_index=3)
    assert evidence.kind == common_pb2.EVIDENCE_KIND_XID
    assert evidence.severity == common_pb2.SEVERITY_FATAL
    assert (evidence.xid, evidence.gpu_index, evidence.pci_bus_id) == (79, 3, "0000:3b:00")
    assert evidence.raw == FALLEN_OFF and evidence.source == "kmsg" and evidence.node == "gpu-node-07"


def test_pci_ids_from_nvml_and_the_driver_match() -> None:
    assert normalize_pci_bus_id("00000000:3B:00.0") == normalize_pci_bus_id("0000:3b:00") == "0000:3b:00"
