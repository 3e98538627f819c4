"""runwarden as the demo deploys it (examples/demo.demo_cluster): examples/cluster.LocalCluster (private
etcd, 4 active node agents + 2 spares, the controller, gloo ranks under each agent) with the shipped
defaults (preflight's, the agents' warm-worker setting: whatever the agent ships) but for
`kill_stragglers_mid_run`, running examples/train.py unchanged. The faults are injected as for the
peers (signals to the rank's pid, the agent's pid); the straggler through `controllerctl chaos
slow-rank`, which makes the rank's `ProgressReporter.report` sleep exactly as the peers' adapter does.

A rank's process is found through its agent (GetNodeStatus on the agent's unix socket: the pid each
rank reports with its progress), the same for a cold rank (torchrun's child) and a warm one (a parked
process, nodeagent/warm/rank.py, whose command line and start-up environment name no rank)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import grpc

from bench.peers.observe import Tail, processes_mentioning
from examples.demo import demo_cluster, demo_spec
from runwarden.v1 import agent_pb2, agent_pb2_grpc, common_pb2, events_pb2

E = events_pb2


class RunwardenDeployment:
    store_node = 0  # node rank 0's torchrun hosts the attempt's c10d store

    def __init__(self, root: Path, tail: Tail) -> None:
        self.root = root
        self.cluster = demo_cluster(root / "c")
        self.loss_dir = self.cluster.loss_dir
        self.tail = tail

    @staticmethod
    def config() -> dict[str, object]:
        return {
            "spec": {k: v for k, v in vars(demo_spec()).items() if k != "train_args"},
            "layout": "LocalCluster",
            "preflight": "shipped defaults + the checkpoint path",
        }

    def start(self) -> None:
        self.cluster.start()

    def _launch_nodes(self) -> list[str]:
        for ev in reversed(self.cluster.events()):
            if ev.kind == E.EVENT_KIND_LAUNCH:
                return list(ev.launch.nodes)
        return []

    def node_of_rank(self, rank: int) -> str:
        return self._launch_nodes()[rank]  # node rank `rank` (its global rank is c10d's join order)

    def rank_pid(self, rank: int) -> int | None:
        found = self._rank_process(rank)
        return found[0] if found else None

    def node_of_pid(self, pid: int) -> str:
        """The node whose agent reports a rank with this pid ("" if none does)."""
        for node in self._launch_nodes():
            if any(r.pid == pid for r in self._reported_ranks(node)):
                return node
        return ""

    def _rank_process(self, rank: int) -> tuple[int, str] | None:
        """(pid, node) of global rank `rank` of the current attempt, as its agent reports it."""
        for node in self._launch_nodes():
            for r in self._reported_ranks(node):
                if r.rank == rank and r.pid > 0:
                    return r.pid, node
        return None

    def _reported_ranks(self, node: str) -> list[common_pb2.RankProgress]:
        sock = self.cluster.root / "nodes" / node / "agent.sock"
        with grpc.insecure_channel(f"unix:{sock}") as channel:
            try:
                status = agent_pb2_grpc.NodeAgentStub(channel).GetNodeStatus(
                    agent_pb2.GetNodeStatusRequest(), timeout=5.0
                )
            except grpc.RpcError:
                return []  # a dead agent reports nothing
        return list(status.ranks)

    def kill_launcher(self, node_rank: int) -> str:
        node = self.node_of_rank(node_rank)
        self.cluster.kill_agent_process(node)  # SIGKILL the agent alone; its lease expires like a crash
        return node

    def restart_launcher(self, node: str) -> None:
        self.cluster.restart_agent(node)

    def slow_rank(self, rank: int, seconds: float) -> None:
        out = self.cluster.ctl("chaos", self.node_of_rank(rank), "slow-rank", "--seconds", f"{seconds:g}")
        if out.returncode != 0:
            raise RuntimeError(f"chaos slow-rank failed: {out.stderr.strip()}")

    def first_reaction(self, after: float, dead_node: str = "") -> float | None:
        for ev in self.cluster.events():
            if ev.kind == E.EVENT_KIND_DETECTION and ev.ts > after:
                return ev.ts
        return None

    def reaction_lines(self, after: float, dead_node: str = "", limit: int = 6) -> list[str]:
        kinds = (E.EVENT_KIND_DETECTION, E.EVENT_KIND_ATTRIBUTION, E.EVENT_KIND_QUARANTINE,
                 E.EVENT_KIND_SPARE_TAKEN, E.EVENT_KIND_LAUNCH)  # fmt: skip
        return [
            f"+{ev.ts - after:.1f}s {E.EventKind.Name(ev.kind).removeprefix('EVENT_KIND_').lower()}: {ev.message[:200]}"
            for ev in self.cluster.events()
            if ev.ts > after and ev.kind in kinds
        ][:limit]

    def nodes_after(self, after: float) -> list[str] | None:
        """The nodes of the first attempt launched after `after` (None: none was)."""
        for ev in self.cluster.events():
            if ev.kind == E.EVENT_KIND_LAUNCH and ev.ts > after:
                return list(ev.launch.nodes)
        return None

    def alive(self) -> bool:
        return self.cluster.controller is not None and self.cluster.controller.poll() is None

    def stop(self, grace_s: float = 40.0) -> list[str]:
        """LocalCluster.stop's signals (agents SIGINT: stop the workers now; controller SIGTERM), then
        count what is still running before LocalCluster.stop kills the strays and etcd."""
        c = self.cluster
        procs = [p for p in [c.controller, *c.agents.values()] if p is not None]
        for p in procs:
            if p.poll() is None:
                sig = signal.SIGTERM if p is c.controller else signal.SIGINT
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, sig)
        deadline = time.monotonic() + grace_s
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        time.sleep(0.5)
        keep = {c.etcd.pid} if c.etcd is not None and c.etcd.pid else set()
        left = [f"{p.pid} {' '.join(p.cmdline)[:160]}" for p in processes_mentioning(str(self.root))
                if p.pid not in keep and "etcd" not in " ".join(p.cmdline)]  # fmt: skip
        c.stop()
        return left
