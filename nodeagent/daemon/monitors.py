"""Continuous monitors: the kernel log's Xid lines and NVML's error counters and throttle reasons.

Kernel log sources, first that works ("auto"): /dev/kmsg (read from its end), `journalctl -k -f`,
then `dmesg` polled every `dmesg_interval_s` (new lines only). Every line goes through
`XidMonitor.feed(line, source)`, which is also the injection point for FAULT_KIND_XID and tests.
Lines are parsed by the preflight package's `parse_xid_line`; non-Xid lines cost one regex search.

The NVML poller talks to NVML only through `preflight.nvml.Nvml` (the narrow boundary tests fake)
and publishes evidence on changes only: a counter that went up, a flag that turned on.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from preflight.nvml import THROTTLE_BITS, GpuLost, Nvml, NvmlError, NvmlUnavailable
from preflight.xid import normalize_pci_bus_id, parse_xid_line, xid_evidence
from runwarden.v1 import common_pb2

log = logging.getLogger(__name__)
Publish = Callable[[common_pb2.Evidence], Any]
MAX_LINE_BYTES = 8192


class GpuMap:
    """Which GPU an NVRM line names, and which rank sat on it: the line's PCI bus id -> NVML's
    index (NVML's own map, read once and again when a bus id is not in it) -> the local rank
    (torchrun's local rank i runs on CUDA device i: the i-th of CUDA_VISIBLE_DEVICES as the agent,
    whose environment the ranks inherit, has it, else NVML index i, the PCI order CUDA uses on a
    node of one GPU model) -> the global rank: `global_rank_of(local rank)` where the caller knows
    it (the running attempt's progress reports), else the RANK a process NVML lists on that GPU
    was started with (/proc/<pid>/environ: torchrun's ranks; a warm rank learns its rank after
    exec, so not those). NVML errors make the answer None, never an exception."""

    RETRY_S = 60.0  # after NVML failed: asked again at most this often (a line per Xid, not a loop)

    def __init__(
        self,
        nvml: Nvml | None = None,
        *,
        visible_devices: str | None = None,
        global_rank_of: Callable[[int], int | None] = lambda _: None,
    ) -> None:
        self._nvml = nvml
        self._visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible_devices is None else visible_devices
        self.global_rank_of = global_rank_of
        self._by_bus: dict[str, int] = {}
        self._failed_at = -float("inf")
        self._lock = threading.Lock()

    def _read(self) -> None:
        if time.monotonic() - self._failed_at < self.RETRY_S:
            return
        try:
            if self._nvml is None:
                from preflight.nvml import PynvmlAdapter

                self._nvml = PynvmlAdapter()
            self._nvml.init()
            self._by_bus = {
                normalize_pci_bus_id(self._nvml.pci_bus_id(i)): i for i in range(self._nvml.device_count())
            }
        except NvmlError as exc:
            self._failed_at = time.monotonic()
            log.info("Xid monitor: no GPU index from NVML: %s", exc)

    def index_of(self, bus_id: str) -> int | None:
        key = normalize_pci_bus_id(bus_id)
        with self._lock:
            if key not in self._by_bus:
                self._read()
            return self._by_bus.get(key)

    def local_rank_of(self, index: int) -> int | None:
        visible = (self._visible or "").strip()
        if not visible:
            return index
        ids = [v.strip() for v in visible.split(",")]
        if not all(v.isdigit() for v in ids):
            return None  # UUIDs or MIG names: not NVML indices
        return ids.index(str(index)) if str(index) in ids else None

    def describe(self, bus_id: str) -> tuple[int | None, str]:
        """(NVML index, the words Xid evidence adds: "GPU 3 (NVML), local rank 3, global rank 11")."""
        index = self.index_of(bus_id)
        if index is None:
            return None, "GPU index unknown (not in NVML's bus map)"
        local = self.local_rank_of(index)
        if local is None:
            return index, f"GPU {index} (NVML), no local rank runs on it"
        rank = self.global_rank_of(local)
        if rank is None:
            rank = self._rank_on(index)
        where = f"global rank {rank}" if rank is not None else "global rank unknown here"
        return index, f"GPU {index} (NVML), local rank {local}, {where}"

    def _rank_on(self, index: int) -> int | None:
        """The RANK of the one rank process NVML lists on GPU `index` (None: none, or several)."""
        try:
            assert self._nvml is not None
            pids = [p.pid for p in self._nvml.compute_processes(index)]
        except NvmlError:
            return None
        ranks = {r for r in (_exec_env_int(pid, "RANK") for pid in pids) if r is not None}
        return ranks.pop() if len(ranks) == 1 else None


def _exec_env_int(pid: int, name: str) -> int | None:
    """An integer variable of the environment `pid` was started with, None if absent or unreadable."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            raw = fh.read(1 << 20)
    except OSError:
        return None
    prefix = name.encode() + b"="
    for item in raw.split(b"\0"):
        if item.startswith(prefix):
            value = item[len(prefix) :]
            return int(value) if value.isdigit() else None
    return None


class XidMonitor:
    def __init__(
        self,
        *,
        node: str,
        publish: Publish,
        gpu_index_of: Callable[[str], int | None] | None = None,
        gpus: GpuMap | None = None,
    ):
        self._node = node
        self._publish = publish
        self._gpu_index_of = gpu_index_of  # an explicit map (older callers); else `gpus`
        self.gpus = gpus if gpus is not None else GpuMap()
        self._closed = threading.Event()
        self._proc: subprocess.Popen[bytes] | None = None

    def feed(self, line: str | bytes, source: str) -> common_pb2.Evidence | None:
        """Parse one kernel-log line; publish and return the evidence if it is an Xid, naming the
        GPU and the rank on it where they are known (GpuMap)."""
        event = parse_xid_line(line)
        if event is None:
            return None
        if self._gpu_index_of is not None:
            index, where = self._gpu_index_of(normalize_pci_bus_id(event.pci_bus_id)), ""
        else:
            index, where = self.gpus.describe(event.pci_bus_id)
        evidence = xid_evidence(
            event, node=self._node, observed_at=time.time(), source=source, gpu_index=index
        )
        if where:
            evidence.detail = f"{evidence.detail} = {where}"
        self._publish(evidence)
        return evidence

    def start(self, kind: str, dmesg_interval_s: float) -> str:
        """Start following the kernel log; returns the source used ("none" if nothing works)."""
        for candidate in ("kmsg", "journalctl", "dmesg") if kind == "auto" else (kind,):
            lines = self._open(candidate, dmesg_interval_s)
            if lines is not None:
                threading.Thread(
                    target=self._follow, args=(lines, candidate), name="xid-monitor", daemon=True
                ).start()
                log.info("Xid monitor following the kernel log via %s", candidate)
                return candidate
        if kind != "none":
            log.warning(
                "Xid monitor: no kernel log source works here (%s); Xid evidence only by injection", kind
            )
        return "none"

    def stop(self) -> None:
        self._closed.set()
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()

    def _open(self, kind: str, interval_s: float) -> Iterator[bytes] | None:
        if kind == "kmsg":
            try:
                fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_CLOEXEC)
                os.lseek(fd, 0, os.SEEK_END)  # only new records: old ones were preflight's job
            except OSError as exc:
                log.debug("/dev/kmsg unavailable: %s", exc)
                return None
            return self._kmsg_lines(fd)
        if kind == "journalctl" and shutil.which("journalctl"):
            try:
                probe = subprocess.run(["journalctl", "-k", "-n", "0", "-q"], capture_output=True, timeout=5)
                if probe.returncode != 0:
                    return None
                self._proc = subprocess.Popen(
                    ["journalctl", "-k", "-f", "-n", "0", "-q", "-o", "short"],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                )
            except (OSError, subprocess.TimeoutExpired):
                return None
            assert self._proc.stdout is not None
            return iter(self._proc.stdout.readline, b"")
        if kind == "dmesg" and shutil.which("dmesg"):
            first = _run_dmesg()
            if first is None:
                return None
            return self._dmesg_lines(first, interval_s)
        return None

    def _kmsg_lines(self, fd: int) -> Iterator[bytes]:
        try:
            while not self._closed.is_set():
                try:
                    yield os.read(fd, MAX_LINE_BYTES)  # one record per read
                except BrokenPipeError:
                    continue  # records overwritten before we read them (EPIPE): carry on
        finally:
            os.close(fd)

    def _dmesg_lines(self, seen: list[bytes], interval_s: float) -> Iterator[bytes]:
        last = seen[-1] if seen else None
        while not self._closed.wait(interval_s):
            lines = _run_dmesg()
            if lines is None:
                continue
            start = 0
            if last is not None and last in lines:
                start = len(lines) - lines[::-1].index(last)
            yield from lines[start:]
            if lines:
                last = lines[-1]

    def _follow(self, lines: Iterator[bytes], source: str) -> None:
        try:
            for line in lines:
                if self._closed.is_set():
                    return
                try:
                    self.feed(line[:MAX_LINE_BYTES], source)
                except Exception:
                    log.exception("Xid monitor: line not handled: %r", line[:200])
        except Exception:
            log.exception("Xid monitor: %s source failed", source)


def _run_dmesg() -> list[bytes] | None:
    try:
        out = subprocess.run(["dmesg"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.splitlines() if out.returncode == 0 else None


# --- NVML ----------------------------------------------------------------------------------------

SLOWDOWN_BITS = ("hw_slowdown", "hw_thermal", "hw_power_brake", "sw_thermal")


class NvmlPoller:
    """Polls every GPU's counters; publishes evidence when something gets worse."""

    def __init__(self, *, node: str, nvml: Nvml, publish: Publish) -> None:
        self._node = node
        self._nvml = nvml
        self._publish = publish
        self._last: dict[tuple[int, str], Any] = {}
        self._closed = threading.Event()

    def start(self, interval_s: float) -> bool:
        try:
            self._nvml.init()
        except NvmlError as exc:
            log.info("NVML poller off: %s", exc)
            return False
        threading.Thread(target=self._loop, args=(interval_s,), name="nvml-poller", daemon=True).start()
        return True

    def stop(self) -> None:
        self._closed.set()

    def _loop(self, interval_s: float) -> None:
        while not self._closed.is_set():
            try:
                self.poll_once()
            except NvmlUnavailable as exc:
                log.warning("NVML went away: %s", exc)
            except Exception:
                log.exception("NVML poll failed")
            self._closed.wait(interval_s)

    def poll_once(self) -> list[common_pb2.Evidence]:
        out: list[common_pb2.Evidence] = []
        for index in range(self._nvml.device_count()):
            try:
                out += self._poll_gpu(index)
            except GpuLost as exc:
                out += self._changed(
                    index,
                    "lost",
                    True,
                    common_pb2.EVIDENCE_KIND_GPU_LOST,
                    common_pb2.SEVERITY_FATAL,
                    f"GPU {index} is lost: {exc}",
                )
        for evidence in out:
            self._publish(evidence)
        return out

    def _poll_gpu(self, i: int) -> list[common_pb2.Evidence]:
        out: list[common_pb2.Evidence] = []
        fatal, warn = common_pb2.SEVERITY_FATAL, common_pb2.SEVERITY_WARNING
        ecc = _optional(lambda: self._nvml.ecc_uncorrected(i, volatile=True))
        if ecc is not None:
            out += self._increased(
                i,
                "ecc",
                ecc,
                common_pb2.EVIDENCE_KIND_ECC_UNCORRECTABLE,
                fatal,
                f"GPU {i}: uncorrectable ECC errors now {ecc}",
            )
        rows = _optional(lambda: self._nvml.remapped_rows(i))
        if rows is not None:
            out += self._changed(
                i,
                "remap_failure",
                rows.failure,
                common_pb2.EVIDENCE_KIND_ROW_REMAP_FAILURE,
                fatal,
                f"GPU {i}: row remapping failed",
            )
            out += self._changed(
                i,
                "remap_pending",
                rows.pending,
                common_pb2.EVIDENCE_KIND_ROW_REMAP_PENDING,
                warn,
                f"GPU {i}: row remap pending (reset needed)",
            )
        pending = _optional(lambda: self._nvml.retired_pages_pending(i))
        if pending is not None:
            out += self._changed(
                i,
                "pages_pending",
                pending,
                common_pb2.EVIDENCE_KIND_RETIRED_PAGES_PENDING,
                warn,
                f"GPU {i}: retired pages pending",
            )
        reasons = _optional(lambda: self._nvml.throttle_reasons(i))
        if reasons is not None:
            for name in SLOWDOWN_BITS:
                out += self._changed(
                    i,
                    f"throttle_{name}",
                    bool(reasons & THROTTLE_BITS[name]),
                    common_pb2.EVIDENCE_KIND_THROTTLE,
                    warn,
                    f"GPU {i}: clocks throttled ({name})",
                )
        action = _optional(lambda: self._nvml.recovery_action(i))
        if action is not None:
            out += self._changed(
                i,
                "recovery_action",
                action != 0,
                common_pb2.EVIDENCE_KIND_RECOVERY_ACTION,
                fatal,
                f"GPU {i}: NVML recovery action {action}",
            )
        return out

    def _evidence(self, i: int, kind: int, severity: int, detail: str) -> common_pb2.Evidence:
        evidence = common_pb2.Evidence(
            node=self._node, gpu_index=i, detail=detail, raw=detail, observed_at=time.time(), source="nvml"
        )
        evidence.kind = kind  # type: ignore[assignment]  # plain ints from the EvidenceKind enum
        evidence.severity = severity  # type: ignore[assignment]  # plain ints from the Severity enum
        return evidence

    def _changed(
        self, i: int, key: str, on: bool, kind: int, sev: int, detail: str
    ) -> list[common_pb2.Evidence]:
        was = self._last.get((i, key), False)
        self._last[(i, key)] = on
        return [self._evidence(i, kind, sev, detail)] if on and not was else []

    def _increased(
        self, i: int, key: str, value: int, kind: int, sev: int, detail: str
    ) -> list[common_pb2.Evidence]:
        was = self._last.get((i, key))
        self._last[(i, key)] = value
        # The first reading is the baseline: preflight judged it; the monitor reports increases.
        return [self._evidence(i, kind, sev, detail)] if was is not None and value > was else []


def _optional(fn: Callable[[], Any]) -> Any:
    """A counter this GPU/driver does not support is None, not an error; GpuLost propagates."""
    try:
        return fn()
    except GpuLost:
        raise
    except NvmlError:
        return None
