"""The agents' part of a run's policy (runwarden/run_policy.py), changed live: a real agent watching a
real etcd takes the flight-recorder size and trace level for its next launch and the progress
interval at once, refuses a bad record without losing the last good one, and keeps serving."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import pytest

from controller.supervisor.policy import SupervisorConfig
from controller.supervisor.reconfigure import to_value
from runwarden.run_policy import AgentPolicy
from runwarden.store import Store, StoreConfig
from runwarden.v1 import agent_pb2, store_pb2
from testbed.etcd_server import EtcdServer, free_port
from tests.nodeagent.helpers import ROOT, AgentProc, wait_for


def record(**values: object) -> bytes:
    return store_pb2.PolicyRecord(
        run="r1", values={k: to_value(v) for k, v in values.items()}
    ).SerializeToString()


def test_a_record_without_the_agents_keys_means_each_agents_own_config() -> None:
    assert AgentPolicy.parse(record(hang_timeout_floor_s=30.0)) == AgentPolicy()
    got = AgentPolicy.parse(
        record(agent_fr_buffer_size=5000, agent_trace_level="detail", agent_progress_interval_s=0.25)
    )
    assert got == AgentPolicy(fr_buffer_size=5000, trace_level="detail", progress_interval_s=0.25)
    assert got.trace_env()["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL"
    assert AgentPolicy(trace_level="").trace_env() == {}


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("agent_fr_buffer_size", -1, "agent_fr_buffer_size"),
        ("agent_fr_buffer_size", 10**9, "agent_fr_buffer_size"),
        ("agent_fr_buffer_size", "big", "agent_fr_buffer_size"),
        ("agent_fr_buffer_size", True, "agent_fr_buffer_size"),
        ("agent_trace_level", "verbose", "agent_trace_level"),
        ("agent_trace_level", 3, "agent_trace_level"),
        ("agent_progress_interval_s", 0.001, "agent_progress_interval_s"),
        ("agent_progress_interval_s", 3600.0, "agent_progress_interval_s"),
        ("agent_progress_interval_s", float("nan"), "agent_progress_interval_s"),
        ("agent_progress_interval_s", "fast", "agent_progress_interval_s"),
    ],
)
def test_a_bad_value_is_refused_by_the_agent_and_by_the_controller(
    key: str, value: object, says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        AgentPolicy.parse(record(**{key: value}))
    with pytest.raises(ValueError, match=says):
        SupervisorConfig(**{key: value})


def test_bytes_that_are_not_a_policy_record_are_refused() -> None:
    with pytest.raises(ValueError, match="not a PolicyRecord"):
        AgentPolicy.parse(b"\xff\xff\xff\xff garbage")


def _gauge(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith("runwarden_agent_progress_interval_seconds "):
            return float(line.split()[1])
    raise AssertionError("no progress interval gauge on /metrics")


def _launch_env(agent: AgentProc, tmp_path: Path, attempt: int) -> dict[str, str]:
    out = tmp_path / f"env-{attempt}.json"
    code = "import os,sys,json\njson.dump(dict(os.environ), open(sys.argv[1],'w'))"
    leader = agent.stub.LaunchWorkers(
        agent_pb2.LaunchWorkersRequest(
            run="r1",
            attempt=attempt,
            argv=[sys.executable, "-c", code, str(out)],
            env={"PYTHONPATH": str(ROOT)},
        )
    ).pid

    def ended() -> bool:
        ws = agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest()).workers
        return any(w.pid == leader and not w.running for w in ws)

    wait_for(ended, 20, "the worker to end")
    return json.loads(out.read_text())


def test_the_agent_takes_the_runs_policy_live_and_keeps_the_last_good_one(
    agent_factory, tmp_path: Path
) -> None:
    etcd = EtcdServer(tmp_path / "etcd", fast=True).start()
    store = Store.connect(StoreConfig(endpoints=(etcd.endpoint,), timeout_s=5.0))
    try:
        port = free_port()
        agent = agent_factory(
            etcd=etcd.endpoint,
            flags=[
                "--metrics-listen",
                f"127.0.0.1:{port}",
                "--progress-interval",
                "1.0",
                "--allow-exec",
                sys.executable,
            ],
        )
        key = store.keys.policy("r1")
        assert _gauge(port) == 1.0
        # No record yet: the agent's own flight-recorder size, torch's default tracing.
        env = _launch_env(agent, tmp_path, 1)
        assert env["TORCH_FR_BUFFER_SIZE"] == "2000" and "TORCH_DISTRIBUTED_DEBUG" not in env
        # The operator turns tracing up and the progress interval down (what `controllerctl config
        # set` writes): the interval changes at once, the next launch gets the rest.
        store.put(
            key, record(agent_fr_buffer_size=8000, agent_trace_level="detail", agent_progress_interval_s=0.2)
        )
        wait_for(lambda: _gauge(port) == 0.2, 10, "the progress interval to follow the policy")
        env = _launch_env(agent, tmp_path, 2)
        assert env["TORCH_FR_BUFFER_SIZE"] == "8000"
        assert env["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL" and env["TORCH_NCCL_TRACE_CPP_STACK"] == "1"
        # A bad record (a value out of range; then bytes that are no record) changes nothing.
        store.put(key, record(agent_progress_interval_s=0.001))
        store.put(key, b"\x08\x96\x01 not a record \xff")
        wait_for(lambda: agent.log().count("policy record refused") >= 2, 10, "both records refused")
        assert _gauge(port) == 0.2
        assert _launch_env(agent, tmp_path, 3)["TORCH_FR_BUFFER_SIZE"] == "8000"
        # The record removed: back to the agent's own config.
        store.delete(key)
        wait_for(lambda: _gauge(port) == 1.0, 10, "the agent's own interval again")
        assert _launch_env(agent, tmp_path, 4)["TORCH_FR_BUFFER_SIZE"] == "2000"
    finally:
        store.close()
        etcd.discard()
