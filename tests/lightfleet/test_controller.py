"""The real `controller run` drives 16 light agents (12 active, 4 spares) started as the CLI starts
them (`python -m lightfleet`'s two processes): it preflights and launches them, and each fault is
detected, blamed and recovered from as on real agents -- a crash relaunches (a new attempt record),
a lost lease is replaced by a spare, a hang's flight-recorder dumps blame the culprit's node -- and a
planned stop saves, commits and relaunches from that commit."""

from __future__ import annotations

import pytest

from runwarden.v1 import events_pb2, store_pb2

from .conftest import LightDeployment

E = events_pb2
pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
TTL_S = 3.0
# steps of 0.5 s, ranks loaded 1 s after the attempt record, leases of 3 s; the hang floor stays above
# the lease TTL (as the shipped 10 s is above 5 s) so a dark host is a lost lease, not a hang
FLAGS = ["--lease-ttl=3", "--step-s=0.5", "--startup-s=1", "--preflight-s=0.3:1", "--ckpt-every=4"]
POLICY = {"hang_timeout_floor_s": 8.0}


def deploy(light_deployment) -> tuple[LightDeployment, list[str]]:
    d: LightDeployment = light_deployment(nodes=16, active=12, flags=FLAGS, policy=POLICY)
    launch = d.steady()
    assert launch.attempt == 1 and len(launch.launch.nodes) == 12
    preflight = d.last(E.EVENT_KIND_PREFLIGHT_RESULT)
    assert "all 12 nodes passed quick preflight" in preflight.message
    return d, list(launch.launch.nodes)


def attempt_record(d: LightDeployment) -> store_pb2.AttemptRecord:
    kv = d.store.get(d.store.keys.attempt(d.RUN))
    assert kv is not None
    return store_pb2.AttemptRecord.FromString(kv.value)


def test_a_crash_is_detected_and_relaunched_under_a_new_attempt_record(light_deployment) -> None:
    d, nodes = deploy(light_deployment)
    victim = nodes[3]
    mark = d.mark()
    d.inject(f"crash {victim}")
    detection = d.wait_event(E.EVENT_KIND_DETECTION, mark)
    assert detection.detection.detector == E.DETECTOR_CRASH and detection.detection.nodes == [victim]
    assert "exit:1" in detection.message  # torchrun's exit after a rank died, as the real agent records it
    relaunch = d.steady(mark)
    assert relaunch.attempt == 2 and relaunch.launch.rendezvous_id == f"{d.RUN}-2"
    record = attempt_record(d)
    assert record.attempt == 2 and list(record.nodes) == list(relaunch.launch.nodes)
    blame = d.last(E.EVENT_KIND_ATTRIBUTION)
    assert blame.attribution.suspects[0].node == victim  # first to exit; not quarantined on a first offence
    assert victim in relaunch.launch.nodes


def test_a_lost_lease_is_detected_and_its_node_replaced_by_a_spare(light_deployment) -> None:
    d, nodes = deploy(light_deployment)
    victim = nodes[5]
    spares = sorted(set(d.fleet.names) - set(nodes))
    mark = d.mark()
    d.inject(f"lease-loss {victim}")
    lost = d.wait_event(E.EVENT_KIND_DETECTION, mark, TTL_S + 10)
    assert lost.detection.detector == E.DETECTOR_NODE_LOST and lost.detection.nodes == [victim]
    spare = d.wait_event(E.EVENT_KIND_SPARE_TAKEN, mark)
    assert spare.spare.replaces == victim and spare.spare.node in spares
    relaunch = d.steady(mark)
    assert victim not in relaunch.launch.nodes and spare.spare.node in relaunch.launch.nodes
    assert attempt_record(d).attempt == relaunch.attempt == 2


def test_a_hang_is_blamed_on_the_culprits_node_from_its_flight_recorder_dumps(light_deployment) -> None:
    d, nodes = deploy(light_deployment)
    # node rank 9: hosted by the fleet's second process, while node rank 0 is in the first -- the hang
    # stops every node of the attempt at one step across processes
    victim, node_rank = nodes[9], 9
    assert victim in d.fleet.children[1].nodes and nodes[0] in d.fleet.children[0].nodes
    mark = d.mark()
    d.inject(f"hang {victim} culprit-rank 5")
    detection = d.wait_event(E.EVENT_KIND_DETECTION, mark, 30)
    assert detection.detection.detector == E.DETECTOR_HANG
    blame = d.wait_event(E.EVENT_KIND_ATTRIBUTION, mark)
    assert blame.attribution.blame_method == E.BLAME_METHOD_FLIGHT_RECORDER, blame.message
    top = blame.attribution.suspects[0]
    assert (top.node, list(top.ranks)) == (victim, [node_rank * 8 + 5])
    assert len(blame.attribution.suspects) == 1  # the waiting ranks are not blamed
    quarantine = d.wait_event(E.EVENT_KIND_QUARANTINE, mark)
    assert quarantine.quarantine.node == victim
    relaunch = d.steady(mark)
    assert victim not in relaunch.launch.nodes


def test_a_planned_stop_commits_and_relaunches_from_that_commit_on_the_same_nodes(light_deployment) -> None:
    d, nodes = deploy(light_deployment)
    mark = d.mark()
    out = d.ctl("stop", d.RUN, "--relaunch", "--reason", "new config")
    assert out.returncode == 0 and "restart requested" in out.stdout, out.stderr
    relaunch = d.steady(mark)
    between = [e for e in d.events() if mark < e.seq < relaunch.seq]
    kinds = {e.kind for e in between}
    assert E.EVENT_KIND_STOP_REQUEST in kinds and not kinds & {
        E.EVENT_KIND_DETECTION,
        E.EVENT_KIND_QUARANTINE,
    }
    (ended,) = [e for e in between if e.kind == E.EVENT_KIND_EXIT]
    assert (ended.exit.classification, ended.message) == (
        "planned_stop",
        "attempt 1 ended on 12 nodes: clean x12",
    )
    commits = [e.step for e in between if e.kind == E.EVENT_KIND_CHECKPOINT_COMMIT]
    assert commits and relaunch.launch.resume_step == max(commits) > 0
    assert list(relaunch.launch.nodes) == nodes


@pytest.mark.timeout(240)
def test_an_attempt_of_more_nodes_than_etcds_transaction_limit_launches(light_deployment) -> None:
    """160 nodes on a stock etcd (--max-txn-ops 128): the attempt record's transaction compares the
    claims as one prefix (controller.fleet.claims), not one compare a node, and the run starts; a
    crash then relaunches it the same way."""
    d: LightDeployment = light_deployment(
        nodes=164, active=160, flags=[*FLAGS, "--preflight-s=0.2:0.5"], policy=POLICY
    )
    launch = d.wait_event(E.EVENT_KIND_LAUNCH, 0, timeout_s=150)
    d.wait_event(E.EVENT_KIND_WORKERS_STARTED, launch.seq, timeout_s=120)
    assert launch.attempt == 1 and len(launch.launch.nodes) == 160
    assert attempt_record(d).attempt == 1
    assert not [e for e in d.events() if "too many operations" in e.message]
    mark = d.mark()
    d.inject(f"crash {launch.launch.nodes[7]}")
    relaunch = d.wait_event(E.EVENT_KIND_LAUNCH, mark, timeout_s=90)
    d.wait_event(E.EVENT_KIND_WORKERS_STARTED, relaunch.seq, timeout_s=90)
    assert relaunch.attempt == 2 and attempt_record(d).attempt == 2
