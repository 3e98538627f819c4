"""The controller's own state on /metrics, for the alerts in deploy/prometheus/alerts.yaml.

* ``runwarden_controller_is_leader{run, identity}``: 1 while this replica leads its run;
* ``runwarden_controller_leader_present{run}``: 1 while the run's election has a leader, as this
  replica reads etcd (a standby says so too: the alert needs no leader to be scraped);
* ``runwarden_pool_nodes{state}``: live nodes by pool state (spare, assigned, quarantined, burn_in,
  held; a node whose lease is gone is not counted: it is no spare);
* ``runwarden_pool_spares_wanted{run}``: the spares the run is configured to keep (0: none wanted,
  so an empty spare pool is not a page);
* ``runwarden_controller_etcd_up``: 0 when etcd did not answer this scrape (the others are then
  absent: unknown, not zero).

Read from etcd at scrape time: a few prefix reads, the size of the fleet, not of the event log.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controller.api.view import ViewUnavailable
from runwarden.v1 import common_pb2, controller_pb2

POOL_STATES = ("spare", "assigned", "quarantined", "burn_in", "held")


class _View(Protocol):
    def leader(self) -> tuple[str, int]: ...

    def node_infos(self) -> Sequence[controller_pb2.NodeInfo]: ...


def pool_state_name(state: common_pb2.PoolState.ValueType) -> str:
    try:
        return common_pb2.PoolState.Name(state).removeprefix("POOL_STATE_").lower()
    except ValueError:  # a number this build does not know (a newer writer): not one of ours
        return "unknown"


class ControlPlaneCollector(Collector):
    def __init__(
        self, view: _View, *, run: str, identity: str, spares_wanted: int, is_leader: Callable[[], bool]
    ) -> None:
        self._view = view
        self._run = run
        self._identity = identity
        self._spares_wanted = spares_wanted
        self._is_leader = is_leader

    def collect(self) -> Iterator[Metric]:
        leading = GaugeMetricFamily(
            "runwarden_controller_is_leader",
            "1 while this replica leads its run.",
            labels=["run", "identity"],
        )
        leading.add_metric([self._run, self._identity], 1.0 if self._is_leader() else 0.0)
        wanted = GaugeMetricFamily(
            "runwarden_pool_spares_wanted", "Spares the run is configured to keep.", labels=["run"]
        )
        wanted.add_metric([self._run], self._spares_wanted)
        up = GaugeMetricFamily("runwarden_controller_etcd_up", "1 when etcd answered this scrape.")
        yield from (leading, wanted)
        try:
            leader, _ = self._view.leader()
            infos = self._view.node_infos()
        except ViewUnavailable:
            up.add_metric([], 0.0)
            yield up
            return
        up.add_metric([], 1.0)
        present = GaugeMetricFamily(
            "runwarden_controller_leader_present", "1 while the run's election has a leader.", labels=["run"]
        )
        present.add_metric([self._run], 1.0 if leader else 0.0)
        counts = Counter(pool_state_name(n.pool_state) for n in infos if n.alive)
        pool = GaugeMetricFamily("runwarden_pool_nodes", "Live nodes by pool state.", labels=["state"])
        for state in POOL_STATES:
            pool.add_metric([state], counts.get(state, 0))
        yield from (up, present, pool)
