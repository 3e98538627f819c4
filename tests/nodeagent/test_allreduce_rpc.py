"""MeasureAllReduce against real agents on distinct loopback addresses (127.0.0.11, .12, .13: all of
127.0.0.0/8 is loopback), each running a real gloo rank of `preflight.collective`; bad requests refused;
access as for the other mutating RPCs."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from runwarden.v1 import agent_pb2, agent_pb2_grpc
from tests.nodeagent.helpers import AgentProc, wait_for
from tests.support.pki import make_pki

HOSTS = ("127.0.0.11", "127.0.0.12", "127.0.0.13")
SIZE = 1 << 20


def tcp_stub(agent: AgentProc) -> agent_pb2_grpc.NodeAgentStub:
    """A stub on the agent's TCP listener (its address as the agent's log states it)."""
    m = wait_for(
        lambda: re.search(r"serving: tcp ([\d.]+):\d+ \(port (\d+)\)", agent.log()), 10, "the serving line"
    )
    channel = grpc.insecure_channel(f"{m.group(1)}:{m.group(2)}")
    return agent_pb2_grpc.NodeAgentStub(channel)


def request(group: str, rank: int, world: int, addr: str = "", port: int = 0, timeout_s: float = 60.0):
    return agent_pb2.MeasureAllReduceRequest(
        group_id=group,
        rank=rank,
        world_size=world,
        master_addr=addr,
        master_port=port,
        size_bytes=SIZE,
        iterations=3,
        warmup=1,
        timeout_s=timeout_s,
    )


def run_group(stubs, group: str, timeout_s: float = 60.0):
    """Rank 0 first; its first message names the master; then the others with it. Rank 0's items."""
    first = stubs[0].MeasureAllReduce(
        request(group, 0, len(stubs), timeout_s=timeout_s), timeout=timeout_s + 5
    )
    head = next(first)
    assert head.HasField("master")
    others = [
        s.MeasureAllReduce(
            request(group, r, len(stubs), head.master.addr, head.master.port, timeout_s),
            timeout=timeout_s + 5,
        )
        for r, s in enumerate(stubs[1:], 1)
    ]
    with ThreadPoolExecutor(len(stubs)) as pool:
        rest = [pool.submit(list, it) for it in others]
        tail = list(first)
        return head, tail, [f.result() for f in rest]


@pytest.fixture
def three_agents(agent_factory):
    agents = [
        agent_factory(node=f"n{i + 1}", flags=["--listen", f"{host}:0"]) for i, host in enumerate(HOSTS)
    ]
    return agents, [tcp_stub(a) for a in agents]


@pytest.mark.slow
def test_a_real_gloo_all_reduce_across_three_agents_and_then_a_pair(three_agents) -> None:
    agents, stubs = three_agents
    started = time.monotonic()
    head, tail, rest = run_group(stubs, "bw-test-set")
    elapsed = time.monotonic() - started
    # rank 0 listens on its own advertised host, on a port it chose there
    assert head.master.addr == "127.0.0.11" and 0 < head.master.port < 65536
    [item] = tail
    r = item.result
    assert r.correct and r.world_size == 3 and r.backend == "gloo" and r.size_bytes == SIZE
    assert r.iterations == 3 and r.time_s > 0 and r.busbw_gbps > 0
    assert r.busbw_gbps == pytest.approx(r.algbw_gbps * 2 * 2 / 3)
    assert [[i.WhichOneof("item") for i in items] for items in rest] == [["result"], ["result"]]
    print(f"3-node all-reduce through the agents: {elapsed:.2f}s, busbw {r.busbw_gbps:.3f} GB/s")
    # the node is free again at once: a pair on the other two, with n3 as rank 0
    _, tail, _ = run_group([stubs[2], stubs[1]], "bw-test-pair")
    assert tail[0].result.correct and tail[0].result.world_size == 2
    # the ranks ran as their own processes and are gone
    assert all("all-reduce bw-test-set: rank" in a.log() for a in agents)


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    return err.value


BAD = [
    ("group_id", dict(group_id="")),
    ("group_id", dict(group_id="a/b")),
    ("world_size", dict(world_size=1)),
    ("world_size", dict(world_size=100000)),
    ("rank", dict(rank=3)),
    ("rank", dict(rank=-1)),
    ("master_addr, master_port: rank 0 chooses", dict(master_addr="127.0.0.12", master_port=5000)),
    ("master_addr", dict(rank=1, master_addr="", master_port=5000)),
    ("master_addr", dict(rank=1, master_addr="bad host!", master_port=5000)),
    ("master_port", dict(rank=1, master_addr="127.0.0.12", master_port=0)),
    ("master_port", dict(rank=1, master_addr="127.0.0.12", master_port=70000)),
    ("size_bytes", dict(size_bytes=0)),
    ("size_bytes", dict(size_bytes=1 << 40)),
    ("iterations", dict(iterations=0)),
    ("warmup", dict(warmup=-1)),
    ("timeout_s", dict(timeout_s=0.0)),
    ("timeout_s", dict(timeout_s=float("nan"))),
    ("timeout_s", dict(timeout_s=1e9)),
]


