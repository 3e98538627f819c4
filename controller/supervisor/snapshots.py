"""The in-memory snapshots the ranks take between commits (nodeagent.trainer.snapshot), as the core
sees them, and the resume point they give a relaunch. Pure, like every rule.

A rank reports the snapshots it holds complete (RankSample.snapshot_steps: its copy kept, and the
rank state of the rank before it on the ring, whose buddy it is; for sharded state that rank's
shard too). So one rule covers both: a rank's state (its rank state, and its shard where the
model and optimizer are sharded; a replica any holder has) is where it or its buddy holds the step. `SnapshotTracker`, one per
attempt, keeps per node the steps every rank of it holds, and each rank's node.

At a launch, `choose` picks the resume point: the newest snapshot newer than the newest commit (and
not cut by a loss rollback) for which every rank's state has a holder among the new attempt's
nodes that keep their processes (a warm launch; a node that went cold holds nothing): the rank's
own node, or its buddy's (the same local rank on the next node: the node after it in rank order),
holding that step; else the newest commit. A lost node's last reports do not count: its buddy's
do (its ranks may have trained on, snapshotting, after its agent stopped reporting). The LAUNCH
event says which and why. The candidates are the ending attempt's snapshots, then the one it
resumed from (its processes still hold it). The ranks check the same at their load with what each
process really holds: if some rank's state is gone after all, every rank refuses the snapshot
(CheckpointInvalid for its step, `resume_points`), it is dropped, and the relaunch resumes from the
commit. Nothing about them is stored: every report carries its rank's snapshots, so a controller
that takes over an attempt knows them after one report interval (level-triggered, as the rest).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence, Set
from dataclasses import dataclass, field

from controller.supervisor.events import RankSample


@dataclass(slots=True)
class SnapshotTracker:
    """One attempt's snapshots as its ranks report them."""

    held: dict[str, frozenset[int]] = field(default_factory=dict)  # node -> steps all its ranks hold
    rank_node: dict[int, str] = field(default_factory=dict)  # global rank -> its node
    node_ranks: dict[str, int] = field(default_factory=dict)  # node -> how many ranks it runs

    def observe(self, node: str, ranks: Sequence[RankSample]) -> None:
        """A node's put (all its ranks). On the progress path: one pass, sets built only when the
        node's ranks report different snapshots (while one of them has not reported its newest)."""
        first: tuple[int, ...] | None = None
        alike = True
        n = 0
        for r in ranks:
            n += 1
            self.rank_node[r.rank] = node
            if first is None:
                first = r.snapshot_steps
            elif r.snapshot_steps != first:
                alike = False
        self.node_ranks[node] = n
        if alike:
            self.held[node] = frozenset(first or ())
        else:
            self.held[node] = frozenset.intersection(*(frozenset(r.snapshot_steps) for r in ranks))

    def uncovered(self, step: int, live: Set[str]) -> str:
        """Why some rank's state at `step` has no holder among `live` nodes ("" if every one has)."""
        world = len(self.rank_node)
        if world == 0 or set(self.rank_node) != set(range(world)):
            return "not every rank reported"
        local = self.node_ranks.get(self.rank_node[0], 1) or 1
        for rank in range(world):
            own, buddy = self.rank_node[rank], self.rank_node[(rank + local) % world]
            if not any(n in live and step in self.held.get(n, ()) for n in (own, buddy)):
                return f"rank {rank}'s state is neither on {self._holds(own, live)} nor on its buddy {self._holds(buddy, live)}"
        return ""

    def _holds(self, node: str, live: Set[str]) -> str:
        if node not in live:
            return f"{node} (not in this attempt)"
        return f"{node} (holds {', '.join(map(str, sorted(self.held.get(node, ())))) or 'none'})"


@dataclass(frozen=True, slots=True)
class ResumePoint:
    step: int
    snapshot_attempt: int = 0  # > 0: `step` is that attempt's in-memory snapshot
    reason: str = ""  # why the snapshot was taken, or passed over ("": there was none to consider)


def choose(
    candidates: Iterable[tuple[int, SnapshotTracker]],
    nodes: tuple[str, ...],
    commit: int,
    *,
    cut: int | None,
    cold: bool,
    went_cold: Set[str],
) -> ResumePoint:
    """The resume point of a launch on `nodes`, from the candidates' snapshots ((attempt, its
    tracker), in order), the newest usable commit, the loss rollback's cut (the steps from it on
    hold the anomaly's state), whether the launch goes cold and the nodes that went cold."""
    live = set(nodes).difference(went_cold)
    passed = ""
    for attempt, tracker in candidates:
        steps = sorted(set().union(*(tracker.held.get(n, ()) for n in live)), reverse=True)
        for step in steps:
            why = _passed_over(tracker, step, nodes, live, commit, cut=cut, cold=cold)
            if not why:
                return ResumePoint(
                    step,
                    attempt,
                    f"the in-memory snapshot of step {step} (attempt {attempt}): every rank's state has a "
                    f"holder among these nodes; newest commit {commit}",
                )
            passed = passed or f"the in-memory snapshot of step {step} passed over: {why}"
            if step <= commit or (cut is not None and step >= cut) or cold:
                break  # older ones fare no better
    return ResumePoint(commit, reason=passed)


def _passed_over(
    tracker: SnapshotTracker,
    step: int,
    nodes: tuple[str, ...],
    live: Set[str],
    commit: int,
    *,
    cut: int | None,
    cold: bool,
) -> str:
    if step <= commit:
        return f"committed step {commit} is as new"
    if cut is not None and step >= cut:
        return f"a loss rollback discards the steps from {cut}"
    if cold:
        return "this launch goes cold: new processes hold no snapshot"
    if len(tracker.node_ranks) != len(nodes):
        return f"it was taken on {len(tracker.node_ranks)} nodes, this attempt has {len(nodes)}"
    return tracker.uncovered(step, live)
