"""Teardown leaves no namespace of the prefix and no process; sweep removes a crashed run's leftovers
(and only those of its prefix)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from testbed import fleet as F
from testbed.fleet import Fleet
from tests.fleet.conftest import require_namespaces


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_dead(pids: list[int], timeout_s: float = 5.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def test_teardown_leaves_no_namespace_and_no_process() -> None:
    require_namespaces()
    prefix = f"{F.default_prefix()}t"
    F.sweep(prefix)
    with Fleet(prefix) as fleet:
        a, b = fleet.add_host("a"), fleet.add_host("b")
        # a process that forked a child of its own, and a stopped one: both must go
        forked = a.popen(["sh", "-c", "sleep 300 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
        assert forked.stdout is not None
        grandchild = int(forked.stdout.readline())
        stopped = b.popen(["sleep", "300"])
        deadline = time.monotonic() + 5
        while stopped.pid not in F.netns_pids(b.netns) and time.monotonic() < deadline:
            time.sleep(0.02)  # stopped once it runs on b (a process stopped before is caught too)
        F.sigstop(stopped)
        pids = [forked.pid, grandchild, stopped.pid]
        assert set(F.netns_pids(a.netns)) >= {forked.pid, grandchild}
        assert sorted(F.namespaces(prefix)) == sorted(fleet.namespaces())
    assert F.namespaces(prefix) == []
    assert _wait_dead(pids) == [], "teardown left processes of the fleet running"
    assert forked.returncode == -9 and stopped.returncode == -9


def test_sweep_removes_a_left_behind_namespace_of_its_prefix_only() -> None:
    require_namespaces()
    prefix, other = f"{F.default_prefix()}s", f"{F.default_prefix()}o"
    left, keep = f"{prefix}-left", f"{other}-keep"
    for name in (left, keep):
        subprocess.run(["ip", "netns", "add", name], check=True)
    # what a crashed run leaves: a namespace with a process in it that nobody will reap here
    orphan = subprocess.Popen(["ip", "netns", "exec", left, "sleep", "300"], start_new_session=True)
    try:
        deadline = time.monotonic() + 5
        while orphan.pid not in F.netns_pids(left) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert F.sweep(prefix) == [left]
        assert F.namespaces(prefix) == []
        assert orphan.wait(timeout=5) == -9
        assert F.namespaces(other) == [keep], "sweep touched another prefix"
    finally:
        subprocess.run(["ip", "netns", "del", keep], check=False, capture_output=True)
        subprocess.run(["ip", "netns", "del", left], check=False, capture_output=True)


def test_sweep_orphans_removes_dead_runs_and_keeps_live_ones() -> None:
    require_namespaces()
    dead_pid = _a_dead_pid()
    dead, live = f"rw{dead_pid}-h1", f"{F.default_prefix()}l-h1"
    for name in (dead, live):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        removed = F.sweep_orphans()
        assert dead in removed and live not in removed
        assert F.namespaces(f"rw{dead_pid}") == []
        assert F.namespaces(f"{F.default_prefix()}l") == [live]
    finally:
        subprocess.run(["ip", "netns", "del", live], check=False, capture_output=True)
        subprocess.run(["ip", "netns", "del", dead], check=False, capture_output=True)


def _a_dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert not Path(f"/proc/{proc.pid}").exists() or proc.pid == os.getpid()
    return proc.pid
