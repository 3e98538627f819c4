"""Live Xid evidence names the GPU (issue 28): the NVRM line's PCI bus id -> NVML's index -> the local
rank on it -> the global rank. NVML is faked at its boundary (tests/preflight/fake_nvml.py); the
kernel log is real: a test writes an NVRM line into /dev/kmsg and the agent's follower must turn
it into evidence within a second.

The written line is an application-class Xid (13) on a bus id no GPU here has: a fatal Xid in this
host's kernel log would fail every preflight's Xid check on it for the check's window."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nodeagent.daemon.monitors import GpuMap, XidMonitor
from preflight.nvml import GpuProcess, NvmlUnavailable
from runwarden.v1 import common_pb2
from tests.preflight.fake_nvml import FakeNvml

# FakeNvml's GPUs sit at 00000000:18:00.0 .. 00000000:1F:00.0: 0000:1a:00 is NVML index 2.
LINE = "NVRM: Xid (PCI:0000:1a:00): 13, pid=4242, name=runwarden-test, Graphics Exception: test line {tag}"


def test_the_bus_id_names_the_nvml_index_the_local_rank_and_the_global_rank() -> None:
    gpus = GpuMap(FakeNvml(), visible_devices="", global_rank_of=lambda local: 8 + local)
    assert gpus.describe("0000:1a:00") == (2, "GPU 2 (NVML), local rank 2, global rank 10")
    assert gpus.describe("00000000:1A:00.0")[0] == 2  # NVML's spelling of the same bus id
    assert gpus.describe("0000:99:00") == (None, "GPU index unknown (not in NVML's bus map)")
    masked = GpuMap(FakeNvml(), visible_devices="4,2")
    assert masked.describe("0000:1a:00") == (2, "GPU 2 (NVML), local rank 1, global rank unknown here")
    assert masked.describe("0000:18:00") == (0, "GPU 0 (NVML), no local rank runs on it")


def test_without_the_agents_map_the_rank_is_the_one_nvml_lists_on_that_gpu() -> None:
    rank = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE,
        env={**os.environ, "RANK": "11", "LOCAL_RANK": "2"},
    )
    try:
        nvml = FakeNvml()
        nvml.gpus[2].processes = [GpuProcess(pid=rank.pid, used_bytes=1 << 30)]
        assert GpuMap(nvml, visible_devices="").describe("0000:1a:00") == (
            2,
            "GPU 2 (NVML), local rank 2, global rank 11",
        )
        me = os.getpid()  # this test's process: started without RANK (else not a fair case)
        assert b"\0RANK=" not in b"\0" + Path(f"/proc/{me}/environ").read_bytes()
        nvml.gpus[2].processes = [GpuProcess(pid=me, used_bytes=0)]  # no RANK: not a rank
        assert GpuMap(nvml, visible_devices="").describe("0000:1a:00")[1].endswith("global rank unknown here")
    finally:
        rank.communicate(b"")


def test_no_nvml_means_no_index_never_an_error() -> None:
    nvml = FakeNvml(init_error=NvmlUnavailable("NVML init failed: driver not loaded"))
    monitor = XidMonitor(node="n", publish=lambda e: None, gpus=GpuMap(nvml))
    evidence = monitor.feed(LINE.format(tag="x"), "test")
    assert evidence is not None and not evidence.HasField("gpu_index")
    assert "GPU index unknown" in evidence.detail
    monitor.feed(LINE.format(tag="y"), "test")
    assert nvml.inits == 1  # a failed NVML is asked again only after GpuMap.RETRY_S


def _kmsg_writable() -> bool:
    return os.access("/dev/kmsg", os.R_OK | os.W_OK)


@pytest.mark.skipif(not _kmsg_writable(), reason="/dev/kmsg is not readable and writable here (not root)")
def test_a_real_nvrm_line_in_the_kernel_log_is_evidence_naming_its_gpu_within_a_second() -> None:
    got: queue.Queue[common_pb2.Evidence] = queue.Queue()
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    monitor = XidMonitor(
        node="gpu-node-1",
        publish=lambda e: got.put(e) if tag in e.raw else None,  # only this test's line
        gpus=GpuMap(FakeNvml(), visible_devices="", global_rank_of=lambda local: 8 + local),
    )
    assert monitor.start("kmsg", 5.0) == "kmsg"
    try:
        fd = os.open("/dev/kmsg", os.O_WRONLY)
        try:
            written = time.monotonic()
            os.write(fd, (LINE.format(tag=tag) + "\n").encode())
        finally:
            os.close(fd)
        evidence = got.get(timeout=1.0)
        took = time.monotonic() - written
    finally:
        monitor.stop()
    assert took < 1.0
    assert evidence.source == "kmsg" and evidence.xid == 13 and evidence.node == "gpu-node-1"
    assert evidence.gpu_index == 2 and evidence.pci_bus_id == "0000:1a:00"
    assert evidence.detail.endswith("= GPU 2 (NVML), local rank 2, global rank 10"), evidence.detail
    assert evidence.severity == common_pb2.SEVERITY_APPLICATION
