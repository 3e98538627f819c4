"""controllerctl on a root with several runs (issue 21), against a real Controller API server over a
real etcd: `status` lists every run with its own leader and claimed nodes, `nodes` names the run
holding each node, `claims release` gives back a gone run's claims and refuses a run that leads."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.api.access import AccessPolicy
from controller.api.server import build_server
from controller.api.store_view import StoreBackedView
from controller.ctl.main import main
from controller.fleet.claims import Claims
from runwarden.keys import run_election
from runwarden.store import Store
from runwarden.v1 import store_pb2

from .conftest import populate


@pytest.fixture
def two_runs(store: Store, tmp_path: Path) -> Iterator[str]:
    """Run "llm" (the fixture's, 4 nodes) led by ctl-a; run "vision" with no controller left."""
    populate(store, 1_764_547_200.0, claims=False)
    k = store.keys
    store.put(k.spec("vision"), store_pb2.RunSpec(run="vision", nodes=1, max_attempts=3).SerializeToString())
    store.put(
        k.attempt("vision"),
        store_pb2.AttemptRecord(
            run="vision", attempt=1, nodes=["n4"], rendezvous_id="vision-1"
        ).SerializeToString(),
    )
    # ctl-a's lease must outlast this process starved for seconds on a loaded machine (the full suite
    # once lost a 5 s one mid-test, and `claims release --run llm` then found no leader): 30 s
    llm = store.campaign(run_election("llm"), b"ctl-a", ttl_s=30, timeout_s=5)
    assert Claims(store, "llm").take(["n0", "n1", "n3"], llm) == []
    vision = store.campaign(run_election("vision"), b"ctl-v", ttl_s=30, timeout_s=5)
    assert Claims(store, "vision").take(["n4"], vision) == []
    vision.resign()  # its controllers are gone; its claim stays (persistent by design)
    server, port = build_server(
        StoreBackedView(store, tmp_path / "events.jsonl"), "127.0.0.1:0", policy=AccessPolicy()
    )
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)
        llm.resign()


def ctl(capsys: pytest.CaptureFixture[str], address: str, *args: str) -> tuple[int, str, str]:
    rc = main(["--controller", address, *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_status_lists_every_run_with_its_leader_and_claims(
    two_runs: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = ctl(capsys, two_runs, "status")
    assert rc == 0
    lines = out.splitlines()
    assert not lines[0].startswith("leader:") or "unknown" not in lines[0]  # several runs: per row
    header = next(line for line in lines if line.startswith("RUN"))
    assert header.split()[-3:] == ["CLAIMED", "LEADER", "REASON"]
    rows = {line.split()[0]: line.split() for line in lines[lines.index(header) + 1 :]}
    assert set(rows) == {"llm", "vision"}
    claimed = header.index("CLAIMED")
    llm_line = next(line for line in lines if line.startswith("llm "))
    vision_line = next(line for line in lines if line.startswith("vision "))
    assert llm_line[claimed:].split()[:2] == ["3", "ctl-a"]
    assert vision_line[claimed:].split()[:2] == ["1", "none"]
    rc, out, _ = ctl(capsys, two_runs, "status", "--json")
    runs = {r["run"]: r for r in json.loads(out)["runs"]}
    assert runs["llm"]["leader"] == "ctl-a" and runs["llm"]["claimed_nodes"] == 3
    assert runs["vision"].get("leader", "") == "" and runs["vision"]["claimed_nodes"] == 1


def test_nodes_show_the_run_holding_each_and_claims_release(
    two_runs: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = ctl(capsys, two_runs, "nodes")
    lines = out.splitlines()
    col = lines[0].index("HELD BY")
    held = {line.split()[0]: line[col:].split()[0] for line in lines[1:]}
    assert held == {"n0": "llm", "n1": "llm", "n2": "-", "n3": "llm", "n4": "vision"}
    rc, _, err = ctl(capsys, two_runs, "claims", "release", "--run", "llm")
    assert rc == 1 and "has a leader (ctl-a)" in err  # a live run gives its nodes back itself
    rc, _, err = ctl(capsys, two_runs, "claims", "release", "n2")
    assert rc == 5 and "no run holds node 'n2'" in err
    rc, _, err = ctl(capsys, two_runs, "claims", "release", "n2", "--run", "vision")
    assert rc == 2
    rc, out, _ = ctl(capsys, two_runs, "claims", "release", "--run", "vision", "--json")
    assert rc == 0 and json.loads(out) == {"nodes": ["n4"]}
    rc, out, _ = ctl(capsys, two_runs, "--json", "nodes")
    nodes = {n["node"]: n for n in json.loads(out)["nodes"]}
    assert nodes["n4"].get("claimed_by", "") == "" and nodes["n0"]["claimed_by"] == "llm"
