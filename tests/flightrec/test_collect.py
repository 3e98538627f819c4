"""nodeagent.daemon.flight_recorder.collect_dumps against real unix-socket servers that misbehave in every way.

The happy path against torch's real worker server is in test_real_dumps.py; here each failure a rank
can show (no socket, dead, wedged, wrong answer, too big) must become "no dump" with its reason.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent.daemon.flight_recorder import collect_dumps, discover_sockets
from nodeagent.wire import fr_pg_config_path as pg_config_path_for
from nodeagent.wire import fr_socket_path as socket_path_for
from runwarden.flightrec import parse_dump

DUMP = {
    "version": "2.10",
    "pg_config": {"": {"name": "", "desc": "", "ranks": "[]"}},  # as gloo writes it
    "entries": [
        {
            "record_id": 0,
            "process_group": ["0", "default_pg"],
            "collective_seq_id": 1,
            "profiling_name": "gloo:barrier",
        }
    ],
}


def _http(status: int, body: bytes, length: int | None = None) -> bytes:
    n = len(body) if length is None else length
    return (
        f"HTTP/1.1 {status} X\r\nContent-Length: {n}\r\nContent-Type: application/json\r\n\r\n".encode()
        + body
    )


class FakeRank:
    """A unix-socket server answering every request with `reply` (None: accept and stay silent)."""

    def __init__(self, path: Path, reply: bytes | None) -> None:
        self.path, self.reply = path, reply
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(8)
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.recv(65536)
            if self.reply is None:
                self.held.append(conn)  # wedged: never answers
                continue
            conn.sendall(self.reply)
            conn.close()

    def close(self) -> None:
        self.sock.close()
        for c in self.held:
            c.close()


@pytest.fixture
def sockets(tmp_path: Path) -> Iterator[tuple[Path, list[FakeRank]]]:
    ranks: list[FakeRank] = []
    yield tmp_path, ranks
    for r in ranks:
        r.close()


def test_answering_rank_gets_its_pg_config_repaired(sockets: tuple[Path, list[FakeRank]]) -> None:
    base, ranks = sockets
    path = socket_path_for(base, 0)
    ranks.append(FakeRank(path, _http(200, json.dumps(DUMP).encode())))
    config = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}}
    pg_config_path_for(path).write_text(json.dumps(config))
    (dump,) = collect_dumps({0: path}, timeout_s=2.0)
    assert dump.ok and dump.format == "json" and dump.error == ""
    parsed = parse_dump(dump.data)
    assert parsed.group("0") is not None and parsed.group("0").ranks == (0, 1)
    assert discover_sockets(base) == {0: path}


def test_a_kept_ranks_earlier_attempts_are_cut_at_the_launch(sockets: tuple[Path, list[FakeRank]]) -> None:
    """A warm rank kept across attempts: torch's ring still holds attempt 1's collectives (its default
    group was "0" too, its sequence numbers run ahead). The agent's fetch drops what was recorded
    before this attempt's launch (found live: a fresh rank was blamed for the old attempt's seq)."""
    base, ranks = sockets
    path = socket_path_for(base, 0)
    launch_ns = 2_000_000_000
    old = {**DUMP["entries"][0], "record_id": 0, "collective_seq_id": 18, "time_created_ns": launch_ns - 1}
    new = {**DUMP["entries"][0], "record_id": 1, "collective_seq_id": 1, "time_created_ns": launch_ns + 5}
    ranks.append(FakeRank(path, _http(200, json.dumps({**DUMP, "entries": [old, new]}).encode())))
    (cut,) = collect_dumps({0: path}, timeout_s=2.0, since_ns=launch_ns)
    assert [e["collective_seq_id"] for e in json.loads(cut.data)["entries"]] == [1]
    (whole,) = collect_dumps({0: path}, timeout_s=2.0)
    assert [e["collective_seq_id"] for e in json.loads(whole.data)["entries"]] == [18, 1]


def test_every_failure_is_no_dump_with_its_reason(sockets: tuple[Path, list[FakeRank]]) -> None:
    base, ranks = sockets
    paths = {r: socket_path_for(base, r) for r in range(7)}
    ranks.append(FakeRank(paths[1], None))  # wedged (a SIGSTOPped rank looks like this)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(paths[2]))  # a socket file nobody listens on: the rank died
    dead.close()
    ranks.append(FakeRank(paths[3], _http(404, b"Handler fr_trace_json not found")))
    ranks.append(FakeRank(paths[4], _http(200, b"not json at all")))
    ranks.append(FakeRank(paths[5], _http(200, b"{}", length=10**12)))
    ranks.append(FakeRank(paths[6], _http(200, json.dumps(DUMP).encode())))
    started = time.monotonic()
    result = {d.rank: d for d in collect_dumps(paths, timeout_s=1.0, max_bytes=1 << 20)}
    elapsed = time.monotonic() - started
    assert [r for r, d in result.items() if d.ok] == [6]
    assert "no socket" in result[0].error
    assert "no answer within 1 s" in result[1].error
    assert "connection refused" in result[2].error
    assert "HTTP 404" in result[3].error
    assert "invalid dump" in result[4].error
    assert "over the limit" in result[5].error
    assert all(d.error.startswith("no dump: ") and d.data == b"" for r, d in result.items() if r != 6)
    assert elapsed < 4.0, f"ranks must be asked in parallel, took {elapsed:.1f} s"  # one timeout, not several


def test_collect_validates_its_arguments() -> None:
    assert collect_dumps({}, timeout_s=1.0) == []
    with pytest.raises(ValueError):
        collect_dumps({0: Path("/nonexistent")}, timeout_s=0)


def test_setup_refuses_bad_arguments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nodeagent.trainer.flight_recording import setup_flight_recording, setup_flight_recording_from_env

    monkeypatch.delenv("RUNWARDEN_FR_SOCKET_DIR", raising=False)
    assert setup_flight_recording_from_env() is None  # not launched by runwarden
    monkeypatch.setenv("RUNWARDEN_FR_SOCKET_DIR", str(tmp_path / ("x" * 120)))
    monkeypatch.setenv("RANK", "3")
    assert setup_flight_recording_from_env() is None  # socket path too long: logged, training goes on

    with pytest.raises(ValueError, match="longer than"):
        setup_flight_recording(tmp_path / ("x" * 120) / "rank0.sock")
    with pytest.raises(ValueError, match="buffer_size"):
        setup_flight_recording(tmp_path / "rank0.sock", buffer_size=-1)
