"""controller.supervisor.flight_recorder on hand-made dumps: the rule, cascades, cycles, mismatches, and the verdict.

Where the verdict ranks against hardware evidence and heartbeats: tests/supervisor/test_blame.py."""

from __future__ import annotations

import json

import pytest

from controller.supervisor.flight_recorder import (
    CONFIDENCE_CIRCULAR,
    CONFIDENCE_LAGGING,
    CONFIDENCE_MISMATCH,
    CONFIDENCE_NO_DUMP,
    CONFIDENCE_NO_DUMP_ALONE,
    CONFIDENCE_STOPPED,
    CONFIDENCE_VICTIM_OF_STOPPED,
    analyze_flight_recorder,
    dumps_from_rank_dumps,
    stopped_ranks,
    verdict,
    verdict_from_rank_dumps,
)
from controller.supervisor.policy import SupervisorConfig
from runwarden.flightrec import dump_from_object
from runwarden.v1 import agent_pb2, common_pb2, events_pb2
from tests.flightrec.handmade import default_only, make_dump


@pytest.mark.parametrize("culprit", [0, 1, 3])
def test_the_rank_that_never_called_the_collective_is_the_culprit(culprit: int) -> None:
    dumps = default_only(4, {r: 4 if r == culprit else 5 for r in range(4)})
    findings = analyze_flight_recorder(dumps)
    assert set(findings.suspects) == {culprit}
    assert findings.suspects[culprit][0] == CONFIDENCE_LAGGING
    assert "collective #5" in findings.suspects[culprit][1] and "#4" in findings.suspects[culprit][1]
    (group,) = findings.groups
    assert group.lagging == (culprit,) and group.seq == 5 and group.stuck


def test_no_hang_no_suspect() -> None:
    findings = analyze_flight_recorder(default_only(3, {0: 5, 1: 5, 2: 5}))
    assert findings.suspects == {} and not findings.groups[0].stuck


def test_p2p_entries_are_ignored() -> None:
    dumps = default_only(2, {0: 3, 1: 3})
    groups = {"0": ("default_pg", [0, 1])}
    dumps[0] = make_dump(0, [("0", 1), ("0", 2), ("0", 3), ("0", 9, {"is_p2p": True})], groups)
    assert analyze_flight_recorder(dumps).suspects == {}


TP_DP = {
    "0": ("default_pg", [0, 1, 2, 3]),
    "1": ("tp0", [0, 1]), "2": ("tp1", [2, 3]), "3": ("dp0", [0, 2]), "4": ("dp1", [1, 3]),
}  # fmt: skip


def test_cascade_victim_that_lags_because_it_waits_elsewhere_is_not_blamed() -> None:
    # rank 3 stops before tp1 #2; rank 2 waits in tp1 and so never reaches dp0 #2, where rank 0 waits.
    dumps = {
        0: make_dump(0, [("0", 1), ("1", 1), ("3", 1), ("0", 2), ("1", 2), ("3", 2)], TP_DP),
        1: make_dump(1, [("0", 1), ("1", 1), ("4", 1), ("0", 2), ("1", 2), ("4", 2)], TP_DP),
        2: make_dump(2, [("0", 1), ("2", 1), ("3", 1), ("0", 2), ("2", 2)], TP_DP),
        3: make_dump(3, [("0", 1), ("2", 1), ("4", 1), ("0", 2)], TP_DP),
    }
    findings = analyze_flight_recorder(dumps, reported_timeout=[0, 1, 2])
    assert set(findings.suspects) == {3}
    assert "tp1" in findings.suspects[3][1] and "dp1" in findings.suspects[3][1]
    assert {g.pg_desc: g.lagging for g in findings.groups if g.lagging} == {
        "tp1": (3,),
        "dp0": (2,),
        "dp1": (3,),
    }
    # without knowing who reported the timeout, the wait-for graph alone finds the same culprit
    assert set(analyze_flight_recorder(dumps).suspects) == {3}


def test_circular_wait_blames_both_ranks_with_low_confidence() -> None:
    groups = {"a": ("a", [0, 1]), "b": ("b", [0, 1])}
    dumps = {
        0: make_dump(0, [("a", 1), ("b", 1), ("a", 2)], groups),  # a#2 then b#2
        1: make_dump(1, [("a", 1), ("b", 1), ("b", 2)], groups),  # b#2 then a#2: a different order
    }
    findings = analyze_flight_recorder(dumps)
    assert {r: c for r, (c, _) in findings.suspects.items()} == {
        0: CONFIDENCE_CIRCULAR,
        1: CONFIDENCE_CIRCULAR,
    }
    assert "circular" in findings.suspects[0][1]


