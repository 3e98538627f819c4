"""nodeagent.trainer.bootstrap: an unmodified script's progress, derived from the flight recorder's counters.

The counting and the compute/wait split are pure (`CollectiveClock`, `CollectiveSampler` with a
fake clock); the end-to-end test runs a plain DDP script (tests/nodeagent/plain_ddp.py, no
runwarden import) under real torchrun with two gloo ranks, through the bootstrap, against the
agent's real progress-datagram server, and reads the ranks' flight-recorder dumps over their
sockets while one of them stalls."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from controller.supervisor.flight_recorder import verdict_from_rank_dumps
from nodeagent.daemon import torchrun
from nodeagent.daemon.flight_recorder import collect_dumps, discover_sockets
from nodeagent.daemon.progress_socket import ProgressDatagramServer
from nodeagent.daemon.validate import ValidationError, launch_request
from nodeagent.trainer import bootstrap
from nodeagent.trainer.bootstrap import BootstrapConfig, CollectiveClock, CollectiveSampler, GroupCounters
from nodeagent.wire import progress_socket_path
from runwarden.v1 import agent_pb2

ROOT = Path(__file__).resolve().parents[2]
PLAIN_DDP = Path(__file__).with_name("plain_ddp.py")


def g(enqueued: int, completed: int, started: int = -1) -> GroupCounters:
    return GroupCounters(enqueued=enqueued, started=started, completed=completed)


# --- the pure part --------------------------------------------------------------------------------


def test_entered_collectives_are_the_step_and_outstanding_time_is_the_wait():
    clock = CollectiveClock(now=0.0)
    clock.observe(0.5, {})  # before init_process_group: no group yet
    assert clock.take(0.5) is None
    clock.observe(1.0, {"0": g(1, 1)})  # the first collective (DDP's broadcast)
    first = clock.take(1.0)
    assert first is not None and (first.step, first.steps) == (1, 1)
    assert first.step_time_s == first.compute_s == first.wait_s == 0.0  # start-up is no step's time
    clock.observe(1.2, {"0": g(2, 1)})  # entered 2, waiting in it
    clock.observe(1.5, {"0": g(2, 2)})  # done: 0.3 s of wait
    clock.observe(1.8, {"0": g(3, 3)})
    clock.observe(2.0, {"0": g(3, 3)})
    got = clock.take(2.0)
    assert got is not None and (got.step, got.steps) == (3, 2)
    assert got.step_time_s == pytest.approx(0.5) and got.wait_s == pytest.approx(0.15)
    assert got.compute_s == pytest.approx(0.35)
    # no collective entered: no report, and the time carries on into the next step's
    clock.observe(3.0, {"0": g(3, 3)})
    assert clock.take(3.0) is None
    clock.observe(4.0, {"0": g(4, 4)})
    later = clock.take(4.0)
    assert later is not None and later.steps == 1 and later.step_time_s == pytest.approx(2.0)


def test_a_rank_waiting_in_a_collective_its_peer_never_called_is_one_step_ahead():
    waiting, stalled = CollectiveClock(now=0.0), CollectiveClock(now=0.0)
    waiting.observe(1.0, {"0": g(7, 6)})  # entered collective 7, its peer has not
    stalled.observe(1.0, {"0": g(6, 6)})  # stopped between steps, outside any collective
    assert waiting.entered == 7 and waiting.waiting and stalled.entered == 6 and not stalled.waiting


def test_groups_add_up_and_a_recreated_group_keeps_what_it_counted():
    clock = CollectiveClock(now=0.0)
    clock.observe(1.0, {"0": g(10, 10), "1": g(3, 3)})
    assert clock.entered == 13
    clock.observe(2.0, {"0": g(2, 2)})  # destroyed and made again; group 1 left the table
    assert clock.entered == 15


def test_a_warm_ranks_next_attempt_counts_from_its_baseline_and_ignores_old_groups():
    # torch keeps a destroyed group's last counters, here left mid-collective by a hung attempt
    old = {"0": g(40, 39)}
    clock = CollectiveClock(now=0.0, baseline=old)
    clock.observe(1.0, dict(old))
    assert clock.entered == 0 and not clock.waiting
    clock.observe(2.0, {**old, "1": g(3, 2)})  # the new attempt's group gets a new id
    assert clock.entered == 3 and clock.waiting
    clock.observe(3.0, {"0": g(1, 1), "1": g(3, 3)})  # and an id reused, counting from 0 again
    assert clock.entered == 4 and not clock.waiting


def test_the_device_view_is_used_when_the_started_counter_is_tracked():
    assert g(5, 4).in_collective  # gloo: enqueued and not completed
    assert not g(5, 4, started=4).in_collective  # NCCL with timing: queued behind compute, not waiting
    assert g(5, 4, started=5).in_collective


def test_torchs_pg_status_is_parsed_and_anything_else_refused():
    raw = json.dumps(
        {
            "pg_status": {
                "0": {
                    "last_enqueued_collective": "5",
                    "last_started_collective": "-1",
                    "last_completed_collective": "4",
                }
            },
            "version": "2.10",
        }
    )
    assert bootstrap.parse_pg_status(raw) == {"0": g(5, 4)}
    for bad in (
        "not json",
        "[]",
        '{"pg_status": 3}',
        '{"pg_status": {"0": 7}}',
        '{"pg_status": {"0": {"last_enqueued_collective": "x"}}}',
        '{"pg_status": {}, "pad": "' + "x" * (1 << 20) + '"}',
    ):
        with pytest.raises(ValueError):
            bootstrap.parse_pg_status(bad)


class Reporter:
    """What the sampler needs of a ProgressReporter: the reports it gets."""

    def __init__(self) -> None:
        self.reports: list[tuple[int, float, float, float]] = []
        self.flushes = 0

    def report(self, step: int, *, step_time_s: float, compute_s: float, wait_s: float) -> None:
        self.reports.append((step, step_time_s, compute_s, wait_s))

    def flush(self) -> bool:
        self.flushes += 1
        return True


def test_the_sampler_reports_at_once_then_once_per_interval_with_steps_and_the_last_at_stop():
    now = [0.0]
    table: dict[str, GroupCounters] = {}
    reporter = Reporter()
    recorded: list[int] = []
    fail = [True]

    def record() -> None:
        if fail[0]:  # a group made while the table was read: tried again at the next sample
            fail[0] = False
            raise RuntimeError("dictionary changed size during iteration")
        recorded.append(len(table))

    sampler = CollectiveSampler(
        reporter=reporter,
        config=BootstrapConfig(sample_interval_s=0.1, report_interval_s=1.0),
        on_new_group=record,
        read_status=lambda: dict(table),
        clock=lambda: now[0],
    )

    def at(t: float, **groups: GroupCounters) -> None:
        now[0] = t
        table.clear()
        table.update(groups)
        sampler.sample()

    at(0.1)
    assert reporter.reports == []
    at(0.2, **{"0": g(1, 1)})
    assert [r[0] for r in reporter.reports] == [1] and reporter.flushes == 1  # the first, at once
    assert recorded == []  # the first try failed...
    at(0.5, **{"0": g(3, 3)})
    assert recorded == [1]  # ...and the next sample tried again
    at(1.1, **{"0": g(4, 4)})  # before the report interval is over
    assert [r[0] for r in reporter.reports] == [1]
    at(1.3, **{"0": g(5, 5), "1": g(1, 1)})
    assert [r[0] for r in reporter.reports] == [1, 6] and recorded == [1, 2]  # a new group: recorded
    at(2.5, **{"0": g(5, 5), "1": g(1, 1)})
    assert len(reporter.reports) == 2  # nothing entered: nothing sent
    now[0] = 2.6
    table.update({"0": g(6, 6)})
    sampler.stop()  # the thread never ran; the last step still goes out
    assert [r[0] for r in reporter.reports] == [1, 6, 7]


def test_bad_settings_are_refused_before_anything_runs(monkeypatch, capsys):
    for env, why in (
        ({"RUNWARDEN_BOOTSTRAP_SAMPLE_S": "fast"}, "not a number"),
        ({"RUNWARDEN_BOOTSTRAP_SAMPLE_S": "0"}, "RUNWARDEN_BOOTSTRAP_SAMPLE_S"),
        ({"RUNWARDEN_BOOTSTRAP_SAMPLE_S": "nan"}, "RUNWARDEN_BOOTSTRAP_SAMPLE_S"),
        ({"RUNWARDEN_BOOTSTRAP_REPORT_S": "0.001"}, "RUNWARDEN_BOOTSTRAP_REPORT_S"),
        (
            {"RUNWARDEN_AGENT_SOCKET": "/tmp/a.sock", "RANK": "0", "TORCH_FR_BUFFER_SIZE": "0"},
            "turns the flight recorder off",
        ),
    ):
        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, value)
            assert bootstrap.main([str(PLAIN_DDP)]) == bootstrap.EXIT_USAGE
        assert why in capsys.readouterr().err
    for argv, why in (
        ([], "usage"),
        (["-u", "x.py"], "interpreter option"),
        (["-m"], "module name"),
        (["-m", "not a module"], "module name"),
        (["/nonexistent/train.py"], "can't open file"),
    ):
        assert bootstrap.main(argv) == bootstrap.EXIT_USAGE
        assert why in capsys.readouterr().err


def test_the_script_runs_as_python_would_run_it_and_keeps_its_exit(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import json, sys\n"
        "print(json.dumps({'name': __name__, 'argv': sys.argv, 'path0': sys.path[0]}))\n"
        "if sys.argv[1] == 'exit': sys.exit(3)\n"
        "if sys.argv[1] == 'raise': raise KeyError('boom')\n"
    )
    (tmp_path / "jobmod.py").write_text(script.read_text())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RUNWARDEN_", "RANK"))}
    env["PYTHONPATH"] = str(ROOT)

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "nodeagent.trainer.bootstrap", *argv],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env=env,
            timeout=60,
        )

    ok = run(str(script), "ok", "--x")
    assert ok.returncode == 0, ok.stderr
    seen = json.loads(ok.stdout)
    assert seen == {"name": "__main__", "argv": [str(script), "ok", "--x"], "path0": str(tmp_path)}
    assert run(str(script), "exit").returncode == 3
    raised = run(str(script), "raise")
    assert raised.returncode == 1 and "KeyError: 'boom'" in raised.stderr
    mod = run("-m", "jobmod", "ok")
    assert mod.returncode == 0 and json.loads(mod.stdout)["name"] == "__main__", mod.stderr


# --- the launch ------------------------------------------------------------------------------------


def launch(**fields: Any) -> agent_pb2.LaunchWorkersRequest:
    t: dict[str, Any] = {"command": ["/repo/train.py"], "rdzv_endpoint": "10.0.0.1:29400"}
    t.update(fields)
    return agent_pb2.LaunchWorkersRequest(
        run="r", attempt=1, nnodes=1, torchrun=agent_pb2.TorchrunLaunch(**t)
    )


def test_an_unmodified_launch_runs_the_command_behind_the_bootstrap_and_is_validated():
    req = launch(script_mode=agent_pb2.SCRIPT_MODE_UNMODIFIED, command=["/repo/train.py", "--lr", "1"])
    launch_request(req)
    assert torchrun.rank_command(req.torchrun) == (
        "-m",
        "nodeagent.trainer.bootstrap",
        "/repo/train.py",
        "--lr",
        "1",
    )
    assert torchrun.rank_command(launch().torchrun) == ("/repo/train.py",)
    launch_request(launch(script_mode=agent_pb2.SCRIPT_MODE_UNMODIFIED, command=["-m", "pkg.train"]))
    for bad, why in (
        (launch(script_mode=agent_pb2.SCRIPT_MODE_UNMODIFIED, no_python=True), "no_python"),
        (launch(script_mode=agent_pb2.SCRIPT_MODE_UNMODIFIED, command=["-u", "t.py"]), "a script or -m"),
        (launch(script_mode=agent_pb2.SCRIPT_MODE_UNMODIFIED, command=["-m"]), "a script or -m"),
        (launch(script_mode=7), "unknown value 7"),
    ):
        with pytest.raises(ValidationError, match=why):
            launch_request(bad)


def test_the_plain_script_has_no_runwarden_in_it():
    tree = ast.parse(PLAIN_DDP.read_text())
    imported = {
        (n.module or "").split(".")[0] if isinstance(n, ast.ImportFrom) else a.name.split(".")[0]
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in n.names
    }
    assert imported == {"__future__", "argparse", "os", "time", "torch"}


# --- end to end: torchrun, two gloo ranks, the agent's datagram server ------------------------------


@pytest.mark.slow
def test_a_plain_ddp_script_under_torchrun_reports_steps_a_straggler_and_a_stall(tmp_path):
    reports: list[tuple[float, agent_pb2.ReportProgressRequest]] = []

    def handle(req: agent_pb2.ReportProgressRequest) -> agent_pb2.ReportProgressResponse:
        reports.append((time.monotonic(), req))
        return agent_pb2.ReportProgressResponse()

    agent_socket = str(tmp_path / "agent.sock")
    server = ProgressDatagramServer(progress_socket_path(agent_socket), handle, lambda code, s: None)
    server.start()
    faults, fr_dir = tmp_path / "faults", tmp_path / "fr"
    faults.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "RUNWARDEN_RUN": "plain",
        "RUNWARDEN_ATTEMPT": "1",
        "RUNWARDEN_AGENT_SOCKET": agent_socket,
        "RUNWARDEN_FR_SOCKET_DIR": str(fr_dir),
        "RUNWARDEN_BOOTSTRAP_REPORT_S": "0.5",
    }
    # the agent's own line for an unmodified script, standalone instead of its rendezvous
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--max-restarts=0",
        *torchrun.BOOTSTRAP,
        str(PLAIN_DDP),
        "--steps",
        "150",
        "--step-sleep",
        "0.03",
        "--slow-s",
        "0.15",
        "--fault-dir",
        str(faults),
    ]
    proc = subprocess.Popen(argv, env=env, cwd=tmp_path)

    def latest() -> dict[int, Any]:
        out: dict[int, Any] = {}
        for _, req in reports:
            for r in req.reports:
                out[r.rank] = r
        return out

    def wait(cond: Any, what: str, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            assert proc.poll() is None, f"torchrun exited ({proc.returncode}) waiting for {what}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)

    try:
        assert server.path == agent_socket + ".progress"
        wait(lambda: len(latest()) == 2 and min(r.step for r in latest().values()) >= 5, "both ranks' steps")
        first = {r.rank: r for _, req in reports for r in req.reports if r.step > 0}
        assert set(first) == {0, 1} and all(r.pid > 0 and r.world_size == 2 for r in first.values())
        assert reports[0][1].run == "plain" and reports[0][1].attempt == 1

        # a straggler: rank 1 slow in its forward pass; rank 0 waits for it in the all-reduce
        (faults / "slow-rank1").touch()
        seen = len(reports)
        wait(lambda: sum(1 for _, q in reports[seen:] for r in q.reports if r.rank == 1) >= 4, "slow reports")
        (faults / "slow-rank1").unlink()
        slow = [r for _, q in reports[seen + 2 :] for r in q.reports]  # past the interval it began in
        by_rank = {rank: [r for r in slow if r.rank == rank] for rank in (0, 1)}
        assert by_rank[0] and by_rank[1]
        compute = {k: sum(r.compute_s for r in v) / len(v) for k, v in by_rank.items()}
        wait_s = {k: sum(r.wait_s for r in v) / len(v) for k, v in by_rank.items()}
        assert compute[1] > 2 * compute[0] and wait_s[0] > 2 * wait_s[1], (compute, wait_s)

        # a stall outside any collective: rank 1 stops at S-1, rank 0 waits in collective S
        (faults / "stall-rank1").touch()
        stalled_at = time.monotonic()

        def settled() -> bool:  # nothing entered, nothing sent: no report for 4 report intervals
            return time.monotonic() - max(reports[-1][0], stalled_at) >= 4 * 0.5

        wait(settled, "the reports to stop once both ranks are stuck", timeout_s=60.0)
        stuck = latest()
        assert stuck[0].step == stuck[1].step + 1, (stuck[0].step, stuck[1].step)
        for _ in range(3):  # a worker server under load can reset a connection; the agent's "no dump"
            dumps = collect_dumps(discover_sockets(fr_dir), 5.0)
            if all(d.ok for d in dumps):
                break
        assert [d.ok for d in dumps] == [True, True], [d.error for d in dumps]
        rank_dumps = [agent_pb2.RankDump(rank=d.rank, ok=d.ok, format=d.format, data=d.data) for d in dumps]
        found = verdict_from_rank_dumps(rank_dumps, {0: "node-a", 1: "node-b"})
        assert [s.node for s in found.suspects] == ["node-b"] and found.suspects[0].ranks == (1,), found
        (faults / "stall-rank1").unlink()

        assert proc.wait(timeout=120) == 0
        last = latest()
        assert all(r.finished for r in last.values()) and last[0].step == last[1].step >= 150
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        server.stop()


def test_a_real_agent_refuses_an_unmodified_launch_when_its_flight_recorder_is_off(agent_factory):
    agent = agent_factory(
        flags=["--listen", "127.0.0.12:0", "--allow-exec", sys.executable],
        env={"RUNWARDEN_AGENT_FR_BUFFER_SIZE": "0"},
    )
    request = agent_pb2.LaunchWorkersRequest(
        run="r1",
        attempt=1,
        nnodes=2,
        node_rank=1,
        torchrun=agent_pb2.TorchrunLaunch(
            command=[str(PLAIN_DDP)],
            rdzv_endpoint="127.0.0.13:29400",
            script_mode=agent_pb2.SCRIPT_MODE_UNMODIFIED,
        ),
    )
    with pytest.raises(grpc.RpcError) as err:
        agent.stub.LaunchWorkers(request, timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
    assert "fr_buffer_size = 0" in err.value.details()
    request.torchrun.no_python = True
    with pytest.raises(grpc.RpcError) as bad:
        agent.stub.LaunchWorkers(request, timeout=10)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no_python" in bad.value.details()
