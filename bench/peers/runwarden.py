"""runwarden with the demo's settings: examples/cluster.LocalCluster (private etcd, 4 active node agents
+ 2 spares, the controller, torchrun + gloo under each agent), `kill_stragglers_mid_run` on, running
examples/train.py unchanged. The faults are injected as for the peers (signals to the rank's pid, the
agent's pid); the straggler through `controllerctl chaos slow-rank`, which makes the rank's
`ProgressReporter.report` sleep exactly as the peers' adapter does."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from bench.peers.observe import Tail, processes_mentioning, rank_pid
from examples.cluster import ClusterSpec, LocalCluster
from runwarden.v1 import events_pb2

E = events_pb2
DEMO_SPEC = ClusterSpec(policy={"kill_stragglers_mid_run": True})


class RunwardenDeployment:
    store_node = 0  # node rank 0's torchrun hosts the attempt's c10d store

    def __init__(self, root: Path, tail: Tail) -> None:
        self.root = root
        self.cluster = LocalCluster(root / "c", ClusterSpec(policy=dict(DEMO_SPEC.policy)))
        self.loss_dir = self.cluster.loss_dir
        self.tail = tail

    @staticmethod
    def config() -> dict[str, object]:
        return {
            "spec": {k: v for k, v in vars(DEMO_SPEC).items() if k != "train_args"},
            "layout": "LocalCluster",
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
        return rank_pid(str(self.cluster.root), rank)

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