def test_missing_dump_is_the_suspect_when_everyone_else_waits_for_it() -> None:
    dumps = default_only(3, {0: 5, 1: 5})
    findings = analyze_flight_recorder(dumps)  # rank 2 known from pg_config only
    assert set(findings.suspects) == {2}
    assert findings.suspects[2][0] == CONFIDENCE_NO_DUMP_ALONE
    assert findings.groups[0].no_dump == (2,)


def test_missing_dump_ranks_below_a_real_culprit() -> None:
    dumps = default_only(4, {0: 5, 1: 4, 2: 5})
    findings = analyze_flight_recorder(dumps, no_dump={3: "no dump: no answer within 2 s"})
    assert findings.suspects[1][0] == CONFIDENCE_LAGGING
    assert findings.suspects[3] == (CONFIDENCE_NO_DUMP, "gave no dump (no dump: no answer within 2 s)")


def test_a_stopped_rank_outranks_ranks_that_lag_behind_it() -> None:
    # Seen in the e2e test: rank 0 SIGSTOPped, most likely inside DDP's gradient all-reduce, which
    # did not appear in that run's dumps (inferred, not confirmed); ranks 1 and 3 wait in it (their last recorded collective is #4), rank 2 got through
    # and waits in #5. Without the process state, ranks 1 and 3 look like two culprits.
    dumps = default_only(4, {1: 4, 2: 5, 3: 4})
    no_dump = {0: "no dump: no answer within 1.8 s (stopped or wedged)"}
    findings = analyze_flight_recorder(dumps, no_dump=no_dump, stopped=[0])
    assert findings.suspects[0][0] == CONFIDENCE_STOPPED and "process is stopped" in findings.suspects[0][1]
    assert findings.suspects[1][0] == findings.suspects[3][0] == CONFIDENCE_VICTIM_OF_STOPPED
    assert "blocked by stopped rank(s) [0]" in findings.suspects[1][1]
    result = verdict(rank_to_node={0: "a", 1: "b", 2: "c", 3: "d"}, dumps=dumps, no_dump=no_dump, stopped=[0])
    assert result.suspects[0].node == "a" and result.suspects[0].confidence == CONFIDENCE_STOPPED
    assert [s.node for s in result.suspects] == ["a", "b", "d"]
    assert all(s.confidence < SupervisorConfig().fr_min_confidence for s in result.suspects if s.node != "a")
    # without the process state the old reading stands: the laggers lead
    plain = analyze_flight_recorder(dumps, no_dump=no_dump)
    assert plain.suspects[1][0] == CONFIDENCE_LAGGING and plain.suspects[0][0] == CONFIDENCE_NO_DUMP


def test_only_a_dumpless_rank_seen_stopped_counts_as_stopped() -> None:
    rank_dumps = [
        agent_pb2.RankDump(rank=0, ok=False, error="no dump: no answer within 2 s", process_state="T"),
        agent_pb2.RankDump(rank=1, ok=False, error="no dump: no answer within 2 s", process_state="D"),
        agent_pb2.RankDump(rank=2, ok=False, error="no dump: connection refused"),
        agent_pb2.RankDump(rank=3, ok=False, error="no dump", process_state="t"),
    ]
    assert stopped_ranks(rank_dumps) == {0, 3}


def test_when_no_rank_gave_a_dump_only_a_stopped_rank_is_a_suspect() -> None:
    # Every agent answered without a dump (sockets that could not open: a run_dir too long for a unix
    # socket path): nobody is seen waiting for anyone, so a missing dump says nothing about its node.
    why = "no dump: its flight-recorder socket path is 110 bytes, over the 107-byte limit"
    nodes = {0: "a", 1: "b"}
    silent = [agent_pb2.RankDump(rank=r, ok=False, error=why) for r in nodes]
    result = verdict_from_rank_dumps(silent, nodes)
    assert not result.suspects and "no rank gave a dump (2 asked)" in result.explanation
    # the same with rank 0's process seen stopped: that is a fact about its node, and it alone is blamed
    silent[0].process_state = "T"
    result = verdict_from_rank_dumps(silent, nodes)
    assert [(s.node, s.ranks) for s in result.suspects] == [("a", (0,))]
    # ranks the agents did not answer for at all are no evidence either
    assert not verdict_from_rank_dumps([], nodes).suspects


