"""A whole local deployment (etcd, agents, controller processes) per test; nothing left behind."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from examples.cluster import ClusterSpec, LocalCluster, leftover_processes


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[object]:
    made: list[LocalCluster] = []

    def make(**spec: object) -> LocalCluster:
        # cold unless a test names warm_workers (None: the shipped default, warm): most of these tests
        # find ranks by their /proc environment, which a warm rank does not carry
        cluster = LocalCluster(
            tmp_path / f"cluster{len(made)}", ClusterSpec(**{"warm_workers": False, **spec})
        )
        made.append(cluster)
        return cluster.start()

    yield make
    for cluster in made:
        cluster.stop()
        assert leftover_processes(cluster.root) == [], "processes of the test cluster were left behind"
