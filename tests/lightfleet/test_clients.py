"""Light agents answer the controller's real clients (controller.backends.agents.AgentClients and the
local backend that launches through them) over real gRPC, and what they put in the real etcd reads
back through the controller's real Translator."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

import runwarden
from controller.backends.agents import AgentClients
from controller.backends.base import AttemptSpec, AttemptState
from controller.backends.local import LocalBackend
from controller.live.translate import Translator
from controller.supervisor import flight_recorder
from controller.supervisor.events import AttemptExited, Event, NodeJoined, ProgressObserved
from lightfleet.agent import WARM_ON
from lightfleet.process import Receipts
from lightfleet.settings import AgentSettings, Latency
from runwarden.store import EventType, Store, WatchEvent
from runwarden.v1 import agent_pb2, agent_pb2_grpc, common_pb2, store_pb2
from testbed.wait import wait_until

RUN = "r1"
NODES = ("n0", "n1", "n2")
FAST = AgentSettings(preflight=Latency.fixed(0.2), step_s=0.3, startup_s=0.5, ckpt_every=0)


def node_events(store: Store, translator: Translator, clients: AgentClients) -> list[Event]:
    """The node records as the controller's relist-free watch path reads them (one PUT each)."""
    kvs, _ = store.get_prefix(store.keys.nodes_prefix())
    out: list[Event] = []
    for kv in kvs:
        item = WatchEvent(
            type=EventType.PUT,
            key=kv.key,
            value=kv.value,
            mod_revision=kv.mod_revision,
            create_revision=kv.create_revision,
        )
        events, addresses = translator.watch_event(item)
        for node, (address, registration) in addresses.set.items():
            clients.set_address(node, address, registration)
        out += events
    return out


