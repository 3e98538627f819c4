"""`controllerctl attribute`: exit codes, text and JSON output, on hand-made dump directories."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from controller.ctl.attribute import EXIT_BAD_INPUT, EXIT_NO_SUSPECT, EXIT_SUSPECTS, add_parser, main, run

ROOT = Path(__file__).resolve().parents[2]


def _dump(last: int, world: int) -> dict[str, object]:
    entries = [
        {"record_id": i, "process_group": ("0", "default_pg"), "collective_seq_id": i + 1,
         "profiling_name": "gloo:all_reduce", "input_sizes": [[8]], "input_dtypes": ["Float"]}
        for i in range(last)
    ]  # fmt: skip
    pg = {"0": {"name": "0", "desc": "default_pg", "ranks": str(list(range(world)))}}
    return {"version": "2.10", "pg_config": pg, "entries": entries}


def _write(directory: Path, lasts: dict[int, int], *, prefix: str = "nccl_trace_rank_") -> Path:
    directory.mkdir(exist_ok=True)
    for rank, last in lasts.items():
        dump = _dump(last, len(lasts))
        if rank % 2:
            (directory / f"{prefix}{rank}").write_bytes(pickle.dumps(dump, protocol=pickle.HIGHEST_PROTOCOL))
        else:
            (directory / f"{prefix}{rank}").write_text(json.dumps(dump))
    return directory


def test_suspects_found_exit_0_with_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _write(tmp_path / "d", {0: 6, 1: 6, 2: 5, 3: 6})
    assert main(["attribute", str(d)]) == EXIT_SUSPECTS
    out = capsys.readouterr().out
    assert "suspect rank 2 (confidence 0.90)" in out and "collective #6" in out


def test_json_output_and_a_custom_prefix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _write(tmp_path / "d", {0: 3, 1: 2}, prefix="trace_")
    assert main(["attribute", str(d), "--prefix", "trace_", "--json"]) == EXIT_SUSPECTS
    report = json.loads(capsys.readouterr().out)
    assert report["method"] == "flight_recorder" and [s["rank"] for s in report["suspects"]] == [1]
    assert report["groups"][0]["lagging"] == [1] and report["groups"][0]["front"] == [0]


def test_world_size_turns_a_missing_file_into_a_suspect(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = _write(tmp_path / "d", {0: 4, 1: 4})
    assert main(["attribute", str(d)]) == EXIT_NO_SUSPECT  # ranks 0 and 1 agree; pg_config says world 2
    (d / "nccl_trace_rank_1").unlink()
    capsys.readouterr()
    assert main(["attribute", str(d), "--world-size", "2", "--json"]) == EXIT_SUSPECTS
    assert [s["rank"] for s in json.loads(capsys.readouterr().out)["suspects"]] == [1]


def test_bad_input_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["attribute", str(tmp_path / "missing")]) == EXIT_BAD_INPUT
    (tmp_path / "empty").mkdir()
    assert main(["attribute", str(tmp_path / "empty")]) == EXIT_BAD_INPUT
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "nccl_trace_rank_0").write_bytes(b"\x80\x04garbage")
    assert main(["attribute", str(tmp_path / "bad")]) == EXIT_BAD_INPUT
    assert "rank 0" in capsys.readouterr().err


def test_malicious_pickle_in_the_dir_is_reported_and_never_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = _write(tmp_path / "d", {0: 4, 2: 4})
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    (d / "nccl_trace_rank_1").write_bytes(pickle.dumps(Evil(), protocol=pickle.HIGHEST_PROTOCOL))
    assert main(["attribute", str(d)]) == EXIT_SUSPECTS  # rank 1's dump is refused: it is a suspect
    out = capsys.readouterr().out
    assert "rank 1: unreadable" in out and "suspect rank 1" in out
    assert not marker.exists()


def test_add_parser_plugs_into_a_parent_cli(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser(prog="controllerctl")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["attribute", str(_write(tmp_path / "d", {0: 1, 1: 1})), "--json"])
    assert args.func is run and run(args) == EXIT_NO_SUSPECT


def test_runs_as_a_module_without_torch_imported(tmp_path: Path) -> None:
    d = _write(tmp_path / "d", {0: 2, 1: 1})
    code = (
        "import sys; from controller.ctl.attribute import main; rc = main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "attribute", str(d)], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == EXIT_SUSPECTS, proc.stderr
    assert "suspect rank 1" in proc.stdout
