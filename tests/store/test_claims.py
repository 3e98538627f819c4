"""Claims of nodes by runs (controller/fleet/claims.py) and the store's transactions, on a real etcd:
create-if-absent, give back only while still this run's, every change fenced by the leader's key,
the bid round (priority, then first come) with both runs asking at once, and the operator's release."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.fleet.claims import Claims, read_claim, release_by_operator
from runwarden.keys import KeySchema, run_election
from runwarden.store import Compare, Delete, Leadership, Put, Store, StoreConfig, StoreError
from testbed.etcd_server import EtcdServer


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    server = EtcdServer(Path(tmp_path_factory.mktemp("claims-etcd")) / "data", fast=True).start()
    yield server
    server.discard()


_roots = iter(range(10_000))


@pytest.fixture
def shared(etcd_server: EtcdServer) -> Iterator[Store]:
    """A store on its own key root (tests share the etcd, never their keys)."""
    cfg = StoreConfig(endpoints=(etcd_server.endpoint,), root=f"/claims{next(_roots)}", timeout_s=5.0)
    with Store.connect(cfg) as store:
        yield store


def lead(store: Store, run: str) -> Leadership:
    # a lease long enough to outlast this process starved on a loaded machine: no test here is about expiry
    return store.campaign(run_election(run), run.encode(), ttl_s=30, timeout_s=5)


def test_claim_keys_and_the_run_election() -> None:
    keys = KeySchema()
    assert keys.claim("gpu-001") == "/runwarden/v1/claims/gpu-001"
    assert keys.claims_prefix() == "/runwarden/v1/claims/"
    assert keys.bid("gpu-001", "llm") == "/runwarden/v1/bids/gpu-001/llm"
    assert keys.bids_prefix("gpu-001") == "/runwarden/v1/bids/gpu-001/"
    assert not keys.bids_prefix("a10").startswith(keys.bids_prefix("a1"))
    assert keys.election(run_election("llm")) == "/runwarden/v1/elections/llm/"
    for bad in ("", "a/b", "a b"):
        with pytest.raises(ValueError, match="run name"):
            run_election(bad)
        with pytest.raises(ValueError, match="run name"):
            keys.bid("n1", bad)


def test_txn_applies_all_or_nothing(shared: Store) -> None:
    k = shared.keys
    a, b = k.claim("a"), k.claim("b")
    ok = shared.txn("t", [Compare(key=a, absent=True)], [Put(key=a, value=b"1"), Put(key=b, value=b"2")])
    assert ok.succeeded and ok.revision > 0
    again = shared.txn("t", [Compare(key=a, absent=True)], [Put(key=b, value=b"3")])
    assert not again.succeeded and shared.get(b).value == b"2"  # nothing applied
    cur = shared.get(a)
    assert shared.txn("t", [Compare(key=a, mod_revision=cur.mod_revision)], [Delete(key=a)]).succeeded
    assert shared.get(a) is None
    with pytest.raises(StoreError, match="exactly one"):
        Compare(key=a)
    with pytest.raises(StoreError, match="positive"):
        Compare(key=a, mod_revision=0)


def test_a_prefix_compare_holds_until_any_key_under_it_is_written(shared: Store) -> None:
    """One compare for many keys (an attempt of more nodes than etcd's --max-txn-ops): it fails once
    any key under the prefix is created or changed after the revision it names."""
    k = shared.keys
    for n in ("a", "b"):
        shared.put(k.claim(n), b"mine")
    _, revision = shared.get_prefix(k.claims_prefix())
    unwritten = Compare(key=k.claims_prefix(), prefix=True, written_before=revision + 1)
    assert shared.txn("t", [unwritten], [Put(key=k.attempt("r"), value=b"1")]).succeeded
    shared.put(k.claim("c"), b"another run's")  # a claim of another node, written since
    assert not shared.txn("t", [unwritten], [Put(key=k.attempt("r"), value=b"2")]).succeeded
    assert shared.get(k.attempt("r")).value == b"1"
    with pytest.raises(StoreError, match="prefix"):
        Compare(key=k.claims_prefix(), written_before=revision + 1)
    with pytest.raises(StoreError, match="prefix"):
        Compare(key=k.claims_prefix(), prefix=True, mod_revision=revision)


def test_large_attempts_compare_the_claims_as_one_prefix_and_see_another_runs_claim(shared: Store) -> None:
    alpha = Claims(shared, "alpha")
    nodes = [f"n{i:03d}" for i in range(130)]
    assert alpha.take(nodes, lead(shared, "alpha")) == []
    few = alpha.compares(nodes[:3])
    assert isinstance(few, list) and [c.key for c in few] == [shared.keys.claim(n) for n in nodes[:3]]
    (whole,) = alpha.compares(nodes)  # 130 nodes: one compare, within etcd's 128 operations
    assert whole.prefix and whole.key == shared.keys.claims_prefix()
    assert shared.txn("record", [whole], [Put(key=shared.keys.attempt("alpha"), value=b"1")]).succeeded
    shared.delete(shared.keys.claim(nodes[5]))  # an operator's release, then another run takes it
    shared.put(shared.keys.claim(nodes[5]), b"beta's")
    assert not shared.txn("record", [whole], [Put(key=shared.keys.attempt("alpha"), value=b"2")]).succeeded
    assert "n005" in str(alpha.compares(nodes))  # read again: no longer this run's


def test_claim_is_taken_once_given_back_only_by_its_run_and_fenced(shared: Store) -> None:
    alpha_lead, beta_lead = lead(shared, "alpha"), lead(shared, "beta")
    alpha = Claims(shared, "alpha", identity="a-1", bid_window_s=0.05)
    beta = Claims(shared, "beta", identity="b-1", bid_window_s=0.05)
    assert alpha.take(["n1", "n2"], alpha_lead) == []
    refused = beta.take(["n1", "n3"], beta_lead)
    assert [(r.node, r.reason) for r in refused] == [("n1", "claimed by run alpha")]
    assert alpha.held() == {"n1", "n2"} and beta.held() == {"n3"}
    claim = read_claim(shared.get(shared.keys.claim("n1")))
    assert claim is not None and claim.run == "alpha" and claim.claimed_by == "a-1"
    # the launch's compares: every node still this run's, or why not
    assert isinstance(alpha.compares(["n1", "n2"]), list)
    assert alpha.compares(["n1", "n3"]) == "not claimed by run alpha: n3"
    # beta cannot give back alpha's node (it does not hold it), alpha can
    assert not beta.release("n1", beta_lead)
    assert alpha.release("n1", alpha_lead) and shared.get(shared.keys.claim("n1")) is None
    # a deposed leader takes and gives back nothing: the fence (its election key) is gone
    alpha_lead.resign()
    assert alpha.take_now("n4", alpha_lead) != "" and shared.get(shared.keys.claim("n4")) is None
    assert not alpha.release("n2", alpha_lead)
    still = read_claim(shared.get(shared.keys.claim("n2")))
    assert still is not None and still.run == "alpha"
    # its successor (a standby of the same run) finds the run's claims and adopts them
    successor = Claims(shared, "alpha", identity="a-2")
    others = successor.load(shared.get_prefix(shared.keys.claims_prefix())[0])
    assert successor.held() == {"n2"} and others == {"n3": "beta"}
    assert successor.release("n2", lead(shared, "alpha"))


def test_operator_release_of_a_vanished_runs_claims(shared: Store) -> None:
    gone = Claims(shared, "gone")
    stays = Claims(shared, "stays")
    assert gone.take(["n1", "n2"], lead(shared, "gone")) == []
    assert stays.take(["n3"], lead(shared, "stays")) == []
    assert release_by_operator(shared, run="gone") == ["n1", "n2"]
    assert release_by_operator(shared, node="n3") == ["n3"]
    assert shared.get_prefix(shared.keys.claims_prefix())[0] == []


def _alpha_asked(store: Store, node: str, timeout_s: float = 5.0) -> None:
    """Wait until alpha's bid for `node` is in etcd (or alpha already holds it): beta then asks
    second by etcd's order, not by a sleep that two loaded cores can swallow."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if store.get(store.keys.bid(node, "alpha")) or store.get(store.keys.claim(node)):
            return
        time.sleep(0.002)
    raise AssertionError(f"alpha never asked for {node}")


def _race(
    store: Store, priorities: tuple[int, int], rounds: int, beta_second: bool = False, tag: str = "spare"
) -> list[str]:
    """Both runs ask for the same free node at once (with `beta_second`, beta asks once alpha's bid
    is in etcd, within the bid window), `rounds` times; the winner of each round."""
    runs = ("alpha", "beta")
    leads = {r: lead(store, r) for r in runs}
    claims = {
        r: Claims(store, r, priority=p, identity=r, bid_window_s=0.1)
        for r, p in zip(runs, priorities, strict=True)
    }
    winners = []
    for i in range(rounds):
        node = f"{tag}{i}"
        start = threading.Barrier(2)
        refused: dict[str, list[str]] = {}

        def ask(
            run: str,
            node: str = node,
            start: threading.Barrier = start,
            refused: dict[str, list[str]] = refused,
        ) -> None:
            start.wait()
            if run == "beta" and beta_second:
                _alpha_asked(store, node)
            refused[run] = [r.node for r in claims[run].take([node], leads[run])]

        threads = [threading.Thread(target=ask, args=(r,)) for r in runs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        won = [r for r in runs if not refused[r]]
        holder = read_claim(store.get(store.keys.claim(node)))
        assert len(won) == 1, (
            f"round {i}: {won} both took {node}" if won else f"round {i}: nobody took {node}"
        )
        assert holder is not None and holder.run == won[0]
        assert store.get_prefix(store.keys.bids_prefix(node))[0] == []  # no bid left behind
        winners.append(won[0])
    for leadership in leads.values():
        leadership.resign()
    return winners


def test_two_runs_asking_at_once_never_both_take_a_spare_and_priority_wins(shared: Store) -> None:
    assert _race(shared, (0, 5), rounds=15) == ["beta"] * 15  # the higher priority, every time


def test_same_priority_first_asker_wins_and_never_both(shared: Store) -> None:
    assert _race(shared, (1, 1), rounds=8, beta_second=True) == ["alpha"] * 8  # first come
    assert (
        len(_race(shared, (1, 1), rounds=8, tag="again")) == 8
    )  # truly at once: one of them, never both (asserted inside)


def test_a_run_alone_takes_many_nodes_a_transaction_and_a_held_one_is_refused_alone(shared: Store) -> None:
    """No other run campaigns under the root (no bid round): 250 nodes in 3 transactions of 100; a
    chunk holding a node another run kept (its controller gone, its claim left) is taken node by node:
    that node refused, the rest of its chunk taken."""
    shared.put(shared.keys.claim("n120"), b"")  # unreadable: no run can be said to hold it
    beta = Claims(shared, "beta")
    beta_lead = lead(shared, "beta")
    assert beta.take_now("n130", beta_lead) == ""
    beta_lead.resign()  # beta's controller is gone; its claim stays
    txns = 0
    real_txn = shared.txn

    def counted(*args, **kwargs):
        nonlocal txns
        txns += 1
        return real_txn(*args, **kwargs)

    shared.txn = counted  # the real transaction, counted
    alpha = Claims(shared, "alpha")
    nodes = [f"n{i:03d}" for i in range(250)]
    refused = alpha.take(nodes, lead(shared, "alpha"))
    assert sorted((r.node, r.reason.split(" (")[0]) for r in refused) == [
        ("n120", "claim not taken"),
        ("n130", "claimed by run beta"),
    ]
    assert alpha.held() == set(nodes) - {"n120", "n130"}
    assert txns == 3 + 100  # three chunks; the second's 100 nodes then one by one
    assert read_claim(shared.get(shared.keys.claim("n249"))).run == "alpha"
