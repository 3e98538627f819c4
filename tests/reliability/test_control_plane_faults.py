"""Faults of runwarden's own parts during a real supervised run (etcd, agents, controller, torchrun
workers on gloo/CPU, all real processes; examples/cluster.py):

* etcd SIGSTOP shorter than a lease TTL: nothing is declared dead.
* etcd SIGKILL + restart on the same data dir: no node quarantined for it, no event lost or
  duplicated, agents re-register, the run continues; a node whose agent really died during the
  outage is still detected once etcd is back (its lease survived the restart, countdown reset).
* agent SIGKILL + quick restart within its lease TTL: the ranks keep training, progress reporting
  resumes, no false hang or relaunch.
* controller leader SIGKILL right after a relaunch began: the standby takes over within the
  election TTL + 2 s, the relaunch happens exactly once, and the event log stays whole.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from examples.cluster import LocalCluster
from runwarden.store import Store, StoreConfig
from runwarden.v1 import store_pb2
from testbed.wait import wait_contender

from .helpers import ALARMS, E, assert_log_whole, last_seq, names, since, tail, wait_commit_after

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _start(make_cluster, **spec: object) -> LocalCluster:
    cluster: LocalCluster = make_cluster(active=2, spares=1, ckpt_every=5, **spec)
    first = cluster.wait_for_event(E.EVENT_KIND_FIRST_STEP, 0, 150)
    assert first is not None, tail(cluster)
    # steady training: a checkpoint committed after the first step
    assert wait_commit_after(cluster, first.ts, 60) is not None, tail(cluster)
    return cluster


def _quiet_window(cluster: LocalCluster, window_s: float, timeout_s: float = 60) -> None:
    """Until a checkpoint commit logged `window_s` from now: the controller has run through the window
    (an alarm raised in it is in the log before that commit)."""
    assert wait_commit_after(cluster, time.time() + window_s, timeout_s) is not None, tail(cluster)


def _active(cluster: LocalCluster) -> list[str]:
    return list([e for e in cluster.events() if e.kind == E.EVENT_KIND_LAUNCH][-1].launch.nodes)


def test_etcd_pause_then_kill_and_restart(make_cluster) -> None:
    cluster = _start(make_cluster)
    etcd = cluster.etcd
    assert etcd is not None and etcd.pid
    active = _active(cluster)
    spare = next(n for n in cluster.nodes if n not in active)

    # 1. SIGSTOP for 40% of the 2 s lease TTL, then SIGCONT: nothing is declared dead.
    mark, paused_at = last_seq(cluster), time.time()
    os.kill(etcd.pid, signal.SIGSTOP)
    time.sleep(0.4 * cluster.spec.lease_ttl_s)  # the pause under test, not a wait
    os.kill(etcd.pid, signal.SIGCONT)
    assert wait_commit_after(cluster, paused_at + 1.0, 30) is not None, tail(cluster)
    _quiet_window(cluster, cluster.spec.lease_ttl_s + 2)  # a lease the pause broke would have expired
    alarms = [e for e in since(cluster, mark) if e.kind in ALARMS]
    assert alarms == [], names(alarms)

    # 2. SIGKILL etcd; while it is down the spare's agent really dies; restart etcd on the same data.
    mark, killed_at = last_seq(cluster), time.time()
    etcd.kill()
    cluster.kill_agent_process(spare)  # its lease is never revoked: it must expire after the restart
    time.sleep(2.0)  # the outage under test, not a wait
    etcd.start()
    back_at = time.time()
    lost = cluster.wait_for_event(E.EVENT_KIND_NODE_LOST, mark, 30, pred=lambda e: spare in e.message)
    assert lost is not None, f"the spare that died during the outage was never detected\n{tail(cluster)}"
    assert lost.ts - back_at <= cluster.spec.lease_ttl_s + 8, "detected, but far too late"
    # the run continues on the same attempt, and nothing was blamed on the etcd outage
    assert wait_commit_after(cluster, back_at + 1.0, 60) is not None, tail(cluster)
    _quiet_window(cluster, cluster.spec.lease_ttl_s + 2)
    after = since(cluster, mark)
    wrong = [
        e
        for e in after
        if e.kind in (E.EVENT_KIND_QUARANTINE, E.EVENT_KIND_LAUNCH, E.EVENT_KIND_DETECTION)
        and spare not in e.message
        and not (e.kind == E.EVENT_KIND_QUARANTINE and e.quarantine.node == spare)
    ]
    assert wrong == [], names(wrong)
    assert not any(e.kind == E.EVENT_KIND_NODE_LOST and n in e.message for e in after for n in active), names(
        after
    )
    # the live agents re-registered: their node keys are back in etcd with a lease
    with Store.connect(StoreConfig(endpoints=(etcd.endpoint,), timeout_s=5.0)) as store:
        for node in active:
            kv = store.get(store.keys.node(node))
            assert kv is not None and kv.lease, f"{node} is not registered after the etcd restart"
        assert store.get(store.keys.node(spare)) is None
    assert killed_at < back_at
    assert_log_whole(cluster)


def test_agent_restart_within_its_lease_ttl_keeps_the_run(make_cluster) -> None:
    # A lease TTL long enough that a restarted agent (python start-up on a loaded machine) beats it.
    cluster = _start(make_cluster, lease_ttl_s=10.0)
    victim = _active(cluster)[0]
    assert cluster.etcd is not None
    mark, at = last_seq(cluster), time.time()
    cluster.kill_agent_process(victim)  # SIGKILL; the workers live in their own process group
    cluster.restart_agent(victim)
    with Store.connect(StoreConfig(endpoints=(cluster.etcd.endpoint,), timeout_s=5.0)) as store:
        deadline, fresh = time.monotonic() + 60, False
        while time.monotonic() < deadline and not fresh:
            kv = store.get(store.keys.progress(cluster.spec.run, victim))
            if kv is not None:
                fresh = store_pb2.NodeProgress.FromString(kv.value).written_at > at + 3.0
            time.sleep(0.5)
        assert fresh, f"progress from {victim} did not resume after its agent restarted\n{tail(cluster)}"
    assert wait_commit_after(cluster, time.time(), 30) is not None, tail(cluster)
    _quiet_window(cluster, 5)  # a false hang or relaunch would be logged in it
    alarms = [e for e in since(cluster, mark) if e.kind in ALARMS]
    assert alarms == [], names(alarms)
    assert_log_whole(cluster)


# If the leader dies after logging LAUNCH but before its LaunchWorkers RPCs reach the agents, the
# standby adopts attempt N from the attempt record; its adopt check then finds no worker of that
# attempt on the agents and reports it ended, so the core relaunches under N+1 (never N twice).
def test_leader_killed_during_a_relaunch_standby_finishes_it_once(make_cluster) -> None:
    cluster = _start(make_cluster)
    cluster.start_standby("controller-b")
    assert cluster.etcd is not None
    wait_contender(cluster.etcd.endpoint, cluster.spec.run, "controller-b")
    victim = _active(cluster)[0]
    mark = last_seq(cluster)
    out = cluster.ctl("chaos", victim, "kill-rank")
    assert out.returncode == 0, out.stderr
    launch = cluster.wait_for_event(E.EVENT_KIND_LAUNCH, mark, 90)
    assert cluster.controller is not None and launch is not None, tail(cluster)
    os.killpg(cluster.controller.pid, signal.SIGKILL)  # the leader dies right after the relaunch began
    killed_at = time.time()
    took_over = cluster.wait_for_event(E.EVENT_KIND_CONTROL_PLANE, mark, 30, pred=lambda e: e.ts > killed_at)
    assert took_over is not None, tail(cluster, "controller-b.log")
    assert took_over.ts - killed_at <= 3.0 + 2.0, "the standby took over after more than election TTL + 2 s"
    # Training goes on: the standby either adopted the relaunched attempt (no new FIRST_STEP: it did
    # not launch it) or launched it itself; either way checkpoints commit after the takeover.
    assert wait_commit_after(cluster, took_over.ts + 1.0, 60) is not None, tail(cluster, "controller-b.log")
    _quiet_window(cluster, 3)  # a second relaunch would be logged in it
    launches = [e for e in since(cluster, mark) if e.kind == E.EVENT_KIND_LAUNCH]
    # exactly one relaunch for the one crash: adopted by the standby, or redone under a new attempt
    # number if the first never started - never the same attempt number twice
    assert 1 <= len(launches) <= 2, names(launches)
    assert_log_whole(cluster)
