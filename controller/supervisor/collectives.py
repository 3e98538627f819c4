"""The collective rule: a rank that has not entered a collective its peers entered T seconds ago
is hung, whatever the step length.

Every rank reports how many collectives it has entered on the job's default process group
(`RankSample.collectives_entered`: torch's sequence number for the group, the same on every rank
once each has called the same collectives) and how long before its agent's write it entered the
newest (`collective_age_s`). The core places each entry on its own clock (`now - age`: no host's
clock is compared with another's). A collective on the default group completes only when every rank
has entered it, so while some rank is at a lower count than the highest, every rank at the highest
is waiting in that collective for it: since the first of them entered it.

The rule fires once that wait is `collective_hang_s` old (default 5 s), or
`collective_lateness_multiple` times the longest lateness this run has shown without a hang (a rank
that is always seconds late into its collectives, a straggler, is slow, not hung), and blames the
ranks left behind. It is off while any rank is inside a checkpoint save or a declared evaluation
(and a wait such a period overlapped counts from its end), or while some rank reports no count (an
older trainer, a script whose process group is not up yet): the step rule is the backstop.

`CollectiveMarks` is the attempt's one owner of these counts. Each update is O(1) (a count per
rank, how many ranks are at each count), so the hot path stays flat at 16,384 ranks; the ranks
behind are listed only when the rule fires.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from controller.supervisor.events import RankSample


@dataclass(slots=True)
class Stall:
    """The highest count some ranks reached while others are below it."""

    entered: int  # the collective the leaders wait in
    since: float  # when the first of them entered it (the core's clock)


@dataclass(slots=True)
class CollectiveMarks:
    """Per attempt: each rank's collectives entered and when (the core's clock) it entered the newest."""

    entered: dict[int, int] = field(default_factory=dict)
    since: dict[int, float] = field(default_factory=dict)
    node_of: dict[int, str] = field(default_factory=dict)
    at_count: dict[int, int] = field(default_factory=dict)  # count -> how many ranks are at it
    top: int = -1  # the highest count any rank reached
    top_since: float = 0.0  # when the first rank at `top` entered it
    nodes: set[str] = field(default_factory=set)  # nodes whose every rank reported a count
    untracked: set[int] = field(default_factory=set)  # ranks whose last sample had no count
    busy: set[int] = field(default_factory=set)  # ranks in a checkpoint save or an evaluation
    quiet_since: float = float("-inf")  # when the last busy rank said it was no longer busy

    def observe(self, node: str, ranks: tuple[RankSample, ...], now: float) -> list[float]:
        """One node's samples; returns the lateness of each rank that caught up with the leaders
        (how long after the first of them it entered their collective), for the run's record."""
        late: list[float] = []
        tracked = True
        for r in ranks:
            if r.in_checkpoint or r.in_eval:
                self.busy.add(r.rank)
            elif r.rank in self.busy:
                self.busy.discard(r.rank)
                if not self.busy:
                    self.quiet_since = now
            if r.collectives_entered is None:
                tracked = False
                self.untracked.add(r.rank)
                continue
            self.untracked.discard(r.rank)
            self.node_of[r.rank] = node
            entered_at = now - r.collective_age_s
            old = self.entered.get(r.rank)
            if old is not None and r.collectives_entered <= old:
                if r.collectives_entered == old and entered_at < self.since[r.rank]:
                    self.since[r.rank] = entered_at  # the earliest estimate: later ones carry more delay
                    if old == self.top:
                        self.top_since = min(self.top_since, entered_at)
                continue
            if old is not None:
                left = self.at_count[old] - 1
                if left:
                    self.at_count[old] = left
                else:
                    del self.at_count[old]
            count = r.collectives_entered
            self.entered[r.rank] = count
            self.since[r.rank] = entered_at
            self.at_count[count] = self.at_count.get(count, 0) + 1
            if count > self.top:
                self.top, self.top_since = count, entered_at
            elif count == self.top:
                if entered_at < self.top_since:
                    self.top_since = entered_at
                elif not self.busy and self.quiet_since < self.top_since:  # no save or evaluation in it
                    late.append(entered_at - self.top_since)
        if tracked:
            self.nodes.add(node)
        else:
            self.nodes.discard(node)
        return late

    def stall(self, attempt_nodes: int) -> Stall | None:
        """The leaders' collective while some rank is below it; None while every rank is at the top,
        while a rank or node has reported no count, or while a rank is busy (a save, an evaluation).
        A wait that a busy period overlapped counts from its end: the rank that was busy is late
        only once it had the time to catch up."""
        if self.untracked or self.busy or len(self.nodes) < attempt_nodes or not self.entered:
            return None
        if self.at_count.get(self.top, 0) == len(self.entered):
            return None
        return Stall(entered=self.top, since=max(self.top_since, self.quiet_since))

    def behind(self) -> list[tuple[int, str, int]]:
        """(rank, node, its count) of every rank below the top, lowest count first."""
        return sorted(
            ((r, self.node_of[r], c) for r, c in self.entered.items() if c < self.top),
            key=lambda x: (x[2], x[0]),
        )


def hang_after_s(collective_hang_s: float, multiple: float, lateness: Iterable[float]) -> float:
    """How long the leaders may wait: the floor, or `multiple` x the longest lateness seen."""
    longest = max(lateness, default=0.0)
    return max(collective_hang_s, multiple * longest)
