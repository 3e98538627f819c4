"""The flight-recorder rung of the blame ladder: which ranks a hang's dumps point at. Pure, no I/O.

This module reads flight-recorder dumps and says who the dumps blame; where that answer ranks
against hardware evidence and heartbeats is decided once, in controller/supervisor/blame.py.

`analyze_flight_recorder` gives the per-rank findings (groups, suspects by rank, explanation);
`verdict` turns them into a `blame.FlightRecorderVerdict` (suspects per node, strongest first), and
`verdict_from_rank_dumps` does the whole path from the agents' `RankDump` answers.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from controller.supervisor.blame import FlightRecorderVerdict, Suspect
from runwarden.flightrec import FlightRecorderError, FrDump, FrEntry, parse_dump
from runwarden.v1 import agent_pb2, common_pb2

CONFIDENCE_STOPPED = 0.95  # no dump, and its agent read its process state as stopped (SIGSTOP, T)
CONFIDENCE_LAGGING = 0.9
CONFIDENCE_NO_DUMP_ALONE = 0.8  # no dump, and no dumped rank lags for its own reasons
CONFIDENCE_NO_DUMP = 0.5
CONFIDENCE_MISMATCH = 0.6
CONFIDENCE_CIRCULAR = 0.4
CONFIDENCE_VICTIM_OF_STOPPED = 0.3  # lagging while another rank is stopped: below fr_min_confidence


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupLag:
    """One process group as the flight recorder saw it."""

    pg_name: str
    pg_desc: str
    members: tuple[int, ...]
    seq: int  # S: the highest collective any member enqueued
    lagging: tuple[int, ...]  # members with last < S
    no_dump: tuple[int, ...]
    unknown: tuple[int, ...]  # dumped members whose ring buffer no longer holds this group
    last: tuple[tuple[int, int], ...]  # (rank, last seq) for the members with a known last
    op: str  # what the front ranks wait in: "gloo:all_reduce sizes [[8]] dtypes [Float]"
    completed: bool  # collective S is known to have completed (so a dumpless member is not awaited)

    @property
    def front(self) -> tuple[int, ...]:
        return tuple(r for r, s in self.last if s == self.seq)

    @property
    def stuck(self) -> bool:
        """The front ranks wait in collective S: someone lags, or a dumpless member may not have joined."""
        return bool(self.lagging) or (bool(self.no_dump) and not self.completed)


@dataclass(frozen=True, slots=True, kw_only=True)
class FrFindings:
    groups: tuple[GroupLag, ...]
    suspects: Mapping[int, tuple[float, str]]  # rank -> (confidence, reason)
    explanation: tuple[str, ...]


# --- inputs from the agents ---------------------------------------------------------------------


def dumps_from_rank_dumps(
    rank_dumps: Iterable[agent_pb2.RankDump], *, max_bytes: int | None = None
) -> tuple[dict[int, FrDump], dict[int, str]]:
    """The agents' RankDump messages -> (parsed dumps by rank, rank -> why there is no dump)."""
    dumps: dict[int, FrDump] = {}
    no_dump: dict[int, str] = {}
    for rd in rank_dumps:
        if not rd.ok:
            no_dump[rd.rank] = rd.error or "no dump"
            continue
        try:
            kwargs = {} if max_bytes is None else {"max_bytes": max_bytes}
            dumps[rd.rank] = parse_dump(rd.data, rank=rd.rank, **kwargs)
        except FlightRecorderError as exc:
            no_dump[rd.rank] = f"unreadable dump: {exc}"
    return dumps, no_dump


def stopped_ranks(rank_dumps: Iterable[agent_pb2.RankDump]) -> frozenset[int]:
    """Ranks that gave no dump and whose agent saw their process stopped (/proc state T or t)."""
    return frozenset(rd.rank for rd in rank_dumps if not rd.ok and rd.process_state in ("T", "t"))


# --- the flight-recorder rule -------------------------------------------------------------------


def _describe(entry: FrEntry) -> str:
    sizes = [list(s) for s in entry.input_sizes]
    return f"{entry.profiling_name} sizes {sizes} dtypes [{', '.join(entry.input_dtypes)}]"


def _tops(dump: FrDump) -> dict[str, FrEntry]:
    """Per group name, this rank's non-p2p entry with the highest collective_seq_id (one pass)."""
    tops: dict[str, FrEntry] = {}
    for e in dump.entries:
        if not e.is_p2p:
            old = tops.get(e.pg_name)
            if old is None or (e.collective_seq_id, e.record_id) > (old.collective_seq_id, old.record_id):
                tops[e.pg_name] = e
    return tops


