"""What one agent RPC costs the controller (issue 31): the shell's CPU per call, by kind, at fleet width.

    PYTHONPATH=. flock /tmp/runwarden-heavy.lock .venv/bin/python bench/bench_agent_rpc.py \
        --hosts 2048 --repeats 5 --out bench/results/bench_agent_rpc.json

The controller's own `AgentClients` (one asyncio loop, one channel per node) fans each kind out to
`--hosts` nodes at once and waits for all (`gather`), as the executor and `LocalBackend` do; the
requests are the real ones (`LocalBackend.requests` for a launch of that many nodes). The agents are
grpc.aio servers in `--servers` other processes that answer at once, so the figures are the controller's side
alone: CPU seconds of this process (user + system) per fan-out, per call, and the fan-out's wall time.
Every node's channel has its own connection (as on a fleet, where each agent has its own address).
Medians over `--repeats`. On a real fleet the agents run on their own hosts; here they share the two
cores, so the wall time is an upper bound and the CPU per call is what scales with the fleet.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from controller.backends.agents import AgentClients  # noqa: E402
from controller.backends.base import AttemptSpec  # noqa: E402
from controller.backends.local import LocalBackend, Rendezvous  # noqa: E402
from runwarden.v1 import agent_pb2  # noqa: E402

SERVER = """
import asyncio, sys
from grpc import aio
from runwarden.v1 import agent_pb2, agent_pb2_grpc, common_pb2

class Agents(agent_pb2_grpc.NodeAgentServicer):
    async def LaunchWorkers(self, request, context):
        return agent_pb2.LaunchWorkersResponse(pid=1, launch_path="warm", launch_detail="parked ranks [1]")
    async def StopWorkers(self, request, context):
        return agent_pb2.StopWorkersResponse()
    async def GetNodeStatus(self, request, context):
        return agent_pb2.GetNodeStatusResponse(node="n")
    async def RunPreflight(self, request, context):
        yield agent_pb2.RunPreflightResponse(result=common_pb2.CheckResult(name="inventory", status=common_pb2.CHECK_STATUS_PASS))
        yield agent_pb2.RunPreflightResponse(summary=common_pb2.PreflightSummary(mode=request.mode, passed=True))
    async def CollectFlightRecorder(self, request, context):
        return agent_pb2.CollectFlightRecorderResponse()

async def main():
    server = aio.server()
    agent_pb2_grpc.add_NodeAgentServicer_to_server(Agents(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


def cpu_s() -> float:
    return time.process_time()  # every thread of this process, user + system


def fan_out(clients: AgentClients, kind: str, nodes: list[str], launches: dict[str, Any]) -> list[Any]:
    if kind == "launch":
        return [o for o, _ in clients.gather(clients.launch_async(n, launches[n], 60.0) for n in nodes)]
    if kind == "stop":
        req = agent_pb2.StopWorkersRequest(run="bench", attempt=1, grace_s=1.0)
        return clients.gather(clients.stop_async(n, req, 60.0) for n in nodes)
    if kind == "preflight":
        req = agent_pb2.RunPreflightRequest(mode="quick")
        return [o.rpc for o in clients.gather(clients.run_preflight_async(n, req, 60.0) for n in nodes)]
    if kind == "dumps":
        req = agent_pb2.CollectFlightRecorderRequest(run="bench", timeout_s=1.0)
        return [o for o, _ in clients.gather(clients.collect_dumps_async(n, req, 60.0) for n in nodes)]
    raise ValueError(kind)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    # Agent processes: one process answering 2,048 connections at once cancels some of their calls
    # (CANCELLED, with gRPC's sync and aio servers alike); a fleet's agents are a process each.
    p.add_argument("--servers", type=int, default=4)
    p.add_argument("--out", default="")
    args = p.parse_args()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    servers = [
        subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, env=env, text=True)
        for _ in range(args.servers)
    ]
    try:
        ports = [int(s.stdout.readline()) for s in servers if s.stdout is not None]
        nodes = [f"n{i:05d}" for i in range(args.hosts)]
        clients = AgentClients()
        for i, n in enumerate(nodes):
            clients.set_address(n, f"127.0.0.1:{ports[i % len(ports)]}", registration=1)
        spec = AttemptSpec(
            run="bench",
            attempt=1,
            nodes=tuple(nodes),
            command=("train.py",),
            env={"PYTHONPATH": "/repo"},
            resume_step=100,
            procs_per_node=8,
            leader_fence=1,
        )
        backend = LocalBackend(clients, lambda n: Rendezvous(host="10.0.0.1", port=29400))
        t0, c0 = time.monotonic(), cpu_s()
        launches = dict(backend.requests(spec, endpoint="10.0.0.1:29400"))
        build = {"wall_s": time.monotonic() - t0, "cpu_s": cpu_s() - c0}
        t0, c0 = time.monotonic(), cpu_s()
        fan_out(clients, "stop", nodes, launches)  # every channel connected before measuring
        cold = {"wall_s": time.monotonic() - t0, "cpu_s": cpu_s() - c0}
        print("stop on new channels", cold, flush=True)
        results: dict[str, Any] = {
            "launch_requests_built": {k: round(v, 3) for k, v in build.items()},
            # the first fan-out connects every node's channel: what a controller's first preflight pays
            "stop_on_new_channels": {k: round(v, 3) for k, v in cold.items()},
        }
        for kind in ("preflight", "launch", "stop", "dumps"):
            walls, cpus = [], []
            for _ in range(args.repeats):
                t0, c0 = time.monotonic(), cpu_s()
                outs = fan_out(clients, kind, nodes, launches)
                walls.append(time.monotonic() - t0)
                cpus.append(cpu_s() - c0)
                assert all(o.ok for o in outs), [o.error for o in outs if not o.ok][:3]
            results[kind] = {
                "wall_s": round(statistics.median(walls), 3),
                "cpu_s": round(statistics.median(cpus), 3),
                "cpu_us_per_call": round(1e6 * statistics.median(cpus) / args.hosts, 1),
            }
            print(kind, results[kind], flush=True)
        clients.close()
    finally:
        for server in servers:
            server.terminate()
            server.wait(10)
    out = {
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "load_before": [round(x, 2) for x in os.getloadavg()],
        "hosts": args.hosts,
        "repeats": args.repeats,
        "servers": args.servers,
        "results": results,
    }
    print(json.dumps(out))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
