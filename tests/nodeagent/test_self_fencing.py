"""Self-fencing against a real etcd: an agent that cannot renew its lease before the TTL runs out
stops its workers (TERM, then KILL after its stop grace), refuses launches, says so in its log and a
metric, and re-registers under a new lease once etcd answers again."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
import urllib.request

import grpc
import pytest

from runwarden.v1 import agent_pb2, store_pb2
from testbed.etcd_server import free_port
from tests.nodeagent.helpers import wait_for

TTL_S = 2.0
GRACE_S = 1.0
MARGIN_S = 0.5
# Ignores SIGTERM: the fence has to escalate to SIGKILL after the grace.
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


@pytest.mark.slow
def test_an_agent_cut_off_from_etcd_stops_its_workers_within_ttl_plus_grace(etcd, store, agent_factory):
    metrics_port = free_port()
    agent = agent_factory(
        etcd=etcd.endpoint,
        etcd_root=store.keys.root,
        flags=[
            "--lease-ttl",
            str(TTL_S),
            "--allow-exec",
            sys.executable,
            "--metrics-listen",
            f"127.0.0.1:{metrics_port}",
        ],
        env={"RUNWARDEN_AGENT_STOP_GRACE_S": str(GRACE_S)},
    )
    key = store.keys.node("n1")
    before = wait_for(lambda: store.get(key), 10, "the node key")
    pid = agent.stub.LaunchWorkers(
        agent_pb2.LaunchWorkersRequest(run="r1", attempt=1, argv=[sys.executable, "-c", STUBBORN]), timeout=10
    ).pid
    time.sleep(TTL_S)  # a few keepalives: the fence must not fire while etcd answers
    assert (
        os.path.exists(f"/proc/{pid}")
        and agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest()).lease_held
    )

    os.kill(etcd.pid, signal.SIGSTOP)  # etcd unreachable: no keepalive is answered from now on
    cut_at = time.monotonic()
    try:
        wait_for(lambda: not os.path.exists(f"/proc/{pid}"), TTL_S + GRACE_S + 5, "the worker to be stopped")
        stopped_after = time.monotonic() - cut_at
        print(
            f"\nworker stopped {stopped_after:.2f} s after etcd was cut (TTL {TTL_S} s + grace {GRACE_S} s)"
        )
        assert stopped_after <= TTL_S + GRACE_S + MARGIN_S
        # the last renewal was at most a keepalive interval (TTL/3) before the cut: not earlier than that
        assert stopped_after >= TTL_S * 2 / 3 + GRACE_S - 0.2
        # the process is gone once the agent's reaper has waited for it; its record follows
        status = wait_for(
            lambda: (
                (st := agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest(), timeout=5))
                .workers[0]
                .HasField("exit")
                and st
            ),
            5,
            "the worker's exit record",
        )
        assert not status.lease_held
        (worker,) = status.workers
        assert worker.exit.signal == signal.SIGKILL
        with pytest.raises(grpc.RpcError) as refused:
            agent.stub.LaunchWorkers(
                agent_pb2.LaunchWorkersRequest(run="r1", attempt=2, argv=[sys.executable, "-c", "pass"]),
                timeout=10,
            )
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "holds no lease" in refused.value.details()
        assert "self-fencing" in agent.log() and "stopping the workers of r1 attempt 1" in agent.log()
        assert _metric(metrics_port, "runwarden_agent_self_fences_total") == 1
    finally:
        os.kill(etcd.pid, signal.SIGCONT)

    after = wait_for(
        lambda: (kv := store.get(key)) is not None and kv.lease != before.lease and kv,
        TTL_S + 10,
        "re-registration under a new lease",
    )
    assert after.lease != 0
    wait_for(
        lambda: agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest()).lease_held,
        5,
        "the lease held again",
    )


def test_an_agent_without_workers_fences_nothing_and_reregisters(etcd, store, agent_factory):
    agent = agent_factory(etcd=etcd.endpoint, etcd_root=store.keys.root, flags=["--lease-ttl", str(TTL_S)])
    key = store.keys.node("n1")
    before = wait_for(lambda: store.get(key), 10, "the node key")
    os.kill(etcd.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: "self-fencing" in agent.log(), TTL_S + 3, "the fence in the log")
        assert "no workers run here" in agent.log()
    finally:
        os.kill(etcd.pid, signal.SIGCONT)
    wait_for(
        lambda: (kv := store.get(key)) is not None and kv.lease != before.lease, TTL_S + 10, "re-registration"
    )


def test_the_vouch_fences_when_a_peer_renewed_after_this_lease_ran_out() -> None:
    from nodeagent.daemon.liveness import peers_cannot_renew

    ttl = 2.0
    # peers answer, their last renewal before this lease ran out: nobody reaches etcd, keep running
    keep = peers_cannot_renew({"b:1": 0.5, "c:1": None}, unconfirmed_s=2.1, ttl_s=ttl)
    assert keep.keep and not keep.others_renew
    # a peer renewed 0.6 s after this lease ran out: etcd answers others
    cut = peers_cannot_renew({"b:1": 2.5, "c:1": 0.3}, unconfirmed_s=2.9, ttl_s=ttl)
    assert cut.others_renew and not cut.keep and "c:1" in cut.why
    # no peer answers: cut off from them too
    alone = peers_cannot_renew({}, unconfirmed_s=2.1, ttl_s=ttl)
    assert not alone.keep and not alone.others_renew


@pytest.mark.slow
@pytest.mark.parametrize("etcd_returns", [False, True], ids=["cut-off", "etcd-back-for-everyone"])
def test_peers_renewing_fence_after_the_recovery_allowance_unless_this_lease_renews(
    etcd, store, etcd_returns: bool
) -> None:
    """Registration against a real etcd, the peers' answers played by the test. Cut off (etcd killed,
    the peers said to renew all along) it fences RECOVERY_TTLS x TTL after it first saw them renew.
    etcd down for everyone (the peers cannot renew either: keep), then back (a restart on the same
    data: the lease survives, the peers renew first): its own keeper renews within the allowance and
    nothing is fenced."""
    from nodeagent.daemon.liveness import RECOVERY_TTLS, Registration, Verdict
    from nodeagent.daemon.metrics import AgentMetrics

    fenced: list[float] = []
    renewing_seen: list[float] = []  # when the vouch first answered "a peer renewed"

    def vouch(unconfirmed_s: float) -> Verdict:
        if etcd_returns and not etcd.running:
            return Verdict(keep=True, why="peers answer and none renewed since (the test)")
        renewing_seen[:] = renewing_seen or [time.monotonic()]
        return Verdict(keep=False, others_renew=True, why="peer p renewed (the test)")

    reg = Registration(
        store=store,
        node="v1",
        ttl_s=TTL_S,
        make_record=store_pb2.NodeRecord,
        metrics=AgentMetrics(),
        on_fenced=lambda reason: fenced.append(time.monotonic()),
        vouch=vouch,
    )
    reg.start()
    try:
        etcd.kill()
        if not etcd_returns:
            wait_for(lambda: fenced, TTL_S + RECOVERY_TTLS * TTL_S + 3, "the fence")
            waited = fenced[0] - renewing_seen[0]
            print(f"\nfenced {waited:.2f} s after the peers were first seen renewing")
            assert RECOVERY_TTLS * TTL_S <= waited <= RECOVERY_TTLS * TTL_S + TTL_S / 6 + MARGIN_S
            return
        # the lease runs out unconfirmed and the peers cannot renew either: no fence
        wait_for(
            lambda: reg.last_heartbeat_at() < time.monotonic() - TTL_S - 0.5, TTL_S + 3, "the TTL run out"
        )
        assert not fenced
        etcd.start()  # back for everyone: the peers renew, and this host's keeper must too
        wait_for(
            lambda: (reg.last_heartbeat_at() or 0) > renewing_seen[0] if renewing_seen else False,
            10,
            "renewal",
        )
        assert not fenced and reg.lease_held
        print(
            f"\nrenewed {reg.last_heartbeat_at() - renewing_seen[0]:.2f} s after the peers were seen renewing"
        )
    finally:
        reg.stop(revoke=False)


def test_peers_report_how_long_ago_etcd_confirmed_their_leases(etcd, store, agent_factory) -> None:
    from nodeagent.daemon.liveness import PeerLeases

    agent_factory(etcd=etcd.endpoint, etcd_root=store.keys.root, flags=["--lease-ttl", str(TTL_S)])
    record = wait_for(lambda: store.get(store.keys.node("n1")), 10, "the node key")
    peer = store_pb2.NodeRecord.FromString(record.value).address
    with socket.create_server(("127.0.0.1", 0)) as gone:
        dead = f"127.0.0.1:{gone.getsockname()[1]}"  # closed again: nothing listens there
    leases = PeerLeases(None, timeout_s=1.0)
    try:
        ages = leases.ages((peer, dead))
        assert list(ages) == [peer]  # the dead one did not answer
        assert ages[peer] is not None and 0 <= ages[peer] < TTL_S / 3 + 0.5  # renewed every TTL/3
        os.kill(etcd.pid, signal.SIGSTOP)
        try:  # no renewal while etcd is out: the age it reports keeps growing past the TTL
            wait_for(lambda: (leases.ages((peer,)).get(peer) or 0) > TTL_S, TTL_S + 5, "the age past the TTL")
        finally:
            os.kill(etcd.pid, signal.SIGCONT)
        wait_for(
            lambda: (leases.ages((peer,)).get(peer) or 99) < TTL_S / 3 + 0.5, TTL_S + 10, "renewals again"
        )
    finally:
        leases.close()
