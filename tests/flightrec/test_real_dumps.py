"""The flight-recorder verdict on REAL flight-recorder dumps from gloo ranks that hang, cross-checked with torch's analyzer."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from controller.ctl.attribute import EXIT_SUSPECTS, main
from controller.supervisor.flight_recorder import analyze_flight_recorder, verdict
from runwarden.flightrec import TORCH_DEFAULT_PREFIX, _checked_entry, _plain_entry, read_dump_dir
from runwarden.v1 import common_pb2
from tests.flightrec.conftest import SCENARIOS
from tests.flightrec.scenarios import PICKLE_PREFIX, ScenarioRun

pytestmark = pytest.mark.slow
NAMES = [s.name for s in SCENARIOS]


def _rank_to_node(world: int) -> dict[int, str]:
    return {r: f"node{r // 2}" for r in range(world)}  # two ranks per node


@pytest.mark.parametrize("name", NAMES)
def test_collected_json_blames_the_culprit_and_never_a_rank_that_reported_the_timeout(
    fr_runs: dict[str, ScenarioRun], name: str
) -> None:
    run = fr_runs[name]
    sc = run.scenario
    if not sc.sigstop:  # a hung rank answers over its worker-server socket, even one spinning in Python
        assert all(d.ok for d in run.collected), [d.error for d in run.collected]
        assert run.collect_s < 2.0, f"collect took {run.collect_s:.2f} s"
    read = read_dump_dir(run.json_dir)
    no_dump = {d.rank: d.error for d in run.collected if not d.ok}
    result = verdict(rank_to_node=_rank_to_node(sc.world), dumps=read.dumps, no_dump=no_dump)

    assert result.suspects, result.explanation
    top = result.suspects[0]
    assert top.ranks == (sc.culprit,) or sc.culprit in top.ranks, result.explanation
    assert top.node == f"node{sc.culprit // 2}"
    blamed = {r for s in result.suspects for r in s.ranks}
    assert blamed == {sc.culprit}, result.explanation
    assert blamed == set(
        analyze_flight_recorder(read.dumps, expected_ranks=range(sc.world), no_dump=no_dump).suspects
    )
    assert not blamed & set(run.timeouts), "a rank that reported the timeout was blamed"
    assert set(run.timeouts) == set(range(sc.world)) - {sc.culprit}
    # The first victim to time out closes its gloo pairs: on a loaded machine another victim's op can
    # fail on that connection (a gloo transport error) before its own timer fires. Either way it
    # failed waiting, and at least one saw the timeout itself.
    assert any("Timed out" in text for text in run.timeouts.values()), run.timeouts
    assert all("Timed out" in t or "gloo/transport" in t for t in run.timeouts.values()), run.timeouts
    proto = top.to_proto()
    assert proto.node == top.node and proto.evidence[0].kind == common_pb2.EVIDENCE_KIND_FLIGHT_RECORDER


def test_sigstopped_rank_gives_no_dump_through_the_worker_server_and_is_the_suspect(
    fr_runs: dict[str, ScenarioRun],
) -> None:
    run = fr_runs["w4_c1_sigstop"]
    by_rank = {d.rank: d for d in run.collected}
    assert not by_rank[1].ok and "no answer within" in by_rank[1].error
    assert all(by_rank[r].ok for r in (0, 2, 3))
    findings = analyze_flight_recorder(read_dump_dir(run.json_dir).dumps, expected_ranks=range(4))
    assert set(findings.suspects) == {1}
    assert "gave no dump" in findings.suspects[1][1]
    # rank 0 lags in dp0 only because it waits in tp0 for the stopped rank: a victim, not a culprit
    dp0 = next(g for g in findings.groups if g.pg_desc == "dp0")
    assert dp0.lagging == (0,)


def test_the_ring_buffer_wrapped_and_the_rule_still_works(fr_runs: dict[str, ScenarioRun]) -> None:
    run = fr_runs["w3_c1_wrapped"]
    dumps = read_dump_dir(run.json_dir).dumps
    assert all(d.wrapped and len(d.entries) == 8 for d in dumps.values())
    (group,) = analyze_flight_recorder(dumps).groups
    assert group.lagging == (1,) and group.seq == run.scenario.hang_step + 1


def test_cascade_victim_lags_in_a_group_but_is_not_blamed(fr_runs: dict[str, ScenarioRun]) -> None:
    findings = analyze_flight_recorder(read_dump_dir(fr_runs["w4_c3_tp_dp"].json_dir).dumps)
    lagging = {g.pg_desc: g.lagging for g in findings.groups if g.lagging}
    assert lagging == {"tp1": (3,), "dp0": (2,), "dp1": (3,)}
    assert set(findings.suspects) == {3}


@pytest.mark.parametrize("name", NAMES)
def test_json_over_the_socket_and_the_in_process_pickle_normalise_to_the_same_entries(
    fr_runs: dict[str, ScenarioRun], name: str
) -> None:
    run = fr_runs[name]
    from_json = read_dump_dir(run.json_dir).dumps
    from_pickle = read_dump_dir(run.pickle_dir, prefix=PICKLE_PREFIX).dumps
    assert set(from_json) == set(from_pickle)
    for rank, dump in from_json.items():
        other = from_pickle[rank]
        assert (dump.format, other.format) == ("json", "pickle")
        assert dump.pg_config == other.pg_config and dump.pg_config, "pg_config not repaired"
        key = [
            (e.record_id, e.pg_name, e.collective_seq_id, e.profiling_name, e.input_sizes)
            for e in dump.entries
        ]
        assert key == [
            (e.record_id, e.pg_name, e.collective_seq_id, e.profiling_name, e.input_sizes)
            for e in other.entries
        ]


def test_torchs_json_entries_take_the_one_pass_check_and_give_the_same_entries(
    fr_runs: dict[str, ScenarioRun],
) -> None:
    """What the agents collect (torch's JSON dumps) is checked in one pass, to the same entries."""
    checked = 0
    for run in fr_runs.values():
        for path in sorted(run.json_dir.glob(f"{TORCH_DEFAULT_PREFIX}*")):
            for i, raw in enumerate(json.loads(path.read_bytes()).get("entries", [])):
                fast = _plain_entry(raw, {})
                assert fast is not None, (path.name, i, raw)
                assert fast == _checked_entry(raw, i)
                checked += 1
    assert checked > 50


def _analyzer_dir(run: ScenarioRun, culprits: set[int], dest: Path) -> Path:
    """Copy the pickles so that torch's analyzer reads a healthy rank first (it lists the dir in
    os.listdir order and blames relative to the first rank it reads). It finds files by prefix, so
    a leading tag changes the hash order on ext4 without changing what it reads."""
    files = sorted(run.pickle_dir.glob(f"{PICKLE_PREFIX}*"))
    for attempt in range(40):
        target = dest / f"try{attempt}"
        target.mkdir()
        for f in files:
            shutil.copy(f, target / f"{'t' * (attempt % 7)}{attempt}{f.name}")
        first = os.listdir(target)[0]
        if int(first.rsplit("_", 1)[1]) not in culprits:
            return target
    raise AssertionError("could not make the analyzer read a healthy rank first")


def _analyzer_missing(stdout: str) -> set[tuple[str, int, frozenset[int]]]:
    found = set()
    for block in stdout.split("Not all ranks joining collective")[1:]:
        seq = re.search(r"sequence number: (\d+)", block)
        group = re.search(r"group info: ([^:\n]+):", block)
        missing = re.search(r"missing ranks: \{([\d, ]*)\}", block)
        assert seq and group and missing, block
        ranks = frozenset(int(x) for x in re.findall(r"\d+", missing.group(1)))
        found.add((group.group(1), int(seq.group(1)), ranks))
    return found


def test_official_analyzer_reports_the_same_lagging_ranks(
    fr_runs: dict[str, ScenarioRun], tmp_path: Path
) -> None:
    procs = {}
    for name in NAMES:
        run = fr_runs[name]
        dumps = read_dump_dir(run.pickle_dir, prefix=PICKLE_PREFIX).dumps
        findings = analyze_flight_recorder(dumps, expected_ranks=range(run.scenario.world))
        mine = {(g.pg_name, g.seq, frozenset(g.lagging)) for g in findings.groups if g.lagging}
        (tmp_path / name).mkdir()
        directory = _analyzer_dir(run, set(findings.suspects), tmp_path / name)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.flight_recorder.fr_trace",
            str(directory),
            "-p",
            PICKLE_PREFIX,
        ]
        if run.scenario.sigstop:
            cmd.append("--allow-incomplete-ranks")
        procs[name] = (
            mine,
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
        )
    for name, (mine, proc) in procs.items():
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"{name}: analyzer failed:\n{out[-3000:]}"
        assert _analyzer_missing(out) == mine, f"{name}: analyzer says:\n{out[-3000:]}"


def test_controllerctl_attribute_on_real_dump_dirs(
    fr_runs: dict[str, ScenarioRun], capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    run = fr_runs["w4_c3_tp_dp"]
    assert main(["attribute", str(run.pickle_dir), "--prefix", PICKLE_PREFIX, "--json"]) == EXIT_SUSPECTS
    report = json.loads(capsys.readouterr().out)
    assert [s["rank"] for s in report["suspects"]] == [3]
    assert report["ranks_read"] == [0, 1, 2, 3]
    stopped = fr_runs["w4_c1_sigstop"]
    assert main(["attribute", str(stopped.json_dir)]) == EXIT_SUSPECTS
    text = capsys.readouterr().out
    assert "suspect rank 1" in text and "gave no dump" in text
    assert TORCH_DEFAULT_PREFIX == "nccl_trace_rank_"