def test_a_dumpless_member_of_a_completed_collective_is_not_awaited() -> None:
    # gloo is synchronous: rank 0 went on after tp0 #2, so tp0 #2 completed with rank 1 in it.
    groups = {"0": ("default_pg", [0, 1, 2]), "1": ("tp0", [0, 1])}
    dumps = {
        0: make_dump(0, [("0", 1), ("1", 1), ("1", 2), ("0", 2)], groups),
        2: make_dump(2, [("0", 1)], groups),
    }
    findings = analyze_flight_recorder(dumps)
    tp0 = next(g for g in findings.groups if g.pg_desc == "tp0")
    assert tp0.completed and not tp0.stuck
    assert findings.suspects[2][0] == CONFIDENCE_LAGGING
    assert findings.suspects[1][0] == CONFIDENCE_NO_DUMP


def test_wrapped_ring_without_the_group_is_unknown_not_blamed() -> None:
    groups = {"0": ("default_pg", [0, 1]), "1": ("pair", [0, 1])}
    dumps = {
        0: make_dump(0, [("1", 7), ("0", 40), ("0", 41)], groups, first_record=100),
        1: make_dump(1, [("0", 40), ("0", 41)], groups, first_record=100),  # its 'pair' records fell out
    }
    findings = analyze_flight_recorder(dumps)
    pair = next(g for g in findings.groups if g.pg_desc == "pair")
    assert pair.unknown == (1,) and pair.lagging == ()
    assert findings.suspects == {}


def test_unrepaired_gloo_pg_config_still_works_for_the_default_group() -> None:
    entries = [{"record_id": i, "process_group": ["0", "default_pg"], "collective_seq_id": i + 1,
                "profiling_name": "gloo:barrier"} for i in range(3)]  # fmt: skip
    broken = {"": {"name": "", "desc": "", "ranks": "[]"}}
    dumps = {
        r: dump_from_object(
            {"version": "2.10", "pg_config": broken, "entries": entries[:n]}, fmt="json", rank=r
        )
        for r, n in {0: 3, 1: 2}.items()
    }
    findings = analyze_flight_recorder(dumps, expected_ranks=range(3))
    assert findings.groups[0].members == (0, 1, 2)
    assert findings.suspects[1][0] == CONFIDENCE_LAGGING and 2 in findings.suspects


@pytest.mark.parametrize(("world", "odd", "expected"), [(3, 1, {1}), (2, 1, {0, 1})])
def test_mismatched_collective_at_the_same_seq(world: int, odd: int, expected: set[int]) -> None:
    groups = {"0": ("default_pg", list(range(world)))}
    dumps = {
        r: make_dump(r, [("0", 1), ("0", 2, {"input_sizes": [[9]]} if r == odd else {})], groups)
        for r in range(world)
    }
    findings = analyze_flight_recorder(dumps)
    assert set(findings.suspects) == expected
    assert all(c == CONFIDENCE_MISMATCH for c, _ in findings.suspects.values())
    assert "differs across ranks" in findings.explanation[0]


NODES = {0: "a", 1: "a", 2: "b", 3: "b"}


def test_the_verdict_groups_suspects_by_node_strongest_first_with_flight_recorder_evidence() -> None:
    dumps = default_only(4, {0: 5, 1: 5, 2: 5, 3: 4})  # rank 3 (node b) lags; rank 4 (node c) gave no dump
    result = verdict(rank_to_node={**NODES, 4: "c"}, dumps=dumps, no_dump={4: "no dump: agent down"})
    assert [(s.node, s.ranks, s.confidence) for s in result.suspects] == [
        ("b", (3,), CONFIDENCE_LAGGING),
        ("c", (4,), CONFIDENCE_NO_DUMP),
    ]
    top = result.suspects[0]
    assert top.reason.startswith("rank 3 never called collective #5") and "(its last there: #4)" in top.reason
    (ev,) = top.evidence
    assert ev.node == "b" and ev.kind == common_pb2.EVIDENCE_KIND_FLIGHT_RECORDER
    assert ev.severity == common_pb2.SEVERITY_WARNING and ev.detail == top.reason
    assert result.explanation.splitlines() == [
        "group 0 (default_pg, ranks [0, 1, 2, 3]): ranks [0, 1, 2] wait in collective #5 gloo:all_reduce sizes [[8]] "
        "dtypes [Float]; lagging ['3@#4']; no dump []"
    ]
    proto = top.to_proto()
    assert (
        isinstance(proto, events_pb2.Suspect)
        and proto.evidence[0].kind == common_pb2.EVIDENCE_KIND_FLIGHT_RECORDER
    )
    assert events_pb2.Suspect.FromString(proto.SerializeToString()) == proto


