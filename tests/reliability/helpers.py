"""Reading a LocalCluster's event log for the reliability tests."""

from __future__ import annotations

import time
from collections import Counter

from examples.cluster import LocalCluster
from runwarden.eventlog import LogEntry, read_events
from runwarden.v1 import events_pb2

E = events_pb2
ALARMS = (E.EVENT_KIND_DETECTION, E.EVENT_KIND_QUARANTINE, E.EVENT_KIND_NODE_LOST, E.EVENT_KIND_LAUNCH)


def tail(cluster: LocalCluster, name: str = "controller.log") -> str:
    return (cluster.run_dir / name).read_text(errors="replace")[-3000:]


def last_seq(cluster: LocalCluster) -> int:
    evs = cluster.events()
    return evs[-1].seq if evs else 0


def since(cluster: LocalCluster, mark: int) -> list[LogEntry]:
    return [e for e in cluster.events() if e.seq > mark]


def names(events: list[LogEntry]) -> list[str]:
    return [f"{e.seq}:{E.EventKind.Name(e.kind)}:{e.message[:80]}" for e in events]


def wait_commit_after(cluster: LocalCluster, ts: float, timeout_s: float) -> LogEntry | None:
    """The run keeps training: a checkpoint committed after `ts` (the example commits every few steps)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for e in cluster.events():
            if e.kind == E.EVENT_KIND_CHECKPOINT_COMMIT and e.ts > ts:
                return e
        time.sleep(0.3)
    return None


def assert_log_whole(cluster: LocalCluster) -> None:
    """No torn, unparseable or duplicated line; seq contiguous; no attempt number launched twice."""
    read = read_events(cluster.event_log)
    assert read.torn_tail is None and read.errors == [], (read.torn_tail, read.errors)
    seqs = [e.seq for e in read.entries]
    assert seqs == list(range(1, len(seqs) + 1)), "the event log has a gap or a duplicate"
    attempts = [e.attempt for e in read.entries if e.kind == E.EVENT_KIND_LAUNCH]
    assert attempts == sorted(attempts) and (not attempts or max(Counter(attempts).values()) == 1), attempts
