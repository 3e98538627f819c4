"""A real multi-node Ray cluster on this host for tests and benchmarks (`start_ray_cluster`): a head
with no CPUs (so no bundle lands there) and 1-CPU worker raylets, each on its own loopback address
(ray.cluster_utils.Cluster). A start is retried with a growing pause; every failed start is
reported on stderr and the last one is raised.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any


def start_ray_cluster(head_ip: str, worker_ips: Sequence[str], *, attempts: int = 5) -> Any:
    """A started `ray.cluster_utils.Cluster` with every worker registered, or the last error.

    Why retry: a worker raylet occasionally dies within a second of its start on a busy host (Ray then
    waits 30 s: "The current node timed out during startup"); what is tested is runwarden on a cluster,
    not whether Ray's own start is flawless.
    """
    from ray import cluster_utils

    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, not {attempts}")
    for attempt in range(1, attempts + 1):
        cluster = None
        try:
            cluster = cluster_utils.Cluster(
                initialize_head=True,
                head_node_args={"num_cpus": 0, "node_ip_address": head_ip, "include_dashboard": False},
            )
            for ip in worker_ips:
                cluster.add_node(num_cpus=1, node_ip_address=ip)
            cluster.wait_for_nodes()
            return cluster
        except Exception as e:  # Ray raises bare Exception for a node that did not start
            print(f"ray cluster start {attempt}/{attempts} failed: {e}", file=sys.stderr)
            if cluster is not None:
                try:
                    cluster.shutdown()
                except Exception as shutdown_error:
                    print(f"ray cluster shutdown after a failed start: {shutdown_error}", file=sys.stderr)
            if attempt == attempts:
                raise
            time.sleep(5.0 * attempt)
    raise AssertionError("unreachable")