def test_two_ranks_of_one_node_make_one_suspect_at_the_stronger_confidence() -> None:
    dumps = default_only(4, {0: 5, 1: 5})
    result = verdict(rank_to_node=NODES, dumps=dumps, no_dump={2: "lost", 3: "lost"})
    (suspect,) = result.suspects
    assert suspect.node == "b" and suspect.ranks == (2, 3) and suspect.confidence == CONFIDENCE_NO_DUMP_ALONE
    assert suspect.reason == "rank 2 gave no dump (lost); rank 3 gave no dump (lost)"


def test_a_rank_the_mapping_does_not_know_is_a_suspect_without_a_node() -> None:
    dumps = default_only(3, {0: 5, 1: 5, 2: 4})
    result = verdict(rank_to_node={0: "a", 1: "a"}, dumps=dumps)
    assert [(s.node, s.ranks) for s in result.suspects] == [("", (2,))]


def test_no_hang_gives_an_empty_verdict_that_says_so() -> None:
    result = verdict(rank_to_node={0: "a", 1: "b"}, dumps=default_only(2, {0: 5, 1: 5}))
    assert result.suspects == ()
    assert result.explanation.startswith("flight recorder: no suspect")


def test_the_rank_that_reported_the_timeout_is_never_blamed() -> None:
    dumps = default_only(3, {0: 5, 1: 5, 2: 4})
    result = verdict(rank_to_node={0: "a", 1: "a", 2: "b"}, dumps=dumps, no_dump={}, reported_timeout=[0, 1])
    assert [(s.node, s.ranks) for s in result.suspects] == [("b", (2,))]
    # even when its own dump is missing, the reporter was alive and waiting
    findings = analyze_flight_recorder(
        default_only(3, {1: 5, 2: 4}), no_dump={0: "lost"}, reported_timeout=[0]
    )
    assert set(findings.suspects) == {2}


def test_rank_dumps_from_agents_become_dumps_and_no_dumps() -> None:
    data = json.dumps(
        {
            "version": "2.10",
            "entries": [
                {
                    "record_id": 0,
                    "process_group": ["0", "default_pg"],
                    "collective_seq_id": 1,
                    "profiling_name": "gloo:all_reduce",
                }
            ],
        }
    ).encode()
    rank_dumps = [
        agent_pb2.RankDump(rank=0, ok=True, format="json", data=data),
        agent_pb2.RankDump(rank=1, ok=False, error="no dump: no answer within 2 s"),
        agent_pb2.RankDump(rank=2, ok=True, format="json", data=b"\x80garbage"),
    ]
    dumps, no_dump = dumps_from_rank_dumps(rank_dumps)
    assert list(dumps) == [0] and dumps[0].entries[0].collective_seq_id == 1 and dumps[0].rank == 0
    assert no_dump[1] == "no dump: no answer within 2 s" and no_dump[2].startswith("unreadable dump")


def test_the_live_shells_path_from_rank_dumps_to_the_verdict() -> None:
    def answer(rank: int, last: int) -> agent_pb2.RankDump:
        data = json.dumps(
            {
                "version": "2.10",
                "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"}},
                "entries": [
                    {
                        "record_id": i,
                        "process_group": ["0", "default_pg"],
                        "collective_seq_id": i + 1,
                        "profiling_name": "gloo:all_reduce",
                    }
                    for i in range(last)
                ],
            }
        ).encode()
        return agent_pb2.RankDump(rank=rank, ok=True, format="json", data=data)

    rank_dumps = [
        answer(1, 4),
        answer(2, 5),
        answer(3, 4),
        agent_pb2.RankDump(rank=0, ok=False, error="no dump: no answer within 2 s", process_state="T"),
    ]
    result = verdict_from_rank_dumps(iter(rank_dumps), {0: "a", 1: "b", 2: "c", 3: "d"})
    assert [(s.node, s.confidence) for s in result.suspects] == [
        ("a", CONFIDENCE_STOPPED),
        ("b", CONFIDENCE_VICTIM_OF_STOPPED),
        ("d", CONFIDENCE_VICTIM_OF_STOPPED),
    ]
    assert "process is stopped" in result.suspects[0].reason
    # the rank that reported the timeout is passed through
    assert (
        verdict_from_rank_dumps(rank_dumps, {0: "a", 1: "b", 2: "c", 3: "d"}, reported_timeout=[0])
        .suspects[0]
        .node
        == "b"
    )
