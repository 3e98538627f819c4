"""Progress aggregation with real rank processes and a real etcd: one write per node per interval."""

from __future__ import annotations

import itertools
import os
import subprocess
import threading
import time

import pytest

from runwarden.v1 import store_pb2
from tests.nodeagent.helpers import PYTHON, ROOT, wait_for

RANKS = 8


@pytest.mark.slow
def test_eight_ranks_at_high_rate_one_etcd_write_per_interval(etcd, store, agent_factory):
    agent = agent_factory(etcd=etcd.endpoint, etcd_root=store.keys.root, flags=["--progress-interval", "1"])
    key = store.keys.progress("r1", "n1")
    puts: list[tuple[float, int]] = []
    lock = threading.Lock()

    def on_event(event: object) -> None:
        if getattr(event, "key", None) == key:
            with lock:
                puts.append((time.monotonic(), event.mod_revision))

    start_rev = store.revision() + 1
    watch = store.watch_prefix(store.keys.progress_prefix("r1"), start_rev, on_event)
    procs = []
    t0 = time.monotonic()
    for r in range(RANKS):
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "RANK": str(r),
            "LOCAL_RANK": str(r),
            "WORLD_SIZE": str(RANKS),
            "RUNWARDEN_RUN": "r1",
            "RUNWARDEN_ATTEMPT": "3",
            "RUNWARDEN_AGENT_SOCKET": agent.socket,
        }
        procs.append(
            subprocess.Popen(
                [PYTHON, str(ROOT / "tests/nodeagent/rank_progress.py"), "3", str(1000 + r)],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    for p in procs:
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0 and "flushed" in out
    reports_done = time.monotonic()

    def final_written() -> store_pb2.NodeProgress | None:
        """The write that holds every rank's last report, once the watch has seen it too."""
        kv = store.get(key)
        if kv is None:
            return None
        value = store_pb2.NodeProgress.FromString(kv.value)
        with lock:
            seen = any(rev == kv.mod_revision for _, rev in puts)
        return value if seen and [r.step for r in value.ranks] == [1000 + r for r in range(RANKS)] else None

    value = wait_for(final_written, 30, "the last reports' write")
    window = time.monotonic() - t0
    watch.cancel()

    # Values: one NodeProgress with all 8 ranks at their final step, the pids of the rank processes.
    assert value.node == "n1" and value.run == "r1" and value.attempt == 3
    assert [r.rank for r in value.ranks] == list(range(RANKS))
    assert [r.step for r in value.ranks] == [1000 + r for r in range(RANKS)]
    assert [r.pid for r in value.ranks] == [p.pid for p in procs]
    assert all(r.step_time_s == 0.5 and r.wait_s == 0.125 and r.loss == 1.5 for r in value.ranks)

    # Writes: at most one per interval (thousands of reports and hundreds of RPCs went in).
    with lock:
        times = [t for t, _ in puts]
    assert 2 <= len(times) <= window / 1.0 + 1, f"{len(times)} writes in {window:.1f} s"
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert min(gaps) > 0.5, f"two progress writes {min(gaps):.3f} s apart"
    assert times[-1] >= reports_done - 1.0  # the final values were written, not only early ones


def test_stale_rank_keeps_its_timestamp_and_old_attempt_is_dropped(etcd, store, agent_factory):
    from runwarden.v1 import agent_pb2, common_pb2

    agent = agent_factory(etcd=etcd.endpoint, etcd_root=store.keys.root, flags=["--progress-interval", "0.2"])
    now = time.time()
    agent.stub.ReportProgress(
        agent_pb2.ReportProgressRequest(
            run="r1",
            attempt=2,
            reports=[
                common_pb2.RankProgress(rank=0, step=10, reported_at=now - 30),
                common_pb2.RankProgress(rank=1, step=12, reported_at=now),
            ],
        )
    )
    agent.stub.ReportProgress(
        agent_pb2.ReportProgressRequest(
            run="r1", attempt=1, reports=[common_pb2.RankProgress(rank=0, step=99, reported_at=now)]
        )
    )  # an older attempt: dropped
    key = store.keys.progress("r1", "n1")
    kv = wait_for(lambda: store.get(key), 5, "progress in etcd")
    value = store_pb2.NodeProgress.FromString(kv.value)
    assert value.attempt == 2
    assert [(r.rank, r.step) for r in value.ranks] == [(0, 10), (1, 12)]
    assert value.ranks[0].reported_at == pytest.approx(now - 30)  # stale, and visibly so


def test_stop_key_in_etcd_reaches_the_ranks(etcd, store, agent_factory, tmp_path):
    from runwarden.v1 import agent_pb2, common_pb2

    agent = agent_factory(etcd=etcd.endpoint, etcd_root=store.keys.root)
    reply = agent.stub.ReportProgress(
        agent_pb2.ReportProgressRequest(
            run="r1", attempt=1, reports=[common_pb2.RankProgress(rank=0, step=1)]
        )
    )
    assert not reply.stop_requested
    store.put(
        store.keys.stop("r1"),
        store_pb2.StopRequest(run="r1", reason="preempted", requested_at=time.time()).SerializeToString(),
    )

    def stopped():
        return agent.stub.GetStopState(agent_pb2.GetStopStateRequest(run="r1")).stop_requested

    wait_for(stopped, 5, "the stop key to reach the agent")
    assert agent.stub.GetStopState(agent_pb2.GetStopStateRequest(run="r1")).reason == "preempted"
    stop_file = agent.tmp / "run" / "runs" / "r1" / "stop"
    assert stop_file.read_text().strip() == "preempted"  # what trainer.stop_requested() polls
    store.delete(store.keys.stop("r1"))
    wait_for(lambda: not stopped(), 5, "the withdrawn stop")
    assert not stop_file.exists()


def test_worker_exit_is_written_into_the_nodes_progress_at_once(etcd, store, agent_factory):
    """The controller's only source of worker exits: the agent's NodeProgress, written as soon as the
    worker ends (not at the next interval), for the attempt that ended, with its code."""
    import sys

    from runwarden.v1 import agent_pb2, common_pb2
    from tests.nodeagent.helpers import ROOT

    agent = agent_factory(
        etcd=etcd.endpoint,
        etcd_root=store.keys.root,
        flags=["--allow-exec", sys.executable, "--progress-interval", "30"],
    )
    key = store.keys.progress("r1", "n1")
    agent.stub.ReportProgress(
        agent_pb2.ReportProgressRequest(
            run="r1", attempt=4, reports=[common_pb2.RankProgress(rank=0, step=7)]
        )
    )
    agent.stub.LaunchWorkers(
        agent_pb2.LaunchWorkersRequest(
            run="r1",
            attempt=4,
            argv=[sys.executable, "-c", "import time, sys; time.sleep(0.5); sys.exit(3)"],
            env={"PYTHONPATH": str(ROOT)},
            leader_fence=1,
        )
    )
    t0 = time.monotonic()

    def exited() -> store_pb2.NodeProgress | None:
        kv = store.get(key)
        value = store_pb2.NodeProgress.FromString(kv.value) if kv else None
        return value if value is not None and value.HasField("exit") else None

    value = wait_for(exited, 10, "the exit in etcd")
    # well before the 30 s progress interval: the exit is flushed on its own
    assert time.monotonic() - t0 < 10
    assert value.attempt == 4 and value.exit.exit_code == 3 and not value.exit.HasField("signal")
    assert [(r.rank, r.step) for r in value.ranks] == [(0, 7)]  # the last progress rides along
    assert "exit code 3" in value.exit.detail and value.exit.ended_at > 0


def test_progress_table_exit_belongs_to_its_attempt():
    from nodeagent.daemon.progress import ProgressTable
    from runwarden.v1 import common_pb2

    table = ProgressTable()
    table.record("r", 2, [common_pb2.RankProgress(rank=0, step=5)])
    assert table.record_exit("r", 2, common_pb2.ExitStatus(exit_code=1, detail="exit code 1"))
    ((run, value),) = table.take_dirty("n1")
    assert run == "r" and value.attempt == 2 and value.exit.exit_code == 1 and len(value.ranks) == 1
    assert not table.record_exit("r", 1, common_pb2.ExitStatus(exit_code=0))  # an older attempt: dropped
    table.record("r", 2, [common_pb2.RankProgress(rank=0, step=6)])  # a late report keeps the exit
    ((_, value),) = table.take_dirty("n1")
    assert value.exit.exit_code == 1 and value.ranks[0].step == 6
    table.record("r", 3, [common_pb2.RankProgress(rank=0, step=6)])  # a newer attempt: clean slate
    ((_, value),) = table.take_dirty("n1")
    assert value.attempt == 3 and not value.HasField("exit")
    # The first report in which a rank says "loaded" is counted once (the agent flushes it at once).
    assert table.take_urgent_reports() == 0
    table.record(
        "r",
        3,
        [
            common_pb2.RankProgress(rank=0, step=6, loaded_step=6),
            common_pb2.RankProgress(rank=1, step=6, loaded_step=6),
        ],
    )
    assert table.take_urgent_reports() == 2 and table.take_urgent_reports() == 0
    # ... and so is its first report of a step after the load (the restart's first new step), once
    table.record("r", 3, [common_pb2.RankProgress(rank=0, step=7, loaded_step=6)])
    assert table.take_urgent_reports() == 1
    table.record("r", 3, [common_pb2.RankProgress(rank=0, step=8, loaded_step=6)])
    assert table.take_urgent_reports() == 0
    table.take_dirty("n1")
    # A worker that died before any report still gets its exit written (no ranks).
    assert table.record_exit("q", 1, common_pb2.ExitStatus(signal=9))
    ((run, value),) = table.take_dirty("n1")
    assert run == "q" and value.exit.signal == 9 and not value.ranks


def test_a_ranks_collective_entry_goes_out_as_its_age_at_the_write():
    from nodeagent.daemon.progress import ProgressTable
    from runwarden.v1 import common_pb2

    table = ProgressTable()
    entered_at = time.time() - 2.5
    table.record(
        "r",
        1,
        [
            common_pb2.RankProgress(rank=0, step=5, collectives_entered=40, collective_entered_at=entered_at),
            common_pb2.RankProgress(rank=1, step=5),  # no count: no age
        ],
    )
    before = time.time()
    ((_, value),) = table.take_dirty("n1")
    after = time.time()
    r0, r1 = value.ranks
    assert r0.collectives_entered == 40 and before - entered_at <= r0.collective_age_s <= after - entered_at
    assert not r1.HasField("collectives_entered") and r1.collective_age_s == 0.0
    # a later write of the same entry ages it further: the controller's estimate of when stays put
    table.mark_dirty("r")
    ((_, again),) = table.take_dirty("n1")
    assert again.ranks[0].collective_age_s >= r0.collective_age_s
