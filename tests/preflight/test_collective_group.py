"""preflight.collective with an explicit group (what the node agent's MeasureAllReduce runs): rank 0
serves the store on a socket its caller bound; each rank's gloo connections use its own address."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from preflight.collective import Group, main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        (dict(rank=2, world_size=2), "rank < world_size"),
        (dict(rank=-1, world_size=2), "rank < world_size"),
        (dict(master_addr=""), "master address"),
        (dict(master_port=0), "master address and port"),
        (dict(rank=1, master_listen_fd=3), "only rank 0"),
    ],
)
def test_a_bad_group_is_refused(fields: dict, words: str) -> None:
    base = dict(rank=0, world_size=2, master_addr="127.0.0.1", master_port=29500)
    with pytest.raises(ValueError, match=words):
        Group(**{**base, **fields})


def test_the_cli_wants_the_whole_group(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--world-size", "2", "--rank", "0"])
    assert "--master-addr" in capsys.readouterr().err


@pytest.mark.slow
def test_two_ranks_on_their_own_loopback_addresses(tmp_path: Path) -> None:
    listener = socket.create_server(("127.0.0.21", 0))
    port = listener.getsockname()[1]
    common = ["--world-size=2", "--master-addr=127.0.0.21", f"--master-port={port}", "--group=g-test"]
    common += ["--backend=gloo", "--size-bytes=65536", "--iterations=2", "--warmup=0", "--timeout=60"]
    out = tmp_path / "result.json"
    ranks = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "preflight.collective",
                "--rank=0",
                "--bind-host=127.0.0.21",
                f"--master-listen-fd={listener.fileno()}",
                f"--out={out}",
                *common,
            ],
            cwd=ROOT,
            pass_fds=(listener.fileno(),),
        ),
        subprocess.Popen(
            [sys.executable, "-m", "preflight.collective", "--rank=1", "--bind-host=127.0.0.22", *common],
            cwd=ROOT,
        ),
    ]
    listener.close()
    assert [p.wait(timeout=90) for p in ranks] == [0, 0]
    result = json.loads(out.read_text())
    assert result["correct"] and result["world_size"] == 2 and result["backend"] == "gloo"
    assert result["size_bytes"] == 65536 and result["busbw_gbps"] > 0
