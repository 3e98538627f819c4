"""Multi-host figures on a fleet of network-namespace hosts (root): the bandwidth gate's cost for 4 and
8 hosts, and the self-fencing time and detection latency of a host partitioned mid-run.

    .venv/bin/python bench/bench_fleet.py --hosts 4,8 --partitions 5 --out bench/results/bench_fleet.json

Each size is one `testbed.fleet_cluster.FleetCluster` (etcd, the controller and one agent
per host, each in its own namespace, mTLS; the gate on, 2 s leases, a 5 s stop grace). The gate's cost
is the duration the gate's own PREFLIGHT_RESULT event reports for the first launch. A partition takes
a node of the running attempt off the bridge; fencing is the time until no process but its agent is
left on that host (its agent stopped the ranks: TERM, KILL after the grace); detection is the NODE_LOST
DETECTION event's time after the cut. The host is healed before the next trial.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runwarden.v1 import events_pb2
from testbed.fleet import Fleet, default_prefix, heal, netns_pids, partition, sweep_orphans
from testbed.fleet_cluster import ClusterSpec, FleetCluster

E = events_pb2


def _nodes(cluster: FleetCluster) -> list[str]:
    return next(
        (list(e.launch.nodes) for e in reversed(cluster.events()) if e.kind == E.EVENT_KIND_LAUNCH), []
    )


def one_size(hosts: int, partitions: int) -> dict[str, object]:
    spec = ClusterSpec(active=hosts, spares=2, lease_ttl_s=2.0,
                       policy={"bandwidth_gate": True, "bandwidth_gate_timeout_s": 90.0, "stop_grace_s": 5.0})  # fmt: skip
    out: dict[str, object] = {"hosts": hosts}
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp, Fleet(default_prefix()) as fleet:
        cluster = FleetCluster(fleet, Path(tmp) / "c", spec)
        try:
            cluster.start()
            if cluster.wait_for_event(E.EVENT_KIND_FIRST_STEP, 0, 300) is None:
                raise SystemExit(f"{hosts} hosts: the run did not start")
            gate = next(e for e in cluster.events() if "bandwidth gate on" in e.message)
            match = re.search(r"\((\d+(?:\.\d+)?)s;", gate.message)
            out["gate_s"] = float(match.group(1)) if match else None
            out["gate_message"] = gate.message
            fences, detections = [], []
            for _ in range(partitions):
                time.sleep(3)
                victim = _nodes(cluster)[1]
                mark = cluster.events()[-1].seq
                host = cluster.host(victim)
                agent = cluster.agents[victim].pid
                t_cut = time.time()
                t0 = time.monotonic()
                partition(host)
                while [p for p in netns_pids(host.netns) if p != agent] and time.monotonic() - t0 < 30:
                    time.sleep(0.05)
                fences.append(time.monotonic() - t0)
                det = cluster.wait_for_event(E.EVENT_KIND_DETECTION, mark, 30)
                detections.append(det.ts - t_cut if det else float("nan"))
                cluster.wait_for_event(E.EVENT_KIND_FIRST_STEP, mark, 180)
                heal(host)
                cluster.wait_for_event(
                    E.EVENT_KIND_RELEASE, mark, 120, lambda e, v=victim: e.release.node == v
                )
            out["fence_s"] = fences
            out["detect_s"] = detections
            out["fence_median_s"] = statistics.median(fences) if fences else None
            out["detect_median_s"] = statistics.median(detections) if detections else None
        finally:
            cluster.stop()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", default="4,8")
    p.add_argument("--partitions", type=int, default=5)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    sweep_orphans()
    results = []
    for n in (int(x) for x in args.hosts.split(",") if x):
        results.append(one_size(n, args.partitions))
        print(json.dumps(results[-1]), flush=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