def _groups_of(
    dumps: Mapping[int, FrDump], tops: Mapping[int, Mapping[str, FrEntry]], expected: frozenset[int]
) -> dict[tuple[str, tuple[int, ...]], str]:
    """(name, members) -> desc, from every dump's pg_config; default_pg is all expected ranks if unnamed."""
    groups: dict[tuple[str, tuple[int, ...]], str] = {}
    for dump in dumps.values():
        for pg in dump.pg_config:
            groups.setdefault((pg.name, tuple(sorted(pg.ranks))), pg.desc)
    named = {name for name, _ in groups}
    for rank, dump in dumps.items():  # groups missing from pg_config (a dump from unrepaired gloo)
        for name, e in tops[rank].items():
            if name in named or dump.group(name) is not None:
                continue
            if e.pg_desc == "default_pg":
                members = tuple(sorted(expected))
            else:  # membership unknown: the ranks that recorded the group
                members = tuple(sorted(r for r, t in tops.items() if name in t))
            groups[(name, members)] = e.pg_desc
            named.add(name)
    return groups


def _group_lag(
    name: str,
    members: tuple[int, ...],
    desc: str,
    dumps: Mapping[int, FrDump],
    tops: Mapping[int, Mapping[str, FrEntry]],
) -> tuple[GroupLag, dict[int, FrEntry]] | None:
    last: dict[int, int] = {}
    at_last: dict[int, FrEntry] = {}
    no_dump, unknown = [], []
    for r in members:
        dump = dumps.get(r)
        if dump is None:
            no_dump.append(r)
            continue
        top = tops[r].get(name)
        if top is not None:
            last[r], at_last[r] = top.collective_seq_id, top
        elif dump.wrapped:
            unknown.append(r)  # its ring lost this group's records: we cannot say where it is
        else:
            last[r] = 0
    if not last or max(last.values()) == 0:
        return None
    seq = max(last.values())
    front = [r for r in members if last.get(r) == seq]
    lag = GroupLag(
        completed=any(_completed(at_last[r], dumps[r]) for r in front),
        pg_name=name, pg_desc=desc, members=members, seq=seq,
        lagging=tuple(r for r in members if r in last and last[r] < seq),
        no_dump=tuple(no_dump), unknown=tuple(unknown), last=tuple(sorted(last.items())),
        op=_describe(at_last[front[0]]),
    )  # fmt: skip
    return lag, {r: at_last[r] for r in front}


def _completed(entry: FrEntry, dump: FrDump) -> bool:
    """NCCL marks completion; gloo runs collectives synchronously, so a later record proves it returned."""
    if entry.state == "completed":
        return True
    return entry.profiling_name.startswith("gloo:") and dump.entries[-1].record_id > entry.record_id


def _mismatch(lag: GroupLag, front: Mapping[int, FrEntry]) -> tuple[list[int], str] | None:
    """Every member reached S: the ranks whose entry at S differs from the majority's."""
    sig = {r: (e.profiling_name, e.input_sizes, e.input_dtypes) for r, e in front.items()}
    counts = Counter(sig.values())
    if len(counts) < 2:
        return None
    (common, n), *rest = counts.most_common()
    odd = [r for r, s in sig.items() if s != common] if n > rest[0][1] else sorted(sig)
    detail = "; ".join(f"rank {r}: {_describe(front[r])}" for r in sorted(front))
    return odd, f"collective #{lag.seq} of group {lag.pg_name} ({lag.pg_desc}) differs across ranks: {detail}"


def _reaches_sink(rank: int, waits_for: Mapping[int, set[int]]) -> bool:
    """Does following 'waits for' from rank end at a rank that waits for nobody (a culprit or no dump)?"""
    seen, todo = {rank}, [rank]
    while todo:
        for nxt in waits_for.get(todo.pop(), ()):
            if not waits_for.get(nxt):
                return True
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return not waits_for.get(rank)


def _lag_text(rank: int, groups: list[GroupLag]) -> str:
    parts = [
        f"collective #{g.seq} {g.op} of group {g.pg_name} ({g.pg_desc}) that the others wait in "
        f"(its last there: #{dict(g.last)[rank]})"
        for g in groups
    ]
    return "; nor ".join(parts)