def test_bad_requests_are_refused_and_the_agent_keeps_serving(agent_factory) -> None:
    agent = agent_factory(flags=["--listen", f"{HOSTS[0]}:0"])
    stub = tcp_stub(agent)
    for field, change in BAD:
        req = request("bw-bad", 0, 3)
        for key, value in change.items():
            setattr(req, key, value)
        err = _code(stub.MeasureAllReduce(req, timeout=10))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, err.details())
        assert err.details().startswith(field), (field, err.details())
    assert agent.proc.poll() is None
    assert stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest(), timeout=5).node == "n1"


def test_rank_0_alone_is_bounded_by_its_timeout_and_the_node_is_free_after(agent_factory) -> None:
    # A caller that never asks the other ranks: rank 0 waits for them at most timeout_s, then is killed.
    agent = agent_factory(flags=["--listen", f"{HOSTS[0]}:0"])
    stub = tcp_stub(agent)
    started = time.monotonic()
    call = stub.MeasureAllReduce(request("bw-alone", 0, 2, timeout_s=3.0), timeout=20)
    assert next(call).HasField("master")
    err = _code(call)
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "did not finish within 3 s" in err.details()
    assert time.monotonic() - started < 8
    # a caller that goes away: the agent stops the rank at once, and the node is free again
    call = stub.MeasureAllReduce(request("bw-gone", 0, 2, timeout_s=60.0), timeout=20)
    assert next(call).HasField("master")
    call.cancel()
    wait_for(lambda: "the caller went away" in agent.log(), 10, "the rank to be stopped")
    call = stub.MeasureAllReduce(request("bw-again", 0, 2, timeout_s=1.0), timeout=20)
    assert next(call).HasField("master")
    assert _code(call).code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_one_measurement_at_a_time_and_none_while_workers_run(agent_factory, tmp_path: Path) -> None:
    agent = agent_factory(flags=["--listen", f"{HOSTS[0]}:0", "--allow-exec", "/bin/sleep"])
    stub = tcp_stub(agent)
    busy = stub.MeasureAllReduce(request("bw-busy", 0, 2, timeout_s=30.0), timeout=40)
    assert next(busy).HasField("master")
    err = _code(stub.MeasureAllReduce(request("bw-second", 0, 2), timeout=10))
    assert err.code() == grpc.StatusCode.ABORTED and "busy" in err.details()
    busy.cancel()
    wait_for(lambda: "the caller went away" in agent.log(), 10, "the first rank to be stopped")
    # workers of an attempt: refused, saying why
    stub.LaunchWorkers(
        agent_pb2.LaunchWorkersRequest(run="r1", attempt=1, argv=["/bin/sleep", "30"], cwd=str(tmp_path)),
        timeout=10,
    )
    err = _code(stub.MeasureAllReduce(request("bw-workers", 0, 2), timeout=10))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "workers of run 'r1' attempt 1 are running" in err.details() and "compete" in err.details()
    stub.StopWorkers(agent_pb2.StopWorkersRequest(run="r1", grace_s=1), timeout=10)


def test_a_mutating_rpc_under_mtls(agent_factory, tmp_path, free_port) -> None:
    pki = make_pki(tmp_path / "pki")
    agent = agent_factory(
        flags=[
            "--listen",
            f"127.0.0.1:{free_port}",
            "--tls-cert",
            pki.server_cert,
            "--tls-key",
            pki.server_key,
            "--tls-client-ca",
            pki.ca_file,
        ]
    )
    ca = Path(pki.ca_file).read_bytes()
    admin = grpc.secure_channel(
        f"localhost:{free_port}",
        grpc.ssl_channel_credentials(
            ca, Path(pki.client_key).read_bytes(), Path(pki.client_cert).read_bytes()
        ),
    )
    bad = request("", 0, 2)  # passes the access check, then fails validation
    err = _code(agent_pb2_grpc.NodeAgentStub(admin).MeasureAllReduce(bad, timeout=10))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    # the local ranks' unix socket may not mutate when TLS is on
    assert _code(agent.stub.MeasureAllReduce(bad, timeout=10)).code() == grpc.StatusCode.PERMISSION_DENIED
    admin.close()


def test_threads_are_not_left_behind() -> None:
    assert not [t for t in threading.enumerate() if t.name.startswith("allreduce")]


@pytest.mark.slow
def test_the_agents_collective_interface_is_the_ranks(agent_factory) -> None:
    # collective_ifname becomes GLOO_SOCKET_IFNAME for the rank, as for the workers: an interface that
    # does not exist makes gloo fail, and the agent says so
    agents = [
        agent_factory(node=f"n{i + 1}", flags=["--listen", f"{host}:0", "--collective-ifname", "nosuch0"])
        for i, host in enumerate(HOSTS[:2])
    ]
    with pytest.raises(grpc.RpcError) as err:
        run_group([tcp_stub(a) for a in agents], "bw-ifname", timeout_s=30.0)
    assert err.value.code() == grpc.StatusCode.ABORTED and "nosuch0" in err.value.details()
