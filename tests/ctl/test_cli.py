"""controllerctl against a live Controller gRPC server backed by a real etcd and a real event log."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from controller.ctl.main import main
from controller.goodput.report import compute_goodput
from runwarden.eventlog import LogEntry, read_events
from runwarden.v1 import common_pb2, controller_pb2, controller_pb2_grpc, events_pb2, store_pb2

from .conftest import RUN, T0, LiveController

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("RUNWARDEN_CONTROLLER", raising=False)
    monkeypatch.delenv("RUNWARDEN_CTL_CONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def ctl(capsys: pytest.CaptureFixture[str], live: LiveController | None, *args: str) -> tuple[int, str, str]:
    argv = (["--controller", live.address] if live else []) + list(args)
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_status_table_and_json(live: LiveController, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = ctl(capsys, live, "status")
    assert rc == 0
    header, row = out.splitlines()[1:3]
    assert header.split() == [
        "RUN",
        "PHASE",
        "ATTEMPT",
        "STEP",
        "COMMITTED",
        "BUDGET",
        "LAST",
        "PROGRESS",
        "NODES",
        "CLAIMED",
        "LEADER",
        "REASON",
    ]
    # aligned: every column starts where its header starts
    assert row.split()[:6] == ["llm", "running", "2", "141", "100", "3"]
    assert row.index("running") == header.index("PHASE")
    assert "\x1b[" not in out  # not a terminal: no colour
    rc, out, _ = ctl(capsys, live, "status", "--json")
    data = json.loads(out)
    (run,) = data["runs"]
    assert run["run"] == RUN and run["phase"] == "RUN_PHASE_RUNNING"
    assert run["attempt"] == "2" and run["current_step"] == "141" and run["last_committed_step"] == "100"
    assert run["restart_budget_left"] == 3 and run["nodes"] == ["n0", "n1", "n3", "n4"]
    rc, _, err = ctl(capsys, live, "status", "nope")
    assert rc == 5 and "no run named 'nope'" in err


def test_nodes_and_node(live: LiveController, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = ctl(capsys, live, "nodes")
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["NODE", "POOL", "STATE", "ALIVE"]
    n2 = next(line for line in lines if line.startswith("n2 "))
    assert n2.split()[:4] == ["n2", "quarantined", "-", "no"]
    assert "1 (1 fatal)" in n2
    rc, out, _ = ctl(capsys, live, "--json", "nodes")
    nodes = {n["node"]: n for n in json.loads(out)["nodes"]}
    assert sorted(nodes) == ["n0", "n1", "n2", "n3", "n4"]
    # a spare entry in its claiming run's attempt is that run's: assigned, not "spare"
    assert nodes["n4"]["pool_state"] == "POOL_STATE_ASSIGNED" and nodes["n4"]["run"] == RUN
    assert nodes["n4"]["alive"] is True
    n0 = next(line for line in lines if line.startswith("n0 "))
    assert n0.split()[:2] == ["n0", "assigned"] and RUN in n0.split()
    # a reputation with nothing against it is 0, never "-0"
    assert n0.split()[n0.split().index("assigned") + 5] == "0", n0
    assert nodes["n2"]["evidence"][0]["xid"] == 79
    rc, out, _ = ctl(capsys, live, "node", "n2")
    assert rc == 0 and "Xid 79: GPU has fallen off the bus" in out and "fatal" in out
    rc, out, err = ctl(capsys, live, "node", "n9")
    assert rc == 5 and out == "" and "no node named 'n9'" in err


def test_events_filters(live: LiveController, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = ctl(capsys, live, "events", "--kind", "detection,attribution", "--json")
    kinds = [e["kind"] for e in json.loads(out)["events"]]
    assert rc == 0 and kinds == ["EVENT_KIND_DETECTION", "EVENT_KIND_ATTRIBUTION"]
    rc, out, _ = ctl(capsys, live, "events", "--limit", "3")
    lines = out.splitlines()
    assert rc == 0 and len(lines) == 4 and lines[0].split()[0] == "WHEN"
    assert [line.split()[6] for line in lines[1:]] == [
        "launch",
        "load-done",
        "first-step",
    ]  # "when" is 2 words
    rc, out, _ = ctl(capsys, live, "events", "--since", str(T0 + 250), "--json")
    assert [e["kind"] for e in json.loads(out)["events"]] == ["EVENT_KIND_LOAD_DONE", "EVENT_KIND_FIRST_STEP"]
    with pytest.raises(SystemExit) as exc:
        main(["--controller", live.address, "events", "--kind", "bogus"])
    assert exc.value.code == 2
    assert "unknown event kind 'bogus'" in capsys.readouterr().err


def test_quarantine_release_stop_write_etcd(live: LiveController, capsys: pytest.CaptureFixture[str]) -> None:
    k = live.store.keys
    rc, out, _ = ctl(capsys, live, "quarantine", "n1", "--reason", "ECC storm on GPU 5")
    assert rc == 0 and out.strip() == "node n1: quarantined"
    entry = store_pb2.PoolEntry.FromString(live.store.get(k.pool("n1")).value)
    assert entry.state == common_pb2.POOL_STATE_QUARANTINED and entry.operator_hold
    assert "ECC storm on GPU 5" in entry.reason
    rc, out, _ = ctl(capsys, live, "release", "n1", "--json")
    assert rc == 0 and json.loads(out)["pool_state"] == "POOL_STATE_BURN_IN"
    rc, _, err = ctl(capsys, live, "release", "n4")
    assert rc == 1 and "not quarantined" in err
    # `repaired` is the release of a node held for repair, its note the reason
    rc, out, _ = ctl(capsys, live, "quarantine", "n1", "--reason", "Xid 79")
    rc, out, _ = ctl(capsys, live, "repaired", "n1", "--note", "GPU 3 reseated, RMA 4411", "--json")
    assert rc == 0 and json.loads(out)["pool_state"] == "POOL_STATE_BURN_IN"
    rc, _, err = ctl(capsys, live, "repaired", "n1", "--note", "  ")
    assert rc == 2 and "--note must say what was repaired" in err
    rc, _, err = ctl(capsys, live, "quarantine", "n1", "--reason", "   ")
    assert rc == 2 and "reason must not be empty" in err
    rc, _, err = ctl(capsys, live, "quarantine", "ghost", "--reason", "x")
    assert rc == 5
    rc, out, _ = ctl(capsys, live, "stop", RUN, "--reason", "drain for maintenance")
    assert rc == 0 and "stop requested" in out
    stop = store_pb2.StopRequest.FromString(live.store.get(k.stop(RUN)).value)
    assert stop.reason == "drain for maintenance" and stop.requested_by.startswith("ipv4:127.0.0.1")
    rc, out, _ = ctl(capsys, live, "status", "--json")
    assert json.loads(out)["runs"][0]["phase"] == "RUN_PHASE_STOPPING"
    rc, out, _ = ctl(capsys, live, "stop", RUN, "--relaunch")
    assert rc == 0 and "restart requested" in out
    stop = store_pb2.StopRequest.FromString(live.store.get(k.stop(RUN)).value)
    assert stop.relaunch and stop.reason == "operator restart"
    rc, _, err = ctl(capsys, live, "drain", "n1")
    assert rc == 2 and "--reason" in err
    # A store-backed view has no agents to ask; the live controller's drain is tested end to end.
    rc, _, err = ctl(capsys, live, "drain", "n1", "--reason", "firmware update")
    assert rc != 0 and "running controller" in err


def test_status_says_how_long_the_run_waits_for_nodes() -> None:
    from controller.ctl.status import waiting_line

    r = controller_pb2.RunStatus(run=RUN, waiting_for_nodes=1, waiting_since=1000.0)
    assert waiting_line(r, 1000.0 + 4 * 60 + 10) == "waiting for 1 node from the queue for 4 min"
    r.waiting_for_nodes = 2
    assert waiting_line(r, 1030.0) == "waiting for 2 nodes from the queue for 30 s"
    assert waiting_line(controller_pb2.RunStatus(run=RUN), 1030.0) == ""


def test_goodput_online_matches_offline(
    live_ended: LiveController, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    rc, online, _ = ctl(capsys, live_ended, "goodput", RUN, "--json")
    assert rc == 0
    rc, offline, _ = ctl(capsys, None, "goodput", RUN, "--log", str(live_ended.log_path), "--json")
    assert rc == 0 and json.loads(online) == json.loads(offline)
    report = json.loads(online)
    expected = compute_goodput(read_events(live_ended.log_path).entries, run=RUN)
    assert report["productive_s"] == 95.0 and report["allocated_s"] == 300.0
    assert report["productive_s"] == expected.productive_us / 1e6
    assert report["lost_by_cause"][0] == {"cause": "hardware:xid", "seconds": 90.0}
    rc, out, _ = ctl(capsys, live_ended, "goodput", RUN)
    assert rc == 0 and "31.7%" in out and "hardware:xid" in out
    rc, out, _ = ctl(capsys, live_ended, "goodput", "--by", "week")
    assert rc == 0 and "2025-W49" in out and "WEEK" in out
    png = tmp_path / "online.png"
    rc, out, _ = ctl(capsys, live_ended, "goodput", RUN, "--png", str(png))
    assert rc == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_offline_goodput_torn_tail_png_and_missing_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], live_ended: LiveController
) -> None:
    log = tmp_path / "copy.jsonl"
    log.write_bytes(live_ended.log_path.read_bytes() + b'{"seq": 50, "ts": 1.0, "ki')
    png = tmp_path / "postmortem.png"
    rc, out, err = ctl(capsys, None, "goodput", "--log", str(log), "--png", str(png))
    assert rc == 0 and "torn last line" in err and "31.7%" in out
    assert png.stat().st_size > 20_000
    rc, _, err = ctl(capsys, None, "goodput", "--log", str(tmp_path / "nope.jsonl"))
    assert rc == 2 and "no event-log file" in err
    rc, _, err = ctl(capsys, None, "goodput", "other-run", "--log", str(log))
    assert rc == 5


def test_unreachable_controller_is_exit_3(
    free_port: int, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RUNWARDEN_CONTROLLER", f"127.0.0.1:{free_port}")
    rc, out, err = ctl(capsys, None, "--timeout", "1", "status")
    assert rc == 3 and out == ""
    assert f"cannot reach the controller at 127.0.0.1:{free_port}" in err


def test_address_precedence_flag_env_config(
    live: LiveController,
    tmp_path: Path,
    free_port: int,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = tmp_path / "ctl.toml"
    cfg.write_text(f'[controllerctl]\naddress = "{live.address}"\ntimeout_s = 2.0\n')
    assert ctl(capsys, None, "--config", str(cfg), "status")[0] == 0  # config file
    monkeypatch.setenv("RUNWARDEN_CONTROLLER", f"127.0.0.1:{free_port}")
    assert ctl(capsys, None, "--config", str(cfg), "status")[0] == 3  # env beats the file
    assert (
        ctl(capsys, None, "--config", str(cfg), "--controller", live.address, "status")[0] == 0
    )  # flag beats env
    cfg.write_text('[controllerctl]\nadress = "typo"\n')
    rc, _, err = ctl(capsys, None, "--config", str(cfg), "status")
    assert rc == 2 and "unknown key(s) adress" in err


def test_watch_events_resumes_after_seq_and_follow_streams(live: LiveController) -> None:
    channel = grpc.insecure_channel(live.address)
    stub = controller_pb2_grpc.ControllerStub(channel)
    stream = stub.WatchEvents(controller_pb2.WatchEventsRequest(after_seq=12), timeout=20)
    got = [next(stream).event.seq, next(stream).event.seq]
    assert got == [13, 14]  # the log holds seq 1..14: resume after 12
    live.log.append(LogEntry(ts=T0 + 400, run=RUN, kind=events_pb2.EVENT_KIND_PAGE, message="paged"))
    ev = next(stream).event
    assert (ev.seq, ev.kind, ev.message) == (15, events_pb2.EVENT_KIND_PAGE, "paged")
    stream.cancel()
    # the console entry point in a real process: --follow prints appended events as JSON lines
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": "/nonexistent"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "controller.ctl.main",
            "--controller",
            live.address,
            "events",
            "--follow",
            "--json",
            "--kind",
            "checkpoint-commit",
            "--limit",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())
        assert first["kind"] == "EVENT_KIND_CHECKPOINT_COMMIT" and first["seq"] == "6"
        live.log.append(
            LogEntry(ts=T0 + 500, run=RUN, step=200, kind=events_pb2.EVENT_KIND_CHECKPOINT_COMMIT)
        )
        second = json.loads(proc.stdout.readline())
        assert second["seq"] == "16" and second["step"] == "200"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    channel.close()


def test_watch_rejects_bad_input_and_health_reflection(live: LiveController) -> None:
    channel = grpc.insecure_channel(live.address)
    stub = controller_pb2_grpc.ControllerStub(channel)
    with pytest.raises(grpc.RpcError) as exc:
        next(stub.WatchEvents(controller_pb2.WatchEventsRequest(kinds=[999]), timeout=5))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as exc:
        stub.GetGoodput(controller_pb2.GetGoodputRequest(by="month"), timeout=5)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "by must be" in exc.value.details()
    for since in (
        -1.0,
        1.7976931348623158e302,
        math.inf,
        math.nan,
    ):  # the last finite ones overflowed microseconds
        with pytest.raises(grpc.RpcError) as exc:
            stub.GetGoodput(controller_pb2.GetGoodputRequest(since=since), timeout=5)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "since must be" in exc.value.details()
    with pytest.raises(grpc.RpcError) as exc:
        stub.GetNode(controller_pb2.GetNodeRequest(node="a/b"), timeout=5)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    health = health_pb2_grpc.HealthStub(channel)
    resp = health.Check(health_pb2.HealthCheckRequest(service="runwarden.v1.Controller"), timeout=5)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = refl.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
    )
    names = {s.name for a in answers for s in a.list_services_response.service}
    assert "runwarden.v1.Controller" in names and "grpc.health.v1.Health" in names
    channel.close()


def test_completion_scripts_are_valid_shell(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, out, _ = ctl(capsys, None, "completion", "bash")
    assert rc == 0 and "complete -o default -F _controllerctl controllerctl" in out
    assert "goodput)" in out and "--png" in out and "cause week" in out
    script = tmp_path / "c.bash"
    script.write_text(
        out + "\nCOMP_WORDS=(controllerctl goodput --b); COMP_CWORD=2; _controllerctl; "
        'echo "${COMPREPLY[@]}"\n'
    )
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["--by"]
    rc, out, _ = ctl(capsys, None, "completion", "zsh")
    assert rc == 0 and "bashcompinit" in out


def test_colour_only_when_asked(live: LiveController, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = ctl(capsys, live, "--color", "always", "nodes")
    assert rc == 0 and "\x1b[31mquarantined" in out


def test_optional_subcommands_load_lazily_or_say_what_is_missing(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import controller.ctl.main as ctl_module

    monkeypatch.setitem(
        ctl_module.OPTIONAL_SUBCOMMANDS,
        "frobnicate",
        ("controller.no_such_module_cli", "a subcommand not installed here"),
    )
    rc, _, err = ctl(capsys, None, "frobnicate", "--anything")
    assert rc == 1 and "controller.no_such_module_cli is not installed" in err
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "frobnicate" in out and "attribute" in out and "exit codes:" in out
    if ctl_module._import_optional("controller.ctl.attribute") is not None:
        with pytest.raises(SystemExit) as exc:
            main(["attribute", "--help"])
        assert exc.value.code == 0 and "attribute" in capsys.readouterr().out