def _explain(g: GroupLag) -> str:
    text = (
        f"group {g.pg_name} ({g.pg_desc}, ranks {list(g.members)}): ranks {list(g.front)} wait in collective "
        f"#{g.seq} {g.op}; lagging {[f'{r}@#{s}' for r, s in g.last if s < g.seq]}; no dump {list(g.no_dump)}"
    )
    return text + (f"; unknown (ring wrapped) {list(g.unknown)}" if g.unknown else "")


def analyze_flight_recorder(
    dumps: Mapping[int, FrDump],
    *,
    expected_ranks: Iterable[int] = (),
    no_dump: Mapping[int, str] | None = None,
    reported_timeout: Iterable[int] = (),
    stopped: Iterable[int] = (),
) -> FrFindings:
    """Apply the rule to a set of dumps. Ranks in expected_ranks without a dump are 'no dump'.

    The rule, per process group, over non-p2p entries: last[r] = the highest collective_seq_id rank r
    enqueued, S = the highest over the members. Members with last[r] < S never called collective S: they
    lag. A lagging rank that is itself waiting at the front of another stuck group is a victim of a
    cascade (it cannot call S because it is blocked elsewhere); the lagging ranks that wait for nobody
    are the culprits. A member with no dump is a suspect; one whose agent saw its process stopped
    (/proc state T) is the culprit, and the lagging ranks are then taken for its victims (blocked in an
    operation the recorder does not see, like gloo's send/recv). If every member reached S, the entries
    at S are compared (op, sizes, dtypes): the odd one out is a suspect.

    The rank that reported the timeout was waiting: it is never blamed for lagging. collective_seq_id is
    used, not op_id or record_id: it is aligned across ranks and survives the ring buffer wrapping.

    `stopped`: dumpless ranks whose process was seen stopped. They outrank lagging ranks: a dumped
    rank that never called collective S may be blocked on the stopped one in an operation the
    recorder does not see (gloo records no send/recv), while a stopped process is a fact.
    """
    no_dump = dict(no_dump or {})
    reported = frozenset(reported_timeout)
    expected = frozenset(expected_ranks) | frozenset(dumps) | frozenset(no_dump)
    for r in expected - set(dumps):
        no_dump.setdefault(r, "no dump collected")
    groups: list[GroupLag] = []
    fronts: list[dict[int, FrEntry]] = []
    tops = {r: _tops(d) for r, d in dumps.items()}
    for (name, members), desc in sorted(_groups_of(dumps, tops, expected).items()):
        found = _group_lag(name, members, desc, dumps, tops)
        if found:
            groups.append(found[0])
            fronts.append(found[1])
    for g in groups:
        for r in g.no_dump:  # known from another rank's pg_config only
            no_dump.setdefault(r, f"no dump; a member of group {g.pg_name} ({g.pg_desc})")
    # The wait-for graph: the front ranks of a stuck group wait for its lagging and dumpless members.
    waits_for: dict[int, set[int]] = defaultdict(set)
    lags_in: dict[int, list[GroupLag]] = defaultdict(list)
    for g in groups:
        for r in g.lagging:
            lags_in[r].append(g)
        if g.stuck:
            for r in g.front:
                waits_for[r].update(g.lagging, g.no_dump)
    waiting = set(waits_for) | reported  # a rank that reported a timeout was waiting too
    culprits = sorted(r for r in lags_in if r not in waiting)
    circular = sorted(r for r in lags_in if r not in reported and not _reaches_sink(r, waits_for))
    awaited_no_dump = {r for g in groups if g.stuck for r in g.no_dump}
    lines = [_explain(g) for g in groups if g.stuck]
    suspects: dict[int, tuple[float, str]] = {}
    stopped_set = frozenset(r for r in stopped if r in no_dump and r not in reported)
    for r in culprits:
        if stopped_set:
            # A stopped process blocks everyone; a rank that merely never called S is far more likely
            # its victim, waiting in an operation the recorder does not see, than a second culprit.
            suspects[r] = (
                CONFIDENCE_VICTIM_OF_STOPPED,
                f"never called {_lag_text(r, lags_in[r])}; probably "
                f"blocked by stopped rank(s) {sorted(stopped_set)}",
            )
            continue
        suspects[r] = (CONFIDENCE_LAGGING, "never called " + _lag_text(r, lags_in[r]))
    for r in circular:
        suspects[r] = (CONFIDENCE_CIRCULAR, "circular wait (collective order differs across ranks): "
                                            "it waits elsewhere and never called " + _lag_text(r, lags_in[r]))  # fmt: skip
    # Without a single dump nobody is seen waiting for anyone: a missing dump is then no evidence
    # about its node (an agent or a config that cannot serve dumps, not the rank), only a stopped
    # process is.
    silent = not dumps
    if silent and no_dump and not stopped_set:
        lines.append(
            f"no rank gave a dump ({len(no_dump)} asked): nothing to compare, no suspect from missing dumps"
        )
    for r, why in sorted(no_dump.items()):
        if r in reported:
            continue
        if r in stopped_set:
            suspects[r] = (CONFIDENCE_STOPPED, f"gave no dump and its process is stopped ({why})")
            continue
        if silent:
            continue
        alone = r in awaited_no_dump and not culprits
        suspects[r] = (CONFIDENCE_NO_DUMP_ALONE if alone else CONFIDENCE_NO_DUMP, f"gave no dump ({why})")
    for g, front in zip(groups, fronts, strict=True):
        mismatch = None if g.stuck or len(front) < len(g.members) else _mismatch(g, front)
        if mismatch:
            odd, detail = mismatch
            lines.append(detail)
            for r in odd:
                suspects.setdefault(r, (CONFIDENCE_MISMATCH, detail))
    return FrFindings(groups=tuple(groups), suspects=suspects, explanation=tuple(lines))


