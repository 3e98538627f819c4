"""Leader election between real processes; fencing refuses a stale leader's write."""

from __future__ import annotations

import signal
from collections.abc import Callable

import pytest

from runwarden.store import CampaignTimeout, NotLeader, Store
from testbed.etcd_server import EtcdServer
from tests.store.helpers import Peer

TTL_S = 2
ELECTION = "controller"


def _contender(spawn_peer: Callable[..., Peer], etcd: EtcdServer, value: str) -> Peer:
    peer = spawn_peer("contender", etcd.endpoint, ELECTION, value, str(TTL_S))
    peer.expect("CAMPAIGNING", timeout_s=20)
    return peer


def test_one_leader_and_the_other_takes_over_when_the_leader_dies(
    etcd: EtcdServer, store: Store, spawn_peer: Callable[..., Peer]
) -> None:
    first = _contender(spawn_peer, etcd, "first")
    _, line = first.expect("LEADER", timeout_s=10)
    first_fence = int(line.split()[1])
    second = _contender(spawn_peer, etcd, "second")
    assert second.silent_for("LEADER", 1.5), "two leaders at once"
    leader = store.leader(ELECTION)
    assert leader is not None and leader.value == b"first" and leader.create_revision == first_fence

    killed_at = first.signal(signal.SIGKILL)
    won_at, line = second.expect("LEADER", timeout_s=TTL_S + 5)
    takeover = won_at - killed_at
    print(
        f"second contender led {takeover:.3f} s after SIGKILL of the leader "
        f"(TTL {TTL_S} s, bound {TTL_S + 1} s)"
    )
    assert takeover <= TTL_S + 1
    assert int(line.split()[1]) > first_fence
    leader = store.leader(ELECTION)
    assert leader is not None and leader.value == b"second"


def test_stale_leader_fenced_write_is_refused(
    etcd: EtcdServer, store: Store, spawn_peer: Callable[..., Peer]
) -> None:
    key = store.keys.attempt("run1")
    first = _contender(spawn_peer, etcd, "first")
    first.expect("LEADER", timeout_s=10)
    first.send(f"put {key} from-first")
    first.expect("WROTE", timeout_s=5)
    second = _contender(spawn_peer, etcd, "second")

    first.signal(signal.SIGSTOP)  # a leader stalled past its TTL (GC pause, swapped out, partitioned)
    second.expect("LEADER", timeout_s=TTL_S + 5)
    second.send(f"put {key} from-second")
    second.expect("WROTE", timeout_s=5)
    first.signal(signal.SIGCONT)
    first.send(f"put {key} stale")
    _, answer = first.expect("", timeout_s=5)
    assert answer.startswith("REFUSED"), answer
    kv = store.get(key)
    assert kv is not None and kv.value == b"from-second"


def test_in_process_leadership_loss_and_resign(store: Store) -> None:
    leadership = store.campaign("ctl", b"a", ttl_s=1, timeout_s=5)
    assert store.fenced_put(store.keys.spec("r"), b"v1", leadership) > 0
    with pytest.raises(CampaignTimeout):
        store.campaign("ctl", b"b", ttl_s=1, timeout_s=0.5)
    store.revoke(leadership.lease)  # the key goes with the lease
    assert leadership.lost.wait(3), "leadership did not notice its key was deleted"
    with pytest.raises(NotLeader):
        store.fenced_put(store.keys.spec("r"), b"v2", leadership)
    successor = store.campaign("ctl", b"b", ttl_s=1, timeout_s=5)
    assert successor.fence > leadership.fence
    assert store.fenced_put(store.keys.spec("r"), b"v3", successor) > 0
    successor.resign()
    assert store.leader("ctl") is None
    kv = store.get(store.keys.spec("r"))
    assert kv is not None and kv.value == b"v3"