def test_the_controllers_clients_preflight_launch_read_progress_collect_dumps_and_stop(
    hosted, store: Store
) -> None:
    h = hosted(3, FAST)
    keys = store.keys
    translator = Translator(keys, RUN, procs_per_node=1)
    clients = AgentClients()
    joined = node_events(store, translator, clients)
    assert sorted((e.node, e.local_ranks) for e in joined if isinstance(e, NodeJoined)) == [
        (n, 8) for n in NODES
    ]
    for node in NODES:
        record = translator.known_nodes[node]
        assert record.agent_version == runwarden.__version__ and record.state == common_pb2.NODE_STATE_READY
        assert record.address == h.address(node) and record.registered_at > 0
        assert store.lease_ttl(record.lease_id) > 0  # the record lives under the agent's own live lease
        assert translator.rendezvous(node) is not None

    # preflight: a pass, then an injected failure (evidence in etcd, the summary in the node record)
    passed = clients.run_preflight("n0", agent_pb2.RunPreflightRequest(mode="quick"), 10.0)
    assert passed.ok and passed.summary.passed and passed.summary.mode == "quick"
    h.inject("fail-preflight n1 check compute.matmul times 1")
    failed = clients.run_preflight("n1", agent_pb2.RunPreflightRequest(mode="full"), 10.0)
    assert failed.ok and not failed.summary.passed and [r.name for r in failed.failed] == ["compute.matmul"]
    evidence = wait_until(
        lambda: store.get_prefix(keys.evidence_prefix("n1"))[0], 5, "n1's preflight evidence"
    )
    record = store_pb2.EvidenceRecord.FromString(evidence[0].value).evidence
    assert record.kind == common_pb2.EVIDENCE_KIND_PREFLIGHT_FAIL and "compute.matmul" in record.detail
    wait_until(
        lambda: (
            (kv := store.get(keys.node("n1"))) is not None
            and store_pb2.NodeRecord.FromString(kv.value).last_preflight.fail_count == 1
        ),
        5,
        "n1's record to carry its failed preflight",
    )
    assert clients.run_preflight("n1", agent_pb2.RunPreflightRequest(mode="quick"), 10.0).summary.passed

    # launch through the controller's own backend, after the attempt record it writes first
    seen: list[Event] = []
    lock = threading.Lock()

    def on_progress(item: object) -> None:
        assert isinstance(item, WatchEvent)
        events, _ = translator.watch_event(item)
        with lock:
            seen.extend(events)

    watch = store.watch_prefix(keys.progress_prefix(RUN), None, on_progress)
    record = store_pb2.AttemptRecord(
        run=RUN, attempt=1, nodes=list(NODES), launched_at=time.time(), leader_fence=1
    )
    store.put(keys.attempt(RUN), record.SerializeToString())
    translator.new_attempt(1)
    backend = LocalBackend(clients, translator.rendezvous)
    handle = backend.launch(
        AttemptSpec(run=RUN, attempt=1, nodes=NODES, command=("train.py",), leader_fence=1)
    )
    assert {(s.node, s.path, s.detail) for s in handle.started} == {
        (n, "warm", WARM_ON)
        for n in NODES  # the real agent's default: warm workers
    }
    # the process stamps each arrival: one window of the fan-out's three launches, for attempt 1
    (launches,) = h.process.stats()["received"]["LaunchWorkers"]
    first, last, count, attempt = launches
    assert (count, attempt) == (3, 1) and first <= last <= time.time(), launches

    def steps() -> dict[str, int]:
        with lock:
            return {e.node: min(r.step for r in e.ranks) for e in seen if isinstance(e, ProgressObserved)}

    wait_until(
        lambda: len(steps()) == 3 and min(steps().values()) >= 2,
        15,
        "every node's ranks to step",
        detail=steps,
    )
    assert translator.ranks() == {
        rank: NODES[rank // 8] for rank in range(24)
    }  # torchrun's --node-rank order

    # a hang: the dumps through the controller's client, analysed by its real rule, blame n2's rank 6
    h.inject("hang n2 culprit-rank 6")
    request = agent_pb2.CollectFlightRecorderRequest(run=RUN, timeout_s=2.0)
    dumps = []
    for node in NODES:
        out, response = clients.collect_dumps(node, request, 5.0)
        assert out.ok and response is not None and response.node == node
        dumps += response.dumps
    verdict = flight_recorder.verdict_from_rank_dumps(dumps, translator.ranks())
    assert [(s.node, s.ranks) for s in verdict.suspects] == [("n2", (22,))]

    # the stop: hung ranks cannot act on TERM, so they are KILLed after the grace; the exits reach etcd
    status = backend.stop(handle, grace_s=0.5)
    assert status.state == AttemptState.STOPPED

    def exits() -> list[AttemptExited]:
        with lock:
            return [e for e in seen if isinstance(e, AttemptExited)]

    wait_until(lambda: len(exits()) == 3, 10, "the three exits", detail=exits)
    assert {(e.node, e.signal) for e in exits()} == {(n, 9) for n in NODES}
    _, status_response = clients.status("n0")
    assert status_response is not None and not any(w.running for w in status_response.workers)
    watch.cancel()


def test_a_launch_with_stop_older_parks_the_older_attempt_first_as_the_real_agent_does(
    hosted, store: Store
) -> None:
    """LaunchWorkersRequest.stop_older on a light agent: the older attempt's warm ranks park, the
    new attempt starts, one call; without it the launch is refused (ALREADY_EXISTS)."""
    hosted(2, FAST)
    nodes = NODES[:2]
    translator = Translator(store.keys, RUN, procs_per_node=1)
    clients = AgentClients()
    node_events(store, translator, clients)
    backend = LocalBackend(clients, translator.rendezvous)
    specs = {
        attempt: AttemptSpec(run=RUN, attempt=attempt, nodes=nodes, command=("train.py",), leader_fence=1)
        for attempt in (1, 2)
    }
    backend.launch(specs[1])
    older = agent_pb2.StopOlder(grace_s=1.0, park_within_s=3.0)
    reqs = dict(backend.requests(specs[2], endpoint=backend.endpoint(specs[2]), stop_older={"n0": older}))
    out, answer = clients.launch("n0", reqs["n0"], 10.0)
    assert out.ok and answer is not None and answer.launch_path == "warm"
    (ended,) = answer.stopped
    assert (ended.attempt, ended.running, ended.exit.exit_code) == (1, False, 1), ended  # parked: exit 1
    out, _ = clients.launch("n1", reqs["n1"], 10.0)
    assert not out.ok and out.code == "ALREADY_EXISTS", out

    def running(node: str) -> list[int]:
        _, status = clients.status(node)
        assert status is not None
        return [w.attempt for w in status.workers if w.running]

    assert (running("n0"), running("n1")) == ([2], [1])
    clients.close()


def test_requests_are_validated_and_refused_as_the_real_agent_does(hosted) -> None:
    h = hosted(1, FAST)
    with grpc.insecure_channel(h.address("n0")) as channel:
        stub = agent_pb2_grpc.NodeAgentStub(channel)
        cases = [
            (
                lambda: stub.RequestStop(agent_pb2.RequestStopRequest(run="bad/name")),
                "INVALID_ARGUMENT",
                "run",
            ),
            (
                lambda: stub.RequestStop(agent_pb2.RequestStopRequest(run="unknown")),
                "NOT_FOUND",
                "is not known",
            ),
            (
                lambda: stub.StopWorkers(agent_pb2.StopWorkersRequest(run="unknown")),
                "NOT_FOUND",
                "no workers",
            ),
            (
                lambda: list(stub.RunPreflight(agent_pb2.RunPreflightRequest(mode="fast"))),
                "INVALID_ARGUMENT",
                "mode",
            ),
            (
                lambda: stub.LaunchWorkers(agent_pb2.LaunchWorkersRequest(run="r", attempt=1, argv=[])),
                "INVALID_ARGUMENT",
                "argv",
            ),
            (
                lambda: stub.CollectFlightRecorder(
                    agent_pb2.CollectFlightRecorderRequest(run="r", timeout_s=-1)
                ),
                "INVALID_ARGUMENT",
                "timeout_s",
            ),
            (lambda: stub.Drain(agent_pb2.DrainRequest(reason="a\nb")), "INVALID_ARGUMENT", "printable"),
            (
                lambda: list(stub.MeasureAllReduce(agent_pb2.MeasureAllReduceRequest())),
                "UNIMPLEMENTED",
                "no all-reduce",
            ),
            (lambda: stub.InjectFault(agent_pb2.InjectFaultRequest()), "UNIMPLEMENTED", "control channel"),
        ]
        for call, code, words in cases:
            with pytest.raises(grpc.RpcError) as exc:
                call()
            assert (exc.value.code().name, words in exc.value.details()) == (code, True), exc.value.details()
        drained = stub.Drain(agent_pb2.DrainRequest(reason="maintenance"))
        assert drained.draining and drained.reason == "maintenance"
        status = stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest())
        assert status.state == common_pb2.NODE_STATE_DRAINING and status.lease_held
        assert 0 <= status.last_heartbeat_age_s < FAST.lease_ttl_s
        h.inject("lease-loss n0")
        with pytest.raises(grpc.RpcError) as exc:
            stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest())
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE


def test_receipts_are_windows_of_arrivals_split_by_a_quiet_gap_or_another_attempt() -> None:
    r = Receipts()
    for at in (10.0, 10.4, 11.2):  # gaps under GAP_S: one window
        r.add("LaunchWorkers", at, attempt=2)
    r.add("LaunchWorkers", 11.3, attempt=3)  # another attempt: a window of its own
    r.add("LaunchWorkers", 11.3 + Receipts.GAP_S + 0.1, attempt=3)  # after a quiet gap: another
    r.add("RunPreflight", 10.0)
    assert r.as_dict() == {
        "LaunchWorkers": [[10.0, 11.2, 3, 2], [11.3, 11.3, 1, 3], [12.4, 12.4, 1, 3]],
        "RunPreflight": [[10.0, 10.0, 1, 0]],
    }
    for i in range(Receipts.WINDOWS + 5):  # bounded: the newest kept
        r.add("StopWorkers", 100.0 + 10 * i)
    kept = r.as_dict()["StopWorkers"]
    assert len(kept) == Receipts.WINDOWS and kept[-1][0] == 100.0 + 10 * (Receipts.WINDOWS + 4)