# --- the verdict -------------------------------------------------------------------------------


def verdict(
    *,
    rank_to_node: Mapping[int, str],
    dumps: Mapping[int, FrDump],
    no_dump: Mapping[int, str] | None = None,
    stopped: Iterable[int] = (),
    reported_timeout: Iterable[int] = (),
) -> FlightRecorderVerdict:
    """The flight recorder's answer for one hang: suspects per node, strongest first.

    Every rank of `rank_to_node` is expected: one without a dump is "no dump". A suspect whose rank
    the mapping does not know has node "". Each suspect carries one FLIGHT_RECORDER evidence record
    with its reasons; the explanation is the analysis in lines (one per stuck group or mismatch).
    """
    findings = analyze_flight_recorder(dumps, expected_ranks=rank_to_node, no_dump=no_dump,
                                       reported_timeout=reported_timeout, stopped=stopped)  # fmt: skip
    by_node: dict[str, list[int]] = defaultdict(list)
    for r in sorted(findings.suspects):
        by_node[rank_to_node.get(r, "")].append(r)
    suspects = []
    for node, ranks in by_node.items():
        reason = "; ".join(f"rank {r} {findings.suspects[r][1]}" for r in ranks)
        ev = common_pb2.Evidence(node=node, kind=common_pb2.EVIDENCE_KIND_FLIGHT_RECORDER,
                                 severity=common_pb2.SEVERITY_WARNING, detail=reason[:1000])  # fmt: skip
        suspects.append(Suspect(node=node, ranks=tuple(ranks), confidence=max(findings.suspects[r][0] for r in ranks),
                                reason=reason, evidence=(ev,)))  # fmt: skip
    suspects.sort(key=lambda s: -s.confidence)  # stable: ties stay in rank order
    lines = list(findings.explanation)
    if not suspects:
        lines.append("flight recorder: no suspect (no rank lags, no rank other than a timeout reporter "
                     "is missing its dump, no collective differs across ranks)")  # fmt: skip
    return FlightRecorderVerdict(suspects=tuple(suspects), explanation="\n".join(lines))


def verdict_from_rank_dumps(
    rank_dumps: Iterable[agent_pb2.RankDump],
    rank_to_node: Mapping[int, str],
    *,
    reported_timeout: Iterable[int] = (),
    max_bytes: int | None = None,
) -> FlightRecorderVerdict:
    """The agents' `RankDump` answers -> the verdict (parse, note the stopped ranks, analyse).

    `rank_to_node` should name every rank of the attempt, including those of a node whose agent did
    not answer (give them a `RankDump(ok=False)` too, or they count as "no dump collected").
    """
    rank_dumps = tuple(rank_dumps)
    dumps, no_dump = dumps_from_rank_dumps(rank_dumps, max_bytes=max_bytes)
    return verdict(rank_to_node=rank_to_node, dumps=dumps, no_dump=no_dump, stopped=stopped_ranks(rank_dumps),
                   reported_timeout=reported_timeout)  # fmt: skip
