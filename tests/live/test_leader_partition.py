"""A leader cut off from etcd stops acting before its lease can have expired; the standby takes over.

Real etcd, two real `LiveController`s sharing one run directory (one event log), and a TCP proxy
between the leader and etcd whose link the test cuts (the partition; `tests/support/tcp_proxy.py`).
The agent is the in-process `AgentDouble` (the test is about the controllers, not the agent)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from controller.live.loop import LiveController, ShellConfig
from controller.supervisor.machine import Supervisor
from controller.supervisor.policy import RunPlan
from runwarden.eventlog import read_events
from runwarden.store import Store, StoreConfig
from testbed.etcd_server import EtcdServer
from testbed.wait import wait_contender, wait_until
from tests.live.shell import RUN, LogWatch, agent_double, is_launch, policy
from tests.support.tcp_proxy import TcpProxy

TTL_S = 2.0


def _controller(
    store: Store, run_dir: Path, identity: str
) -> tuple[LiveController, LogWatch, threading.Thread]:
    cfg = ShellConfig(run=RUN, command=("train.py",), run_dir=run_dir, identity=identity, election_ttl_s=TTL_S,
                      tick_s=0.1)  # fmt: skip
    shell = LiveController(cfg, store, lambda: Supervisor(policy(), RunPlan(run=RUN, nodes=1)))
    watch = LogWatch()
    shell.listeners.append(watch)
    thread = threading.Thread(target=shell.run, name=f"shell-{identity}", daemon=True)
    thread.start()
    return shell, watch, thread


def _wait(pred: Callable[[], bool], timeout_s: float) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return time.monotonic()
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout_s} s")


def _loop_turns(shell: LiveController, turns: int, timeout_s: float = 30.0) -> None:
    """Until `shell` has fed its core `turns` more items (ticks included): it publishes a new status
    after each."""
    last, count = shell.status, 0

    def counted() -> bool:
        nonlocal last, count
        if shell.status is not last:  # a lower bound: two turns between two looks count as one
            last, count = shell.status, count + 1
        return count >= turns

    wait_until(counted, timeout_s, f"{turns} loop turns of {shell.cfg.identity}", interval_s=0.005)


def test_a_leader_partitioned_from_etcd_stops_before_the_standby_leads_and_nothing_is_doubled(
    etcd: EtcdServer, store: Store, tmp_path: Path
) -> None:
    host, port = etcd.endpoint.rsplit(":", 1)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with TcpProxy((host, int(port))) as proxy, agent_double(store) as agent:
        via_proxy = Store.connect(StoreConfig(endpoints=(proxy.endpoint,), timeout_s=1.0))
        direct = Store.connect(StoreConfig(endpoints=(etcd.endpoint,), timeout_s=2.0))
        leader, leader_log, t1 = _controller(via_proxy, run_dir, "leader")
        standby = standby_log = t2 = None
        try:
            leader_log.wait(is_launch(1), 30)
            _wait(lambda: len(agent.launches) == 1, 10)
            standby, standby_log, t2 = _controller(direct, run_dir, "standby")
            wait_contender(direct, RUN, "standby")
            assert leader.is_leader.is_set() and not standby.is_leader.is_set()
            held = leader.leadership
            assert held is not None
            cut_at = time.monotonic()
            proxy.cut()
            stepped_down = _wait(lambda: not leader.is_leader.is_set(), TTL_S + 1.0)
            # it stopped acting while its lease was still certainly alive, not once it noticed the loss
            assert stepped_down < held.may_expire_at(), (stepped_down - cut_at, held.may_expire_at() - cut_at)
            took_over = _wait(lambda: standby.is_leader.is_set(), TTL_S + 2.0)
            assert stepped_down < took_over, "the old leader must stop before the standby leads"
            assert took_over - cut_at <= TTL_S + 2.0
            standby_log.wait(lambda e: "adopted, not relaunched" in e.message, 20)
            last_old = max((t for t, _ in leader_log.entries), default=0.0)
            first_new = min(t for t, _ in standby_log.entries)
            assert last_old < first_new, "no event-log append by the old leader once the standby leads"
            _loop_turns(standby, 10)  # a relaunch would be decided on one of them
            assert [r.attempt for r in agent.launches] == [1], "no double launch"
            read = read_events(run_dir / "events.jsonl")
            assert not read.errors and read.torn_tail is None
            seqs = [e.seq for e in read.entries]
            assert seqs == sorted(set(seqs)) and len(seqs) == len(leader_log.entries) + len(
                standby_log.entries
            )
            print(f"leader stepped down {stepped_down - cut_at:.2f}s after the cut; standby led at "
                  f"{took_over - cut_at:.2f}s (TTL {TTL_S:g}s)")  # fmt: skip
        finally:
            for shell, thread in ((leader, t1), (standby, t2)):
                if shell is not None and thread is not None:
                    shell.stop()
                    thread.join(timeout=15)
                    shell.close()
            via_proxy.close()
            direct.close()
