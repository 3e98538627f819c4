"""Liveness against a real etcd: the node key lives and dies with the agent's lease."""

from __future__ import annotations

import threading
import time

import pytest

from runwarden import net
from runwarden.v1 import store_pb2
from tests.nodeagent.helpers import wait_for

TTL_S = 2.0


@pytest.mark.slow
def test_sigkill_agent_node_key_gone_within_ttl_then_restart_reregisters(etcd, store, agent_factory):
    key = store.keys.node("n1")
    agent = agent_factory(etcd=etcd.endpoint, etcd_root=store.keys.root, flags=["--lease-ttl", str(TTL_S)])
    kv = wait_for(lambda: store.get(key), 10, "the node key")
    record = store_pb2.NodeRecord.FromString(kv.value)
    assert record.node == "n1" and record.lease_id == kv.lease != 0
    assert record.address.startswith("127.0.0.1:") and not record.address.endswith(":0")
    time.sleep(TTL_S)  # several keepalives: the key must outlive its first TTL
    assert store.get(key) is not None

    agent.kill()
    killed_at = time.monotonic()
    wait_for(lambda: store.get(key) is None, TTL_S + 3, "the node key to expire")
    gone_after = time.monotonic() - killed_at
    assert gone_after <= TTL_S + 0.6, f"node key outlived the agent by {gone_after:.2f} s"

    agent_factory(etcd=etcd.endpoint, etcd_root=store.keys.root, flags=["--lease-ttl", str(TTL_S)])
    kv2 = wait_for(lambda: store.get(key), 10, "re-registration")
    assert kv2.lease != kv.lease


def test_lost_lease_reregisters_at_once_and_logs_it(etcd, store, agent_factory):
    key = store.keys.node("n1")
    agent = agent_factory(etcd=etcd.endpoint, etcd_root=store.keys.root, flags=["--lease-ttl", str(TTL_S)])
    kv = wait_for(lambda: store.get(key), 10, "the node key")
    store.revoke(kv.lease)  # what an etcd-side expiry looks like to the agent: the lease is gone
    kv2 = wait_for(
        lambda: (k := store.get(key)) is not None and k.lease != kv.lease and k,
        TTL_S + 3,
        "re-registration under a new lease",
    )
    assert kv2.lease != 0
    assert "re-registering" in agent.log()


def test_sigterm_revokes_lease_and_exits_zero(etcd, store, agent_factory):
    key = store.keys.node("n1")
    agent = agent_factory(etcd=etcd.endpoint, etcd_root=store.keys.root, flags=["--lease-ttl", "5"])
    wait_for(lambda: store.get(key), 10, "the node key")
    assert agent.terminate() == 0
    assert store.get(key) is None  # revoked at once, not after the TTL


def test_an_agent_started_before_its_etcd_waits_for_it_and_registers(tmp_path, etcd_factory, free_port):
    """A host that boots before its etcd (or is too busy to finish the first handshake in time): the
    agent keeps trying to reach etcd for a while instead of exiting, and registers once it answers."""
    from runwarden.store import Store, StoreConfig
    from tests.nodeagent.helpers import AgentProc

    endpoint = f"127.0.0.1:{free_port}"
    started: list[AgentProc] = []
    failed: list[BaseException] = []

    def start() -> None:
        try:  # blocks until the agent serves, which it does once it registered
            started.append(AgentProc(tmp_path / "agent", etcd=endpoint, flags=["--lease-ttl", str(TTL_S)]))
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    log = tmp_path / "agent" / "n1.log"
    wait_for(lambda: log.exists() and "trying again" in log.read_text(errors="replace"), 30, "a failed try")
    etcd_factory(client_port=free_port, peer_port=net.free_port(), metrics_port=net.free_port())
    thread.join(timeout=60)
    assert not failed, failed
    assert started, "the agent did not serve"
    try:
        with Store.connect(StoreConfig(endpoints=(endpoint,))) as store:
            assert wait_for(lambda: store.get(store.keys.node("n1")), 10, "the node key")
    finally:
        started[0].close()
