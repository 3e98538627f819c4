"""Agents as distinct hosts on loopback: a real 2-node gloo job through the controller.

127.0.0.0/8 is all loopback, so agents that listen and advertise on 127.0.0.11, 127.0.0.12, 127.0.0.13
behave like three hosts without namespaces: nothing works unless every address is each agent's own.
The controller picks nothing about the launch on its host: the rendezvous is node rank 0's agent's
advertised host and the port it reported, each node's torchrun is its own agent's (its interpreter,
its ranks, --local-addr = its address, the collective interface), and the job takes steps.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from controller.supervisor.machine import Supervisor
from controller.supervisor.policy import RunPlan
from nodeagent.daemon import proctree
from runwarden.v1 import agent_pb2, events_pb2, store_pb2
from tests.live.shell import RUN, is_launch, live_shell, policy
from tests.nodeagent.helpers import ROOT, AgentProc, wait_for

E = events_pb2
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
HOSTS = {"h1": "127.0.0.11", "h2": "127.0.0.12", "h3": "127.0.0.13"}


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def _torchrun_line(agent: AgentProc) -> list[str]:
    """The torchrun command line the agent started for the run (its worker's leader)."""
    status = agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest(), timeout=5)
    (worker,) = [w for w in status.workers if w.run == RUN and w.running]
    return _cmdline(worker.pid)


def test_two_nodes_on_distinct_loopback_hosts_rendezvous_at_node_rank_0_and_take_steps(etcd, store, tmp_path):
    preflight = tmp_path / "preflight.toml"
    preflight.write_text(
        '[compute]\nmodes = ["full"]\nsize_cpu = 64\niterations_cpu = 1\n'
        '[collective]\nmodes = ["full"]\nsize_bytes_cpu = 65536\niterations = 1\ncpu_processes = 2\n'
        f'[storage]\ncheckpoint_path = "{tmp_path}"\nfree_space_floor_gb = 0.01\n'
    )
    agents: dict[str, AgentProc] = {}
    try:
        for node, host in HOSTS.items():
            agents[node] = AgentProc(
                tmp_path / node,
                node=node,
                etcd=etcd.endpoint,
                etcd_root=store.keys.root,
                flags=[
                    "--listen",
                    f"{host}:0",
                    "--allow-exec",
                    sys.executable,
                    "--torchrun",
                    shlex.join([sys.executable, "-m", "torch.distributed.run"]),
                    "--collective-ifname",
                    "lo",
                    "--local-ranks",
                    "1",
                    "--lease-ttl",
                    "3",
                    "--preflight-config",
                    str(preflight),
                ],
            )
        records = {}
        for node in HOSTS:
            kv = wait_for(lambda n=node: store.get(store.keys.node(n)), 10, f"{node}'s record")
            records[node] = store_pb2.NodeRecord.FromString(kv.value)
            assert records[node].torch_host == HOSTS[node] and records[node].rdzv_port > 0

        command = (
            str(ROOT / "examples" / "train.py"),
            "--steps",
            "100000",
            "--ckpt-dir",
            str(tmp_path / "ckpt"),
            "--ckpt-every",
            "1000",
            "--out",
            str(tmp_path / "out"),
            "--step-sleep",
            "0.05",
        )
        env = (("OMP_NUM_THREADS", "1"), ("PYTHONPATH", str(ROOT)))
        core = lambda: Supervisor(policy(startup_timeout_s=240.0), RunPlan(run=RUN, nodes=2))  # noqa: E731
        with live_shell(store, tmp_path / "run", core_factory=core, command=command, env=env) as (shell, log):
            launched_at, launch = log.wait(is_launch(1), 120)
            first_at, _ = log.wait(lambda e: e.kind == E.EVENT_KIND_FIRST_STEP, 180)
            nodes = list(launch.launch.nodes)
            assert len(nodes) == 2 and set(nodes) <= set(HOSTS)
            head = records[nodes[0]]
            endpoint = f"{head.torch_host}:{head.rdzv_port}"
            lines = {node: _torchrun_line(agents[node]) for node in nodes}
            for rank, node in enumerate(nodes):
                line = lines[node]
                assert f"--rdzv-endpoint={endpoint}" in line, line
                assert f"--local-addr={HOSTS[node]}" in line and f"--node-rank={rank}" in line
                assert f"--rdzv-conf=is_host={'true' if rank == 0 else 'false'}" in line
                assert "--nproc-per-node=1" in line and "--max-restarts=0" in line
                assert line[:3] == [sys.executable, "-m", "torch.distributed.run"]

            # Steps continue: both nodes' ranks report progress past the first step.
            def stepped() -> bool:
                ranks = {}
                for node in nodes:
                    kv = store.get(store.keys.progress(RUN, node))
                    if kv is None:
                        return False
                    prog = store_pb2.NodeProgress.FromString(kv.value)
                    ranks.update({r.rank: (node, r.step) for r in prog.ranks})
                return sorted(ranks) == [0, 1] and all(step >= 5 for _, step in ranks.values())

            wait_for(stepped, 60, "both ranks past step 5")
            # The map used for blame is torch's: each rank where its own report came from.
            placed = shell.translator.ranks()
            assert sorted(placed) == [0, 1] and set(placed.values()) == set(nodes)
            # The collectives' interface reached the ranks.
            status = agents[nodes[1]].stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest(), timeout=5)
            rank_pid = next(r.pid for r in status.ranks if r.pid > 0)
            env_of_rank = Path(f"/proc/{rank_pid}/environ").read_bytes().split(b"\0")
            assert b"GLOO_SOCKET_IFNAME=lo" in env_of_rank and b"NCCL_SOCKET_IFNAME=lo" in env_of_rank
            print(
                f"\nnodes {nodes} met at {endpoint} (node rank 0's agent); first step "
                f"{first_at - launched_at:.1f} s after the launch; torch ranks {placed}"
            )
    finally:
        leaders = []
        for agent in agents.values():
            try:
                status = agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest(), timeout=5)
                leaders += [w.pid for w in status.workers if w.running]
            except Exception:
                pass
            agent.close()
        for pid in leaders:
            assert proctree.read_proc(pid) is None or proctree.read_proc(pid).state == "Z"
