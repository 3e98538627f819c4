"""An unplanned stop's exits come from the StopWorkers answers: the relaunch does not wait for each
host's exit record to go through etcd (issue 31: at 2,048 hosts, 2,048 writes and watch events).
A lost node's relaunch sends each survivor one call, its launch, which stops the older attempt there
first (LaunchWorkersRequest.stop_older); the spare is launched at once.

The real `LiveController` and `Supervisor` against a real etcd; two agent doubles (tests/live/shell.py)
that write no exit record at all: n1's crash is written into its progress key by the test, as its
agent would; n2's exit exists only in its answer to the stop. With a 60 s stop grace, a relaunch
within seconds can only come from that answer."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from controller.supervisor.machine import Supervisor
from controller.supervisor.policy import RunPlan
from runwarden.store import Store
from runwarden.v1 import common_pb2, events_pb2, store_pb2
from testbed.wait import wait_until
from tests.live.shell import RUN, AgentDouble, LogWatch, agent_double, is_launch, live_shell, policy

E = events_pb2
pytestmark = pytest.mark.timeout(120)


def test_an_unplanned_stops_exits_are_taken_from_the_answers_and_the_relaunch_follows_at_once(
    store: Store, tmp_path: Path
) -> None:
    core = lambda: Supervisor(policy(stop_grace_s=60.0, stop_margin_s=10.0), RunPlan(run=RUN, nodes=2))  # noqa: E731
    with (
        agent_double(store, "n1") as n1,
        agent_double(store, "n2") as n2,
        live_shell(store, tmp_path / "run", nodes=2, core_factory=core) as (_shell, log),
    ):
        log.wait(is_launch(1), 30)
        n2.stop_exit = common_pb2.ExitStatus(
            signal=15, ended_at=time.time() + 0.5, detail="killed by SIGTERM"
        )
        crash = common_pb2.ExitStatus(exit_code=1, ended_at=time.time(), detail="exit code 1")
        prog = store_pb2.NodeProgress(node="n1", run=RUN, attempt=1, exit=crash)
        crashed_at = time.monotonic()
        store.put(store.keys.progress(RUN, "n1"), prog.SerializeToString())
        relaunched_at, _ = log.wait(is_launch(2), 30)
        assert relaunched_at - crashed_at < 10.0  # not the stop's 70 s deadline
        assert "StopWorkers" in n2.calls
        _, summary = log.wait(
            lambda e: e.kind == E.EVENT_KIND_EXIT and e.attempt == 1 and "ended" in e.message, 1
        )
        assert "signal:SIGTERM" in summary.message, summary.message
        assert store.get(store.keys.progress(RUN, "n2")) is None  # no record: the answer was the exit
        # the launch RPCs go out after the LAUNCH entry is durable: waited for, not assumed
        wait_until(lambda: [d.launches[-1].attempt for d in (n1, n2)] == [2, 2], 10, "attempt 2 on both")


@contextmanager
def spare_checked(store: Store, tmp_path: Path) -> Iterator[tuple[AgentDouble, AgentDouble, LogWatch]]:
    """Attempt 1 on n1 and n2 (a 60 s stop grace) at its first step, and the spare n3's background
    check, which vouches for it: a relaunch needs no preflight, so it comes in the stop's own batch."""
    core = lambda: Supervisor(policy(stop_grace_s=60.0, stop_margin_s=10.0), RunPlan(run=RUN, nodes=2))  # noqa: E731
    with (
        agent_double(store, "n1"),
        agent_double(store, "n2") as n2,
        agent_double(store, "n3") as n3,
        live_shell(store, tmp_path / "run", nodes=2, core_factory=core) as (_shell, log),
    ):
        _, first = log.wait(is_launch(1), 30)
        assert "n3" not in first.launch.nodes, "n3 is the spare"
        now = time.time()
        for rank, node in enumerate(("n1", "n2")):
            prog = store_pb2.NodeProgress(
                node=node,
                run=RUN,
                attempt=1,
                ranks=[common_pb2.RankProgress(rank=rank, step=1, step_time_s=0.1, reported_at=now)],
                written_at=now,
            )
            store.put(store.keys.progress(RUN, node), prog.SerializeToString())
        wait_until(lambda: "RunPreflight" in n3.calls, 10, "the spare's background check")
        yield n2, n3, log


def test_a_lost_nodes_relaunch_stops_each_survivor_within_its_launch(store: Store, tmp_path: Path) -> None:
    """The survivor gets one call: its launch, carrying the stop of the older attempt (stop_older, with
    the unplanned stop's bounds); the spare's launch carries none (nothing of the run runs there)."""
    with spare_checked(store, tmp_path) as (n2, n3, log):
        store.delete(store.keys.node("n1"))  # n1's lease is gone
        _, relaunch = log.wait(is_launch(2), 30)
        assert sorted(relaunch.launch.nodes) == ["n2", "n3"]
        wait_until(lambda: [r.attempt for r in n2.launches] == [1, 2], 10, "attempt 2 on n2")
        wait_until(lambda: [r.attempt for r in n3.launches] == [2], 10, "attempt 2 on the spare")
        assert "StopWorkers" not in n2.calls, n2.calls
        older = n2.launches[-1]
        assert older.HasField("stop_older") and older.stop_older.park_within_s > 0
        assert 0 < older.stop_older.grace_s <= 60.0
        assert not n2.launches[0].HasField("stop_older")
        assert not n3.launches[-1].HasField("stop_older")


def test_a_survivor_whose_relaunch_is_refused_is_stopped_as_the_stop_asked(
    store: Store, tmp_path: Path
) -> None:
    """A launch refused before the agent stopped anything leaves the older attempt's ranks there: the
    controller then sends the stop it folded into the launch."""
    with spare_checked(store, tmp_path) as (n2, _n3, log):
        n2.launch_refusals = 1
        store.delete(store.keys.node("n1"))
        log.wait(is_launch(2), 30)
        wait_until(lambda: "StopWorkers" in n2.calls, 10, "the folded stop sent on its own")
        refused = n2.calls.index("LaunchWorkers", n2.calls.index("LaunchWorkers") + 1)
        assert n2.calls.index("StopWorkers") > refused, n2.calls
